"""Per-expert biases (GPT-OSS): `x + bias[ids]` after a projection, shared by the GEMM-form finders."""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import is_call, shape, strip_shape_ops
from .matches import ExpertWeights

aten = torch.ops.aten


def with_bias(node: Node) -> tuple[Node, Node | None, Node | None]:
    """(x, stacked [E, N] bias, ids it is gathered with) for x + bias[ids]; (node, None, None) without."""
    node = strip_shape_ops(node)
    if is_call(node, aten.add.Tensor) and all(isinstance(a, Node) for a in node.args):
        for x, bias in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            bias = strip_shape_ops(bias)
            if is_call(bias, aten.index.Tensor) and len(bias.args[1]) == 1 and len(shape(bias.args[0])) == 2:
                return strip_shape_ops(x), bias.args[0], bias.args[1][0]
    return node, None, None


def bias_fields(swiglu, up_bias: Node | None, down_bias: Node | None) -> dict:
    """The ExpertsMatch fields of the bias_fused_weights overload (empty without the clamped swiglu)."""
    if swiglu is None:
        return {}
    return dict(
        gate_up_bias=ExpertWeights(stacked=up_bias),
        down_bias=ExpertWeights(stacked=down_bias),
        alpha=swiglu.alpha,
        limit=swiglu.limit,
    )
