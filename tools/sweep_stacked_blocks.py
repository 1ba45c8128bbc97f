"""The third spelling sweep (2026-11-29): routers and stacked expert weights, written afresh by a
reviewer who read none of the package, its tests or its catalog, in the styles of real code bases
(each block's docstring names the one it follows). Every block: forward(x) with x [T, H] -> [T, H];
E=4 experts, K=2 (unless top-1), H=8, I=16. Run by `python tools/spelling_sweep.py --stacked`.
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

E, K, H, I = 4, 2, 8, 16  # noqa: E741 - the intermediate size, as MoE code names it


def _p(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.1)


# --------------------------------------------------------------------------------------------------
# 1
class Qwen2MoeRenormGatherBmm(nn.Module):
    """softmax->topk->renormalise (Qwen2-MoE norm_topk_prob=True); per-token gather w[ids] + torch.bmm; view(T,K,H)*w sum."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)
        flat = ids.reshape(-1)
        xs = x.unsqueeze(1).expand(T, K, H).reshape(T * K, 1, H)
        g = torch.bmm(xs, self.w_gate[flat])
        u = torch.bmm(xs, self.w_up[flat])
        h = F.silu(g) * u
        y = torch.bmm(h, self.w_down[flat]).view(T, K, H)
        return (y * w[..., None]).sum(1)


# 2
class MixtralTopkSoftmaxGatherEinsum(nn.Module):
    """topk on logits then softmax over the k (Mixtral / Mistral reference moe.py); per-token gather + einsum."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.w1 = _p(E, H, I)
        self.w3 = _p(E, H, I)
        self.w2 = _p(E, I, H)

    def forward(self, x):
        logits = self.gate(x)
        top_logits, ids = torch.topk(logits, K)
        w = F.softmax(top_logits, dim=1, dtype=torch.float).to(x.dtype)
        g = torch.einsum("th,tkhi->tki", x, self.w1[ids])
        u = torch.einsum("th,tkhi->tki", x, self.w3[ids])
        y = torch.einsum("tki,tkih->tkh", F.silu(g) * u, self.w2[ids])
        return torch.einsum("tkh,tk->th", y, w)


# 3
class QwenNoNormDenseEinsum(nn.Module):
    """softmax->topk without renormalisation (Qwen norm_topk_prob=False); dense einsum 'th,ehi->eti' over all experts + scattered [T,E] gate table."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = probs.topk(K, dim=-1)
        table = torch.zeros_like(probs).scatter(1, ids, w)  # [T, E]
        g = torch.einsum("th,ehi->eti", x, self.w_gate)
        u = torch.einsum("th,ehi->eti", x, self.w_up)
        y = torch.einsum("eti,eih->eth", F.silu(g) * u, self.w_down)
        return torch.einsum("eth,te->th", y, table)


# 4
class DeepSeekV3SigmoidBiasGate(nn.Module):
    """DeepSeek-V3 MoEGate: sigmoid scores, e_score_correction_bias only for selection, renorm + 1e-20, routed_scaling_factor; gather + einsum experts."""

    def __init__(self):
        super().__init__()
        self.weight = _p(E, H)
        self.register_buffer("e_score_correction_bias", torch.randn(E) * 0.1)
        self.routed_scaling_factor = 2.5
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32), None)
        scores = logits.sigmoid()
        scores_for_choice = scores.view(x.shape[0], -1) + self.e_score_correction_bias.unsqueeze(0)
        _, topk_idx = torch.topk(scores_for_choice, k=K, dim=-1, sorted=False)
        topk_weight = scores.gather(1, topk_idx)
        denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
        topk_weight = topk_weight / denominator
        topk_weight = topk_weight * self.routed_scaling_factor
        g = torch.einsum("th,tkhi->tki", x, self.w_gate[topk_idx])
        u = torch.einsum("th,tkhi->tki", x, self.w_up[topk_idx])
        y = torch.einsum("tki,tkih->tkh", F.silu(g) * u, self.w_down[topk_idx])
        return (y * topk_weight.unsqueeze(-1)).sum(dim=1)


