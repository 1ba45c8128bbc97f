"""The fourth spelling sweep (2026-11-30): whole MoE layers as code bases write them around the routed
experts (shared experts, auxiliary losses, router noise, norms and residuals, expert-parallel ranges,
mixed precision, tuple outputs), written blind by a reviewer who read none of the package, its tests or
its catalog (each block's docstring names the code base it follows). Every block: forward(x) with x
[T, H], returning [T, H] or a tuple whose first element is. Run by `python tools/spelling_sweep.py --layers`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

E, K, H, I = 4, 2, 8, 16  # noqa: E741 - the intermediate size, as MoE code names it


def _init(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        for b in module.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn_like(b) * 0.1)
    return module


def _p(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.1)


class MLP(nn.Module):
    """HF-style gated expert: down(act(gate(x)) * up(x))."""

    def __init__(self, inter=I, act=F.silu):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------- 1
class Qwen2MoeSharedGate(nn.Module):
    """Qwen2-MoE (HF): one_hot mask + torch.where + index_add_, plus sigmoid(shared_expert_gate(x)) * shared_expert(x); returns (out, router_logits)."""

    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, K, False
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        self.shared_expert = MLP(inter=2 * I)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        _init(self)

    def forward(self, hidden_states):
        num_tokens, hidden_dim = hidden_states.shape
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (num_tokens, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states, router_logits


# --------------------------------------------------------------------------- 2
class DeepseekV2Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, H))
        self.routed_scaling_factor = 2.0

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_idx = torch.topk(scores, k=K, dim=-1, sorted=False)
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class DeepseekV2RepeatInterleave(nn.Module):
    """DeepSeek-V2 (modeling_deepseek.py training path): repeat_interleave tokens, y[flat_idx == i] = expert(...), view+sum, plain shared experts added."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        self.gate = DeepseekV2Gate()
        self.shared_experts = MLP(inter=2 * I)
        _init(self)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        hidden_states = hidden_states.repeat_interleave(K, dim=0)
        y = torch.empty_like(hidden_states)
        for i, expert in enumerate(self.experts):
            y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
        y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
        y = y.to(hidden_states.dtype).view(*orig_shape)
        y = y + self.shared_experts(identity)
        return y


# --------------------------------------------------------------------------- 3
class DeepseekV3GroupLimited(nn.Module):
    """DeepSeek-V3 (HF transformers): sigmoid scores + e_score_correction_bias, group-limited top-k, gather+normalise*scale, where/index_add_ loop with `if numel() > 0`, shared experts."""

    def __init__(self):
        super().__init__()
        self.n_group, self.topk_group, self.routed_scaling_factor = 2, 1, 2.5
        self.weight = nn.Parameter(torch.empty(E, H))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        self.shared_experts = MLP(inter=I)
        _init(self)

    def route_tokens_to_experts(self, router_logits):
        router_logits = router_logits.sigmoid()
        router_logits_for_choice = router_logits + self.e_score_correction_bias
        group_scores = (
            router_logits_for_choice.view(-1, self.n_group, E // self.n_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, self.n_group, E // self.n_group).reshape(-1, E)
        )
        scores_for_choice = router_logits_for_choice.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(scores_for_choice, k=K, dim=-1, sorted=False)[1]
        topk_weights = router_logits.gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = F.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states.index_add_(0, token_indices, weighted_output)
        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, hidden_states):
        residuals = hidden_states
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        topk_indices, topk_weights = self.route_tokens_to_experts(router_logits)
        hidden_states = self.moe(hidden_states, topk_indices, topk_weights)
        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


