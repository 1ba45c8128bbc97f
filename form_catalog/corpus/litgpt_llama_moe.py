"""LitGPT's `LLaMAMoE`: top-k softmax router, then a `zip(masks, experts)` loop with `torch.where` and `y[idx] +=`.

Mirrors Lightning-AI/litgpt `litgpt/model.py` at commit 2685705 (`LLaMAMoE.__init__` / `LLaMAMoE.forward`,
the expert MLP `LLaMAMLP`, and `GroupedTopkRouter`), configured as LitGPT's Mixtral configs set it
(`mlp_class_name="LLaMAMoE"`, bias=False, n_expert_per_token=2, no expert groups, no shared expert,
routed_scaling_factor=1.0), with the config fields it reads held by a tiny local config class. The forward
takes x of shape [B, T, C], keeps a `clone()` of it for the shared expert, and views it as [B*T, C]. Without
expert groups the router is a bias-free linear; `torch.topk` picks n_expert_per_token logits per token and
only those are softmaxed (in float32, cast back to x's dtype). With expert groups (not taken here) the
router is `GroupedTopkRouter`: float32 sigmoid scores, a `@torch.no_grad()` group-limited top-k with a
correction bias, gathered weights, optionally divided in place by their sum. If routed_scaling_factor is not
1.0 the weights are scaled. The layer compares the indices, unsqueezed, with `torch.arange(n_expert)` to get
a boolean [B*T, k, E] mask, permutes it to [E, B*T, k], fills `zeros_like(x)`, and loops `for mask, expert
in zip(masks, self.experts)`: `torch.where(mask)` gives (token, slot) index pairs, and `y[token_idx] +=`
the gathered weight times the SwiGLU expert (silu(fc_1 x) * fc_2 x, then proj) run on `x[token_idx]`,
with no skip for experts that got no tokens. It views y back to [B, T, C] and, with a shared expert, adds
`shared_experts(residual_x)`.
Left out: nothing of the forward; the Config dataclass becomes a plain class holding the fields used, and
Mixtral's 8 experts of size 14336 become 8 of size 8.
Constructs: config-dependent Python branches (grouped router vs linear gate, scaling factor, shared expert),
`x.clone()`, top-k then softmax with a dtype argument and a cast, an `==` against `arange` broadcast mask,
a `for mask, expert in zip(masks, experts)` loop over a permuted tensor, `torch.where(mask)` index pairs,
advanced-index gathers and an in-place `y[token_idx] +=` update, no empty-expert skip.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "Lightning-AI/litgpt", "litgpt/model.py", "26857050fe3ff627cd714fe92f5838f51a3d5efa", "LLaMAMoE.forward"
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class TinyConfig:
    n_embd = HIDDEN
    intermediate_size = INTER
    moe_intermediate_size = INTER
    bias = False
    n_expert = EXPERTS
    n_expert_per_token = TOP_K
    n_shared_expert = None
    n_expert_groups = None
    n_topk_groups = None
    n_topk_scores_per_group = None
    routed_scaling_factor = 1.0
    norm_topk_prob = False


class LLaMAMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.fc_1 = nn.Linear(config.n_embd, self.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, self.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(self.intermediate_size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x):
        gate = self.fc_1(x)
        up = self.fc_2(x)
        x = F.silu(gate) * up
        return self.proj(x)


class GroupedTopkRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_expert, config.n_embd))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_expert))

    @torch.no_grad()
    def get_topk_indices(self, scores):
        cfg = self.config
        per_group = cfg.n_expert // cfg.n_expert_groups
        biased = scores.view(-1, cfg.n_expert) + self.e_score_correction_bias.unsqueeze(0)
        group_scores = (
            biased.view(-1, cfg.n_expert_groups, per_group)
            .topk(cfg.n_topk_scores_per_group, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=cfg.n_topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, cfg.n_expert_groups, per_group).reshape(-1, cfg.n_expert)
        )
        biased = biased.masked_fill(~score_mask.bool(), 0.0)
        return torch.topk(biased, k=cfg.n_expert_per_token, dim=-1, sorted=False)[1]

    def forward(self, x):
        logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        if self.config.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        return topk_weights, topk_indices


class LLaMAMoE(nn.Module):
    def __init__(self, config=None):
        super().__init__()
        config = config or TinyConfig()
        self.gate = (
            nn.Linear(config.n_embd, config.n_expert, bias=False)
            if not config.n_expert_groups
            else GroupedTopkRouter(config)
        )
        self.experts = nn.ModuleList(
            LLaMAMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.n_expert)
        )
        if config.n_shared_expert:
            self.shared_experts = LLaMAMLP(
                config, intermediate_size=config.moe_intermediate_size * config.n_shared_expert
            )
        self.config = config

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 - the original's names
        residual_x = x.clone()
        x = x.view(-1, C)
        if not self.config.n_expert_groups:
            router = self.gate(x)
            probs, indices = torch.topk(router, self.config.n_expert_per_token)
            probs = probs.softmax(dim=1, dtype=torch.float).to(dtype=x.dtype)
        else:
            probs, indices = self.gate(x)
        if self.config.routed_scaling_factor != 1.0:
            probs = probs * self.config.routed_scaling_factor
        masks = indices.unsqueeze(-1) == torch.arange(self.config.n_expert, device=x.device)
        masks = masks.permute(2, 0, 1)
        y = torch.zeros_like(x)
        for mask, expert in zip(masks, self.experts):  # noqa: B905 - as the original
            token_idx, expert_idx = torch.where(mask)
            y[token_idx] += probs[token_idx, expert_idx, None] * expert(x[token_idx])

        y = y.view(B, T, C)
        if self.config.n_shared_expert:
            y = y + self.shared_experts(residual_x)
        return y


def build():
    return tiny(LLaMAMoE, HIDDEN)
