"""DeepSeek-V3/R1's Hugging Face remote code as shipped: noaux_tc sigmoid gate and the unpatched moe_infer.

Mirrors 1nl00k/inspectR1 `modeling_deepseek.py` at commit a412072 ("original R1 files": the remote code and
config of the deepseek-ai/DeepSeek-R1 hub repository, which is DeepSeek-V3's architecture and code,
`DeepseekV3*` classes; the hub repositories themselves are not among the stored copies). Read: `MoEGate`
(`__init__`, `forward`), `DeepseekV3MoE` (`__init__`, `forward`, `moe_infer`), `DeepseekV3MLP`,
`DeepseekV3DecoderLayer` (how the MoE is called: `hidden_states = self.mlp(hidden_states)` after the post-
attention RMSNorm, the residual added outside), and `config_r1.json`.
The gate flattens [B, S, H] to [T, H] and scores it with a float32 `F.linear` and a sigmoid (other scoring
functions raise). Only `topk_method == "noaux_tc"` is implemented (it asserts `not self.training`): the
correction bias is added for the choice only, each of the `n_group` groups is ranked by the sum of its two
best biased scores, the `topk_group` best groups are marked in a zero [T, n_group] mask with `scatter_`,
the mask is expanded to [T, E] and the other experts' biased scores are set to 0.0 (not -inf) with
`masked_fill`, an unsorted `topk` picks the experts and the UNbiased sigmoid scores are gathered as weights;
with top_k > 1 and `norm_topk_prob` they are divided by their sum + 1e-20, and always multiplied by
`routed_scaling_factor`. The layer keeps its input for the shared expert, views tokens flat, computes (and
never uses) `flat_topk_idx`, and only `if not self.training` assigns `y = moe_infer(...)`.
`moe_infer` runs under `@torch.no_grad()`: a [T, E] zero table gets ones scattered at the chosen ids and is
summed into per-expert counts, the flat ids are argsorted and the tokens gathered in that order
(`x[idxs // top_k]`), the counts go to the host with `.cpu().numpy()`, and
`for i, num_tokens in enumerate(counts)` advances an end offset, skips `if num_tokens == 0: continue`,
runs `experts[i + ep_rank * experts_per_rank]` on the contiguous slice and appends the result; the outputs
are `torch.cat`ed (or `new_empty(0)` when none), un-permuted with `new_x[idxs] = outs`, viewed [T, k, H],
cast to the weights' dtype, scaled in place with `.mul_(weight.unsqueeze(-1))`, summed over k and cast
back. The shared expert (`moe_intermediate_size * n_shared_experts` wide) is added to the viewed result.
Experts are gate_proj/up_proj/down_proj `nn.Linear`s, `down(act(gate(x)) * up(x))`, act = silu.
Tiny sizes keep the group-limited gate: 8 experts in 4 groups of 2, the best 2 groups kept, top-2, one
shared expert, scaling 2.5 (the real config: 256 experts, 8 groups, 4 kept, top-8, one shared expert,
moe_intermediate_size 2048, hidden 7168, scaling 2.5, `norm_topk_prob` true, `ep_size` 1).
Left out: the `ep_size > 1` branches of `__init__` and `moe_infer` (all-to-all token exchange, numpy
re-sorting of the gathered tokens): they need several processes and the released config has ep_size 1, so
they are dead here (the `ep_rank * experts_per_rank` offset is kept); `reset_parameters`' kaiming init (the
corpus shell draws all weights). There is no training branch to leave out: the original has none.
Constructs: `@torch.no_grad()` on `moe_infer`, `if not self.training` guarding the only assignment of `y`,
an `assert not self.training` in the gate, a `scatter_` count table, argsort + `//` token gather,
`.cpu().numpy()` counts walked by `for i, n in enumerate(counts)` with `if n == 0: continue`, numpy-int
slice bounds, `torch.cat` of a Python list with an empty fallback, index-put un-permutation, in-place `mul_`
combine, 0.0-masked group-limited sigmoid top-k with a correction bias, an unused `view`, a shared expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("1nl00k/inspectR1", "modeling_deepseek.py", "a412072b2aadf0ea05489ff094f70713679b236d",
                "DeepseekV3MoE.moe_infer")
HIDDEN, INTER, EXPERTS, TOP_K, GROUPS, TOP_GROUPS, SHARED = 16, 8, 8, 2, 4, 2, 1
ROUTED_SCALING = 2.5


class DeepseekV3MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k = TOP_K
        self.n_routed_experts = EXPERTS
        self.routed_scaling_factor = ROUTED_SCALING
        self.scoring_func = "sigmoid"
        self.seq_aux = True
        self.topk_method = "noaux_tc"
        self.n_group, self.topk_group = GROUPS, TOP_GROUPS
        self.norm_topk_prob = True
        self.gating_dim = HIDDEN
        self.weight = nn.Parameter(torch.empty(self.n_routed_experts, self.gating_dim))
        if self.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(self.n_routed_experts))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        n = bsz * seq_len
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise NotImplementedError(f"unsupported scoring function for MoE gating: {self.scoring_func}")

        if self.topk_method == "noaux_tc":
            assert not self.training
            biased = scores.view(n, -1) + self.e_score_correction_bias.unsqueeze(0)
            group_scores = biased.view(n, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [n, n_group]
            kept_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, kept_groups, 1)
            expert_mask = (
                group_mask.unsqueeze(-1)
                .expand(n, self.n_group, self.n_routed_experts // self.n_group)
                .reshape(n, -1)
            )  # [n, E]
            candidates = biased.masked_fill(~expert_mask.bool(), 0.0)
            _, topk_idx = torch.topk(candidates, k=self.top_k, dim=-1, sorted=False)
            topk_weight = scores.gather(1, topk_idx)
        else:
            raise NotImplementedError(f"unsupported TopK function for MoE gating: {self.topk_method}")

        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class DeepseekV3MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts_per_tok = TOP_K
        self.n_shared_experts = SHARED
        # ep_size > 1 (experts of other ranks left as None) is not built: one process.
        self.ep_size = 1
        self.experts_per_rank = EXPERTS
        self.ep_rank = 0
        self.experts = nn.ModuleList(DeepseekV3MLP(HIDDEN, INTER) for _ in range(EXPERTS))
        self.gate = MoEGate()
        if self.n_shared_experts is not None:
            self.shared_experts = DeepseekV3MLP(HIDDEN, INTER * self.n_shared_experts)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)  # noqa: F841 - computed and never used, as in the original
        if not self.training:
            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        if self.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        counts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        counts.scatter_(1, topk_ids, 1)
        tokens_per_expert = counts.sum(dim=0)
        order = topk_ids.view(-1).argsort()
        sorted_tokens = x[order // topk_ids.shape[1]]
        # ep_size > 1 (all_to_all of counts and tokens, numpy re-sort of the gathered rows) left out.
        tokens_per_expert = tokens_per_expert.cpu().numpy()

        outputs = []
        start = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end = start + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            rows = sorted_tokens[start:end]
            outputs.append(expert(rows))
            start = end

        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        # ep_size > 1 (all_to_all of the outputs back to their ranks) left out.
        new_x = torch.empty_like(outs)
        new_x[order] = outs
        return (
            new_x.view(*topk_ids.shape, -1)
            .type(topk_weight.dtype)
            .mul_(topk_weight.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(new_x.dtype)
        )


def build():
    return tiny(DeepseekV3MoE, HIDDEN)
