"""transformers 4.x sparse expert loop over an `nn.ModuleList` of gate_proj/up_proj/down_proj experts.

Mirrors transformers 4.57.6 (release wheel) `src/transformers/models/olmoe/modeling_olmoe.py`:
`OlmoeSparseMoeBlock.forward` (the `range(E)` loop with `torch.where` and `index_add_`, shell in
`_sparse_loop.py`) and `OlmoeMLP` (bias-free `gate_proj`, `up_proj`, `down_proj`). Qwen2-MoE,
Qwen3-MoE, Jamba and PhiMoE 4.x blocks are the same loop. Captured in one graph with
`torch._dynamo.config.capture_dynamic_output_shape_ops = True` (`DYNAMO_CONFIG`).

The rewrite must turn each layer into ONE `default` call with w1 = gate_proj, w2 = up_proj,
w3 = down_proj; the per-expert `nonzero` (a host sync each) disappears with the loop.
"""

from __future__ import annotations

from ._common import GatedMLP, TinyDecoder, finish, settings
from ._expected import Expected
from ._sparse_loop import DYNAMO_CONFIG, SparseLoopMoE

EXPECTED = Expected(fused=2, overload="default")
__all__ = ["DYNAMO_CONFIG", "EXPECTED", "build"]


def build(**overrides):
    """(TinyDecoder of SparseLoopMoE layers of GatedMLP experts, (x [1, T, H],)); every DEFAULTS key applies."""
    cfg = settings(overrides)
    make_expert = lambda c: GatedMLP(c["hidden"], c["intermediate"], c["activation"])  # noqa: E731
    return finish(TinyDecoder(lambda c: SparseLoopMoE(c, make_expert), cfg), cfg)
