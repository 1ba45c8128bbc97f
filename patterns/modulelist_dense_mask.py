"""An `nn.ModuleList` of gate/up/down experts run densely, each weighted through a top-k mask.

Mirrors hand-written MoE blocks of the kind optimum-habana uses on its DeepSeek-V3 training path
(`optimum/habana/transformers/models/deepseek_v3/modeling_deepseek_v3.py`, the `padded_weights` dense
loop over `self.experts`) and the static-shape blocks people write to avoid data-dependent shapes:
`for e in range(E): out += expert_e(x) * (w * (ids == e)).sum(-1, keepdim=True)`, with experts holding
`gate_proj`, `up_proj`, `down_proj` `nn.Linear`s (Qwen/DeepSeek naming).

The rewrite must turn each layer into ONE `default` call (gate and up are separate weights), with
w1 = gate_proj, w2 = up_proj, w3 = down_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import GatedMLP, Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="default")


class MaskedLoopMoE(nn.Module):
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
            weight_e = (weights * (ids == e)).sum(dim=-1, keepdim=True)
            out = out + expert(x) * weight_e
        return out.view(shape)


def build(**overrides):
    cfg = settings(overrides)
    return finish(TinyDecoder(MaskedLoopMoE, cfg), cfg)
