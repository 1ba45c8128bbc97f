"""Near miss: one expert's output is also used outside the MoE sum.

The dense-mask `nn.ModuleList` loop of `patterns/modulelist_dense_mask.py`, except that the block also adds a
tenth of expert 0's unweighted output to its result (an auxiliary path, as in experiments that tap an
expert). Fusing would remove that intermediate, so the rewrite must leave each layer untouched and
report that a value escapes the region.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from .modulelist_dense_mask import MaskedLoopMoE

EXPECTED = Expected(fused=0, declined=2, reason="escapes")


class EscapingOutputMoE(MaskedLoopMoE):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        tapped = None
        for e, expert in enumerate(self.experts):
            y = expert(x)
            tapped = y if e == 0 else tapped
            out = out + y * (weights * (ids == e)).sum(dim=-1, keepdim=True)
        return (out + 0.1 * tapped).view(shape)


def build(**overrides):
    cfg = settings(overrides)
    return finish(TinyDecoder(EscapingOutputMoE, cfg), cfg)
