"""transformers 5.x experts stored transposed, [E, H, 2I] and [E, I, H] (`is_transposed=True`).

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/aria/modeling_aria.py`:
`AriaExperts`, whose checkpoints store each projection as (in_features, out_features), decorated
`use_experts_implementation(is_transposed=True)`, run by `batched_mm_experts_forward`
(`src/transformers/integrations/moe.py`, `_batched_linear` with `bmm(x[:, None], W[ids])`). The
block shell is `_stacked_experts.py`; Aria's shared experts are left out (see `qwen2_shared_expert`).

The rewrite must turn each layer into ONE `fused_weights` call. The kernel takes [out, in] weights
with permuted_weights=True, or [in, out] ones with permuted_weights=False: the stacks are passed as
they are stored (unbound views, no copy) with permuted_weights=False.
"""

from __future__ import annotations

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock
from .hf_batched_mm import batched_mm_experts_forward

EXPECTED = Expected(fused=2, overload="fused_weights")


def build(**overrides):
    """(TinyDecoder of SparseMoeBlocks with transposed stacks, (x [1, T, H],)); every DEFAULTS key applies."""
    cfg = settings(overrides)
    make = lambda c: SparseMoeBlock(c, batched_mm_experts_forward, is_transposed=True)  # noqa: E731
    return finish(TinyDecoder(make, cfg), cfg)
