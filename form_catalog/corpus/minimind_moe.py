"""MiniMind's MOEFeedForward: DeepSeek-style gate, argsort + host bincount/cumsum offsets, scatter_add_ combine.

Mirrors jingyaogong/minimind `model/model_minimind.py` at commit c090b69 (`MiniMindConfig` MoE fields,
`FeedForward`, `MoEGate`, `MOEFeedForward.forward`, `MOEFeedForward.moe_infer`), the last commit of that
file with this layer: the "minimind-3" rewrite (101d7df, the newest snapshot read, d65ef2c) replaced it by a
per-expert `mask.any()` / `nonzero` / `index_add_` loop without gate class or shared experts. The gate
flattens [B, S, H] to tokens, scores a bias-free `F.linear` with a softmax (any other `scoring_func`
raises), takes the unsorted top-k and, when top_k > 1 and `norm_topk_prob` (on by default), divides by the
sum + 1e-20; in training with `aux_loss_alpha > 0` it computes a sequence-level (`scatter_add_` of ones
into [B, E], in-place `div_`) or token-level (`one_hot` mean) balance loss, otherwise a zero scalar from
`new_zeros(1).squeeze()`. The layer keeps the input as the shared experts' input, flattens tokens and the
expert ids, and in training repeats each token top_k times (`repeat_interleave`), runs every expert on its
boolean-mask rows into an `empty_like` buffer (an expert with no rows writes its empty output plus
0 * the sum of its parameters), then weights and sums over the top_k axis. In eval it calls `moe_infer`
(under `@torch.no_grad()`): zero buffer, `argsort` of the flat ids, `bincount()` (no minlength, so trailing
unused experts are never visited) read to numpy and `cumsum(0)`, token rows `idxs // top_k`, and a loop
`for i, end_idx in enumerate(...)` whose start is the previous offset, skipping `if start_idx == end_idx`,
gathering the expert's rows, casting its output to the buffer's dtype, scaling it in place (`mul_`) by the
flat weights picked through the sorted order and adding it with `scatter_add_` on a `repeat`ed index. Each
shared expert (a ModuleList of `n_shared_experts` MLPs the routed size) is then added on the layer's input
in a Python loop, and the gate's loss is stored as `self.aux_loss` on the module. Experts are SwiGLU MLPs
(`ACT2FN["silu"]`, here `nn.SiLU`) followed by a dropout (p = 0.0 by default).
Left out: the config's attention/rope fields and the `PretrainedConfig` base (a plain local class carries
the MoE fields); `MoEGate.reset_parameters`' kaiming init is kept but overwritten by the corpus weights.
Constructs: `@torch.no_grad()` on `moe_infer`, `if self.training` branches in gate and layer,
`.cpu().numpy().cumsum(0)` offsets with numpy scalars as slice bounds, a `for ... enumerate(offsets)` loop
with `if start == end: continue`, in-place `mul_` / `scatter_add_`, a module attribute written in forward,
config attributes read in forward, a Python loop over shared experts, boolean-mask gathers/index-puts and a
shape-dependent `if` in the training branch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "jingyaogong/minimind",
    "model/model_minimind.py",
    "c090b69c4d41a2288301b600c9ca040127db0134",
    "MOEFeedForward.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 4, 2, 1


class MiniMindConfig:
    def __init__(
        self,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        dropout=0.0,
        hidden_act="silu",
        num_experts_per_tok=TOP_K,
        n_routed_experts=EXPERTS,
        n_shared_experts=SHARED,
        scoring_func="softmax",
        aux_loss_alpha=0.01,
        seq_aux=True,
        norm_topk_prob=True,
    ):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.dropout, self.hidden_act = dropout, hidden_act
        self.num_experts_per_tok, self.n_routed_experts = num_experts_per_tok, n_routed_experts
        self.n_shared_experts, self.scoring_func = n_shared_experts, scoring_func
        self.aux_loss_alpha, self.seq_aux, self.norm_topk_prob = aux_loss_alpha, seq_aux, norm_topk_prob


class FeedForward(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        if config.intermediate_size is None:
            config.intermediate_size = 64 * ((int(config.hidden_size * 8 / 3) + 64 - 1) // 64)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.dropout(self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class MoEGate(nn.Module):
    def __init__(self, config: MiniMindConfig):
        super().__init__()
        self.config = config
        self.top_k, self.n_routed_experts = config.num_experts_per_tok, config.n_routed_experts
        self.scoring_func, self.alpha, self.seq_aux = (
            config.scoring_func,
            config.aux_loss_alpha,
            config.seq_aux,
        )
        self.norm_topk_prob, self.gating_dim = config.norm_topk_prob, config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, self.gating_dim)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            raise NotImplementedError(f"scoring function {self.scoring_func} is not supported")
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator

        if self.training and self.alpha > 0.0:
            scores_aux, k_aux = scores, self.top_k
            idx_aux = topk_idx.view(bsz, -1)
            if self.seq_aux:
                seq_scores = scores_aux.view(bsz, seq_len, -1)
                ce = torch.zeros(bsz, self.n_routed_experts, device=hidden_states.device)
                ce.scatter_add_(
                    1, idx_aux, torch.ones(bsz, seq_len * k_aux, device=hidden_states.device)
                ).div_(seq_len * k_aux / self.n_routed_experts)
                aux_loss = (ce * seq_scores.mean(dim=1)).sum(dim=1).mean() * self.alpha
            else:
                ce = F.one_hot(idx_aux.view(-1), num_classes=self.n_routed_experts).float().mean(0)
                p_mean = scores_aux.mean(0)
                f_load = ce * self.n_routed_experts
                aux_loss = (p_mean * f_load).sum() * self.alpha
        else:
            aux_loss = scores.new_zeros(1).squeeze()
        return topk_idx, topk_weight, aux_loss


class MOEFeedForward(nn.Module):
    def __init__(self, config: MiniMindConfig | None = None):
        super().__init__()
        config = config or MiniMindConfig()
        self.config = config
        self.experts = nn.ModuleList([FeedForward(config) for _ in range(config.n_routed_experts)])
        self.gate = MoEGate(config)
        if config.n_shared_experts > 0:
            self.shared_experts = nn.ModuleList([FeedForward(config) for _ in range(config.n_shared_experts)])

    def forward(self, x):
        identity = x
        orig_shape = x.shape
        bsz, seq_len, _ = x.shape
        topk_idx, topk_weight, aux_loss = self.gate(x)
        x = x.view(-1, x.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.training:
            x = x.repeat_interleave(self.config.num_experts_per_tok, dim=0)
            y = torch.empty_like(x, dtype=x.dtype)
            for i, expert in enumerate(self.experts):
                expert_out = expert(x[flat_topk_idx == i])
                if expert_out.shape[0] > 0:
                    y[flat_topk_idx == i] = expert_out.to(y.dtype)
                else:
                    y[flat_topk_idx == i] = expert_out.to(y.dtype) + 0 * sum(
                        p.sum() for p in expert.parameters()
                    )
            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.view(*orig_shape)
        else:
            y = self.moe_infer(x, flat_topk_idx, topk_weight.view(-1, 1)).view(*orig_shape)
        if self.config.n_shared_experts > 0:
            for expert in self.shared_experts:
                y = y + expert(identity)
        self.aux_loss = aux_loss
        return y

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        expert_cache = torch.zeros_like(x)
        idxs = flat_expert_indices.argsort()
        tokens_per_expert = flat_expert_indices.bincount().cpu().numpy().cumsum(0)
        token_idxs = idxs // self.config.num_experts_per_tok
        for i, end_idx in enumerate(tokens_per_expert):
            start_idx = 0 if i == 0 else tokens_per_expert[i - 1]
            if start_idx == end_idx:
                continue
            expert = self.experts[i]
            exp_token_idx = token_idxs[start_idx:end_idx]
            expert_tokens = x[exp_token_idx]
            expert_out = expert(expert_tokens).to(expert_cache.dtype)
            expert_out.mul_(flat_expert_weights[idxs[start_idx:end_idx]])
            expert_cache.scatter_add_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out)
        return expert_cache


def build():
    return tiny(MOEFeedForward, HIDDEN)