# --------------------------------------------------------------------------- 4
class Llama4InputScaled(nn.Module):
    """Llama 4 (HF): scatter top-k logits into -inf, sigmoid, scale the INPUT per expert, bmm over stacked gate_up_proj/down_proj, sum over experts, shared expert."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        self.shared_expert = MLP()
        _init(self)

    def experts(self, hidden_states):
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, H)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm((up * F.silu(gate)), self.down_proj)
        return next_states.view(-1, H)

    def forward(self, hidden_states):
        router_logits = self.router(hidden_states)
        router_top_value, router_indices = torch.topk(router_logits, K, dim=1)
        router_scores = (
            torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value).transpose(0, 1)
        )
        router_scores = torch.sigmoid(router_scores.float()).to(hidden_states.dtype)
        routed_in = hidden_states.repeat(router_scores.shape[0], 1)
        routed_in = routed_in * router_scores.reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = self.shared_expert(hidden_states)
        out.add_(routed_out.reshape(router_scores.shape[0], -1, routed_out.shape[-1]).sum(dim=0))
        return out, router_logits


# --------------------------------------------------------------------------- 5
class MixtralAuxLossTuple(nn.Module):
    """Mixtral (HF) loop + load_balancing_loss_func-style aux loss computed in forward; returns (out, aux_loss)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        self.router_aux_loss_coef = 0.02
        _init(self)

    def forward(self, hidden_states):
        T_, D = hidden_states.shape
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((T_, D), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            idx, top_x = torch.where(expert_mask[e])
            cur = self.experts[e](hidden_states[None, top_x].reshape(-1, D)) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, cur.to(hidden_states.dtype))
        # load_balancing_loss_func
        full_probs = F.softmax(router_logits, dim=-1)
        one_hot = F.one_hot(selected_experts, E)
        tokens_per_expert = torch.mean(one_hot.float(), dim=0)
        router_prob_per_expert = torch.mean(full_probs, dim=0)
        aux_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * E
        return final, self.router_aux_loss_coef * aux_loss


# --------------------------------------------------------------------------- 6
class RouterZLossOnSelf(nn.Module):
    """ST-MoE / OLMoE-style router z-loss (logsumexp^2) stored on self.aux_loss; (ids == e).nonzero(as_tuple=True) loop."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        self.z_loss_coef = 1e-3
        self.aux_loss = None
        _init(self)

    def forward(self, x):
        logits = self.router(x)
        z_loss = torch.mean(torch.logsumexp(logits, dim=-1) ** 2)
        self.aux_loss = self.z_loss_coef * z_loss
        probs = logits.softmax(dim=-1)
        topk_w, topk_ids = probs.topk(K, dim=-1)
        topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            out.index_add_(0, tok, self.experts[e](x[tok]) * topk_w[tok, slot].unsqueeze(-1))
        return out


# --------------------------------------------------------------------------- 7
class NoisyTopKGating(nn.Module):
    """Shazeer noisy top-k gating (davidmrau/mixture-of-experts style): noise only when training, top-(k+1), renormalise with +1e-6, scatter into gates, per-expert gates[:, e] > 0."""

    def __init__(self):
        super().__init__()
        self.noisy_gating, self.noise_epsilon = True, 1e-2
        self.w_gate = nn.Parameter(torch.empty(H, E))
        self.w_noise = nn.Parameter(torch.empty(H, E))
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def noisy_top_k_gating(self, x, train):
        clean_logits = x @ self.w_gate
        if self.noisy_gating and train:
            raw_noise_stddev = x @ self.w_noise
            noise_stddev = F.softplus(raw_noise_stddev) + self.noise_epsilon
            logits = clean_logits + (torch.randn_like(clean_logits) * noise_stddev)
        else:
            logits = clean_logits
        logits = F.softmax(logits, dim=1)
        top_logits, top_indices = logits.topk(min(K + 1, E), dim=1)
        top_k_logits = top_logits[:, :K]
        top_k_indices = top_indices[:, :K]
        top_k_gates = top_k_logits / (top_k_logits.sum(1, keepdim=True) + 1e-6)
        zeros = torch.zeros_like(logits)
        gates = zeros.scatter(1, top_k_indices, top_k_gates)
        return gates

    def forward(self, x):
        gates = self.noisy_top_k_gating(x, self.training)
        y = torch.zeros_like(x)
        for e in range(E):
            idx = torch.nonzero(gates[:, e] > 0).squeeze(-1)
            y.index_add_(0, idx, gates[idx, e].unsqueeze(1) * self.experts[e](x[idx]))
        return y


# --------------------------------------------------------------------------- 8
class JitterModuleDict(nn.Module):
    """Mixtral router_jitter_noise (training only) with experts in an nn.ModuleDict keyed by str(i)."""

    def __init__(self):
        super().__init__()
        self.jitter_noise = 0.1
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({str(i): MLP() for i in range(E)})
        _init(self)

    def forward(self, hidden_states):
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(hidden_states)
        for i in range(E):
            expert = self.experts[str(i)]
            token_idx, k_idx = torch.where(selected_experts == i)
            out.index_add_(0, token_idx, expert(hidden_states[token_idx]) * routing_weights[token_idx, k_idx, None])
        return out


# --------------------------------------------------------------------------- 9
class SequentialNonGated(nn.Module):
    """Experts as nn.Sequential(nn.Linear, nn.SiLU(), nn.Linear) (non-gated FFN experts, tutel/fairseq-style simple MoE)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(H, I, bias=False), nn.SiLU(), nn.Linear(I, H, bias=False)) for _ in range(E)]
        )
        _init(self)

    def forward(self, x):
        w, ids = torch.topk(self.router(x).softmax(-1), K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


# --------------------------------------------------------------------------- 10
class FusedW13Chunk(nn.Module):
    """Fused w13 projection per expert, `a, b = h.chunk(2, -1); F.silu(a) * b` (Mistral-inference / vLLM-reference style)."""

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w13 = nn.Linear(H, 2 * I, bias=False)
            self.w2 = nn.Linear(I, H, bias=False)

        def forward(self, x):
            a, b = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(a) * b)

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([self.Expert() for _ in range(E)])
        _init(self)

    def forward(self, inputs):
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, K)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


