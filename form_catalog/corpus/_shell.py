"""What every corpus entry shares: where it was read, and the tiny residual model around its MoE layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Source:
    """The public code an entry mirrors: `repo` (owner/name), `path` in it, and the `commit` read."""

    repo: str
    path: str
    commit: str
    symbol: str  # the class or function mirrored, e.g. "MoE.forward"

    def __str__(self) -> str:
        return f"{self.repo}@{self.commit[:7]}:{self.path} ({self.symbol})"


class Residual(nn.Module):
    """`layers` blocks of x = x + moe(norm(x)), the way a decoder calls its MoE layers."""

    def __init__(self, make_moe: Callable[[], nn.Module], hidden: int, layers: int):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.moes = nn.ModuleList(make_moe() for _ in range(layers))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes, strict=True):
            out = moe(norm(x))
            x = x + (out[0] if isinstance(out, tuple) else out)
        return x


def tiny(make_moe: Callable[[], nn.Module], hidden: int, tokens: int = 7, layers: int = 1, seed: int = 0,
         batch: int = 1):
    """(model, (x,)): `make_moe()` layers in a residual model, weights drawn from `seed` (scaled so outputs
    stay near 1), eval mode, float32, and x of shape [batch, tokens, hidden]."""
    torch.manual_seed(seed)
    model = Residual(make_moe, hidden, layers)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norms" in name:
                continue
            fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / fan_in**0.5)
    x = torch.randn(batch, tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    return model.eval(), (x,)
