"""The routing chain that feeds the portable op, softmax → top-k (→ renormalise) (→ cast), as one op.

Why: see `routing_op.py`; on CUDA the chain costs inductor a separate top-k kernel, the op one Triton
program. Only a chain whose every intermediate value feeds nothing but the chain itself and fused
calls is taken (otherwise the top-k would still run for its other users), and only when its values
are exactly the op's: the softmax in float32 over the last dimension, `torch.topk` with its defaults
(largest, sorted), a renormalisation by `v.sum(-1, keepdim=True)` without an epsilon, at most one cast.
Anything else keeps its chain, unreported (the fused MoE call is the same either way).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Graph, Node

from .. import routing_op
from ..fused_op import NAMESPACE
from ..fx_utils import arguments, device, dtype, is_call, is_cast, is_getitem, shape

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class RoutingChain:
    """softmax(logits) → topk → (renormalise) → (cast) whose outputs only fused calls read."""

    logits: Node  # [T, E]: the float32 softmax input, or the lower-precision tensor it was cast from
    k: int
    renormalize: bool
    dtype: torch.dtype  # of the weights the fused calls take
    weights: Node
    ids: Node
    nodes: frozenset[Node]  # the chain, from the softmax (or the cast into it) to `weights` and `ids`


def _fused_calls(graph: Graph) -> list[Node]:
    return [
        n for n in graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == NAMESPACE and n.target._schema.name == f"{NAMESPACE}::mixture_of_experts"
    ]


def _last_dim(node: Node, dim) -> bool:
    rank = len(shape(node) or ())
    return isinstance(dim, int) and rank > 0 and dim in (-1, rank - 1)


def _softmax_input(node: Node) -> Node | None:
    """x when node = softmax(x, -1) computed and returned in float32."""
    if dtype(node) != torch.float32:
        return None
    if is_call(node, aten._softmax.default):
        x, dim, half_to_float = node.args
        ok = not half_to_float
    elif is_call(node, aten.softmax.int):
        values = arguments(node) or {}
        x, dim = values.get("input"), values.get("dim")
        ok = values.get("dtype") in (None, torch.float32)
    else:
        return None
    return x if ok and isinstance(x, Node) and dtype(x) == torch.float32 and _last_dim(x, dim) else None


def _topk(ids: Node) -> tuple[Node, int] | None:
    """(topk node, k) when ids = topk(p, k)[1] with the defaults: last dim, largest, sorted."""
    if not (is_getitem(ids, 1) and is_call(ids.args[0], aten.topk.default)):
        return None
    topk = ids.args[0]
    values = arguments(topk)
    if values is None or not (values["largest"] and values["sorted"]) or not isinstance(values["k"], int):
        return None
    if not _last_dim(values["input"], values["dim"]):
        return None
    return topk, values["k"]


def _weights_chain(weights: Node, topk: Node) -> tuple[bool, list[Node]] | None:
    """(renormalized, chain nodes) when weights = [cast](v [/ v.sum(-1, keepdim=True)]), v = topk[0]."""
    chain = []
    node = weights
    if is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}:
        chain.append(node)
        node = node.args[0]
    renormalized = False
    if is_call(node, aten.div.Tensor) and isinstance(node.args[1], Node):
        numerator, total = node.args
        values = arguments(total) if is_call(total, aten.sum.dim_IntList) else None
        if not (values and values["input"] is numerator and values["keepdim"] and values.get("dtype") is None
                and list(values["dim"] or ()) in ([-1], [len(shape(numerator) or ()) - 1])):
            return None
        chain += [node, total]
        node, renormalized = numerator, True
    if not (is_getitem(node, 0) and node.args[0] is topk):
        return None
    return renormalized, [*chain, node]


def _read_only_by(nodes: set[Node], calls: set[Node]) -> bool:
    return all(user in nodes or user in calls for node in nodes for user in node.users)


def find(graph: Graph) -> list[RoutingChain]:
    """The routing chains that only the graph's portable fused calls read."""
    calls = _fused_calls(graph)
    found: dict[tuple[Node, Node], RoutingChain] = {}
    for call in calls:
        values = arguments(call) or {}
        ids, weights = values.get("expert_routing_table"), values.get("router_weights")
        if not isinstance(ids, Node) or not isinstance(weights, Node) or (ids, weights) in found:
            continue
        topk_and_k = _topk(ids)
        chain = _weights_chain(weights, topk_and_k[0]) if topk_and_k else None
        if chain is None:
            continue
        topk, k = topk_and_k
        renormalized, weight_nodes = chain
        softmax = topk.args[0]
        logits = _softmax_input(softmax) if isinstance(softmax, Node) else None
        if logits is None or len(shape(logits) or ()) != 2:
            continue
        nodes = {softmax, topk, ids, *weight_nodes}
        if (is_cast(logits) and len(logits.users) == 1 and dtype(logits.args[0]) in (torch.bfloat16, torch.float16)
                and device(logits.args[0]) == device(logits)):
            nodes.add(logits)  # the kernel reads the lower-precision logits and upcasts them itself
            logits = logits.args[0]
        if not _read_only_by(nodes, set(calls)):
            continue
        found[(ids, weights)] = RoutingChain(logits, k, renormalized, dtype(weights), weights, ids, frozenset(nodes))
    return list(found.values())


def rewrite(graph: Graph, chain: RoutingChain) -> Node:
    """The fused calls read `softmax_topk(logits, ...)` instead of the chain, which is then removed."""
    ordered = [n for n in graph.nodes if n in chain.nodes]
    with graph.inserting_before(ordered[0]):
        fused = graph.call_function(routing_op.OP, (chain.logits, chain.k, chain.renormalize, chain.dtype))
        weights = graph.call_function(operator.getitem, (fused, 0))
        ids = graph.call_function(operator.getitem, (fused, 1))
    weights.meta["val"], ids.meta["val"] = chain.weights.meta.get("val"), chain.ids.meta.get("val")
    fused.meta["val"] = (weights.meta["val"], ids.meta["val"])
    chain.weights.replace_all_uses_with(weights)
    chain.ids.replace_all_uses_with(ids)
    for node in reversed(ordered):
        graph.erase_node(node)
    return fused