# --------------------------------------------------------------------------- 11
class StackListComprehension(nn.Module):
    """Dense: torch.stack([expert(x) for expert in experts], 1), gather the top-k outputs, weighted sum (naive MoE tutorials); ReLU-gated experts."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP(act=F.relu) for _ in range(E)])
        _init(self)

    def forward(self, x):
        probs = self.router(x).softmax(dim=-1)
        w, ids = probs.topk(K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        expert_outs = torch.stack([expert(x) for expert in self.experts], dim=1)  # [T, E, H]
        sel = torch.gather(expert_outs, 1, ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return (sel * w.unsqueeze(-1)).sum(dim=1)


# --------------------------------------------------------------------------- 12
class ParamFLinearGelu(nn.Module):
    """Expert weights as stacked nn.Parameter [E, I, H] used with F.linear(x, self.w_gate[e]) in a loop; GELU-tanh gate (Gemma-style act)."""

    def __init__(self):
        super().__init__()
        self.router_weight = _p(E, H)
        self.w_gate = _p(E, I, H)
        self.w_up = _p(E, I, H)
        self.w_down = _p(E, H, I)

    def forward(self, x):
        logits = F.linear(x, self.router_weight)
        w, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            xe = x[tok]
            h = F.gelu(F.linear(xe, self.w_gate[e]), approximate="tanh") * F.linear(xe, self.w_up[e])
            out.index_add_(0, tok, F.linear(h, self.w_down[e]) * w[tok, slot].unsqueeze(-1))
        return out


# --------------------------------------------------------------------------- 13
class NoGradRouting(nn.Module):
    """Expert selection under torch.no_grad(), differentiable weights re-gathered from probs with torch.gather (BASE/Hash-layer style)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        logits = self.router(x)
        with torch.no_grad():
            _, ids = torch.topk(logits, K, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        w = torch.gather(probs, 1, ids)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


# --------------------------------------------------------------------------- 14
class Fp32RouterDetach(nn.Module):
    """Megatron-style fp32 router: autocast disabled, x.float() @ weight.float(), softmax fp32, top-k weights .detach().to(x.dtype)."""

    def __init__(self):
        super().__init__()
        self.weight = _p(E, H)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        with torch.autocast(device_type="cpu", enabled=False):
            logits = torch.matmul(x.float(), self.weight.float().t())
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, K, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).detach().to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


