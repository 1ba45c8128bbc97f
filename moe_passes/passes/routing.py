"""Recognising the routing that produced an expert region's ids and weights.

The fused kernel takes ids and weights as they are, so routing is never rewritten here; it is read
to report what was fused (softmax → top-k → renormalise, top-k → softmax, ...) and to check that the
router's width matches the number of experts the region holds.
"""

from __future__ import annotations

import dataclasses

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


def _scaled_source(weights: Node) -> tuple[Node, float | None]:
    """(v, c) when weights = v * c for a constant c (routed_scaling_factor), else (weights, None)."""
    node = strip_casts(weights)
    if (
        is_call(node, aten.mul.Tensor)
        and isinstance(node.args[1], int | float)
        and isinstance(node.args[0], Node)
    ):
        return node.args[0], float(node.args[1])
    return weights, None


def _sigmoid_topk(topk: Node, ids: Node, values: Node, scale: float | None) -> RoutingInfo | None:
    """DeepSeek-V3 / GLM4-MoE: ids from top-k over (masked) sigmoid scores (+ bias), weights gathered."""
    renormalized_from = _renormalized_source(values)
    gathered = strip_casts(renormalized_from if renormalized_from is not None else values)
    if not (is_call(gathered, aten.gather.default) and strip_casts(gathered.args[2]) is strip_casts(ids)):
        return None
    scores = strip_casts(gathered.args[0])
    if not is_call(scores, aten.sigmoid.default):
        return None
    choice = strip_casts(topk.args[0])
    grouped = is_call(choice, aten.masked_fill.Scalar, aten.where.self, aten.where.ScalarSelf)
    if grouped:
        choice = strip_casts(choice.args[0] if is_call(choice, aten.masked_fill.Scalar) else choice.args[-1])
    bias_corrected = is_call(choice, aten.add.Tensor) and any(
        isinstance(a, Node) and strip_casts(a) is scores for a in choice.args
    )
    if not (bias_corrected or choice is scores):
        return None
    return RoutingInfo(
        "sigmoid_topk",
        renormalized=renormalized_from is not None,
        softmax_fp32=None,
        num_experts=_width(scores),
        bias_corrected=bias_corrected,
        grouped=grouped,
        scale=scale,
    )


def _unmasked(weights: Node) -> tuple[Node, bool]:
    """(w, True) when weights = w.masked_fill(mask, 0) or w * bool_mask (expert parallelism zeroes the
    weights of the experts other ranks hold), else (weights, False)."""
    node = strip_casts(weights)
    if is_call(node, aten.masked_fill.Scalar) and node.args[2] == 0:
        return node.args[0], True
    if is_call(node, aten.mul.Tensor) and all(isinstance(a, Node) for a in node.args):
        for value, mask in (node.args, node.args[::-1]):
            if dtype(mask) == torch.bool or dtype(strip_casts(mask)) == torch.bool:
                return value, True
    return weights, False


def _top1_of(ids: Node) -> Node | None:
    """The scores of a top-1 choice written as `argmax(scores, -1)` or `scores.max(-1)[1]`."""
    ids = strip_casts(ids)
    if is_call(ids, aten.argmax.default):
        return ids.args[0]
    if is_getitem(ids, 1) and is_call(ids.args[0], aten.max.dim):
        return ids.args[0].args[0]
    return None


def _read_at_ids(ids: Node, table: Node) -> RoutingInfo:
    """Routing whose weights are the softmax table read at the chosen ids (no renormalisation)."""
    topk = _topk_of(ids)
    scores = topk.args[0] if topk is not None else _top1_of(ids)
    softmax = _softmax(table)
    if scores is not None and softmax is not None and strip_casts(scores) in (softmax, strip_casts(softmax.args[0])):
        return RoutingInfo(
            "softmax_topk", renormalized=False, softmax_fp32=dtype(softmax) == torch.float32,
            num_experts=_width(softmax),
        )
    return RoutingInfo("opaque", num_experts=_width(table))


def describe(ids: Node, weights: Node, at_ids: bool = False) -> RoutingInfo:
    """What routing produced (ids, weights); kind "opaque" when it is not a recognised form. `at_ids`:
    the weights are a [T, E] table, read at the ids."""
    if at_ids:
        return _read_at_ids(ids, weights)
    topk = _topk_of(ids)
    if topk is None:
        return RoutingInfo("opaque")
    weights, masked = _unmasked(weights)
    info = _describe(topk, ids, weights)
    return dataclasses.replace(info, masked=True) if masked else info


def _describe(topk: Node, ids: Node, weights: Node) -> RoutingInfo:
    weights, scale = _scaled_source(weights)
    sigmoid = _sigmoid_topk(topk, ids, weights, scale)
    if sigmoid is not None:
        return sigmoid
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
                scale=scale,
            )
    if softmax is None and _softmax(values) is not None:
        inner = strip_casts(_softmax(values).args[0])
        if is_getitem(inner, 0) and inner.args[0] is topk:
            return RoutingInfo(
                "topk_softmax",
                renormalized=True,
                softmax_fp32=dtype(_softmax(values)) == torch.float32,
                num_experts=_width(scores),
                scale=scale,
            )
    return RoutingInfo("opaque", num_experts=_width(scores))


def _width(node: Node) -> int | None:
    dims = shape(node)
    return const_int(dims[-1]) if dims else None
