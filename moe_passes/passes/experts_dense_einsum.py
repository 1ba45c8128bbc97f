"""Every expert on every token in einsum / batched-matmul spellings, combined by a [T, E] routing table.

    gate[e, t, i] = sum_h x[t, h] * Wg[e, i, h]        einsum("td,eid->eti"), or bmm of x expanded per expert
    up[e, t, i]   = sum_h x[t, h] * Wu[e, i, h]
    y[e, t, o]    = sum_i (act(gate) * up)[e, t, i] * Wd[e, o, i]
    out[t, o]     = sum_e table[t, e] * y[e, t, o]      einsum("etd,te->td"), or (table[..., None] * y.permute(1, 0, 2)).sum(1)
    out[t, o]     = sum_a w[t, a] * y[ids[t, a], t, o]  y[arange(T)[:, None], ids] or y.gather(1, ...), then einsum("tao,ta->to")

(vLLM-Omni's dense experts, tt-forge's batched DeepSeek-V3 `moe_infer`, JetStream's Mixtral.) Each einsum reaches the graph as
views, permutes, products, sums and a bmm in an arrangement of its own; `axes.contraction` proves what is
multiplied and summed whatever the arrangement. The weights may be stacked parameters or stacks made in
the forward (`torch.stack` of each expert's Linear weight). The table may be built any way from the top-k
ids and weights (scatter, scatter_add, index_put, one_hot(ids) * w summed over the slots): column e must
equal expert e's routing weight, zero where the token did not choose it, which is checked on probe ids and
weights (probe.py). Then out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t]), the kernel's semantics. The
second combine picks each token's chosen outputs by its ids and weights them: that is the kernel's sum
as written, with no table to check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..fx_utils import const_int, dtype, is_call, shape, through_trailing_cast, val
from . import probe
from .axes import VIEW_OPS, contraction, frontier, top_of_views
from .combines import picked_outputs, table_labels
from .finder import Finder, each_anchor
from .matches import (
    BIASES_NEED_SWIGLU,
    EMPTY_BATCH,
    GATE_UP_ROWS_DIFFER,
    IDS_WEIGHTS_SHAPES,
    Decline,
    ExpertsMatch,
    ExpertWeights,
    NoMatch,
    unprobeable,
    unsupported_activation,
)
from .mlp import activation_of, gated_product, halves
from .slots import same_size

aten = torch.ops.aten
FORM = "dense_einsum"


def _experts_product(node: Node) -> bool:
    return is_call(node, aten.mul.Tensor) and gated_product(node) is not None and len(shape(node) or ()) == 3


@dataclass(frozen=True)
class _Combine:
    """How the experts' outputs y[e, t] = (act(gate) * up)[e, t] @ W_down[e] reach the result: weighted
    by a [T, E] table (`table`: the leaf the combine reads, the table, the leaf's labels), or picked at each token's ids and
    weighted by its routing weights (`picked`: ids, weights, the picking node and y's labels)."""

    product: Node  # act(gate) * up, [E, T, I] or [T, E, I]
    down: Node  # W_down, [E, ., .]
    table: tuple[Node, Node, tuple] | None = None
    picked: tuple[Node, Node, Node, tuple] | None = None
    biased: Node | None = None  # the down projection adds a per-expert bias (baddbmm, or + b[:, None])


def _experts_and_down(y: Node) -> tuple[Node, Node] | None:
    """(gated product [E, T, I] or [T, E, I], down weights [E, ., .]) that y reads as an einsum, or None."""
    leaves = frontier(y, stop=_experts_product, products=True)
    if leaves is None or len(leaves) != 2:
        return None
    product = next((leaf for leaf in leaves if _experts_product(leaf)), None)
    weight = next((leaf for leaf in leaves if leaf is not product and len(shape(leaf) or ()) == 3), None)
    return (product, weight) if product is not None and weight is not None else None


def _read_combine(out: Node) -> _Combine | None:
    """The combine `out` is, told by its leaves (the contraction itself is proved in `match_at`)."""
    leaves = frontier(out, stop=lambda n: _experts_product(n) or table_labels(n) is not None
                      or picked_outputs(n) is not None, products=True)
    if leaves is None:
        return None
    if len(leaves) == 2:  # a biased down projection is no einsum: it ends the chain as a leaf
        table = next((leaf for leaf in leaves if table_labels(leaf) is not None), None)
        biased = next((leaf for leaf in leaves if leaf is not table and _biased_down(leaf) is not None), None)
        if table is not None and biased is not None:
            return _Combine(*_biased_down(biased), table=(table, *table_labels(table)), biased=biased)
    if len(leaves) == 3:
        product = next((leaf for leaf in leaves if _experts_product(leaf)), None)
        rest = [leaf for leaf in leaves if leaf is not product]
        table = next((leaf for leaf in rest if table_labels(leaf) is not None), None)
        weight = next((leaf for leaf in rest if leaf is not table and len(shape(leaf) or ()) == 3), None)
        if product is not None and table is not None and weight is not None:
            return _Combine(product, weight, table=(table, *table_labels(table)))
    picks = [leaf for leaf in leaves if picked_outputs(leaf) is not None]
    if len(picks) != 1:
        return None
    y, ids, labels = picked_outputs(picks[0])
    # The weights are read whole, whatever products made them (a scale that is a tensor once shapes are
    # dynamic): the leaf is the [T, k] floating tensor that multiplies the picked outputs.
    leaves = frontier(out, stop=lambda n: n is picks[0] or _shaped_like(n, ids), products=True)
    if leaves is None or len(leaves) != 2:
        return None
    weights = leaves[1] if leaves[0] is picks[0] else leaves[0]
    experts = _experts_and_down(y) if _shaped_like(weights, ids) else None
    return _Combine(*experts, picked=(ids, weights, picks[0], labels)) if experts is not None else None


def _biased_down(node: Node) -> tuple[Node, Node] | None:
    """(gated product, down weights) when `node` is baddbmm(bias, product, W_down), or the experts'
    down einsum plus a bias."""
    if is_call(node, aten.baddbmm.default):
        product, weight = _below_views(node.args[1]), node.args[2]
        if _experts_product(product) and len(shape(weight) or ()) == 3:
            return product, weight
    if is_call(node, aten.add.Tensor):
        for y, bias in (node.args, node.args[::-1]):
            if isinstance(y, Node) and isinstance(bias, Node) and (found := _experts_and_down(y)) is not None:
                return found
    return None


def _shaped_like(node: Node, ids: Node) -> bool:
    """A floating tensor of the ids' [T, k] shape (routing weights)."""
    value = val(node)
    return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 2
            and all(same_size(a, b) for a, b in zip(value.shape, shape(ids), strict=True)))


def _is_candidate(node: Node) -> bool:
    """The combine's bmm or sum, or for top-1 picks (nothing to sum) its product with the weights."""
    if is_call(node, aten.mul.Tensor):
        picks = [p for arg in node.args if isinstance(arg, Node) and (p := picked_outputs(_below_views(arg)))]
        if not picks or const_int(shape(picks[0][1])[1]) != 1:
            return False
        top = top_of_views(node)
        if len(top.users) == 1 and is_call(next(iter(top.users)), aten.sum.dim_IntList, aten.bmm.default):
            return False  # summed over the one slot after all: the sum is the anchor
    return _read_combine(top_of_views(node)) is not None


def _below_views(node: Node) -> Node:
    """The tensor `node` views or permutes."""
    while is_call(node, *VIEW_OPS):
        node = node.args[0]
    return node


def _labels_read(found, wanted: tuple[str, ...], summed: set[str], sizes: dict) -> bool:
    """The contraction keeps `wanted` in order (a label of size 1 carries no axis) and sums `summed`."""
    if found is None:
        return False
    axes = tuple(label for axis in found.axes for label in axis)
    kept = tuple(label for label in wanted if not (isinstance(sizes[label], int) and sizes[label] == 1))
    return axes == kept and set(found.summed) == summed - {k for k, v in sizes.items() if v == 1}


def _projection(node: Node, rows: dict, weight: Node, contracted: str, kept: tuple, sizes: dict) -> bool | None:
    """Whether `weight` ([E, ., .]) is read [out, in] (True) or [in, out] (False) when `node` is
    sum_contracted rows * weight keeping the labels `kept` (e, t and the weight's other label, in
    order); None when it is not that einsum."""
    other = kept[-1]
    for out_in, labels in ((True, ("e", other, contracted)), (False, ("e", contracted, other))):
        found = contraction(node, {**rows, weight: labels})
        if found is not None and found.leaves == frozenset([*rows, weight]):
            if _labels_read(found, kept, {contracted}, sizes):
                return out_in
    return None


def _expanded_tokens(rows: Node, experts: int) -> Node | None:
    """x when `rows` is x ([T, H]) once per expert: x.unsqueeze(0).expand(E, T, H), x.expand(E, T, H) (a new
    leading dim) or x.repeat(E, 1, 1)."""
    if is_call(rows, aten.expand.default) and is_call(rows.args[0], aten.unsqueeze.default) and rows.args[0].args[1] == 0:
        x = rows.args[0].args[0]
    elif is_call(rows, aten.expand.default) and len(shape(rows.args[0]) or ()) == 2 and len(rows.args[1]) == 3:
        x = rows.args[0] if same_size(shape(rows.args[0])[0], shape(rows)[1]) else None  # no token broadcast
    elif is_call(rows, aten.repeat.default) and len(shape(rows.args[0]) or ()) == 2:
        x = rows.args[0] if [const_int(r) for r in rows.args[1]] == [experts, 1, 1] else None
    else:
        return None
    return x if x is not None and const_int(shape(rows)[0]) == experts else None


def _views_a_weight(node: Node, experts: int) -> bool:
    """`node` is a view or permute of an [E, ., .] tensor (a size-1 dim squeezed away), not token rows."""
    dims = shape(_below_views(node)) or ()
    return len(dims) == 3 and const_int(dims[0]) == experts


def _up_projection(node: Node, sizes: dict, width: object, kept: tuple) -> tuple[Node, Node, bool] | NoMatch:
    """(x, weight, out_in) for node[e, t, i] = sum_h x[t, h] * W[e, i, h] (i of size `width`; node's
    dims labelled `kept`, ("e", "t", "i") or ("t", "e", "i")); else why not (stopped at `node`)."""
    def rows_or_expanded(n: Node) -> bool:
        dims = shape(n) or ()
        return (len(dims) == 2 and not _views_a_weight(n, sizes["e"])) or is_call(n, aten.expand.default, aten.repeat.default)

    leaves = frontier(node, stop=rows_or_expanded, products=True)  # a size-1 contraction is a mul
    if leaves is None or len(leaves) != 2:
        return NoMatch("gate/up is not an einsum of the tokens and stacked expert weights", node)
    for rows, weight in (leaves, leaves[::-1]):
        if len(shape(weight) or ()) != 3 or not val(weight).is_floating_point():
            continue
        x = _expanded_tokens(rows, sizes["e"]) if len(shape(rows) or ()) == 3 else rows
        if x is None or len(shape(x) or ()) != 2:
            continue
        labels = ("e", "t", "h") if x is not rows else ("t", "h")
        read_sizes = {**sizes, "h": shape(x)[-1], "i": width}
        out_in = _projection(node, {rows: labels}, weight, "h", kept, read_sizes)
        if out_in is not None:
            return x, weight, out_in
    return NoMatch("gate/up is not x @ W[e]^T for every expert and token", node)


def _expert_weights(node: Node, out_in: bool) -> ExpertWeights:
    """The experts' stack, or each expert's own matrix where the forward stacks them (torch.stack(...))."""
    if is_call(node, aten.stack.default) and (node.args[1] if len(node.args) > 1 else 0) == 0:
        return ExpertWeights(per_expert=tuple(node.args[0]), out_in=out_in)
    return ExpertWeights(stacked=node, out_in=out_in)


def _table_routing(table: Node, experts: int) -> tuple[Node, Node] | NoMatch:
    """(ids, weights) when column e of `table` is expert e's routing weight (zero where not chosen); else
    why not (stopped at `table`)."""
    sources, nodes = probe.table_sources(table)
    routing = probe.ids_and_weights(sources)
    if routing is None or shape(routing[0]) != shape(routing[1]):
        return NoMatch("the routing table is not built from one [T, k] ids tensor and one weights tensor", table)
    ids, weights = routing
    if len(shape(ids)) != 2 or const_int(shape(ids)[1]) is None or const_int(shape(ids)[1]) > experts:
        return NoMatch("routing ids are not [T, k] with k at most the number of experts", table)
    tokens, top_k = (int(probe.concrete(d)) for d in shape(ids))
    if tokens == 0:
        return NoMatch(EMPTY_BATCH, table)
    try:
        for i, w in probe.routing_probes(tokens, top_k, experts, dtype(weights)):
            value = probe.evaluate(nodes, {ids: i.to(dtype(ids)), weights: w})[table]
            if value.shape != (tokens, experts) or not torch.equal(value, probe.padded_columns(i, w, experts).to(value.dtype)):
                return NoMatch("column e of the routing table is not expert e's routing weight", table)
    except probe.NotProbeable as why:
        return NoMatch(unprobeable("the routing table", why), table)
    return ids, weights


def _down_read(combine: _Combine, out: Node, sizes: dict) -> tuple[bool, tuple] | None:
    """(whether W_down is read [out, in], the product's labels) when `out` is the combine that
    `combine`'s leaves say; None when it is not that einsum."""
    product, down = combine.product, combine.down
    orders = [order for order in (("e", "t", "i"), ("t", "e", "i"))
              if all(same_size(shape(product)[d], sizes[label]) for d, label in enumerate(order[:2]))]
    for order in orders:
        for out_in, labels in ((True, ("e", "o", "i")), (False, ("e", "i", "o"))):
            if combine.table is not None:
                table_leaf, _, table_labels = combine.table
                found = contraction(out, {table_leaf: table_labels, product: order, down: labels})
                if _labels_read(found, ("t", "o"), {"e", "i"}, sizes):
                    return out_in, order
                continue
            ids, weights, picking, y_labels = combine.picked
            y = picked_outputs(picking)[0]
            picked_sizes = {**sizes, "a": shape(ids)[1]}
            combined = contraction(out, {weights: ("t", "a"), picking: ("t", "a", "o")})
            experts = contraction(y, {product: order, down: labels})
            if (_labels_read(combined, ("t", "o"), {"a"}, picked_sizes)
                    and _labels_read(experts, y_labels, {"i"}, picked_sizes)):
                return out_in, order
    return None


def _picked_routing(combine: _Combine, experts: int) -> tuple[Node, Node] | NoMatch:
    """(ids, weights) of a picked combine: the sum it computes is the kernel's for any [T, k] pair."""
    ids, weights, picking, _ = combine.picked
    if not all(same_size(a, b) for a, b in zip(shape(ids), shape(weights), strict=True)):
        return NoMatch(IDS_WEIGHTS_SHAPES, picking)
    top_k = const_int(shape(ids)[1])
    if top_k is None or top_k > experts:
        return NoMatch("routing ids are not [T, k] with k at most the number of experts", picking)
    return ids, weights


def match_at(anchor: Node) -> ExpertsMatch | Decline | None:
    out = top_of_views(anchor)
    combine = _read_combine(out)
    product, down_w = combine.product, combine.down
    table = combine.table[1] if combine.table is not None else None
    tokens = shape(table)[0] if table is not None else shape(combine.picked[0])[0]
    experts = const_int(shape(down_w)[0])
    sizes = {"e": experts, "t": tokens, "i": shape(product)[-1], "o": shape(out)[-1], "h": None}

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    if experts is None or (table is not None and not same_size(shape(table)[1], experts)):
        return None  # not a sum over the experts of their outputs
    if combine.biased is not None:
        return no(BIASES_NEED_SWIGLU, combine.biased)
    read = _down_read(combine, out, sizes)
    if read is None:
        if table is None:
            return no("the combine is not sum_a w[t, a] * (h[ids[t, a], t] @ W_down[ids[t, a]])", out)
        return no("the combine is not sum_e table[t, e] * (h[e, t] @ W_down[e])", out)
    down_out_in, order = read
    gated = gated_product(product)
    activation, described = activation_of(gated.activation_node)
    if activation is None:
        return no(unsupported_activation(described), gated.activation_node)
    split = halves(gated.gate, gated.up)  # gate and up as the two halves of one [E, T, 2I] projection
    projected = (("gate_up", split[0]),) if split is not None else (("gate", gated.gate), ("up", gated.up))
    roles = {}
    for name, node in projected:
        projection = _up_projection(node, sizes, sizes["i"] * (2 if split is not None else 1), order)
        if isinstance(projection, NoMatch):
            return projection.decline(FORM, out)
        roles[name] = projection
    hidden = roles[projected[0][0]][0]
    if any(x is not hidden or out_in != roles[projected[0][0]][2] for x, _, out_in in roles.values()):
        return no(GATE_UP_ROWS_DIFFER, gated.up)
    if not same_size(shape(hidden)[0], tokens) or any(const_int(shape(w)[0]) != experts for _, w, _ in roles.values()):
        return no("the experts' weights or the routing hold another number of experts or tokens", table)
    routing = _table_routing(table, experts) if table is not None else _picked_routing(combine, experts)
    if isinstance(routing, NoMatch):
        return routing.decline(FORM, out)
    ids, weights = routing
    return ExpertsMatch(
        form=FORM,
        output=through_trailing_cast(out),
        hidden=hidden,
        ids=ids,
        weights=weights,
        num_experts=experts,
        top_k=const_int(shape(ids)[1]),
        activation=activation,
        picks_routed=table is None,
        down=_expert_weights(down_w, down_out_in),
        **{name: _expert_weights(weight, out_in) for name, (_, weight, out_in) in roles.items()},
    )


# The combine's bmm or sum over the experts (or a top-1 pick's product with its weights) ends the region.
FINDER = Finder(FORM, (aten.bmm.default, aten.sum.dim_IntList, aten.mul.Tensor), each_anchor(_is_candidate), match_at,
                priority=60, reads_every_expert=True)
