"""Expert-parallel sentinels in transformers 5.17's expert code: clamps and masks on the expert ids.

transformers 5.17 prepared its grouped and batched experts for ids that name no local expert (id >= E,
a "sentinel" under expert parallelism): the batched form clamps the ids to 0..E-1 before gathering
weights, the grouped form zeroes the rows whose sorted id is >= E before and after each grouped matmul.
When every id is one of the E experts held, both are no-ops; the finders look through them and mark the
match (`ExpertsMatch.assumes_ids_in_range`), and the pipeline keeps the rewrite only when the routing
shows it (top-k over exactly E router columns).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import const_int, is_call, is_getitem, strip_casts, strip_shape_ops

aten = torch.ops.aten


def through_id_clamp(ids: Node, num_experts: int | None) -> tuple[Node, bool]:
    """(x, True) when ids = `clamp(x, 0, E - 1)` (or `clamp(x, max=E - 1)`); (ids, False) otherwise."""
    node = strip_shape_ops(ids)
    if not is_call(node, aten.clamp.default) or num_experts is None:
        return ids, False
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if low not in (None, 0) or const_int(high) != num_experts - 1:
        return ids, False
    return node.args[0], True


def through_sentinel_mask(node: Node, perm: Node) -> tuple[Node, int | None]:
    """(x, E) when node = x.masked_fill((sorted_ids >= E)[..., None], 0) with sorted_ids from the sort
    that produced `perm`; (node, None) otherwise."""
    if not (is_call(node, aten.masked_fill.Scalar) and node.args[2] == 0):
        return node, None
    test = strip_shape_ops(node.args[1])
    if not is_call(test, aten.ge.Scalar):
        return node, None
    sorted_ids = strip_casts(test.args[0])
    if not (is_getitem(sorted_ids, 0) and is_getitem(perm, 1) and sorted_ids.args[0] is perm.args[0]):
        return node, None
    bound = const_int(test.args[1])
    return (node.args[0], bound) if bound is not None else (node, None)
