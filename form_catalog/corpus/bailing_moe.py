"""Ling (Bailing) MoE's BailingMoeSparseMoeBlock: scatter_ counts read to numpy, sorted tokens, cat + index-put.

Mirrors inclusionAI/Ling `models/modeling_bailing_moe.py` at commit 5ccaeae (`BailingMoeConfig` MoE fields
from `models/configuration_bailing_moe.py`, `BailingMoeMLP`, `BailingMoeGate`,
`BailingMoeSparseMoeBlock.forward`, `BailingMoeSparseMoeBlock.moe_infer`); the file was last changed in
ceb3476 ("update modeling code"). The gate flattens [B, S, H] to tokens, scores a bias-free `F.linear`,
takes a float32 softmax (`softmax(dim=-1, dtype=torch.float32)`), the top-k with `sorted=sort` (a keyword
argument, False as the block calls it) and, when top_k > 1 and `norm_topk_prob`, divides by the sum (no
epsilon); it returns (ids, weights, logits). The block keeps its input for the shared experts, flattens
tokens and the ids, and in training repeats each token top_k times (`repeat_interleave`), fills an
`empty_like` buffer with `y[flat == i] = expert(x[flat == i])` for every expert, weights and sums over the
top_k axis and casts back. In eval it calls `moe_infer` (under `@torch.no_grad()`): a [T, E] zero count
matrix from `new_zeros`, `scatter_(1, ids, 1)` and `sum(dim=0)`, `argsort` of the flat ids, the sorted token
rows `x[idxs // top_k]`, the counts read to the host with `.cpu().numpy()`, then a loop
`for i, num_tokens in enumerate(counts)` with `end = start + num_tokens`, skipping `if num_tokens == 0`
(before `start` moves), slicing the expert's rows from the sorted tokens and appending its output to a
Python list; the list is `torch.cat`-ed (or `new_empty(0)` when empty), un-permuted by an index-put into an
`empty_like` buffer (`new_x[idxs] = outs`), viewed as [T, k, H], cast to the weights' dtype, scaled in place
(`mul_`) by the weights, summed over k and cast back. The shared experts (one MLP `num_shared_experts` times
the routed width, built whenever the field is not None) run on the block's input and are added; the block
returns (output, (router_logits [B, S, E], topk_idx [B, S, k])). Experts are SwiGLU MLPs
(`ACT2FN["silu"]`, here `nn.SiLU`). The real Ling-lite has 64 experts, top-6, 2 shared.
Left out: the attention/rope/vocabulary fields of the config and its `PretrainedConfig` base (a plain local
class carries the MoE fields); `BailingMoeGate.reset_parameters`' kaiming init is kept but overwritten by
the corpus weights.
Constructs: `@torch.no_grad()` on `moe_infer`, `if self.training` branch, `scatter_` counts read with
`.cpu().numpy()` and numpy scalars as slice bounds, a loop `for i, num_tokens in enumerate(counts)` with
`if num_tokens == 0: continue`, a Python list of expert outputs and `torch.cat(...) if len(outputs) else
new_empty(0)`, an index-put un-permute, in-place `mul_`, config attributes read in forward, a module method
called from forward, boolean-mask gathers/index-puts in the training branch, a tuple-of-tuple return.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "inclusionAI/Ling",
    "models/modeling_bailing_moe.py",
    "5ccaeae073d6d3a042f9b784802cefdd0abc819f",
    "BailingMoeSparseMoeBlock.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


class BailingMoeConfig:
    def __init__(
        self,
        hidden_size=HIDDEN,
        hidden_act="silu",
        num_experts=EXPERTS,
        num_shared_experts=SHARED,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        moe_intermediate_size=INTER,
    ):
        self.hidden_size, self.hidden_act = hidden_size, hidden_act
        self.num_experts, self.num_shared_experts = num_experts, num_shared_experts
        self.num_experts_per_tok, self.norm_topk_prob = num_experts_per_tok, norm_topk_prob
        self.moe_intermediate_size = moe_intermediate_size


class BailingMoeMLP(nn.Module):
    def __init__(self, config: BailingMoeConfig, intermediate_size: int):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class BailingMoeGate(nn.Module):
    def __init__(self, config: BailingMoeConfig):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.num_experts, self.gating_dim)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        import torch.nn.init as init

        init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden_states, sort=False):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        logits = F.linear(hidden_states, self.weight, None)
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=sort)
        if self.top_k > 1 and self.norm_topk_prob:
            denominator = topk_weight.sum(dim=-1, keepdim=True)
            topk_weight = topk_weight / denominator
        return topk_idx, topk_weight, logits


class BailingMoeSparseMoeBlock(nn.Module):
    def __init__(self, config: BailingMoeConfig | None = None):
        super().__init__()
        config = config or BailingMoeConfig()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self._setup_experts()
        self.gate = BailingMoeGate(config)
        if config.num_shared_experts is not None:
            self.shared_experts = BailingMoeMLP(
                config=config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts
            )

    def _setup_experts(self):
        self.experts = nn.ModuleList(
            [
                BailingMoeMLP(config=self.config, intermediate_size=self.config.moe_intermediate_size)
                for _ in range(self.config.num_experts)
            ]
        )

    def forward(self, hidden_states):
        identity = hidden_states
        bsz, seq_len, h = hidden_states.shape
        topk_idx, topk_weight, router_logits = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.to(hidden_states.dtype).view(bsz, seq_len, h)
        else:
            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(bsz, seq_len, h)
        if self.config.num_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y, (router_logits.view(bsz, seq_len, -1), topk_idx.view(bsz, seq_len, -1))

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        counts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        counts.scatter_(1, topk_ids, 1)
        tokens_per_expert = counts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i]
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
    return tiny(BailingMoeSparseMoeBlock, HIDDEN)
