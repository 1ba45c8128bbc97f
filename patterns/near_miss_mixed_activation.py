"""Near miss: experts that do not share one activation.

The same dense-mask `nn.ModuleList` loop as `patterns/modulelist_dense_mask.py` (hand-written MoE blocks), but
expert 0 uses GELU while the others use SiLU, as happens when experts are assembled from different
checkpoints. The kernel takes ONE activation for all experts, so the rewrite must leave each layer
untouched and report it declined, naming the activations.
"""

from __future__ import annotations

from ._common import GatedMLP, TinyDecoder, finish, settings
from ._expected import Expected
from .modulelist_dense_mask import MaskedLoopMoE

EXPECTED = Expected(fused=0, declined=2, reason="activation")


class MixedActivationMoE(MaskedLoopMoE):
    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.experts[0] = GatedMLP(cfg["hidden"], cfg["intermediate"], "gelu")


def build(**overrides):
    cfg = settings(overrides, allowed=tuple(k for k in settings({}) if k != "activation"))
    cfg["activation"] = "silu"  # for every expert but expert 0
    return finish(TinyDecoder(MixedActivationMoE, cfg), cfg)
