"""SGLang's torch-native fused MoE: gathered w13/w2 weights per slot, applied with einsum.

Mirrors sgl-project/sglang `python/sglang/srt/layers/moe/fused_moe_native.py` at commit 163b798
(`fused_moe_forward_native`, weights as `UnquantizedFusedMoEMethod.create_weights` makes them:
`w13_weight` [E, 2I, H] with gate rows first, `w2_weight` [E, H, I]); routing as `topk.py`'s
`fused_topk_torch_native`: softmax of the logits in float32 -> top-k -> renormalise, float32 weights.
    w1, w3 = chunk(w13_weight[ids], 2, dim=2)
    y = einsum("tao,taio->tai", act(einsum("ti,taoi->tao", x, w1)) * einsum("ti,taoi->tao", x, w3), w2_weight[ids])
    out = einsum("tai,ta->ti", y, weights.to(y.dtype))

The rewrite must turn each layer into ONE `fused_weights` call with w12 = w13_weight[e] (gate rows then
up rows, as the kernel reads them) and w3 = w2_weight[e].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ACTIVATIONS, SourceRouter, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="fused_weights")
# Keeps its source's own forward: tests/test_mutations.py's per-family mutated forwards do not apply.
MUTATED = False


class NativeTopK(SourceRouter):
    """`fused_topk_torch_native`: float32 softmax, top-k, renormalised (weights stay float32)."""

    def forward(self, x: torch.Tensor):
        weights, ids = torch.topk(F.softmax(self.gate(x).float(), dim=-1), self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class NativeEinsumMoE(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        experts, hidden, inter = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.router = NativeTopK(cfg)
        self.w13_weight = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2_weight = nn.Parameter(torch.empty(experts, hidden, inter))
        self.act = ACTIVATIONS[cfg["activation"]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])
        weights, ids = self.router(x)
        w1, w3 = torch.chunk(self.w13_weight[ids], 2, dim=2)
        gate = self.act(torch.einsum("ti,taoi -> tao", x, w1))
        up = torch.einsum("ti, taoi -> tao", x, w3)
        per_slot = torch.einsum("tao, taio -> tai", gate * up, self.w2_weight[ids])
        return torch.einsum("tai,ta -> ti", per_slot, weights.to(per_slot.dtype)).view(shape)


def build(**overrides):
    """(TinyDecoder of NativeEinsumMoE layers, (x [1, T, H],)); SGLang's own routing."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(NativeEinsumMoE, cfg), cfg)
