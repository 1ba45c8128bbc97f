"""Kimi-Linear's remote-code KimiSparseMoeBlock: an in-place biased sigmoid gate and a host-count moe_infer.

Mirrors troy12x/quasar-kimi `modeling_kimi.py` at commit 153735f, a copy of the `modeling_kimi.py` remote
code of the moonshotai/Kimi-Linear-48B-A3B hub repositories (the hub repositories themselves are not among
the stored copies; MoonshotAI/Kimi-Linear on GitHub holds only the README and report), next to its
`config.json` (`model_type` "kimi_linear"). Read: `KimiMoEGate` (`__init__`, `forward`),
`KimiSparseMoeBlock` (`__init__`, `forward`, `moe_infer`), `KimiBlockSparseMLP`, `KimiMLP`, and how
`KimiDecoderLayer` calls the block (`self.block_sparse_moe(hidden_states)` after the post-attention RMSNorm,
the residual added outside).
The gate reads [B, S, H], flattens it to [T, H] and scores it with a float32 `F.linear` against its own
[E, H] weight, then a sigmoid (a softmax for "softmax"; any other name raises). It asserts
`not self.training`. `scores_for_choice` is `scores.view(T, -1)` -- the same shape, so a view of the very
scores -- and the correction bias is added to it IN PLACE (`+=`), so the bias also lands in `scores` and in
the weights gathered from them later. The group-limited choice runs unconditionally: each of the
`num_expert_group` groups is ranked by the sum of its two best (biased) scores, the `topk_group` best groups
are marked with `scatter_` in a zero [T, G] table, the table is expanded to [T, E], and the other experts'
scores are set to 0.0 (not -inf) with `masked_fill`. An unsorted `topk` picks the experts, the weights are
`scores.gather` (bias included, see above), divided by their sum + 1e-20 when top_k > 1 and
`moe_renormalize`, and always multiplied by `routed_scaling_factor`.
The block keeps its input for the shared expert, gets (ids, weights) from the gate, views tokens flat,
computes and never uses `flat_topk_idx`, and `if not self.training` runs `moe_infer` and views the result
back (`else: raise NotImplementedError`). `moe_infer` runs under `@torch.no_grad()`: a [T, E] zero table
gets ones scattered at the chosen ids and is summed into per-expert counts, the flat ids are argsorted and
the tokens gathered in that order (`x[idxs // top_k]`), the counts go to the host with `.cpu().numpy()`,
and `for i, num_tokens in enumerate(counts)` advances an end offset, skips `if num_tokens == 0: continue`,
runs `experts[i + ep_rank * experts_per_rank]` on the contiguous slice and appends the output; the outputs
are `torch.cat`ed (or `new_empty(0)` when there are none), un-permuted with `new_x[idxs] = outs`, viewed
[T, k, H], cast to the weights' dtype, scaled in place with `.mul_(w.unsqueeze(-1))`, summed over k and
cast back. When `num_shared_experts` is set, one shared MLP (`moe_intermediate_size * num_shared_experts`
wide) is run on the kept input and added. Routed experts are `w2(act(w1(x)) * w3(x))` (w1 gate, w3 up,
w2 down), the shared expert `down(act(gate(x)) * up(x))`; act is `ACT2FN["silu"]`, here `nn.SiLU`.
Tiny sizes keep the released routing: sigmoid scores, one expert group with `topk_group` 1 (so the group
mask keeps every expert), renormalisation on, scaling 2.446, one shared expert; 8 experts and top-2 stand
for the real 256 experts and top-8 (hidden 2304, moe_intermediate_size 1024 in the copy's config).
`build()` shrinks the correction bias to a tenth of the shell's draw so the biased weights stay positive
(the shell draws it from N(0, 1), larger than sigmoid scores; the real bias is learned and small).
Left out: `reset_parameters`' kaiming init (the corpus shell draws every weight); the `PretrainedConfig`
base (a plain local class carries the fields the layer reads). Nothing in the layer is distributed or a
custom kernel (the expert-parallel attributes are fixed at ep_size 1, rank 0, and kept in the index).
Constructs: an in-place `+=` of the bias into a view aliasing the scores, `assert not self.training`, an
unconditional group-limited top-k with `scatter_` / `expand` / 0.0 `masked_fill`, `@torch.no_grad()` on
`moe_infer`, `if not self.training: ... else: raise`, an unused `view`, a `scatter_` count table, argsort
+ `//` token gather, `.cpu().numpy()` counts walked by `for i, n in enumerate(counts)` with
`if n == 0: continue`, numpy-int slice bounds, `torch.cat` of a Python list with an empty fallback,
index-put un-permutation, an in-place `mul_` combine, config attributes read in forward, a shared expert.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "troy12x/quasar-kimi",
    "modeling_kimi.py",
    "153735fdfeb5d1942406f7f7a47f9cae35e3e3c6",
    "KimiSparseMoeBlock.moe_infer",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class KimiLinearConfig:
    """The MoE fields of the kimi_linear config the block and gate read."""

    def __init__(
        self,
        hidden_size=HIDDEN,
        hidden_act="silu",
        intermediate_size=4 * HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_token=TOP_K,
        num_expert_group=1,
        topk_group=1,
        num_shared_experts=1,
        moe_renormalize=True,
        moe_router_activation_func="sigmoid",
        routed_scaling_factor=2.446,
    ):
        self.hidden_size, self.hidden_act = hidden_size, hidden_act
        self.intermediate_size, self.moe_intermediate_size = intermediate_size, moe_intermediate_size
        self.num_experts, self.num_experts_per_token = num_experts, num_experts_per_token
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.num_shared_experts = num_shared_experts
        self.moe_renormalize = moe_renormalize
        self.moe_router_activation_func = moe_router_activation_func
        self.routed_scaling_factor = routed_scaling_factor


class KimiBlockSparseMLP(nn.Module):
    """One routed expert, checkpoint names: w1 gate, w3 up, w2 down."""

    def __init__(self, config: KimiLinearConfig, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.ffn_dim = config.intermediate_size if intermediate_size is None else intermediate_size
        self.hidden_dim = config.hidden_size if hidden_size is None else hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        gated = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(gated)


class KimiMLP(nn.Module):
    """The shared expert: down(act(gate(x)) * up(x))."""

    def __init__(self, config: KimiLinearConfig, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class KimiMoEGate(nn.Module):
    """DeepSeek-V3's MoEGate under Kimi's names (num_experts, num_experts_per_token, num_expert_group)."""

    def __init__(self, config: KimiLinearConfig):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_token
        self.num_experts = config.num_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.moe_router_activation_func = config.moe_router_activation_func
        self.num_expert_group = getattr(config, "num_expert_group", 1)
        self.topk_group = getattr(config, "topk_group", 1)
        self.moe_renormalize = config.moe_renormalize
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.num_experts, self.gating_dim)))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # reset_parameters (redrawn by the shell)

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
        if self.moe_router_activation_func == "sigmoid":
            scores = logits.sigmoid()
        elif self.moe_router_activation_func == "softmax":
            scores = logits.softmax(dim=1)
        else:
            raise NotImplementedError(
                f"insupportable scoring function for MoE gating: {self.moe_router_activation_func}"
            )

        assert not self.training
        # Same shape as `scores`: this is a view of them, and the in-place add below writes the bias into
        # `scores` too (so the gathered weights carry it), exactly as in the remote code.
        scores_for_choice = scores.view(bsz * seq_len, -1)
        scores_for_choice += self.e_score_correction_bias.unsqueeze(0)
        n = bsz * seq_len
        group_scores = scores_for_choice.view(n, self.num_expert_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]  # [n, topk_group]
        group_mask = torch.zeros_like(group_scores)  # [n, G]
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(n, self.num_expert_group, self.num_experts // self.num_expert_group)
            .reshape(n, -1)
        )  # [n, E]
        tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
        _, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
        topk_weight = scores.gather(1, topk_idx)

        if self.top_k > 1 and self.moe_renormalize:
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class KimiSparseMoeBlock(nn.Module):
    """DeepSeek-V3's MoE block under Kimi's names."""

    def __init__(self, config: KimiLinearConfig | None = None):
        super().__init__()
        config = config or KimiLinearConfig()
        self.config = config
        self.hidden_dim = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.moe_renormalize = config.moe_renormalize
        # Expert parallelism is fixed at one rank in the remote code.
        self.ep_size = 1
        self.experts_per_rank = config.num_experts
        self.ep_rank = 0
        self.experts = nn.ModuleList(
            [
                KimiBlockSparseMLP(config, intermediate_size=config.moe_intermediate_size)
                for _ in range(config.num_experts)
            ]
        )
        self.gate = KimiMoEGate(config)
        if config.num_shared_experts is not None:
            intermediate_size = config.moe_intermediate_size * config.num_shared_experts
            self.shared_experts = KimiMLP(config=config, intermediate_size=intermediate_size)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)  # noqa: F841 - computed and never used, as in the original
        if not self.training:
            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        else:
            raise NotImplementedError("Training mode is not supported in KimiSparseMoeBlock")
        if self.config.num_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
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
            expert = self.experts[i + self.ep_rank * self.experts_per_rank]
            expert_out = expert(sorted_tokens[start_idx:end_idx])
            outputs.append(expert_out)
            start_idx = end_idx

        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)

        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (
            new_x.view(*topk_ids.shape, -1)
            .type(topk_weight.dtype)
            .mul_(topk_weight.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(new_x.dtype)
        )


def build():
    model, inputs = tiny(KimiSparseMoeBlock, HIDDEN)
    with torch.no_grad():
        for moe in model.moes:
            moe.gate.e_score_correction_bias.mul_(0.1)
    return model, inputs
