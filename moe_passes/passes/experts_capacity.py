"""Capacity-limited dispatch (GShard, DeepSpeed, Tutel, Hunyuan-Large): fused where it cannot drop.

    dispatched = einsum("sec,sm->ecm", dispatch, x)      y = experts(dispatched)      [E, C, M]
    out = einsum("sec,ecm->sm", combine, y)               combine[s, e, c]: token s in slot c of expert e

Each expert takes at most C tokens; the gating drops the ones past that (their weight is zeroed), which
the fused kernel never does. Both einsums are read with `axes.contraction` (whatever views, bmm or mm over
the merged E * C dim they became: fairseq writes them as `mm`). A region whose capacity is not proved at
least the token count is declined, never rewritten. Tokens dispatched in groups ([G, S, E, C]: tensor2tensor,
lucidrains; each group has its own capacity, the experts often batched einsums) are read the same way and
always declined: dropping where C < S, and not rewritten where it cannot drop.

With C >= S (Hunyuan-Large: C = S) and experts that run one MLP per expert on its [C, M] slots, the
region is the fused kernel's sum when, for every routing, (1) the dispatch is 0/1 with at most one token
per slot, (2) every slot the combine weights holds the token it weights, and (3) the combine summed over
the slots is the kernel's [S, E] weights: then out[s] = sum_e W[s, e] * MLP_e(x[s]). The combine and
dispatch are exact functions of the routing ids and weights (index, mask and running-sum ops, and a
top-k over a whole dim, which only permutes), so the three are checked on probe routings, and on
crowded ones that put every token on the same experts: positions grow with the counts, so a slot that
could overflow, or a threshold on positions, bites there first (thresholds are allowed here for that).
"""

from __future__ import annotations

import itertools

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx_utils import arguments, const_int, dtype, is_call, is_cast, is_getitem, shape, strip_shape_ops
from . import probe
from .axes import contraction, frontier
from .expert_terms import ExpertTerm, first_no_match, no_mlp_reason, one_activation, read_term, role_weights
from .finder import Finder, each_anchor
from .matches import Decline, ExpertsMatch, NoMatch, unprobeable
from .slots import same_shape, same_size

aten = torch.ops.aten
FORM = "capacity_dispatch"
DROPS = (
    "capacity-limited dispatch ([tokens, experts, capacity] dispatch and combine tensors, GShard / DeepSpeed "
    "style), capacity {capacity} for {tokens} tokens: tokens past an expert's capacity are dropped from it, and "
    "nothing in this graph shows the capacity at least every expert's count (one computed in another graph or "
    "read on the host is a constant here); the fused kernel computes every routed token"
)
AT_LEAST_TOKENS = (
    "capacity-limited dispatch ([tokens, experts, capacity] tensors) whose capacity is at least the token count"
)


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default)


def _top(node: Node) -> Node:
    """The last of the views a single-use chain puts on the einsum's bmm."""
    while len(node.users) == 1 and next(iter(node.users)).target in _VIEWS:
        node = next(iter(node.users))
    return node


def _combine(node: Node) -> tuple[Node, Node] | None:
    """(combine [S, E, C], expert outputs [E, C, M]) when `node` is einsum("sec,ecm->sm"), read at the
    last of its views that keeps [S, M] (a reshape back to [B, T, M] splits S); the outputs may carry
    leading dims of size 1 (fairseq's [all2all size, E, C, M], combined with `mm` over E * C)."""
    leaves = frontier(_top(node))
    if leaves is not None and len(leaves) > 2:  # batched experts: their own matmuls extend the chain
        leaves = frontier(_top(node), stop=lambda n: n is not node and is_call(n, aten.bmm.default, aten.mm.default))
    if leaves is None or len(leaves) != 2 or not all(len(shape(leaf) or ()) >= 3 for leaf in leaves):
        return None
    chain = [node]
    while chain[-1] is not _top(node):
        chain.append(next(iter(chain[-1].users)))
    for table, outputs in (leaves, leaves[::-1]):
        for table_axes, outputs_axes in _labellings(table, outputs):
            sizes = dict(zip(table_axes, shape(table), strict=True), m=shape(outputs)[-1])
            for at in reversed(chain):
                read = contraction(at, {table: table_axes, outputs: outputs_axes})
                if read is not None and _reads_as(read, sizes, "gsm" if "g" in table_axes else "sm", "ec"):
                    return table, outputs
    return None


