"""Near miss: experts of unequal shapes (one expert has a wider intermediate layer).

The dense-mask `nn.ModuleList` loop of `form_catalog/modulelist_dense_mask.py` (after huggingface/
optimum-habana `optimum/habana/transformers/models/deepseek_v3/modeling_deepseek_v3.py` at commit
0158412, `GaudiDeepseekV3MoE.forward`), except that expert 0 is twice as wide as the others, as in
pruned or upcycled checkpoints. The kernel takes one [I, H] shape for all experts' weights, so the
rewrite must leave each layer untouched and report that the experts' weights differ in shape.
"""

from __future__ import annotations

from ._common import GatedMLP, TinyDecoder, finish, settings
from ._expected import Expected
from .modulelist_dense_mask import MaskedLoopMoE

EXPECTED = Expected(fused=0, declined=2, reason="differ in shape")

WIDE_EXPERT, WIDTH_FACTOR = 0, 2


class UnequalExpertsMoE(MaskedLoopMoE):
    """MaskedLoopMoE whose expert 0 has twice the intermediate size."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        wide = WIDTH_FACTOR * cfg["intermediate"]
        self.experts[WIDE_EXPERT] = GatedMLP(cfg["hidden"], wide, cfg["activation"])


def build(**overrides):
    """(TinyDecoder of UnequalExpertsMoE layers, (x [1, T, H],)); every `_common.DEFAULTS` key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(UnequalExpertsMoE, cfg), cfg)
