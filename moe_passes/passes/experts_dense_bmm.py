"""Dense all-expert batched matmul with the routing weights on the INPUT (transformers Llama4).

    routed_in = x.repeat(E, 1) * scores.T.reshape(-1, 1)      # every token to every expert, pre-scaled
    bmm(routed_in.view(E, -1, H), gate_up_proj) -> act(gate) * up -> bmm(., down_proj) -> sum over E

The fused kernel scales each expert's OUTPUT; with a non-linear MLP, MLP(w * x) != w * MLP(x), so this
form is recognised only to be declined with that reason.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import is_call, shape, strip_shape_ops
from .matches import Decline

aten = torch.ops.aten
FORM = "dense_bmm"

REASON = (
    "routing weights scale each expert's input (x.repeat(E) * scores before the expert bmm, as in Llama4); "
    "the fused kernel weights outputs, and with a non-linear MLP the two are not equal"
)


def _input_scaled_repeat(node: Node) -> bool:
    node = strip_shape_ops(node)
    if not is_call(node, aten.mul.Tensor):
        return False
    return any(isinstance(a, Node) and is_call(strip_shape_ops(a), aten.repeat.default) for a in node.args)


def find(graph: torch.fx.Graph) -> list[Decline]:
    declines = []
    for node in graph.nodes:
        if not is_call(node, aten.bmm.default):
            continue
        inputs, weights = node.args
        if len(shape(weights) or ()) == 3 and strip_shape_ops(weights).op == "placeholder":
            if _input_scaled_repeat(inputs):
                declines.append(Decline(FORM, REASON, node))
    return declines
