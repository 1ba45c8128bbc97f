"""Near miss: the routing weight scales each expert's INPUT, not its output.

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/llama4/modeling_llama4.py`,
`Llama4TextMoe.forward`: `routed_in = hidden.repeat(E, 1) * scores.T.reshape(-1, 1)` before the expert
MLP (`Llama4TextExperts.forward`), written here as the dense `nn.ModuleList` loop of
`modulelist_dense_mask.py` with `expert(x * w_e)`. The MLP is non-linear, so MLP(w * x) != w * MLP(x)
and the fused kernel (which weights expert outputs) would compute something else: the rewrite must
leave each layer untouched and report it declined, naming the input scaling.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from .modulelist_dense_mask import MaskedLoopMoE, expert_weight

EXPECTED = Expected(fused=0, declined=2, reason="input")


class InputScaledMoE(MaskedLoopMoE):
    """MaskedLoopMoE with the routing weight moved in front of each expert."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x * expert_weight(weights, ids, e))
        return out.view(shape)


def build(**overrides):
    """(TinyDecoder of InputScaledMoE layers, (x [1, T, H],)); every `_common.DEFAULTS` key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(InputScaledMoE, cfg), cfg)
