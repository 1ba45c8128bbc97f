"""Near miss: experts with exact (erf) GELU, an activation the fused kernel does not have.

The transformers 4.x sparse loop of `form_catalog/hf4_sparse_loop.py` (transformers 4.57.6,
`src/transformers/models/olmoe/modeling_olmoe.py`, `OlmoeSparseMoeBlock.forward`) with experts whose
`hidden_act` is `"gelu"`, which `ACT2FN` maps to the exact erf GELU. The kernel's `"gelu"` is the tanh
approximation (HPU_OP contract), so fusing would change the numbers: the rewrite must leave each layer
untouched and report the activation as not supported. With `activation="gelu"` (tanh) the same build
is fused.
"""

from __future__ import annotations

from ._common import GatedMLP, TinyDecoder, finish, settings
from ._expected import Expected
from ._sparse_loop import DYNAMO_CONFIG, SparseLoopMoE

EXPECTED = Expected(fused=0, declined=2, reason="not supported by the fused kernel")
__all__ = ["DYNAMO_CONFIG", "EXPECTED", "build"]


def build(**overrides):
    """(TinyDecoder of SparseLoopMoE layers, (x [1, T, H],)); exact GELU unless `activation` says otherwise."""
    cfg = settings({"activation": "gelu_exact", **overrides})
    make_expert = lambda c: GatedMLP(c["hidden"], c["intermediate"], c["activation"])  # noqa: E731
    return finish(TinyDecoder(lambda c: SparseLoopMoE(c, make_expert), cfg), cfg)