# 5
class DeepSeekV3GroupLimitedPaddedBmm(nn.Module):
    """DeepSeek-V3 group-limited top-k (n_group/topk_group masking, noaux_tc); experts by torch.bmm over a padded [E, C=T, H] buffer."""

    def __init__(self):
        super().__init__()
        self.weight = _p(E, H)
        self.register_buffer("e_score_correction_bias", torch.randn(E) * 0.1)
        self.n_group, self.topk_group = 2, 1
        self.routed_scaling_factor = 1.5
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        scores = F.linear(x, self.weight).sigmoid()
        scores_for_choice = scores + self.e_score_correction_bias.unsqueeze(0)
        group_scores = scores_for_choice.view(T, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(T, self.n_group, E // self.n_group).reshape(T, -1)
        tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
        _, topk_idx = torch.topk(tmp_scores, k=K, dim=-1, sorted=False)
        topk_weight = scores.gather(1, topk_idx)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        topk_weight = topk_weight * self.routed_scaling_factor

        # dispatch into a padded [E, C, H] buffer, C = T (no token is dropped)
        flat = topk_idx.reshape(-1)  # [T*K]
        token = torch.arange(T, device=x.device).repeat_interleave(K)
        onehot = F.one_hot(flat, E)  # [T*K, E]
        pos = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # slot of each assignment inside its expert
        buf = x.new_zeros(E, T, H)
        buf[flat, pos] = x[token]
        hbuf = F.silu(torch.bmm(buf, self.w_gate)) * torch.bmm(buf, self.w_up)
        obuf = torch.bmm(hbuf, self.w_down)  # [E, T, H]
        y = obuf[flat, pos]  # [T*K, H]
        out = torch.zeros_like(x)
        out.index_add_(0, token, y * topk_weight.reshape(-1, 1))
        return out


# 6
class DeepSeekMoeInferSortedSlices(nn.Module):
    """DeepSeek-V2/V3 HF moe_infer: argsort of flat ids, tokens_per_expert .cpu().numpy() slices, new_x[idxs]=outs unsort, view(T,K,H)*w sum."""

    def __init__(self):
        super().__init__()
        self.weight = _p(E, H)
        self.gate_proj = _p(E, I, H)
        self.up_proj = _p(E, I, H)
        self.down_proj = _p(E, H, I)

    def forward(self, x):
        scores = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_ids = torch.topk(scores, k=K, dim=-1, sorted=False)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)

        cnts = topk_ids.new_zeros((topk_ids.shape[0], E))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
            h = F.silu(F.linear(tokens_for_this_expert, self.gate_proj[i])) * F.linear(
                tokens_for_this_expert, self.up_proj[i]
            )
            outputs.append(F.linear(h, self.down_proj[i]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        final_out = (
            new_x.view(*topk_ids.shape, -1)
            .type(topk_weight.dtype)
            .mul_(topk_weight.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(new_x.dtype)
        )
        return final_out


# 7
class SortTopkRepeatInterleaveRows(nn.Module):
    """top-k via torch.sort(descending=True)[:, :K]; sort rows by expert, per-row expert id from repeat_interleave(arange(E), counts), gathered bmm, index_copy unsort."""

    def __init__(self):
        super().__init__()
        self.router = _p(E, H)
        self.w1 = _p(E, H, I)
        self.w3 = _p(E, H, I)
        self.w2 = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        probs = torch.softmax(x @ self.router.t(), dim=-1)
        vals, idx = torch.sort(probs, dim=-1, descending=True)
        w, ids = vals[:, :K], idx[:, :K]
        w = w / w.sum(-1, keepdim=True)
        flat = ids.reshape(-1)
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        perm = torch.argsort(flat, stable=True)
        row_expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=T * K)
        xs = x[perm // K].unsqueeze(1)
        h = F.silu(torch.bmm(xs, self.w1[row_expert])) * torch.bmm(xs, self.w3[row_expert])
        ys = torch.bmm(h, self.w2[row_expert]).squeeze(1)
        y = torch.zeros_like(ys).index_copy(0, perm, ys)
        return (y.view(T, K, H) * w[..., None]).sum(1)


# 8
class ArgsortTopkJoinedGateUp(nn.Module):
    """top-k via argsort(descending) + gather; gate and up joined in one [E, H, 2I] weight split with .chunk(2, -1); gather + bmm."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.gate_up_proj = _p(E, H, 2 * I)
        self.down_proj = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        probs = self.gate(x).softmax(-1)
        ids = torch.argsort(probs, dim=-1, descending=True)[:, :K]
        w = torch.gather(probs, 1, ids)
        w = w / w.sum(-1, keepdim=True)
        flat = ids.flatten()
        xs = x.repeat_interleave(K, dim=0).unsqueeze(1)  # [T*K, 1, H]
        gu = torch.bmm(xs, self.gate_up_proj[flat])
        gate, up = gu.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.down_proj[flat]).squeeze(1)
        return (y.view(T, K, H) * w.unsqueeze(-1)).sum(dim=1)


# 9
class SwitchTop1MaxStackedLoop(nn.Module):
    """Switch Transformer top-1 via torch.max of softmax probs (no renorm); loop over stacked self.w1[e] with a dense token mask."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(H, E, bias=False)
        self.classifier.weight.data = torch.randn(E, H) * 0.1
        self.wi_gate = _p(E, H, I)
        self.wi_up = _p(E, H, I)
        self.wo = _p(E, I, H)

    def forward(self, x):
        probs = torch.softmax(self.classifier(x), dim=-1)
        max_prob, expert_index = torch.max(probs, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = (expert_index == e).to(x.dtype).unsqueeze(-1)
            h = F.silu(x @ self.wi_gate[e]) * (x @ self.wi_up[e])
            out = out + mask * (h @ self.wo[e])
        return out * max_prob.unsqueeze(-1)


# 10
class ArgmaxGatherTop1(nn.Module):
    """top-1 via argmax + gather of the softmax prob; per-token gathered weights with einsum (K=1)."""

    def __init__(self):
        super().__init__()
        self.gate = _p(E, H)
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        probs = F.softmax(F.linear(x, self.gate), dim=-1)
        idx = probs.argmax(dim=-1, keepdim=True)  # [T, 1]
        w = probs.gather(-1, idx)  # [T, 1]
        e = idx.squeeze(-1)
        g = torch.einsum("th,thi->ti", x, self.w_gate[e])
        u = torch.einsum("th,thi->ti", x, self.w_up[e])
        y = torch.einsum("ti,tih->th", F.silu(g) * u, self.w_down[e])
        return y * w


# 11
class Float32RouterOutMajorLoop(nn.Module):
    """router in float32 (.float(), F.linear with nn.Parameter), cast back; out-major [E, I, H] weights via F.linear in a loop over self.w1[e] with a dense gate table."""

    def __init__(self):
        super().__init__()
        self.router_weight = _p(E, H)
        self.w1 = _p(E, I, H)
        self.w3 = _p(E, I, H)
        self.w2 = _p(E, H, I)

    def forward(self, x):
        logits = F.linear(x.float(), self.router_weight.float())
        probs = torch.softmax(logits, dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        gates = torch.zeros(x.shape[0], E, dtype=x.dtype, device=x.device).scatter_(1, ids, w)
        out = torch.zeros_like(x)
        for e in range(E):
            h = F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e])
            out += gates[:, e : e + 1] * F.linear(h, self.w2[e])
        return out


# 12
class Llama4SigmoidInputScaled(nn.Module):
    """Llama4TextMoe: top-1 on logits, sigmoid of the scattered score multiplies the expert INPUT; x.repeat(E,1) + bmm over [E,T,H], gate_up chunk, sum(0)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.router.weight.data = torch.randn(E, H) * 0.1
        self.gate_up_proj = _p(E, H, 2 * I)
        self.down_proj = _p(E, I, H)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        T = hidden_states.shape[0]
        router_logits = self.router(hidden_states)
        router_top_value, router_indices = torch.topk(router_logits, 1, dim=1)
        router_scores = (
            torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value).transpose(0, 1)
        )
        router_scores = torch.sigmoid(router_scores.float()).to(hidden_states.dtype)  # [E, T]
        routed_in = hidden_states.repeat(E, 1)
        routed_in = routed_in * router_scores.reshape(-1, 1)
        routed_in = routed_in.view(E, -1, H)
        gate_up = torch.bmm(routed_in, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm(up * self.act_fn(gate), self.down_proj)
        return next_states.view(E, T, H).sum(dim=0)


# 13
class GptOssInterleavedClampBias(nn.Module):
    """GPT-OSS: biased router, topk then softmax(dim=1); interleaved gate_up[..., ::2]/[..., 1::2] with biases, clamp, gate*sigmoid(alpha*gate)*(up+1); repeat+bmm."""

    def __init__(self):
        super().__init__()
        self.router_weight = _p(E, H)
        self.router_bias = _p(E)
        self.gate_up_proj = _p(E, H, 2 * I)
        self.gate_up_proj_bias = _p(E, 2 * I)
        self.down_proj = _p(E, I, H)
        self.down_proj_bias = _p(E, H)
        self.alpha, self.limit = 1.702, 7.0

    def forward(self, hidden_states):
        T = hidden_states.shape[0]
        router_logits = F.linear(hidden_states, self.router_weight, self.router_bias)
        router_top_value, router_indices = torch.topk(router_logits, K, dim=-1)
        router_top_value = F.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
        routing_weights = torch.zeros_like(router_logits).scatter_(1, router_indices, router_top_value)
        hs = hidden_states.repeat(E, 1).view(E, -1, H)
        gate_up = torch.bmm(hs, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        next_states = torch.bmm(((up + 1) * glu), self.down_proj)
        next_states = next_states + self.down_proj_bias[..., None, :]
        next_states = next_states.view(E, T, H)
        next_states = next_states * routing_weights.transpose(0, 1).view(E, T)[..., None]
        return next_states.sum(dim=0)


# 14
class InterleavedGateUpSiluGather(nn.Module):
    """GPT-OSS-style interleaved gate/up layout ([..., ::2], [..., 1::2]) but plain SiLU and no biases; per-token gather + bmm."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.gate_up_proj = _p(E, H, 2 * I)
        self.down_proj = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        w, ids = torch.topk(self.gate(x), K, dim=-1)
        w = torch.softmax(w, dim=-1)
        flat = ids.reshape(-1)
        xs = x[:, None, :].expand(T, K, H).reshape(-1, 1, H)
        gu = torch.bmm(xs, self.gate_up_proj[flat])
        gate, up = gu[..., ::2], gu[..., 1::2]
        y = torch.bmm(F.silu(gate) * up, self.down_proj[flat]).reshape(T, K, H)
        return (y * w[..., None]).sum(1)


# 15
class BiasedExpertsBaddbmm(nn.Module):
    """experts with biases via torch.baddbmm over x.expand(E,T,H), dense [T,E] gate table (e.g. Phi/MegaBlocks-style biased experts)."""

    def __init__(self):
        super().__init__()
        self.gate = _p(E, H)
        self.w_gate = _p(E, H, I)
        self.b_gate = _p(E, I)
        self.w_up = _p(E, H, I)
        self.b_up = _p(E, I)
        self.w_down = _p(E, I, H)
        self.b_down = _p(E, H)

    def forward(self, x):
        T = x.shape[0]
        probs = (x @ self.gate.t()).softmax(-1)
        w, ids = probs.topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        table = torch.zeros_like(probs).scatter(-1, ids, w)
        xe = x.unsqueeze(0).expand(E, T, H)
        g = torch.baddbmm(self.b_gate.unsqueeze(1), xe, self.w_gate)
        u = torch.baddbmm(self.b_up.unsqueeze(1), xe, self.w_up)
        y = torch.baddbmm(self.b_down.unsqueeze(1), F.silu(g) * u, self.w_down)  # [E, T, H]
        return (y * table.t().unsqueeze(-1)).sum(0)


# 16
class SortedScatterAddCombine(nn.Module):
    """sort token-slots by expert (argsort of flat ids), gathered weights + bmm, weighted rows combined with scatter_add_ (no unsort)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.w1 = _p(E, H, I)
        self.w3 = _p(E, H, I)
        self.w2 = _p(E, I, H)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        flat_ids = ids.view(-1)
        order = flat_ids.argsort()
        sorted_ids = flat_ids[order]
        token_idx = order // K
        sorted_w = w.view(-1)[order]
        xs = x[token_idx].unsqueeze(1)
        h = F.silu(torch.bmm(xs, self.w1[sorted_ids])) * torch.bmm(xs, self.w3[sorted_ids])
        ys = torch.bmm(h, self.w2[sorted_ids]).squeeze(1) * sorted_w.unsqueeze(-1)
        out = torch.zeros_like(x)
        out.scatter_add_(0, token_idx.unsqueeze(-1).expand(-1, H), ys)
        return out


# 17
class IndexPutAccumulateCombine(nn.Module):
    """Qwen3-MoE router (softmax dim=1 float, topk, renorm, .to(dtype)); per-slot gathered einsum experts; index_put_(accumulate=True) combine."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.gate_proj = _p(E, H, I)
        self.up_proj = _p(E, H, I)
        self.down_proj = _p(E, I, H)

    def forward(self, hidden_states):
        T = hidden_states.shape[0]
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, K, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        token_idx = torch.arange(T, device=hidden_states.device).unsqueeze(1).expand(T, K).reshape(-1)
        e = selected_experts.reshape(-1)
        xs = hidden_states[token_idx]
        h = F.silu(torch.einsum("nh,nhi->ni", xs, self.gate_proj[e])) * torch.einsum(
            "nh,nhi->ni", xs, self.up_proj[e]
        )
        y = torch.einsum("ni,nih->nh", h, self.down_proj[e]) * routing_weights.reshape(-1, 1)
        out = torch.zeros_like(hidden_states)
        out.index_put_((token_idx,), y, accumulate=True)
        return out


# 18
class SortedIndexCopyUnsort(nn.Module):
    """argsort of flat ids, gathered sorted x, gathered weights + einsum, unsort with index_copy, then view(T,K,H)*w[...,None]).sum(1)."""

    def __init__(self):
        super().__init__()
        self.gate = _p(E, H)
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        logits = F.linear(x, self.gate)
        w, ids = torch.topk(logits.softmax(-1), K)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        flat = ids.view(-1)
        perm = torch.argsort(flat)
        se = flat[perm]
        xs = x.index_select(0, perm // K)
        h = F.silu(torch.einsum("nh,nhi->ni", xs, self.w_gate[se])) * torch.einsum("nh,nhi->ni", xs, self.w_up[se])
        ys = torch.einsum("ni,nih->nh", h, self.w_down[se])
        y = torch.empty_like(ys).index_copy_(0, perm, ys)
        return (y.view(T, K, H) * w[..., None]).sum(1)


# 19
class BincountSplitInversePerm(nn.Module):
    """sort by expert, torch.split at bincount(minlength=E).tolist() sizes, per-expert matmuls, torch.cat, unsort via inverse permutation (perm.argsort())."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.w1 = _p(E, H, I)
        self.w3 = _p(E, H, I)
        self.w2 = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        probs = torch.softmax(self.gate(x), dim=-1)
        w, ids = probs.topk(K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)
        perm = flat.argsort()
        xs = x[perm // K]
        counts = torch.bincount(flat, minlength=E)
        chunks = torch.split(xs, counts.tolist(), dim=0)
        outs = []
        for e, chunk in enumerate(chunks):
            outs.append((F.silu(chunk @ self.w1[e]) * (chunk @ self.w3[e])) @ self.w2[e])
        ys = torch.cat(outs, dim=0)
        inv = perm.argsort()
        y = ys[inv]
        return (y.view(T, K, H) * w[..., None]).sum(1)


# 20
class GShardEinsumDispatchCombine(nn.Module):
    """GShard / fairseq top2gating: one-hot cumsum slot positions, dispatch/combine tensors [T,E,2T] (capacity never drops), einsum 'tec,th->ech', bmm experts, einsum 'tec,ech->th'."""

    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.wg.weight.data = torch.randn(E, H) * 0.1
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        C = T
        gates = F.softmax(self.wg(x), dim=1)
        indices1 = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(indices1, num_classes=E)
        logits_except1 = gates.masked_fill(mask1.bool(), float("-inf"))
        indices2 = torch.argmax(logits_except1, dim=1)
        mask2 = F.one_hot(indices2, num_classes=E)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1
        locations2 += torch.sum(mask1, dim=0, keepdim=True)
        gates1_s = (gates * mask1).sum(dim=1)
        gates2_s = (gates * mask2).sum(dim=1)
        denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
        gates1_s = gates1_s / denom_s
        gates2_s = gates2_s / denom_s
        locations1_s = torch.sum(locations1 * mask1, dim=1)
        locations2_s = torch.sum(locations2 * mask2, dim=1)
        gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)  # [T, E]
        gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
        locations1_sc = F.one_hot(locations1_s, num_classes=2 * C).to(gates.dtype)  # [T, C']
        locations2_sc = F.one_hot(locations2_s, num_classes=2 * C).to(gates.dtype)
        combine1_sec = torch.einsum("se,sc->sec", gates1, locations1_sc)
        combine2_sec = torch.einsum("se,sc->sec", gates2, locations2_sc)
        combine_weights = combine1_sec + combine2_sec  # [T, E, 2C]
        dispatch_mask = combine_weights.bool().to(x.dtype)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask, x)  # [E, 2C, H]
        h = F.silu(torch.bmm(dispatched, self.w_gate)) * torch.bmm(dispatched, self.w_up)
        expert_out = torch.bmm(h, self.w_down)
        return torch.einsum("sec,ecm->sm", combine_weights, expert_out)


# 21
class OneHotCombineDenseBmm(nn.Module):
    """gate nn.Parameter used as x @ w.t(), softmax dim=1; combine table (F.one_hot(ids,E)*w[...,None]).sum(1); bmm over every expert for every token."""

    def __init__(self):
        super().__init__()
        self.gate_weight = _p(E, H)
        self.w_gate = _p(E, H, I)
        self.w_up = _p(E, H, I)
        self.w_down = _p(E, I, H)

    def forward(self, x):
        T = x.shape[0]
        probs = torch.softmax(x @ self.gate_weight.t(), dim=1)
        w, ids = torch.topk(probs, K, dim=1)
        w = w / w.sum(dim=1, keepdim=True)
        combine = (F.one_hot(ids, E).to(x.dtype) * w[..., None]).sum(1)  # [T, E]
        xe = x.expand(E, T, H)
        h = F.silu(torch.bmm(xe, self.w_gate)) * torch.bmm(xe, self.w_up)
        y = torch.bmm(h, self.w_down)  # [E, T, H]
        return (combine.t()[..., None] * y).sum(0)


# 22
class DbrxFusedViewLoop(nn.Module):
    """DBRX: softmax->topk, p=1 norm (torch.norm) renorm; w1/v1/w2 stored as [E*I, H] viewed per expert; loop with torch.where over the expert mask."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(H, E, bias=False)
        self.layer.weight.data = torch.randn(E, H) * 0.1
        self.w1 = _p(E * I, H)
        self.v1 = _p(E * I, H)
        self.w2 = _p(E * I, H)

    def forward(self, x):
        weights = self.layer(x).softmax(dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(weights, K, dim=-1)
        top_weights = top_weights / torch.norm(top_weights, p=1, dim=-1, keepdim=True)
        top_weights = top_weights.to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(top_experts, num_classes=E).permute(2, 1, 0)
        w1 = self.w1.view(E, I, H)
        v1 = self.v1.view(E, I, H)
        w2 = self.w2.view(E, I, H)
        for expert_idx in range(E):
            topk_idx, token_idx = torch.where(expert_mask[expert_idx])
            if token_idx.shape[0] == 0:
                continue
            expert_tokens = x[None, token_idx].reshape(-1, H)
            x1 = expert_tokens.matmul(w1[expert_idx].t())
            x2 = expert_tokens.matmul(v1[expert_idx].t())
            h = F.silu(x1) * x2
            h = h.matmul(w2[expert_idx])
            expert_out = h * top_weights[token_idx, topk_idx, None]
            out.index_add_(0, token_idx, expert_out)
        return out


# 23
class HFv5MixtralExpertsHitLoop(nn.Module):
    """transformers v5 MixtralExperts: stacked gate_up_proj [E,2I,H] / down_proj [E,H,I], expert_hit nonzero loop, F.linear + chunk, index_add_."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.gate_up_proj = _p(E, 2 * I, H)
        self.down_proj = _p(E, H, I)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        top_k_weights, top_k_index = torch.topk(routing_weights, K, dim=-1)
        top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
        top_k_weights = top_k_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=E).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == E:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states


# 24
class OutMajorGatherTransposeBmm(nn.Module):
    """weights stored out-major [E, I, H] / [E, H, I] (nn.Linear layout), gathered per token-slot and used with .transpose(1, 2) + bmm."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.w1 = _p(E, I, H)
        self.w3 = _p(E, I, H)
        self.w2 = _p(E, H, I)

    def forward(self, x):
        T = x.shape[0]
        probs = self.gate(x).softmax(dim=-1)
        w, ids = probs.topk(K)
        w = w / w.sum(-1, keepdim=True)
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(K, 0).unsqueeze(1)
        h = F.silu(torch.bmm(xs, self.w1[flat].transpose(1, 2))) * torch.bmm(xs, self.w3[flat].transpose(1, 2))
        y = torch.bmm(h, self.w2[flat].transpose(1, 2)).view(T, K, H)
        return torch.sum(y * w.unsqueeze(2), dim=1)


# 25
class Grok1GeluNoNormDense(nn.Module):
    """Grok-1 style: softmax top-2 probs, no renorm, GELU-gated experts (gelu(x@w)*(x@v))@w1, dense einsum over experts + scatter gate table."""

    def __init__(self):
        super().__init__()
        self.router = _p(E, H)
        self.linear = _p(E, H, I)
        self.linear_v = _p(E, H, I)
        self.linear_1 = _p(E, I, H)

    def forward(self, x):
        probs = F.softmax(F.linear(x, self.router).float(), dim=-1).to(x.dtype)
        w, ids = torch.topk(probs, K)
        table = torch.zeros_like(probs)
        table.scatter_(1, ids, w)
        g = torch.einsum("th,ehi->eti", x, self.linear)
        v = torch.einsum("th,ehi->eti", x, self.linear_v)
        y = torch.einsum("eti,eih->eth", F.gelu(g) * v, self.linear_1)
        return (y * table.t()[..., None]).sum(0)


# 26
class MaskedTopkSoftmaxStackedLoop(nn.Module):
    """top-k by masking non-top-k logits to -inf then full softmax (OLMoE/JetMoE-ish); loop over stacked self.w1[e] with per-expert weight column."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.gate.weight.data = torch.randn(E, H) * 0.1
        self.w1 = _p(E, H, I)
        self.w3 = _p(E, H, I)
        self.w2 = _p(E, I, H)

    def forward(self, x):
        logits = self.gate(x)
        kth = torch.topk(logits, K, dim=-1).values[:, -1:]
        masked = logits.masked_fill(logits < kth, float("-inf"))
        gates = torch.softmax(masked, dim=-1)  # [T, E], zero outside the top-k
        out = torch.zeros_like(x)
        for e in range(E):
            h = F.silu(x @ self.w1[e]) * (x @ self.w3[e])
            out = out + gates[:, e, None] * (h @ self.w2[e])
        return out


BLOCKS = [
    Qwen2MoeRenormGatherBmm,
    MixtralTopkSoftmaxGatherEinsum,
    QwenNoNormDenseEinsum,
    DeepSeekV3SigmoidBiasGate,
    DeepSeekV3GroupLimitedPaddedBmm,
    DeepSeekMoeInferSortedSlices,
    SortTopkRepeatInterleaveRows,
    ArgsortTopkJoinedGateUp,
    SwitchTop1MaxStackedLoop,
    ArgmaxGatherTop1,
    Float32RouterOutMajorLoop,
    Llama4SigmoidInputScaled,
    GptOssInterleavedClampBias,
    InterleavedGateUpSiluGather,
    BiasedExpertsBaddbmm,
    SortedScatterAddCombine,
    IndexPutAccumulateCombine,
    SortedIndexCopyUnsort,
    BincountSplitInversePerm,
    GShardEinsumDispatchCombine,
    OneHotCombineDenseBmm,
    DbrxFusedViewLoop,
    HFv5MixtralExpertsHitLoop,
    OutMajorGatherTransposeBmm,
    Grok1GeluNoNormDense,
    MaskedTopkSoftmaxStackedLoop,
]
