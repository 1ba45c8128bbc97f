"""Expert-parallel sentinels in transformers' expert code: clamps and masks on the expert ids.

transformers (5.17 on) prepares its grouped and batched experts for ids that name no local expert (id >=
E, a "sentinel" under expert parallelism): the batched form clamps the ids to 0..E-1 before gathering
weights (and, from 5.23, zeroes the weights of the slots whose id is >= E), the grouped form zeroes the
rows whose sorted id is >= E before and after each grouped matmul. The finders look through them and say
what they do to an id outside 0..E-1 (`ExpertsMatch.sentinels`); the pipeline keeps the rewrite only
when the values the routing ids can take make the region equal to the kernel.
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


def through_weight_mask(weights: Node, ids: Node, num_experts: int | None) -> tuple[Node, bool]:
    """(w, True) when weights = w.masked_fill(ids >= E, 0) on the same ids (transformers 5.23's batched
    experts zero the weights of the sentinel slots); (weights, False) otherwise."""
    node = strip_shape_ops(weights)
    if num_experts is None or not (is_call(node, aten.masked_fill.Scalar) and node.args[2] == 0):
        return weights, False
    test = strip_shape_ops(node.args[1])
    if not (is_call(test, aten.ge.Scalar) and const_int(test.args[1]) == num_experts):
        return weights, False
    if strip_shape_ops(test.args[0]) is not strip_shape_ops(ids):
        return weights, False
    return node.args[0], True
