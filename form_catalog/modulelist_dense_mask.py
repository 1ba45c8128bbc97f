"""An `nn.ModuleList` of gate/up/down experts run densely, each weighted through a top-k mask.

Mirrors the static dense loop over `self.experts` in huggingface/optimum-habana
`optimum/habana/transformers/models/deepseek_v3/modeling_deepseek_v3.py` at commit 0158412
(`GaudiDeepseekV3MoE.forward`, training branch; experts are `GaudiDeepseekV3MLP` with bias-free
`gate_proj`/`up_proj`/`down_proj` `nn.Linear`s): every expert runs on all tokens and its output is
scaled by that expert's per-token routing weight, then summed. That file takes the weight column from
a scattered `padded_weights` table; this form takes it the other way hand-written static-shape blocks
do, with a dense mask: `w_e = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)`.

The rewrite must turn each layer into ONE `default` call (gate and up are separate weights) with
w1 = gate_proj, w2 = up_proj, w3 = down_proj, which is what the same file's inference branch
(`call_dynamic_moe_op`) passes to `torch.ops.hpu.mixture_of_experts` by hand.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import GatedMLP, Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="default")


def expert_weight(weights: torch.Tensor, ids: torch.Tensor, expert: int) -> torch.Tensor:
    """[T, 1]: the routing weight token t gave `expert` (zero when it did not pick it)."""
    return (weights * (ids == expert)).sum(dim=-1, keepdim=True)


class MaskedLoopMoE(nn.Module):
    """Router + ModuleList of GatedMLP experts, combined by a dense loop over all experts."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.router = Router(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg["hidden"], cfg["intermediate"], cfg["activation"]) for _ in range(cfg["num_experts"])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * expert_weight(weights, ids, e)
        return out.view(shape)


def build(**overrides):
    """(TinyDecoder of MaskedLoopMoE layers, (x [1, T, H],)); every `_common.DEFAULTS` key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(MaskedLoopMoE, cfg), cfg)
