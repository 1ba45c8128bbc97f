"""Dense and soft mixtures of experts: recognised so that they are declined with their true reason.

    out = sum_e softmax(g(x))[:, e] * expert_e(x)              dense gating (multi-gate MMoE, ...)
    out = combine(softmax, experts(dispatch(softmax) @ x))      Soft MoE: experts read mixtures of tokens

Neither selects experts: every expert runs on every token (or on every slot), weighted by a softmax over
all of them. The fused kernel computes only the top-k experts a token is routed to, so no rewrite can
be exact. What makes a mixture *dense* is the absence of a selection between the softmax and the place
its weights meet the expert outputs: no top-k, sort, arg-max, threshold or gather of rows.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx import Node

from ..fx_utils import TRANSPOSE_OPS, ancestors, is_call, shape

aten = torch.ops.aten

# Ops that choose experts or rows: one of them between the gate and the combine makes the routing sparse.
SELECTION_OPS = (
    aten.topk, aten.sort, aten.argsort, aten.argmax, aten.argmin, aten.kthvalue, aten.multinomial,
    aten.max.dim, aten.min.dim, aten.gt, aten.ge, aten.lt, aten.le, aten.eq, aten.ne,
    aten.nonzero, aten.index, aten.gather, aten.index_select, aten.masked_select,
)
GATE_OPS = (aten._softmax.default, aten.softmax.int, aten._safe_softmax.default)
MATMUL_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default)

# How far the readers look: an expert's private computation, and the path from its outputs to the combine.
EXPERT_REACH = 40
COMBINE_DEPTH = 12


def _weight_of(node: Node) -> Node:
    """`node` read through transposes."""
    while is_call(node, *TRANSPOSE_OPS):
        node = node.args[0]
    return node


def _is_weight(node: Node) -> bool:
    """A graph input of two or more dims (a parameter, once dynamo lifts it)."""
    return node.op in ("placeholder", "get_attr") and len(shape(node) or ()) >= 2


def _projection_weights(nodes: list[Node]) -> list[Node]:
    """The weight inputs of the matmuls among `nodes`, read through transposes."""
    return [w for n in nodes if is_call(n, *MATMUL_OPS) for w in map(_weight_of, n.all_input_nodes) if _is_weight(w)]


def _held_once(groups: list[list[Node]]) -> set[Node]:
    """The nodes that appear in exactly one of `groups`."""
    counts = Counter(n for group in groups for n in set(group))
    return {n for n, count in counts.items() if count == 1}


def expert_bank(outputs: list[Node]) -> list[list[Node]] | None:
    """Each output's own matmul weights, when the outputs are 2+ experts: each computed with weights no
    other output reads, of the same shapes in the same order. None otherwise."""
    if len(outputs) < 2 or len(set(outputs)) != len(outputs):
        return None
    reads = [_projection_weights(ancestors(out, limit=EXPERT_REACH)) for out in outputs]
    private = _held_once(reads)
    own = [[w for w in weights if w in private] for weights in reads]
    shapes = [tuple(tuple(shape(w) or ()) for w in weights) for weights in own]
    if not own[0] or any(s != shapes[0] for s in shapes):
        return None
    return own


def _selects(nodes: set[Node]) -> Node | None:
    return next((n for n in nodes if is_call(n, *SELECTION_OPS)), None)


def _between(start: Node, end: Node, limit: int) -> set[Node] | None:
    """The nodes on paths from `start` to `end` (both included), None when `end` is not reached in
    `limit` steps along the users."""
    reach, frontier = {start}, [start]
    for _ in range(limit):
        frontier = [u for n in frontier for u in n.users if u not in reach]
        reach.update(frontier)
        if end in reach:
            break
    if end not in reach:
        return None
    return {n for n in ancestors(end, limit=10 * limit) if n in reach}


def dense_gate(weights: Node, combine: Node) -> Node | None:
    """The softmax behind `weights` when nothing between it and `combine` selects: a dense gate."""
    for node in ancestors(weights, limit=COMBINE_DEPTH):
        if is_call(node, *GATE_OPS):
            path = _between(node, combine, COMBINE_DEPTH)
            if path is not None and _selects(path) is None:
                return node
            return None
    return None


RANKINGS = (aten.topk, aten.sort, aten.argsort, aten.kthvalue)
MASKINGS = (aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self, aten.where.ScalarOther,
            aten.where.ScalarSelf, aten.where.Scalar)


def masked_selection(gate: Node | None) -> Node | None:
    """The ranking (a top-k, sort or k-th value) behind a mask on the softmax's input, as in
    `softmax(logits.masked_fill(logits < topk(logits).values[:, -1:], -inf))`, else None."""
    if gate is None:
        return None
    for node in ancestors(gate.args[0], limit=COMBINE_DEPTH):
        if is_call(node, *MASKINGS):
            found = next((n for n in ancestors(node, limit=COMBINE_DEPTH) if is_call(n, *RANKINGS)), None)
            if found is not None:  # a mask by rank (not a padding mask: that selects no expert)
                return found
    return None


def masked_reason(num_experts: int) -> str:
    return (
        f"the {num_experts} experts run on every token, weighted by a softmax over logits masked by a "
        "selection (kept at or above the k-th largest): that is top-k routing only where no logits tie at "
        "the k-th value (a tie keeps more than k experts), and the fused kernel keeps exactly k; routing "
        "with topk's ids and weights is fused"
    )


def dense_reason(num_experts: int, soft: bool) -> str:
    if soft:
        return (
            f"soft mixture of experts: the {num_experts} experts read softmax-weighted mixtures of all tokens "
            "(slots) and their outputs are mixed back by a softmax, with no top-k selection; the fused kernel "
            "sends each token to its top-k experts only"
        )
    return (
        f"dense mixture of experts: all {num_experts} experts run on every token and their outputs are "
        "weighted by a softmax over the experts, with no top-k selection; the fused kernel computes only "
        "the top-k experts of each token"
    )


def read_dense_mixture(outputs: list[Node], merged: Node) -> tuple[str, Node] | None:
    """(the reason, the combine node) when the expert outputs `outputs`, merged at `merged` (a stack or
    cat), are weighted by a dense softmax gate within a few ops; None when they are not a dense mixture."""
    if expert_bank(outputs) is None or _selects(_private_nodes(outputs)) is not None:
        return None
    expert_side = set(ancestors(merged, limit=EXPERT_REACH * len(outputs)))
    reach, frontier = {merged}, [merged]
    for _ in range(COMBINE_DEPTH):
        frontier = [u for n in frontier for u in n.users if u not in reach]
        for node in frontier:
            for arg in node.all_input_nodes:
                if arg in reach or arg in expert_side:
                    continue
                gate = dense_gate(arg, node)
                if not over_experts(gate, len(outputs)):
                    continue
                return dense_reason(len(outputs), _dispatched_by(gate, expert_side)), node
        reach.update(frontier)
    return None


def over_experts(gate: Node | None, num_experts: int) -> bool:
    """The softmax runs over the experts: its axis is E long, or E x slots (Soft MoE's flattened slots)."""
    if gate is None:
        return False
    dims = shape(gate.args[0]) or ()
    axis = gate.args[1] if len(gate.args) > 1 else gate.kwargs.get("dim")
    size = dims[axis] if isinstance(axis, int) and -len(dims) <= axis < len(dims) else None
    return isinstance(size, int) and size >= num_experts and size % num_experts == 0


def _dispatched_by(gate: Node, expert_side: set[Node]) -> bool:
    """Soft MoE: the experts' inputs are mixed by a softmax of the same logits as the combine's."""
    logits = set(ancestors(gate.args[0], limit=4))
    return any(
        is_call(n, *GATE_OPS) and n is not gate and logits & set(ancestors(n.args[0], limit=4)) for n in expert_side
    )


def _private_nodes(outputs: list[Node]) -> set[Node]:
    """The nodes only one of the expert outputs depends on (within the readers' depth)."""
    return _held_once([ancestors(out, limit=EXPERT_REACH) for out in outputs])