# --------------------------------------------------------------------------- 15
class Bf16Boundary(nn.Module):
    """bf16 expert parameters, fp32 router; x cast to bf16 at the boundary and the output cast back to the input dtype (mixed-precision inference)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)
        self.experts.to(torch.bfloat16)

    def forward(self, x):
        orig_dtype = x.dtype
        probs = F.softmax(self.gate(x.float()), dim=-1, dtype=torch.float32)
        w, ids = torch.topk(probs, K, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
        h = x.to(torch.bfloat16)
        out = torch.zeros_like(h)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return out.to(orig_dtype)


# --------------------------------------------------------------------------- 16
class ExpertParallelLocal(nn.Module):
    """DeepSeek-V3 inference/model.py expert-parallel style: ModuleList with None for non-local experts, loop range(start, end), y[idx] += ..., output for remote experts zero; shared experts."""

    def __init__(self):
        super().__init__()
        self.experts_start_idx, self.experts_end_idx = 1, 3
        self.gate_weight = _p(E, H)
        self.experts = nn.ModuleList(
            [MLP() if self.experts_start_idx <= i < self.experts_end_idx else None for i in range(E)]
        )
        self.shared_experts = MLP()
        _init(self)

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, H)
        scores = F.linear(x, self.gate_weight).softmax(dim=-1, dtype=torch.float32)
        indices = torch.topk(scores, K, dim=-1)[1]
        weights = scores.gather(1, indices).type_as(x)
        y = torch.zeros_like(x)
        for i in range(self.experts_start_idx, self.experts_end_idx):
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        # (dist.all_reduce(y) would go here when world_size > 1)
        return (y + z).view(shape)


# --------------------------------------------------------------------------- 17
class NormalizeP1(nn.Module):
    """Top-k weights renormalised with F.normalize(w, p=1, dim=-1) (JetMoE/MoE-LLaVA-style), Mixtral where/index_add_ loop."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        w = F.normalize(w, p=1, dim=-1)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            slot, tok = torch.where(expert_mask[e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


