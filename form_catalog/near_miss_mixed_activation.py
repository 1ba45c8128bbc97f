"""Near miss: experts that do not share one activation.

The dense-mask `nn.ModuleList` loop of `form_catalog/modulelist_dense_mask.py` (after huggingface/
optimum-habana `optimum/habana/transformers/models/deepseek_v3/modeling_deepseek_v3.py` at commit
0158412, `GaudiDeepseekV3MoE.forward`), except that expert 0 uses GELU (tanh) while the others use
SiLU, as when experts are assembled from different checkpoints. The kernel takes ONE activation for
all experts, so the rewrite must leave each layer untouched and report it declined, naming the
activations.
"""

from __future__ import annotations

from ._common import GatedMLP, TinyDecoder, finish, settings
from ._expected import Expected
from .modulelist_dense_mask import MaskedLoopMoE

EXPECTED = Expected(fused=0, declined=2, reason="activation")

ODD_EXPERT, ODD_ACTIVATION, COMMON_ACTIVATION = 0, "gelu", "silu"


class MixedActivationMoE(MaskedLoopMoE):
    """MaskedLoopMoE whose expert 0 is a GELU MLP among SiLU ones."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.experts[ODD_EXPERT] = GatedMLP(cfg["hidden"], cfg["intermediate"], ODD_ACTIVATION)


def build(**overrides):
    """(TinyDecoder of MixedActivationMoE layers, (x [1, T, H],)); all `_common.DEFAULTS` but `activation`."""
    cfg = settings(overrides, exclude=("activation",))
    cfg["activation"] = COMMON_ACTIVATION
    return finish(TinyDecoder(MixedActivationMoE, cfg), cfg)
