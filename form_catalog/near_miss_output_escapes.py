"""Near miss: one expert's output is also used outside the MoE sum.

The dense-mask `nn.ModuleList` loop of `form_catalog/modulelist_dense_mask.py` (after huggingface/
optimum-habana `optimum/habana/transformers/models/deepseek_v3/modeling_deepseek_v3.py` at commit
0158412, `GaudiDeepseekV3MoE.forward`), except that the block also adds a tenth of expert 0's
unweighted output to its result (an auxiliary tap on one expert, as in probing experiments). Fusing
would delete that intermediate, so the rewrite must leave each layer untouched and report that a
value escapes the region.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from .modulelist_dense_mask import MaskedLoopMoE, expert_weight

EXPECTED = Expected(fused=0, declined=2, reason="escapes")

TAPPED_EXPERT, TAP_SCALE = 0, 0.1


class EscapingOutputMoE(MaskedLoopMoE):
    """MaskedLoopMoE that also returns a tap of expert 0's raw output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        tapped = None
        for e, expert in enumerate(self.experts):
            y = expert(x)
            if e == TAPPED_EXPERT:
                tapped = y
            out = out + y * expert_weight(weights, ids, e)
        return (out + TAP_SCALE * tapped).view(shape)


def build(**overrides):
    """(TinyDecoder of EscapingOutputMoE layers, (x [1, T, H],)); every `_common.DEFAULTS` key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(EscapingOutputMoE, cfg), cfg)