# --------------------------------------------------------------------------- 18
class GatherUnsortedAnyMask(nn.Module):
    """topk(largest=True, sorted=False) indices, weights = torch.gather(probs, 1, ids) (no renorm), per-expert mask.any(-1).nonzero() + (w * mask).sum(-1)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        logits = self.router(x)
        probs = logits.softmax(dim=-1)
        _, ids = torch.topk(logits, K, dim=-1, largest=True, sorted=False)
        w = torch.gather(probs, 1, ids)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = ids == e
            token_idx = mask.any(dim=-1).nonzero().squeeze(-1)
            tok_w = (w * mask).sum(dim=-1)[token_idx]
            out.index_add_(0, token_idx, self.experts[e](x[token_idx]) * tok_w.unsqueeze(-1))
        return out


# --------------------------------------------------------------------------- 19
class PreNormResidual(nn.Module):
    """Decoder-layer style: hand-written RMSNorm pre-norm, Mixtral MoE, residual add, all in one module."""

    def __init__(self):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(H))
        self.eps = 1e-6
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)
        with torch.no_grad():
            self.norm_weight.add_(1.0)

    def rms_norm(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.norm_weight

    def forward(self, x):
        residual = x
        h = self.rms_norm(x)
        rw = F.softmax(self.gate(h), dim=1, dtype=torch.float)
        rw, sel = torch.topk(rw, K, dim=-1)
        rw = (rw / rw.sum(dim=-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        expert_mask = F.one_hot(sel, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            idx, top_x = torch.where(expert_mask[e])
            out.index_add_(0, top_x, self.experts[e](h[top_x]) * rw[top_x, idx, None])
        return residual + out


# --------------------------------------------------------------------------- 20
class CapacitySlice(nn.Module):
    """Capacity-factor loop: capacity = int(capacity_factor * T * K / E) with capacity_factor = E (no drop), per-expert [:capacity] slices (Switch/OpenMoE-style)."""

    def __init__(self):
        super().__init__()
        self.capacity_factor = float(E)
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        T_ = x.shape[0]
        capacity = int(self.capacity_factor * T_ * K / E)
        probs = self.router(x).softmax(dim=-1)
        w, ids = probs.topk(K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            token_idx, k_idx = torch.where(ids == e)
            token_idx = token_idx[:capacity]
            k_idx = k_idx[:capacity]
            out.index_add_(0, token_idx, self.experts[e](x[token_idx]) * w[token_idx, k_idx].unsqueeze(-1))
        return out


# --------------------------------------------------------------------------- 21
class GShardEinsumTop2(nn.Module):
    """fairseq/GShard top2gating: argmax twice, cumsum locations, capacity, combine_weights [S,E,C], einsum('sec,sm->ecm') dispatch and einsum('sec,ecm->sm') combine."""

    def __init__(self):
        super().__init__()
        self.capacity_factor = float(E)
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def top2gating(self, logits):
        gates = F.softmax(logits, dim=1)
        num_tokens, num_experts = gates.shape
        capacity = int(self.capacity_factor * num_tokens * K / num_experts)
        indices1_s = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(indices1_s, num_classes=num_experts)
        logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
        indices2_s = torch.argmax(logits_except1, dim=1)
        mask2 = F.one_hot(indices2_s, num_classes=num_experts)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1
        locations2 += torch.sum(mask1, dim=0, keepdim=True)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
        locations1_s = torch.sum(locations1 * mask1, dim=1)
        locations2_s = torch.sum(locations2 * mask2, dim=1)
        gates1_s = (gates * mask1).sum(dim=1)
        gates2_s = (gates * mask2).sum(dim=1)
        denom_s = gates1_s + gates2_s
        denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
        gates1_s = gates1_s / denom_s
        gates2_s = gates2_s / denom_s
        gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
        gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
        locations1_sc = F.one_hot(locations1_s, num_classes=capacity)
        locations2_sc = F.one_hot(locations2_s, num_classes=capacity)
        combine1_sec = torch.bmm(gates1.unsqueeze(-1), locations1_sc.to(gates1.dtype).unsqueeze(1))
        combine2_sec = torch.bmm(gates2.unsqueeze(-1), locations2_sc.to(gates2.dtype).unsqueeze(1))
        combine_weights = combine1_sec + combine2_sec
        dispatch_mask = combine_weights.bool()
        return combine_weights, dispatch_mask

    def forward(self, x):
        combine_weights, dispatch_mask = self.top2gating(self.wg(x))
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.to(x.dtype), x)
        chunks = dispatched_input.chunk(E, dim=0)
        expert_outputs = [expert(chunk) for chunk, expert in zip(chunks, self.experts)]  # noqa: B905 - as fairseq writes it
        expert_output = torch.cat(expert_outputs, dim=0)
        return torch.einsum("sec,ecm->sm", combine_weights, expert_output)


# --------------------------------------------------------------------------- 22
class BatchDim3D(nn.Module):
    """HF-style block written for [B, S, H]: batch_size, sequence_length, hidden_dim = shape; view(-1, H) ... reshape back (x.unsqueeze(0) at entry)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def moe(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        for e in range(E):
            idx, top_x = torch.where(expert_mask[e])
            cur = hidden_states[None, top_x].reshape(-1, hidden_dim)
            final.index_add_(0, top_x, self.experts[e](cur) * routing_weights[top_x, idx, None])
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits

    def forward(self, x):
        out, _ = self.moe(x.unsqueeze(0))
        return out.squeeze(0)


# --------------------------------------------------------------------------- 23
class DenseMaskOutOfPlace(nn.Module):
    """Dense per-expert compute on all tokens, w_e = (w * (ids == e)).sum(-1), accumulated with out = out + w_e * expert(x) (not in place)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.router(x), dim=-1), K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            w_e = (w * (ids == e)).sum(dim=-1, keepdim=True)
            out = out + w_e * self.experts[e](x)
        return out


# --------------------------------------------------------------------------- 24
class IndexAddOutOfPlace(nn.Module):
    """Flattened (token, slot) pairs: token = arange(T).repeat_interleave(K), per-expert (flat_ids == e).nonzero(), out = out.index_add(0, tok, y) (out of place)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        T_ = x.shape[0]
        w, ids = torch.topk(torch.softmax(self.router(x), dim=-1), K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        flat_ids = ids.reshape(-1)
        flat_w = w.reshape(-1)
        token = torch.arange(T_, device=x.device).repeat_interleave(K)
        out = torch.zeros_like(x)
        for e in range(E):
            sel = (flat_ids == e).nonzero().squeeze(-1)
            tok = token[sel]
            y = self.experts[e](x[tok]) * flat_w[sel, None]
            out = out.index_add(0, tok, y)
        return out


# --------------------------------------------------------------------------- 25
class ScatterReduceSum(nn.Module):
    """Collect per-expert outputs and token ids, torch.cat, then zeros_like(x).scatter_reduce(0, idx, y, reduce='sum')."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.router(x), dim=-1), K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        ys, toks = [], []
        for e in range(E):
            tok, slot = torch.where(ids == e)
            ys.append(self.experts[e](x[tok]) * w[tok, slot].unsqueeze(-1))
            toks.append(tok)
        y = torch.cat(ys, dim=0)
        tok = torch.cat(toks, dim=0)
        out = torch.zeros_like(x).scatter_reduce(
            0, tok.unsqueeze(-1).expand(-1, x.shape[-1]), y, reduce="sum", include_self=True
        )
        return out


# --------------------------------------------------------------------------- 26
class GptOssDenseBmm(nn.Module):
    """GPT-OSS (HF inference path): router with bias, softmax over top-k logits scattered to [T,E], repeat over all experts, bmm with biases, interleaved ::2/1::2 clamped swiglu, weighted sum over experts."""

    def __init__(self):
        super().__init__()
        self.alpha, self.limit = 1.702, 7.0
        self.router_weight = _p(E, H)
        self.router_bias = _p(E)
        self.gate_up_proj = _p(E, H, 2 * I)
        self.gate_up_proj_bias = _p(E, 2 * I)
        self.down_proj = _p(E, I, H)
        self.down_proj_bias = _p(E, H)

    def experts(self, hidden_states, routing_weights):
        batch_size = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(-1, H)
        num_experts = routing_weights.shape[1]
        hidden_states = hidden_states.repeat(num_experts, 1)
        hidden_states = hidden_states.view(num_experts, -1, H)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(num_experts, batch_size, -1, H)
        next_states = next_states * routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
        return next_states.sum(dim=0)

    def forward(self, hidden_states):
        router_logits = F.linear(hidden_states, self.router_weight, self.router_bias)
        router_top_value, router_indices = torch.topk(router_logits, K, dim=-1)
        router_top_value = F.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
        router_scores = torch.zeros_like(router_logits).scatter_(1, router_indices, router_top_value)
        x = hidden_states.unsqueeze(0)
        out = self.experts(x, router_scores)
        return out.reshape(hidden_states.shape), router_scores


# --------------------------------------------------------------------------- 27
class DbrxFlatStacked(nn.Module):
    """DBRX (HF): w1/v1/w2 as flat [E*I, H] params viewed per expert, top-k / torch.norm(p=1), where loop with `if token_idx.shape[0] == 0: continue`, x.matmul(w1.t()), down = h.matmul(w2)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(H, E, bias=False)
        self.w1 = _p(E * I, H)
        self.v1 = _p(E * I, H)
        self.w2 = _p(E * I, H)
        _init(self)

    def expert_glu(self, x, expert_w1, expert_v1, expert_w2):
        gate_proj = x.matmul(expert_w1.t())
        up_proj = x.matmul(expert_v1.t())
        gate_proj = F.silu(gate_proj)
        intermediate_states = gate_proj * up_proj
        return intermediate_states.matmul(expert_w2)

    def forward(self, x):
        weights = self.layer(x).softmax(dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(weights, K, dim=-1)
        top_weights = top_weights / torch.norm(top_weights, p=1, dim=-1, keepdim=True)
        top_weights = top_weights.to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(top_experts, num_classes=E).permute(2, 1, 0)
        w1_chunked = self.w1.view(E, I, H).chunk(E, dim=0)
        v1_chunked = self.v1.view(E, I, H).chunk(E, dim=0)
        w2_chunked = self.w2.view(E, I, H).chunk(E, dim=0)
        w1_chunked = [w.squeeze(dim=0) for w in w1_chunked]
        v1_chunked = [v.squeeze(dim=0) for v in v1_chunked]
        w2_chunked = [w.squeeze(dim=0) for w in w2_chunked]
        for expert_idx in range(0, E):
            topk_idx, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.shape[0] == 0:
                continue
            token_list = token_idx
            topk_list = topk_idx
            expert_tokens = x[None, token_list].reshape(-1, H)
            expert_out = (
                self.expert_glu(expert_tokens, w1_chunked[expert_idx], v1_chunked[expert_idx], w2_chunked[expert_idx])
                * top_weights[token_list, topk_list, None]
            )
            out.index_add_(0, token_idx, expert_out)
        return out


# --------------------------------------------------------------------------- 28
class GraniteSplitTolist(nn.Module):
    """JetMoE/GraniteMoE (HF): sort flattened top-k experts, expert_size = gates.sum(0).tolist(), ParallelExperts split+F.linear+cat, chunk-swiglu, zeros.index_add."""

    def __init__(self):
        super().__init__()
        self.router_layer = nn.Linear(H, E, bias=False)
        self.input_linear = _p(E, 2 * I, H)
        self.output_linear = _p(E, H, I)

    def parallel_experts(self, inputs, expert_size, weight):
        input_list = inputs.split(expert_size, dim=0)
        output_list = [F.linear(input_list[i], weight[i]) for i in range(E)]
        return torch.cat(output_list, dim=0)

    def forward(self, layer_input):
        bsz, emb_size = layer_input.shape
        logits = self.router_layer(layer_input).float()
        top_k_logits, top_k_indices = logits.topk(K, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(layer_input)
        zeros = torch.zeros([top_k_gates.size(0), E], dtype=top_k_gates.dtype, device=top_k_gates.device)
        gates = zeros.scatter(1, top_k_indices, 1)
        expert_size = gates.long().sum(0)
        expert_size = expert_size.tolist()
        top_k_experts = top_k_indices.flatten()
        _, index_sorted_experts = top_k_experts.sort(0)
        batch_index = index_sorted_experts.div(K, rounding_mode="trunc")
        top_k_gates = top_k_gates.flatten()
        batch_gates = top_k_gates[index_sorted_experts]

        expert_inputs = layer_input[batch_index]
        hidden_states = self.parallel_experts(expert_inputs, expert_size, self.input_linear)
        chunked_hidden_states = hidden_states.chunk(2, dim=-1)
        hidden_states = F.silu(chunked_hidden_states[0]) * chunked_hidden_states[1]
        expert_outputs = self.parallel_experts(hidden_states, expert_size, self.output_linear)
        expert_outputs = expert_outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz, emb_size), dtype=expert_outputs.dtype, device=expert_outputs.device)
        layer_output = zeros.index_add(0, batch_index, expert_outputs)
        return layer_output


# --------------------------------------------------------------------------- 29
class MixtralExpertHit(nn.Module):
    """Recent HF Mixtral: expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero(); `for expert_idx in expert_hit:` loop over a tensor."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(E)])
        _init(self)

    def forward(self, hidden_states):
        T_, D = hidden_states.shape
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros((T_, D), dtype=hidden_states.dtype, device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, D)
            cur = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, cur.to(hidden_states.dtype))
        return final, router_logits


BLOCKS = [
    Qwen2MoeSharedGate,
    DeepseekV2RepeatInterleave,
    DeepseekV3GroupLimited,
    Llama4InputScaled,
    MixtralAuxLossTuple,
    RouterZLossOnSelf,
    NoisyTopKGating,
    JitterModuleDict,
    SequentialNonGated,
    FusedW13Chunk,
    StackListComprehension,
    ParamFLinearGelu,
    NoGradRouting,
    Fp32RouterDetach,
    Bf16Boundary,
    ExpertParallelLocal,
    NormalizeP1,
    GatherUnsortedAnyMask,
    PreNormResidual,
    CapacitySlice,
    GShardEinsumTop2,
    BatchDim3D,
    DenseMaskOutOfPlace,
    IndexAddOutOfPlace,
    ScatterReduceSum,
    GptOssDenseBmm,
    DbrxFlatStacked,
    GraniteSplitTolist,
    MixtralExpertHit,
]