def _labellings(table: Node, outputs: Node) -> list[tuple[tuple, tuple]]:
    """How the combine's two operands may be labelled: [S, E, C] and [.., E, C, M] (leading dims of size
    1), or, for tokens dispatched in groups (tensor2tensor's and lucidrains' [G, S, E, C], S the tokens of
    a group, each group with its own capacity), [G, S, E, C] and [E, G, C, M], [G, E, C, M] or [E, G * C, M]."""
    rank = len(shape(outputs))
    if len(shape(table)) == 3 and rank >= 3 and all(size == 1 for size in shape(outputs)[: rank - 3]):
        return [(("s", "e", "c"), (None,) * (rank - 3) + ("e", "c", "m"))]
    if len(shape(table)) == 4 and rank == 4:
        return [(("g", "s", "e", "c"), ("e", "g", "c", "m")), (("g", "s", "e", "c"), ("g", "e", "c", "m"))]
    if len(shape(table)) == 4 and rank == 3:  # the experts ran on [E, G * C, M]
        groups, _, _, capacity = shape(table)
        labelled = tuple(a for a, size in (("g", groups), ("c", capacity)) if not same_size(size, 1))  # size 1: no label
        merged = labelled if len(labelled) > 1 else labelled[0] if labelled else None
        return [(("g", "s", "e", "c"), ("e", merged, "m"))]
    return []


def _reads_as(read, sizes: dict, kept: str, summed: str) -> bool:
    """`read` keeps the axes `kept` in that order and sums `summed`, leaving out those of size 1 (which
    carry no label: one token, one slot)."""
    labelled = [axis for axis in kept + summed if not same_size(sizes[axis], 1)]
    return tuple(axis for axis in read.axes if axis) == tuple((a,) for a in kept if a in labelled) and (
        read.summed == frozenset(a for a in summed if a in labelled))


def _dispatched_by(outputs: Node, table: Node, depth: int = 40) -> bool:
    """The expert outputs come from rows dispatched by a [S, E, C] tensor (in any order of its dims):
    einsum("sec,sm->ecm"). Only ever read to decline, so a loose test costs a decline, never a rewrite."""
    seen, frontier_nodes = set(), [outputs]
    for _ in range(depth):
        frontier_nodes = [s for n in frontier_nodes for s in n.all_input_nodes if s not in seen and not seen.add(s)]
        for node in frontier_nodes:
            if node.target in (aten.bmm.default, aten.mm.default):
                leaves = frontier(_top(node)) or []
                # [S, E, C] as the combine reads it, or permuted ([E, C, S]: nanoMoE's dispatch @ x)
                if any(sorted(map(str, shape(leaf))) == sorted(map(str, shape(table))) for leaf in leaves):
                    return True
    return False


def match_at(anchor: Node) -> ExpertsMatch | Decline | None:
    found = _combine(anchor)
    if found is None or not _dispatched_by(found[1], found[0]):
        return None
    combine, outputs = found
    tokens, _, capacity = shape(combine)[-3:]
    if not statically_known_true(capacity >= tokens):
        return Decline(FORM, DROPS.format(capacity=capacity, tokens=tokens), _top(anchor))
    if len(shape(combine)) == 4:
        return Decline(FORM, f"{AT_LEAST_TOKENS}, dispatched in groups ([groups, tokens, experts, capacity])",
                       _top(anchor))
    read = _never_dropping(_top(anchor), combine, outputs)
    return read if isinstance(read, ExpertsMatch) else read.decline(FORM, _top(anchor))


def _never_dropping(out: Node, combine: Node, outputs: Node) -> ExpertsMatch | NoMatch:
    """The fused call's match for a dispatch whose capacity is at least the token count, or why not."""
    terms = _expert_terms(outputs)
    if isinstance(terms, NoMatch):
        return terms
    dispatched = _slot_rows(terms[0].hidden)[0]
    dispatch = _dispatch(dispatched, combine)
    if isinstance(dispatch, NoMatch):
        return dispatch
    dispatch, order, hidden = dispatch
    routing = _routing(combine, dispatch)
    if isinstance(routing, NoMatch):
        return routing
    ids, weights, at_ids, nodes = routing
    width = const_int(shape(combine)[1])
    if width != len(terms) or (at_ids and const_int(shape(weights)[1]) != width):
        return NoMatch("the combine's experts are not the experts the slots run through", combine)
    try:
        broken = _check_slots(combine, dispatch, order, ids, weights, at_ids, nodes, width)
    except probe.NotProbeable as why:
        return NoMatch(f"{AT_LEAST_TOKENS}: {unprobeable('its slot assignment', why)}", combine)
    if broken is not None:
        return NoMatch(f"{AT_LEAST_TOKENS}: {broken}", combine)
    unread = one_activation(terms) or first_no_match(*(roles := [role_weights(terms, r) for r in ("gate_up", "gate", "up", "down")]))
    if unread is not None:
        return unread
    gate_up, gate, up, down = roles
    return ExpertsMatch(
        form=FORM, output=out, hidden=hidden, ids=ids, weights=weights, weights_at_ids=at_ids,
        num_experts=width, top_k=const_int(shape(ids)[1]) if len(shape(ids)) == 2 else 1,
        activation=terms[0].activation, gate_up=gate_up, gate=gate, up=up, down=down,
    )


