"""Every expert on every token in einsum / batched-matmul spellings, combined by a [T, E] routing table.

    gate[e, t, i] = sum_h x[t, h] * Wg[e, i, h]        einsum("td,eid->eti"), or bmm of x expanded per expert
    up[e, t, i]   = sum_h x[t, h] * Wu[e, i, h]
    y[e, t, o]    = sum_i (act(gate) * up)[e, t, i] * Wd[e, o, i]
    out[t, o]     = sum_e table[t, e] * y[e, t, o]      einsum("etd,te->td"), or (table[..., None] * y.permute(1, 0, 2)).sum(1)

(vLLM-Omni's dense experts, tt-forge's batched DeepSeek-V3 `moe_infer`.) Each einsum reaches the graph as
views, permutes, products, sums and a bmm in an arrangement of its own; `axes.contraction` proves what is
multiplied and summed whatever the arrangement. The weights may be stacked parameters or stacks made in
the forward (`torch.stack` of each expert's Linear weight). The table may be built any way from the top-k
ids and weights (scatter, scatter_add, index_put, one_hot(ids) * w summed over the slots): column e must
equal expert e's routing weight, zero where the token did not choose it, which is checked on probe ids and
weights (probe.py). Then out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t]), the kernel's semantics.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import const_int, dtype, is_call, is_cast, shape, through_trailing_cast, val
from . import probe
from .axes import VIEW_OPS, contraction, frontier, top_of_views
from .finder import Finder, each_anchor
from .matches import (
    EMPTY_BATCH,
    GATE_UP_ROWS_DIFFER,
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


def _routing_table(node: Node) -> bool:
    """A floating 2-D tensor built from integer ids and one other tensor (the weights) alone: read as one
    leaf, not through its own products."""
    value = val(node)
    if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point()):
        return False
    return probe.builds_table(node) and len(probe.table_sources(node)[0]) == 2


def _table_labels(node: Node) -> tuple[Node, tuple] | None:
    """(the 2-D routing table, labels of `node`'s dims) when `node` is the table, or a cast of it with
    size-1 dims inserted (`table.unsqueeze(-1).to(y.dtype)`): ("t", "e") with None at the inserted dims."""
    inserted = []
    while is_cast(node) or is_call(node, aten.unsqueeze.default):
        if is_call(node, aten.unsqueeze.default):
            inserted.append(node.args[1] % len(shape(node)))
        node = node.args[0]
    if not _routing_table(node):
        return None
    labels: list = ["t", "e"]
    for dim in reversed(inserted):  # innermost unsqueeze first
        labels.insert(dim, None)
    return node, tuple(labels)


def _combine_leaves(out: Node) -> tuple[Node, Node, Node] | None:
    """(table leaf [T, E] (or a cast with size-1 dims), gated product [E, T, I], down weights [E, ., .])
    that the combine reads, or None."""
    leaves = frontier(out, stop=lambda n: _experts_product(n) or _table_labels(n) is not None, products=True)
    if leaves is None or len(leaves) != 3:
        return None
    product = next((leaf for leaf in leaves if _experts_product(leaf)), None)
    rest = [leaf for leaf in leaves if leaf is not product]
    table = next((leaf for leaf in rest if _table_labels(leaf) is not None), None)
    weight = next((leaf for leaf in rest if leaf is not table and len(shape(leaf) or ()) == 3), None)
    return (table, product, weight) if product is not None and table is not None and weight is not None else None


def _is_candidate(node: Node) -> bool:
    return _combine_leaves(top_of_views(node)) is not None


def _labels_read(found, wanted: tuple[str, ...], summed: set[str], sizes: dict) -> bool:
    """The contraction keeps `wanted` in order (a label of size 1 carries no axis) and sums `summed`."""
    if found is None:
        return False
    axes = tuple(label for axis in found.axes for label in axis)
    kept = tuple(label for label in wanted if not (isinstance(sizes[label], int) and sizes[label] == 1))
    return axes == kept and set(found.summed) == summed - {k for k, v in sizes.items() if v == 1}


def _projection(node: Node, rows: dict, weight: Node, contracted: str, kept: str, sizes: dict) -> bool | None:
    """Whether `weight` ([E, ., .]) is read [out, in] (True) or [in, out] (False) when `node` is
    sum_contracted rows * weight keeping (e, t, kept); None when it is not that einsum."""
    for out_in, labels in ((True, ("e", kept, contracted)), (False, ("e", contracted, kept))):
        found = contraction(node, {**rows, weight: labels})
        if found is not None and found.leaves == frozenset([*rows, weight]):
            if _labels_read(found, ("e", "t", kept), {contracted}, sizes):
                return out_in
    return None


def _expanded_tokens(rows: Node, experts: int) -> Node | None:
    """x when `rows` is x ([T, H]) once per expert: x.unsqueeze(0).expand(E, T, H) (or x.repeat(E, 1, 1))."""
    if is_call(rows, aten.expand.default) and is_call(rows.args[0], aten.unsqueeze.default) and rows.args[0].args[1] == 0:
        x = rows.args[0].args[0]
    elif is_call(rows, aten.repeat.default) and len(shape(rows.args[0]) or ()) == 2:
        x = rows.args[0] if [const_int(r) for r in rows.args[1]] == [experts, 1, 1] else None
    else:
        return None
    return x if x is not None and const_int(shape(rows)[0]) == experts else None


def _views_a_weight(node: Node, experts: int) -> bool:
    """`node` is a view or permute of an [E, ., .] tensor (a size-1 dim squeezed away), not token rows."""
    while is_call(node, *VIEW_OPS):
        node = node.args[0]
    dims = shape(node) or ()
    return len(dims) == 3 and const_int(dims[0]) == experts


def _up_projection(node: Node, sizes: dict, width: object) -> tuple[Node, Node, bool] | NoMatch:
    """(x, weight, out_in) for node[e, t, i] = sum_h x[t, h] * W[e, i, h] (i of size `width`); else why
    not (stopped at `node`)."""
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
        out_in = _projection(node, {rows: labels}, weight, "h", "i", read_sizes)
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


def match_at(anchor: Node) -> ExpertsMatch | Decline | None:
    out = top_of_views(anchor)
    table_leaf, product, down_w = _combine_leaves(out)
    table, table_labels = _table_labels(table_leaf)
    experts = const_int(shape(down_w)[0])
    sizes = {"e": experts, "t": shape(table)[0], "i": shape(product)[-1], "o": shape(out)[-1], "h": None}

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    if experts is None or not same_size(shape(table)[1], experts) or not same_size(shape(product)[0], experts):
        return None  # not a sum over the experts of their outputs
    down_out_in = None
    for out_in, labels in ((True, ("e", "o", "i")), (False, ("e", "i", "o"))):
        found = contraction(out, {table_leaf: table_labels, product: ("e", "t", "i"), down_w: labels})
        if _labels_read(found, ("t", "o"), {"e", "i"}, sizes):
            down_out_in = out_in
            break
    if down_out_in is None:
        return no("the combine is not sum_e table[t, e] * (h[e, t] @ W_down[e])", out)
    gated = gated_product(product)
    activation, described = activation_of(gated.activation_node)
    if activation is None:
        return no(unsupported_activation(described), gated.activation_node)
    split = halves(gated.gate, gated.up)  # gate and up as the two halves of one [E, T, 2I] projection
    projected = (("gate_up", split[0]),) if split is not None else (("gate", gated.gate), ("up", gated.up))
    roles = {}
    for name, node in projected:
        read = _up_projection(node, sizes, sizes["i"] * (2 if split is not None else 1))
        if isinstance(read, NoMatch):
            return read.decline(FORM, out)
        roles[name] = read
    hidden = roles[projected[0][0]][0]
    if any(x is not hidden or out_in != roles[projected[0][0]][2] for x, _, out_in in roles.values()):
        return no(GATE_UP_ROWS_DIFFER, gated.up)
    if not same_size(shape(hidden)[0], shape(table)[0]) or any(
            const_int(shape(w)[0]) != experts for _, w, _ in roles.values()):
        return no("the experts' weights or the table hold another number of experts or tokens", table)
    routing = _table_routing(table, experts)
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
        down=_expert_weights(down_w, down_out_in),
        **{name: _expert_weights(weight, out_in) for name, (_, weight, out_in) in roles.items()},
    )


# The combine's bmm or sum over the experts ends the region.
FINDER = Finder(FORM, (aten.bmm.default, aten.sum.dim_IntList), each_anchor(_is_candidate), match_at,
                priority=60, reads_every_expert=True)
