"""Experts applied per slot on weights gathered by the ids, in einsum spellings (gpt-fast, SGLang).

    gate = einsum("ti,taoi->tao", x, w1[ids])     up = einsum("ti,taoi->tao", x, w3[ids])
    y = einsum("tao,taio->tai", act(gate) * up, w2[ids])       out = einsum("tai,ta->ti", y, weights)

(w1/w3 may be the two halves of one gathered w13[ids], SGLang's `fused_moe_forward_native`.) Each
einsum reaches the graph as views, permutes and a bmm in an arrangement of its own; they are read with
`axes.contraction`, which proves what is multiplied and summed whatever the arrangement: the down
projection and the combine together are sum_a sum_i weights[t, a] * h[t, a, i] * w2[ids][t, a, o, i],
and each of gate and up is sum_i x[t, i] * w[ids][t, a, o, i]. The anchor is the combine's bmm.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import const_int, is_call, is_getitem, shape, strip_casts, through_trailing_cast, val
from .axes import contraction, frontier, top_of_views
from .finder import Finder, each_anchor
from .matches import (
    GATE_UP_ROWS_DIFFER,
    NOT_GATED,
    STACK_COUNTS_DIFFER,
    Decline,
    ExpertsMatch,
    ExpertWeights,
    NoMatch,
    unsupported_activation,
)
from .mlp import activation_of, gated_product
from .slots import same_size

aten = torch.ops.aten
FORM = "gathered_einsum"


def _gathered_stack(node: Node) -> tuple[Node, Node] | None:
    """(stacked weight [E, ., .], ids [T, k]) when node = W[ids] ([T, k, ., .])."""
    node = strip_casts(node)
    if is_call(node, aten.index.Tensor) and len(node.args[1]) == 1 and len(shape(node.args[0]) or ()) == 3:
        ids = node.args[1][0]
        if len(shape(ids) or ()) == 2 and not val(ids).is_floating_point():
            return node.args[0], ids
    return None


def _combine_leaves(out: Node) -> list[Node] | None:
    """What the combine (and the down projection under it) reads: through views, matmuls and products,
    down to the gated product of the experts (a leaf)."""
    def experts_product(n: Node) -> bool:
        return is_call(n, aten.mul.Tensor) and gated_product(n) is not None

    return [out] if experts_product(out) else frontier(out, stop=experts_product, products=True)


def _is_candidate(node: Node) -> bool:
    leaves = _combine_leaves(top_of_views(node))
    return leaves is not None and any(_gathered_stack(leaf) for leaf in leaves)


def match_at(anchor: Node) -> ExpertsMatch | Decline | None:
    out = top_of_views(anchor)
    leaves = _combine_leaves(out)
    stacks = [leaf for leaf in leaves if _gathered_stack(leaf)]
    others = [leaf for leaf in leaves if leaf not in stacks]
    if len(stacks) != 1 or len(others) != 2 or any(strip_casts(o) is strip_casts(stacks[0]) for o in others):
        return None  # not a down projection and a combine over gathered weights
    down_w, ids = _gathered_stack(stacks[0])
    top_k = const_int(shape(ids)[1])

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    table = next((o for o in others if len(shape(o) or ()) == 2 and val(o).is_floating_point()), None)
    hidden_act = next((o for o in others if o is not table), None)
    if table is None or shape(table) != shape(ids):
        return no("the per-slot expert outputs are not summed with a [T, k] table of routing weights", out)
    slot_leaves = {table: ("t", "a"), hidden_act: _slot_labels(hidden_act, "i")}
    down = _projection(out, slot_leaves, stacks[0], "i", "o", summed_slots=top_k > 1)
    if down is None:
        return no("the combine is not sum_a weights[t, a] * (h[t, a] @ W_down[ids[t, a]])", out)
    product = gated_product(hidden_act)
    if product is None:
        return no(NOT_GATED, hidden_act)
    activation, described = activation_of(product.activation_node)
    if activation is None:
        return no(unsupported_activation(described), product.activation_node)
    roles = _gate_and_up(product, ids)
    if isinstance(roles, NoMatch):
        return roles.decline(FORM, out, hidden_act)
    hidden, gate_up_roles = roles
    stacked = [r.stacked for r in gate_up_roles.values()] + [down_w]
    if len({const_int(shape(w)[0]) for w in stacked}) != 1:
        return no(STACK_COUNTS_DIFFER, down_w)
    return ExpertsMatch(
        form=FORM,
        output=through_trailing_cast(out),
        hidden=hidden,
        ids=ids,
        weights=table,
        num_experts=const_int(shape(down_w)[0]),
        top_k=top_k,
        activation=activation,
        down=ExpertWeights(stacked=down_w, out_in=down),
        **gate_up_roles,
    )


def _slot_labels(node: Node, last: str) -> tuple:
    """Labels for a per-slot tensor: [T, k, X] -> (t, a, last); [T * k, X] -> ((t, a), last)."""
    return ("t", "a", last) if len(shape(node)) == 3 else (("t", "a"), last)


def _projection(
    node: Node, leaves: dict, gathered: Node, contracted: str, kept: str, summed_slots: bool = False
) -> bool | None:
    """Whether `gathered` (W[ids], [T, k, ., .]) is read [out, in] (True) or [in, out] (False) when
    `node` sums `contracted` against it, keeping `kept` per slot (per token, the k slots summed, when
    `summed_slots`); None when it is not such a projection. A size-1 axis (k = 1) carries no label."""
    summed = frozenset({contracted, "a"} if summed_slots else {contracted})
    for out_in, labels in ((True, ("t", "a", kept, contracted)), (False, ("t", "a", contracted, kept))):
        found = contraction(node, {**leaves, gathered: labels})
        if found is None or found.leaves != frozenset([*leaves, gathered]):
            continue
        axes = tuple(label for axis in found.axes for label in axis)
        wanted = ("t", kept) if summed_slots or val(gathered).shape[1] == 1 else ("t", "a", kept)
        if axes == wanted and found.summed | ({"a"} if summed_slots else set()) == summed:
            return out_in
    return None


NOT_GATHERED_EINSUM = "gate/up is not an einsum of the tokens and gathered expert weights"


def _gate_and_up(product, ids: Node) -> tuple[Node, dict] | NoMatch:
    """(x, {"gate": .., "up": ..} or {"gate_up": ..}) for gate and up projections of x by gathered weights;
    else why not (where: the caller's gated product)."""
    found = {}
    tokens = shape(ids)[0]

    def token_rows(n: Node) -> bool:  # x as [T, H], not the view chain above it
        dims = shape(n)
        return dims is not None and len(dims) == 2 and same_size(dims[0], tokens) and val(n).is_floating_point()

    for name, node in (("gate", product.gate), ("up", product.up)):
        leaves = frontier(node, token_rows)
        if leaves is None or len(leaves) != 2:
            return NoMatch(NOT_GATHERED_EINSUM)
        weight = next((leaf for leaf in leaves if _weight_source(leaf, ids) is not None), None)
        hidden = next((leaf for leaf in leaves if leaf is not weight), None)
        if weight is None or len(shape(hidden) or ()) != 2:
            return NoMatch(NOT_GATHERED_EINSUM)
        out_in = _projection(node, {hidden: ("t", "h")}, weight, "h", "o")
        if out_in is None:
            return NoMatch("gate/up is not x @ W[ids]^T for every slot")
        found[name] = (hidden, weight, out_in)
    if found["gate"][0] is not found["up"][0] or found["gate"][2] != found["up"][2]:
        return NoMatch(GATE_UP_ROWS_DIFFER)
    hidden, out_in = found["gate"][0], found["gate"][2]
    sources = [_weight_source(found[name][1], ids) for name in ("gate", "up")]
    if sources[0][1] is not None:  # halves of one gathered w13[ids]
        if sources[0][0] is not sources[1][0] or (sources[0][1], sources[1][1]) != (0, 1):
            return NoMatch("gate and up are not the two halves of one gathered gate/up stack")
        return hidden, {"gate_up": ExpertWeights(stacked=sources[0][0], out_in=out_in)}
    return hidden, {name: ExpertWeights(stacked=source[0], out_in=out_in) for name, source in zip(("gate", "up"), sources, strict=True)}


def _weight_source(node: Node, ids: Node) -> tuple[Node, int | None] | None:
    """(stack, None) for W[ids]; (stack, half) for the first or second half of W[ids] along its out dim."""
    gathered = _gathered_stack(node)
    if gathered is not None:
        return (gathered[0], None) if strip_casts(gathered[1]) is strip_casts(ids) else None
    if is_getitem(node) and is_call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split = node.args[0]
        gathered = _gathered_stack(split.args[0])
        if gathered is None or strip_casts(gathered[1]) is not strip_casts(ids):
            return None
        size = shape(split.args[0])
        if (split.args[2] if len(split.args) > 2 else 0) % 4 == 2 and halves_of(split, size[2]):
            return gathered[0], node.args[1]
    return None


def halves_of(split: Node, width: object) -> bool:
    pieces = split.args[1]
    pieces = list(pieces) if isinstance(pieces, list | tuple) else [pieces, pieces]
    return len(pieces) == 2 and const_int(pieces[0]) == const_int(pieces[1]) and const_int(pieces[0]) * 2 == const_int(width)


# The combine's bmm ends the region; with one slot (k = 1) einsum writes it as a product.
FINDER = Finder(FORM, (aten.bmm.default, aten.mul.Tensor), each_anchor(_is_candidate), match_at, priority=80)