def _expert_terms(outputs: Node) -> list[ExpertTerm] | NoMatch:
    """One unweighted MLP per expert, concatenated in expert order, expert e reading slots [e] of one
    [E, C, M] tensor (`dispatched.chunk(E)`, unbind, select)."""
    joined = strip_shape_ops(outputs)
    if is_call(joined, aten.bmm.default, aten.baddbmm.default):
        return NoMatch("the experts run as batched matmuls over all their slots at once (stacked weights); "
                       "this form reads one MLP per expert on its own slots", joined)
    if not is_call(joined, aten.cat.default, aten.stack.default) or (arguments(joined) or {}).get("dim", 0) != 0:
        return NoMatch("the experts' outputs are not joined along the expert dim", joined)
    terms, source = [], None
    for e, part in enumerate(joined.args[0]):
        term = read_term(part)
        if term is None or term.coefficient is not None or term.input_scaled_by is not None or term.swiglu:
            reason = "an expert's output is not a plain gated MLP of its slots"
            return NoMatch(no_mlp_reason(part, reason) if term is None else reason, part)
        rows = _slot_rows(term.hidden)
        if rows is None or rows[1] != e or (source is not None and rows[0] is not source):
            return NoMatch("expert e does not read slots [e] of one dispatched tensor", term.hidden)
        source = rows[0]
        terms.append(term)
    return terms


