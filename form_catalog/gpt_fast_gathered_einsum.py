"""gpt-fast's Mixtral MoE: expert weights gathered per token (`w[ids]`) and applied with einsum.

Mirrors pytorch-labs/gpt-fast `mixtral-moe/model.py` at commit 32971d3 (`MOEFeedForward`,
`ConditionalFeedForward`): softmax over the router logits in the model dtype -> top-k ->
`w /= w.sum(-1, keepdim=True)`; then, with `w1`, `w3` stacked [E, I, H] and `w2` stacked [E, H, I],
    x1 = silu(einsum("ti,taoi->tao", x, w1[ids]))      x3 = einsum("ti,taoi->tao", x, w3[ids])
    y  = einsum("tao,taio->tai", x1 * x3, w2[ids])     out = einsum("tai,ta->ti", y, weights)
No sort, no loop: every slot gathers its expert's matrices ([T, k, I, H] copies).

The rewrite must turn each layer into ONE `default` call with w1 = w1[e] (gate), w2 = w3[e] (up) and
w3 = w2[e] (down): gpt-fast's names follow Mixtral's, where w2 is the down projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ACTIVATIONS, SourceRouter, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="default")
# Keeps its source's own forward: tests/test_mutations.py's per-family mutated forwards do not apply.
MUTATED = False


class MoeGate(SourceRouter):
    """`MOEFeedForward`'s gate and routing: softmax in the model dtype, top-k, renormalised."""

    def forward(self, x: torch.Tensor):
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids


class GatheredEinsumMoE(nn.Module):
    """`MOEFeedForward` + `ConditionalFeedForward`: stacked w1/w3 [E, I, H] and w2 [E, H, I], gathered by ids."""

    def __init__(self, cfg: dict):
        super().__init__()
        experts, hidden, inter = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.router = MoeGate(cfg)
        self.w1 = nn.Parameter(torch.empty(experts, inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.w3 = nn.Parameter(torch.empty(experts, inter, hidden))
        self.act = ACTIVATIONS[cfg["activation"]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])
        weights, ids = self.router(x)
        gate = self.act(torch.einsum("ti,taoi->tao", x, self.w1[ids]))
        up = torch.einsum("ti,taoi->tao", x, self.w3[ids])
        per_slot = torch.einsum("tao,taio->tai", gate * up, self.w2[ids])
        return torch.einsum("tai,ta->ti", per_slot, weights).view(shape)


def build(**overrides):
    """(TinyDecoder of GatheredEinsumMoE layers, (x [1, T, H],)); the routing is gpt-fast's own."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(GatheredEinsumMoE, cfg), cfg)
