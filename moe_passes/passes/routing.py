"""Recognising the routing that produced an expert region's ids and weights.

The fused kernel takes ids and weights as they are, so routing is never rewritten here; it is read
to report what was fused (softmax → top-k → renormalise, top-k → softmax, ...) and to check that the
router's width matches the number of experts the region holds.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import const_int, dtype, is_call, is_getitem, shape, strip_casts
from .matches import RoutingInfo

aten = torch.ops.aten


def _topk_of(ids: Node) -> Node | None:
    ids = strip_casts(ids)
    if is_getitem(ids, 1) and is_call(ids.args[0], aten.topk.default):
        return ids.args[0]
    return None


def _softmax(node: Node) -> Node | None:
    node = strip_casts(node)
    return node if is_call(node, aten._softmax.default, aten.softmax.int) else None


def _renormalized_source(weights: Node) -> Node | None:
    """v when weights = v / v.sum(-1, keepdim=True) (casts allowed around it)."""
    node = strip_casts(weights)
    if is_call(node, aten.div.Tensor) and isinstance(node.args[1], Node):
        numerator, denominator = node.args
        denominator = strip_casts(denominator)
        if is_call(denominator, aten.add.Tensor):  # v.sum() + eps
            denominator = strip_casts(denominator.args[0])
        if is_call(denominator, aten.sum.dim_IntList) and strip_casts(denominator.args[0]) is strip_casts(
            numerator
        ):
            return strip_casts(numerator)
    return None


def describe(ids: Node, weights: Node) -> RoutingInfo:
    """What routing produced (ids, weights); kind "opaque" when it is not a recognised form."""
    topk = _topk_of(ids)
    if topk is None:
        return RoutingInfo("opaque")
    scores = topk.args[0]
    values = strip_casts(weights)
    renormalized_from = _renormalized_source(weights)
    softmax = _softmax(scores)
    if softmax is not None:
        top_values = renormalized_from if renormalized_from is not None else values
        if is_getitem(top_values, 0) and top_values.args[0] is topk:
            return RoutingInfo(
                "softmax_topk",
                renormalized=renormalized_from is not None,
                softmax_fp32=dtype(softmax) == torch.float32,
                num_experts=_width(softmax),
            )
    if softmax is None and _softmax(values) is not None:
        inner = strip_casts(_softmax(values).args[0])
        if is_getitem(inner, 0) and inner.args[0] is topk:
            return RoutingInfo(
                "topk_softmax",
                renormalized=True,
                softmax_fp32=dtype(_softmax(values)) == torch.float32,
                num_experts=_width(scores),
            )
    return RoutingInfo("opaque", num_experts=_width(scores))


def _width(node: Node) -> int | None:
    dims = shape(node)
    return const_int(dims[-1]) if dims else None