def _slot_rows(node: Node) -> tuple[Node, int] | None:
    """(S, e) when `node` is S[e] along dim 0, however it was cut (split / chunk / unbind / select)."""
    node = strip_shape_ops(node)
    if is_getitem(node) and is_call(node.args[0], aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
        parent, index = node.args[0], node.args[1]
        args = arguments(parent) or {}
        sizes = args.get("split_size") if is_call(parent, aten.split.Tensor) else args.get("split_sizes", 1)
        one_each = sizes == 1 or (isinstance(sizes, list | tuple) and all(const_int(s) == 1 for s in sizes))
        if args.get("dim", 0) == 0 and one_each:
            return args.get("self", parent.args[0]), index
    if is_call(node, aten.select.int) and node.args[1] == 0 and const_int(node.args[2]) is not None:
        return node.args[0], const_int(node.args[2])
    return None


def _dispatch(dispatched: Node, combine: Node) -> tuple[Node, tuple[int, ...], Node] | NoMatch:
    """(the dispatch tensor, the order of its dims as (s, e, c), the [S, M] hidden states) when the
    slots are einsum("sec,sm->ecm", dispatch, x), in any order of the dispatch's dims."""
    tokens = shape(combine)[0]
    hidden_size = shape(dispatched)[-1] if shape(dispatched) else None
    leaves = frontier(dispatched, stop=lambda n: len(shape(n) or ()) == 2 and same_size(shape(n)[0], tokens)
                      and same_size(shape(n)[1], hidden_size))
    if leaves is None or len(leaves) != 2:
        return NoMatch("the slots are not one einsum of a dispatch tensor and the hidden states", dispatched)
    table = next((leaf for leaf in leaves if len(shape(leaf) or ()) == 3), None)
    hidden = next((leaf for leaf in leaves if len(shape(leaf) or ()) == 2), None)
    if table is None or hidden is None:
        return NoMatch("the slots are not one einsum of a dispatch tensor and the hidden states", dispatched)
    sizes = dict(zip("sec", shape(combine), strict=True), m=hidden_size)
    for order in itertools.permutations(range(3)):
        labels = tuple(("s", "e", "c")[i] for i in order)
        read = contraction(dispatched, {table: labels, hidden: ("s", "m")})
        if read is not None and _reads_as(read, sizes, "ecm", "s"):
            return table, tuple(labels.index(axis) for axis in "sec"), hidden
    return NoMatch("the slots are not einsum('sec,sm->ecm') of a dispatch tensor and the hidden states", dispatched)


def _whole_topk(node: Node) -> bool:
    """A top-k over a whole dim whose indices only mark positions (scatter indices): a permutation,
    used as a set, so its order of ties cannot matter."""
    args = arguments(node) or {}
    size = shape(args.get("input"))[args.get("dim", -1)] if shape(args.get("input")) else None
    if not same_size(args.get("k"), size):
        return False
    for user in node.users:
        if not is_getitem(user, 1):
            return False
        if not all(is_call(u, aten.scatter.value, aten.scatter.src) and u.args[2] is user and u.args[0] is not user
                   for u in user.users):
            return False
    return True


def _walkable(node: Node) -> bool:
    """An op the probes evaluate; a getitem only of one (the ids of `scores.max(-1)` are a source)."""
    if is_getitem(node):
        return _walkable(node.args[0])
    return node.op == "call_function" and (
        node.target in probe.PROBE_OPS or is_cast(node) or (is_call(node, aten.topk.default) and _whole_topk(node)))


def _routing(combine: Node, dispatch: Node) -> tuple[Node, Node, bool, list[Node]] | NoMatch:
    """(ids, weights, weights are a [S, E] table read at the ids, the nodes computing the combine and the
    dispatch from them): what the slot assignment is a function of."""
    nodes, sources, stack, seen = [], set(), [combine, dispatch], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _walkable(node):
            nodes.append(node)
            stack.extend(node.all_input_nodes)
        elif isinstance(node.meta.get("val"), torch.Tensor):
            sources.add(node)
    routing = probe.ids_and_weights(sources)
    if routing is None:
        names = ", ".join(sorted(n.name for n in sources))
        return NoMatch(f"the slot assignment does not derive from one ids and one weights tensor (it reads {names})", combine)
    ids, weights = routing
    tokens = shape(combine)[0]
    at_ids = len(shape(weights)) == 2 and not same_shape(shape(weights), shape(ids))
    if len(shape(ids)) not in (1, 2) or not same_size(shape(ids)[0], tokens) or (not same_shape(shape(weights), shape(ids)) and not at_ids):
        return NoMatch("the slot assignment's ids and weights are not [S, k] routing tensors", ids)
    order = {n: i for i, n in enumerate(combine.graph.nodes)}
    return ids, weights, at_ids, sorted(nodes, key=order.__getitem__)


def _check_slots(combine, dispatch, order, ids, weights, at_ids, nodes, width) -> str | None:
    """What breaks (1)-(3) of the module docstring on some probe routing, else None."""
    tokens = int(probe.concrete(shape(ids)[0]))
    top_k = int(probe.concrete(shape(ids)[1])) if len(shape(ids)) == 2 else 1
    if tokens == 0 or top_k > width:
        return "its routing cannot be probed (no tokens, or top-k wider than the experts)"
    routings = [i for i, _ in probe.routing_probes(tokens, top_k, width, dtype(weights))]
    routings += [i for i, _ in probe.crowded_probes(tokens, top_k, width, dtype(weights))]
    given_weights = probe.column_probes(tokens, width if at_ids else top_k, dtype(weights), count=len(routings))
    for i, given in zip(routings, given_weights, strict=True):
        kernel = given.gather(1, i) if at_ids else given  # the [S, k] weights the call takes
        env = {ids: (i if len(shape(ids)) == 2 else i[:, 0]).to(dtype(ids)),
               weights: given if at_ids or len(shape(weights)) == 2 else given[:, 0]}
        values = probe.evaluate(nodes, env, extra_ops=frozenset({aten.topk.default}), crowded=True)
        slots, weighted = values[dispatch].permute(order), values[combine]
        if not bool(((slots == 0) | (slots == 1)).all()) or bool((slots.sum(0) > 1).any()):
            return "a slot holds more than one token, or the dispatch is not 0/1"
        if bool(((weighted != 0) & (slots != 1)).any()):
            return "a token is weighted in a slot it was not dispatched to"
        if not torch.equal(weighted.sum(-1), probe.padded_columns(i, kernel, width).to(weighted.dtype)):
            return "the combine weights are not the routing weights (a token past a slot limit is dropped)"
    return None


FINDER = Finder(
    FORM, (aten.bmm.default, aten.mm.default), each_anchor(lambda node: _combine(node) is not None), match_at,
    priority=90,
)
