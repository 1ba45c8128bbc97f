"""mistral-inference's `MoeLayer`: a loop over the experts that finds each one's tokens with `where`.

Mirrors mistralai/mistral-inference `src/mistral_inference/moe.py` at commit 2557e12 (`MoeLayer`; its
experts are `transformer_layers.FeedForward`, `w2(silu(w1(x)) * w3(x))` with nn.Linear w1/w2/w3):
top-k on the raw router logits, softmax over the k in float32 cast back (equal to softmax -> top-k ->
renormalise), then
    for i, expert in enumerate(experts):
        tok, slot = torch.where(ids == i)
        out[tok] += weights[tok, slot, None] * expert(x[tok])
`out[tok] += ...` is a gather, an add and an index_put that overwrites rows: equal to an index_add
because top-k ids of one token are distinct. `where` has a data-dependent size, so the loop is one
graph only with `capture_dynamic_output_shape_ops=True`.

The rewrite must turn each layer into ONE `default` call with w1 = w1 (gate), w2 = w3 (up), w3 = w2
(down): Mixtral's names again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ACTIVATIONS, SourceRouter, TinyDecoder, finish, settings
from ._expected import Expected
from ._sparse_loop import DYNAMO_CONFIG

EXPECTED = Expected(fused=2, overload="default")
# Keeps its source's own forward: tests/test_mutations.py's per-family mutated forwards do not apply.
MUTATED = False
__all__ = ["DYNAMO_CONFIG", "EXPECTED", "build"]


class TopkFirstGate(SourceRouter):
    """mistral's gate and routing: top-k on the logits, softmax over the k in float32, cast back."""

    def forward(self, x: torch.Tensor):
        logits, ids = torch.topk(self.gate(x), self.top_k)
        return F.softmax(logits, dim=1, dtype=torch.float).to(x.dtype), ids


class FeedForward(nn.Module):
    """`transformer_layers.FeedForward`: w1 = gate [I, H], w3 = up [I, H], w2 = down [H, I]."""

    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class WhereLoopMoE(nn.Module):
    """`MoeLayer`: the gate, then each expert on the tokens `where` finds for it."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.gate = TopkFirstGate(cfg)
        self.experts = nn.ModuleList(
            FeedForward(cfg["hidden"], cfg["intermediate"], cfg["activation"]) for _ in range(cfg["num_experts"])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        inputs = x.view(-1, shape[-1])
        weights, ids = self.gate(inputs)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == i)
            results[tok] += weights[tok, slot, None] * expert(inputs[tok])
        return results.view(shape)


def build(**overrides):
    """(TinyDecoder of WhereLoopMoE layers, (x [1, T, H],)); the routing is mistral's own."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(WhereLoopMoE, cfg), cfg)
