"""Experts applied per slot on weights gathered by the ids, in einsum spellings (gpt-fast, SGLang).

    gate = einsum("ti,taoi->tao", x, w1[ids])     up = einsum("ti,taoi->tao", x, w3[ids])
    y = einsum("tao,taio->tai", act(gate) * up, w2[ids])       out = einsum("tai,ta->ti", y, weights)

(w1/w3 may be the two halves of one gathered w13[ids], SGLang's `fused_moe_forward_native`; with biases
gathered the same way and GPT-OSS's clamped swiglu on interleaved columns, OpenAI's gpt-oss reference
MLP, read by `_match_biased` into the bias_fused_weights overload.) Each
einsum reaches the graph as views, permutes and a bmm in an arrangement of its own; they are read with
`axes.contraction`, which proves what is multiplied and summed whatever the arrangement: the down
projection and the combine together are sum_a sum_i weights[t, a] * h[t, a, i] * w2[ids][t, a, o, i],
and each of gate and up is sum_i x[t, i] * w[ids][t, a, o, i]. The anchor is the combine's bmm.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import (
    SHAPE_ONLY_OPS,
    const_int,
    is_call,
    is_getitem,
    shape,
    strip_casts,
    through_trailing_cast,
    val,
)
from .axes import contraction, frontier, top_of_views
from .biases import bias_fields, with_bias
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
from .mlp import activation_of, clamped_swiglu, gated_product
from .slots import same_shape, same_size

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
    return leaves is not None and (any(_gathered_stack(leaf) for leaf in leaves) or _biased_combine(leaves) is not None)


def _biased_combine(leaves: list[Node] | None) -> tuple[Node, Node] | None:
    """(per-slot outputs plus a gathered bias, [T, k] table) when the combine reads those two (GPT-OSS's
    reference MLP: `t += b2[ids]`, then `einsum("bec,be->bc", t, weights)`)."""
    if leaves is None or len(leaves) != 2:
        return None
    for biased, table in (leaves, leaves[::-1]):
        _, bias, ids = with_bias(biased)
        if bias is not None and len(shape(table) or ()) == 2 and val(table).is_floating_point() and (
                same_shape(shape(table), shape(ids))):
            return biased, table
    return None


def match_at(anchor: Node) -> ExpertsMatch | Decline | None:
    out = top_of_views(anchor)
    leaves = _combine_leaves(out)
    if _biased_combine(leaves) is not None:
        return _match_biased(out, *_biased_combine(leaves))
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
    if table is None and _adds_gathered_bias(out, ids):
        return None  # GPT-OSS's reference: the combine after the bias is the candidate (`_match_biased`)
    if table is None or not same_shape(shape(table), shape(ids)):
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
    return _match(out, hidden, ids, table, activation, ExpertWeights(stacked=down_w, out_in=down), **gate_up_roles)


def _match(out: Node, hidden: Node, ids: Node, table: Node, activation: str, down: ExpertWeights, **roles) -> ExpertsMatch:
    """The match of a gathered-einsum region read into its roles (gate/up, and GPT-OSS's biases)."""
    return ExpertsMatch(
        form=FORM,
        output=through_trailing_cast(out),
        hidden=hidden,
        ids=ids,
        weights=table,
        num_experts=const_int(shape(down.stacked)[0]),
        top_k=const_int(shape(ids)[1]),
        activation=activation,
        down=down,
        **roles,
    )


def _match_biased(out: Node, biased: Node, table: Node) -> ExpertsMatch | Decline:
    """GPT-OSS's reference MLP over gathered weights and biases, with its clamped swiglu:

        h = swiglu(einsum("tohi,th->tao", W1[ids], x) + b1[ids])      # gate/up interleaved in W1's rows
        y = einsum("taoi,tai->tao", W2[ids], h) + b2[ids]
        out = einsum("tao,ta->to", y, weights)

    the bias_fused_weights overload's computation."""

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    down_out, down_bias, ids = with_bias(biased)
    top_k = const_int(shape(ids)[1])
    combine = contraction(out, {biased: ("t", "a", "o"), table: ("t", "a")})
    summed = {"a"} if top_k != 1 else set()
    kept = tuple(label for label, size in zip(("t", "o"), (shape(ids)[0], shape(biased)[-1]), strict=True)
                 if const_int(size) != 1)  # a size-1 axis carries no label
    if combine is None or tuple(label for axis in combine.axes for label in axis) != kept or (
            set(combine.summed) != summed):
        return no("the per-slot expert outputs are not summed with a [T, k] table of routing weights", out)
    leaves = frontier(down_out, stop=lambda n: is_call(n, aten.mul.Tensor) and clamped_swiglu(n) is not None)
    stacks = [leaf for leaf in leaves or [] if _gathered_stack(leaf) and strip_casts(_gathered_stack(leaf)[1]) is strip_casts(ids)]
    hidden_act = next((leaf for leaf in leaves or [] if leaf not in stacks), None)
    if len(stacks) != 1 or len(leaves) != 2 or hidden_act is None:
        return no("the down projection is not an einsum of the slots' activations and W_down[ids]", down_out)
    swiglu = clamped_swiglu(hidden_act)
    if swiglu is None or not swiglu.interleaved:
        return no("GPT-OSS-style biases without its clamped swiglu on interleaved gate/up columns", hidden_act)
    down_w = _gathered_stack(stacks[0])[0]
    down = _projection(down_out, {hidden_act: _slot_labels(hidden_act, "i")}, stacks[0], "i", "o")
    gate_up_out, up_bias, bias_ids = with_bias(swiglu.projection)
    if up_bias is None or strip_casts(bias_ids) is not strip_casts(ids):
        return no("the gate/up projection has no bias gathered by the ids", swiglu.projection)
    up_leaves = _projection_leaves(gate_up_out, ids)
    weight = next((leaf for leaf in up_leaves or [] if _weight_source(leaf, ids) is not None), None)
    hidden = next((leaf for leaf in up_leaves or [] if leaf is not weight), None)
    if down is None or weight is None or len(up_leaves) != 2 or len(shape(hidden) or ()) != 2:
        return no(NOT_GATHERED_EINSUM, gate_up_out)
    gate_up_in = _projection(gate_up_out, {hidden: ("t", "h")}, weight, "h", "o")
    gate_up_w = _weight_source(weight, ids)
    if gate_up_in is None or gate_up_w[1] is not None:
        return no("gate/up is not x @ W[ids]^T for every slot", gate_up_out)
    if const_int(shape(gate_up_w[0])[0]) != const_int(shape(down_w)[0]):
        return no(STACK_COUNTS_DIFFER, down_w)
    return _match(
        out, hidden, ids, table, swiglu.description, ExpertWeights(stacked=down_w, out_in=down),
        gate_up=ExpertWeights(stacked=gate_up_w[0], out_in=gate_up_in), **bias_fields(swiglu, up_bias, down_bias),
    )


def _adds_gathered_bias(node: Node, ids: Node, depth: int = 4) -> bool:
    """`node` (through single-user views) is added to a [E, X] stack gathered by `ids`."""
    for _ in range(depth):
        if len(node.users) != 1:
            return False
        node = next(iter(node.users))
        if is_call(node, aten.add.Tensor):
            return any(
                isinstance(a, Node) and is_call(strip_casts(a), aten.index.Tensor) and len(strip_casts(a).args[1]) == 1
                and len(shape(strip_casts(a).args[0]) or ()) == 2 and strip_casts(strip_casts(a).args[1][0]) is strip_casts(ids)
                for a in node.args
            )
        if not is_call(node, *SHAPE_ONLY_OPS):
            return False
    return False


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
        sizes = dict(zip(labels, val(gathered).shape, strict=True))
        wanted = tuple(label for label in (("t", kept) if summed_slots else ("t", "a", kept))
                       if const_int(sizes[label]) != 1)  # a size-1 axis carries no label (one token, k = 1)
        if axes == wanted and found.summed | ({"a"} if summed_slots else set()) == summed:
            return out_in
    return None


NOT_GATHERED_EINSUM = "gate/up is not an einsum of the tokens and gathered expert weights"


def _gate_and_up(product, ids: Node) -> tuple[Node, dict] | NoMatch:
    """(x, {"gate": .., "up": ..} or {"gate_up": ..}) for gate and up projections of x by gathered weights;
    else why not (where: the caller's gated product)."""
    found = {}
    for name, node in (("gate", product.gate), ("up", product.up)):
        leaves = _projection_leaves(node, ids)
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


def _projection_leaves(node: Node, ids: Node) -> list[Node] | None:
    """What a projection of the tokens reads: the gathered weights, and x as [T, H] (not the view chain
    above it)."""
    tokens = shape(ids)[0]

    def token_rows(n: Node) -> bool:
        dims = shape(n)
        return dims is not None and len(dims) == 2 and same_size(dims[0], tokens) and val(n).is_floating_point()

    return frontier(node, token_rows)


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


# The combine's bmm ends the region; with one slot (k = 1) einsum writes it as a product, and written by
# hand as `(y * w[..., None]).sum(1)` it ends in the sum.
FINDER = Finder(FORM, (aten.bmm.default, aten.mul.Tensor, aten.sum.dim_IntList), each_anchor(_is_candidate), match_at,
                priority=80)
