"""Near miss: the routing weight scales each expert's INPUT, not its output.

Mirrors the Llama4 text MoE of transformers (`src/transformers/models/llama4/modeling_llama4.py`,
`Llama4TextMoe.forward`: `routed_in = hidden.repeat(E, 1) * scores` before the expert MLP), written
here as a dense loop over an `nn.ModuleList`. Because the MLP is non-linear, MLP(w * x) != w * MLP(x),
so the fused kernel (which weights outputs) would compute something else: the rewrite must leave
each layer untouched and report it declined, naming the input scaling.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import GatedMLP, Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=0, declined=2, reason="input")


class InputScaledMoE(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.router = Router(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg["hidden"], cfg["intermediate"]) for _ in range(cfg["num_experts"])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            weight_e = (weights * (ids == e)).sum(dim=-1, keepdim=True)
            out = out + expert(x * weight_e)
        return out.view(shape)


def build(**overrides):
    cfg = settings(overrides)
    return finish(TinyDecoder(InputScaledMoE, cfg), cfg)
