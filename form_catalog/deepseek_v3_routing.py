"""DeepSeek-V3 routing: sigmoid scores, a correction bias, grouped top-k, renormalise, routed scaling.

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/deepseek_v3/modeling_deepseek_v3.py`:
`DeepseekV3TopkRouter` (float32 `linear` → `sigmoid`; `scores + e_score_correction_bias` chooses, the
best two per group rank the groups, `topk_group` groups are kept, others masked to -inf; `topk` ids;
weights gathered from the UNbiased scores; `w / (w.sum() + 1e-20)` when `norm_topk_prob`; times
`routed_scaling_factor`; weights stay float32) and `DeepseekV3MoE.forward` (routed experts plus
`shared_experts(x)`, added). Experts run by `batched_mm_experts_forward`
(`src/transformers/integrations/moe.py`). GLM4-MoE routes the same way.

The routing has no fused form on Gaudi and stays as it is; the rewrite must turn the routed experts
of each layer into ONE `fused_weights` call on the ids and (scaled) weights the routing produced,
leave the shared experts beside it, and report the routing as sigmoid grouped top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import GatedMLP, Router, TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock
from .hf_batched_mm import batched_mm_experts_forward

EXPECTED = Expected(fused=2, overload="fused_weights")
ROUTED_SCALING_FACTOR = 2.5
NORM_TOPK_PROB = True


class DeepseekV3Router(Router):
    """`DeepseekV3TopkRouter` returning (weights [T, k] float32, ids [T, k])."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        experts, top_k = cfg["num_experts"], cfg["top_k"]
        self.n_group = 2 if experts % 2 == 0 and experts >= 4 else 1
        per_group = experts // self.n_group
        self.topk_group = 1 if top_k <= per_group else self.n_group
        self.register_buffer("e_score_correction_bias", torch.linspace(-0.1, 0.1, experts))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, self.n_group, choice.shape[-1] // self.n_group)
        group_scores = group_scores.topk(min(2, group_scores.shape[-1]), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.n_group, choice.shape[-1] // self.n_group)
            .reshape(-1, choice.shape[-1])
        )
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if NORM_TOPK_PROB:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * ROUTED_SCALING_FACTOR, ids


class DeepseekV3MoE(SparseMoeBlock):
    """Routed experts on DeepSeek-V3 routing, plus an ungated shared expert."""

    def __init__(self, cfg: dict):
        super().__init__(cfg, batched_mm_experts_forward)
        self.gate = DeepseekV3Router(cfg)
        self.shared_experts = GatedMLP(cfg["hidden"], cfg["intermediate"], cfg["activation"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        flat = x.view(-1, hidden)
        weights, ids = self.gate(flat)
        routed = self.experts(flat, ids, weights).reshape(batch, seq, hidden)
        return routed + self.shared_experts(x)


def build(**overrides):
    """(TinyDecoder of DeepseekV3MoE layers, (x [1, T, H],)); all DEFAULTS but the routing keys."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    cfg.update(routing="softmax_topk", router_fp32=True)  # unused by DeepseekV3Router
    return finish(TinyDecoder(DeepseekV3MoE, cfg), cfg)
