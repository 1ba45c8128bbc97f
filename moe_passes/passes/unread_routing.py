"""Router choices that no expert form read: named, so that a layer no finder recognises is not silent.

A graph can hold an MoE router (a gate projection, then top-k or argmax over the experts) whose experts
run in a way no finder reads: a loop per batch row, a mask over a dense layer's neurons, an [E, T, H]
buffer of masked copies. Without this the report says only "no MoE layer"; with it, it says where the
router is and which op reads its choices, which is the construct that stopped the fusion. Nothing is
rewritten, and a router whose choices reach a layer a finder read (fused or declined) is not named twice.

Only choices read as expert choices count (compared with an expert number, one-hot encoded, used as an
index into a table with one row per expert, counted, sorted or scattered into an [.., E] table), so a
top-k of a model's logits for sampling (whose ids are gathered as tokens) is not taken for a router.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..fx_utils import (
    SHAPE_ONLY_OPS,
    TRANSPOSE_OPS,
    ancestors,
    const_int,
    dtype,
    is_call,
    is_cast,
    is_getitem,
    shape,
)

aten = torch.ops.aten

# What a gate's scores pass through between the projection and the choice (normalisation, a bias added
# for the choice only, a temperature, a mask, a copy in another dtype).
_SCORE_OPS = frozenset(
    {
        aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
        aten.sigmoid.default, aten.tanh.default, aten.relu.default, aten.exp.default,
        aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.masked_fill.Scalar,
        aten.masked_fill.Tensor, aten.where.self, aten.abs.default, aten.neg.default,
    }
)
_PROJECTIONS = frozenset(
    {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default,
     aten.linear.default}
    | ({aten._grouped_mm.default} if hasattr(aten, "_grouped_mm") else set())
)
# Ops that only move the choices around (the same ids, fewer or re-laid out).
_MOVES = SHAPE_ONLY_OPS | TRANSPOSE_OPS | frozenset(
    {aten.select.int, aten.slice.Tensor, aten.flatten.using_ints, aten.movedim.int, aten.lift_fresh_copy.default}
)
_COMPARISONS = frozenset({aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor})
_COUNTS = frozenset({aten.bincount.default, aten.histc.default, aten.sort.default, aten.argsort.default,
                     aten.sort.stable, aten.argsort.stable, aten._unique2.default, aten.unique_dim.default})
_SCATTERS = frozenset({aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_.src,
                       aten.scatter_.value, aten.scatter_add_.default, aten.scatter.value_reduce})


@dataclass(frozen=True)
class UnreadRouting:
    """A router whose choices no finder read: the op that chose, how many of how many, and the first op
    that reads the choices as expert numbers (the construct the finders do not follow)."""

    choice: Node  # the topk / argmax / max node
    experts: int
    top_k: int
    reader: Node
    per_row: bool  # the choices reach the reader one row of a leading dim at a time (a loop over the batch)

    def read_as(self) -> str:
        """How the reader uses the choices, in words."""
        how = self._read_as()
        return how + (", made per batch row (a loop over the batch)" if self.per_row else "")

    def _read_as(self) -> str:
        if is_call(self.reader, aten.one_hot.default) or _one_hot(self.reader, None, self.experts):
            return "one_hot"
        if is_call(self.reader, *_COMPARISONS):
            return "a comparison with an expert number"
        if is_call(self.reader, *_COUNTS):
            return f"{self.reader.target.__name__.split('.')[0]} of the choices"
        if is_call(self.reader, *_SCATTERS):
            return "a scatter into a table with a column per expert"
        return f"{self.reader.target.__name__.split('.')[0]} of a table with a row per expert"


def unread_routings(graph: torch.fx.Graph, read: set[Node]) -> list[UnreadRouting]:
    """The graph's routers whose choices reach none of `read` (the outputs and stopping points of the
    regions the finders matched or declined)."""
    found, to_products = [], None
    for choice, ids, experts, top_k in _choices(graph):
        if _reaches(ids, read) or _leaves_the_graph(ids):
            continue
        scored = set(ancestors(choice))
        path = _expert_reader(ids, experts, choice.target is aten.topk.default, scored)
        if path is None:
            continue
        to_products = _reaching_products(graph) if to_products is None else to_products
        if _steers_experts(path[-1], scored, to_products):
            found.append(UnreadRouting(choice, experts, top_k, path[-1], _per_row(path)))
    return found


def _choices(graph: torch.fx.Graph):
    """(choice op, ids node, experts, k) for each top-k / argmax / max over the last dim of a gate's scores."""
    for node in graph.find_nodes(op="call_function", target=aten.topk.default):
        dims = shape(node.args[0])
        k = const_int(node.args[1])
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
        experts = const_int(dims[-1]) if dims else None
        if experts is None or k is None or not 0 < k < experts or dim not in (-1, len(dims) - 1) or len(dims) < 2:
            continue  # a choice per token ([.., T, E] scores), not a pick among the items of one vector
        ids = next((u for u in node.users if is_getitem(u, 1)), None)
        if ids is not None and _scores_of_a_gate(node.args[0], experts):
            yield node, ids, experts, k
    for node in (*graph.find_nodes(op="call_function", target=aten.argmax.default),
                 *graph.find_nodes(op="call_function", target=aten.max.dim)):
        dims = shape(node.args[0])
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        experts = const_int(dims[-1]) if dims else None
        ids = node if node.target is aten.argmax.default else next((u for u in node.users if is_getitem(u, 1)), None)
        if ids is not None and experts is not None and experts > 1 and dim in (-1, len(dims) - 1) and len(dims) > 1 and (
                _scores_of_a_gate(node.args[0], experts)):
            yield node, ids, experts, 1


def _scores_of_a_gate(scores: Node, experts: int, depth: int = 8) -> bool:
    """`scores` come from a projection to `experts` features by a weight, through score-shaping ops only
    (at most `depth` of them). The weight is an operand no matrix product made: a parameter, maybe
    normalised (a cosine router); attention scores `q @ k.T`, whose both sides are projected, are not a
    gate's, nor are scores transposed to [E, T] (experts choosing tokens) or a one-feature scorer's
    [B, S] (a pick of tokens)."""
    node = scores
    for _ in range(depth):
        if is_call(node, *_PROJECTIONS):
            width = shape(node)
            return bool(width) and const_int(width[-1]) == experts and any(
                _made_without_products(operand) for operand in node.args if isinstance(operand, Node))
        if not (is_call(node, *_SCORE_OPS, *_MOVES) or is_cast(node)) or not isinstance(node.args[0], Node):
            return False
        node = node.args[0]
    return False


def _made_without_products(operand: Node, limit: int = 32) -> bool:
    """No matrix product is among the (at most `limit`) nodes `operand` is made from."""
    made_from = ancestors(operand, limit=limit)
    return len(made_from) < limit and not any(is_call(n, *_PROJECTIONS) for n in made_from)


def _expert_reader(ids: Node, experts: int, from_topk: bool, scored: set[Node], depth: int = 6) -> list[Node] | None:
    """The path from `ids`, through moves of them only, to the first op that reads them as expert
    numbers (the last node); None if there is none. `scored`: what the router's scores were made from
    (a table of those is the tokens', not one row per expert)."""
    frontier, came_from = [ids], {ids: None}
    for _ in range(depth):
        nxt = []
        for node in frontier:
            for user in node.users:
                if user in came_from:
                    continue
                came_from[user] = node
                if _reads_as_expert(user, node, experts, from_topk, scored):
                    path = [user]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                if is_call(user, *_MOVES) or is_cast(user):
                    nxt.append(user)
        frontier = nxt
    return None


def _reads_as_expert(user: Node, ids: Node, experts: int, from_topk: bool, scored: set[Node]) -> bool:
    """`user` reads `ids` as expert numbers. An argmax's ids compared or counted could be a greedy
    token choice (`next_token == eos`), so only a top-k's count as read by those, or an argmax's compared
    with every number 0..E-1 (a loop over the experts)."""
    if is_call(user, aten.one_hot.default) or _one_hot(user, ids, experts):
        return True
    if is_call(user, aten.eq.Scalar, aten.ne.Scalar):  # compared with several numbers: a loop over experts
        numbers = _numbers_compared_with(_root_of(ids))
        # an argmax's compared with every expert number (a stop token is one number, or a few)
        return len(numbers) > 1 if from_topk else numbers >= set(range(experts))
    if is_call(user, *_COMPARISONS, *_COUNTS):
        return from_topk or user.target in (aten.bincount.default, aten.histc.default)
    if is_call(user, *_SCATTERS):  # ids as the index of an [.., E] table
        dims = shape(user.args[0])
        return len(user.args) > 2 and user.args[2] is ids and bool(dims) and const_int(dims[-1]) == experts
    if is_call(user, aten.embedding.default):  # embedding(table, ids)
        return _rows_of_experts(user.args[0], experts, scored) and user.args[1] is ids
    if is_call(user, aten.index_select.default):  # index_select(table, 0, ids)
        return _rows_of_experts(user.args[0], experts, scored) and user.args[1] == 0 and user.args[2] is ids
    if is_call(user, aten.index.Tensor):  # table[ids] (ids index the first dim)
        indices = user.args[1]
        return _rows_of_experts(user.args[0], experts, scored) and bool(indices) and indices[0] is ids
    return False


def _rows_of_experts(table: object, experts: int, scored: set[Node]) -> bool:
    """A table with one row per expert (its first dim is E) that the router did not score (the tokens'
    hidden states, whose rows a top-k over positions picks, are not one)."""
    rows = shape(table) if isinstance(table, Node) else None
    return bool(rows) and const_int(rows[0]) == experts and _root_of(table) not in scored


def _per_row(path: list[Node]) -> bool:
    """A `select` of one index along a dim before the last sits on the way from the ids to the reader."""
    return any(
        is_call(node, aten.select.int) and node.args[1] not in (-1, len(shape(node.args[0]) or ()) - 1)
        for node in path
    )


def _one_hot(user: Node, ids: Node | None, experts: int) -> bool:
    """`ids[..., None] == arange(E)`: one_hot as dynamo's decomposition writes it."""
    if not is_call(user, aten.eq.Tensor):
        return False
    return any(
        is_call(other, aten.arange.default, aten.arange.start) and const_int(shape(other)[0]) == experts
        for other in user.args[:2] if other is not ids
    )


def _moves_of(ids: Node) -> list[Node]:
    """`ids` and every node made from it by moves and casts only."""
    found, frontier = [ids], [ids]
    while frontier:
        for user in frontier.pop().users:
            if user not in found and (is_call(user, *_MOVES) or is_cast(user)):
                found.append(user)
                frontier.append(user)
    return found


def _numbers_compared_with(ids: Node) -> set:
    """The constants `ids`, or moves of them (a batch row's), are compared with for equality."""
    return {user.args[1] for node in _moves_of(ids) for user in node.users
            if is_call(user, aten.eq.Scalar, aten.ne.Scalar) and user.args[0] is node}


def _root_of(node: Node) -> Node:
    """The ids a move of them was made from (the top-k's getitem, or the argmax)."""
    while (is_call(node, *_MOVES) or is_cast(node)) and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _leaves_the_graph(ids: Node) -> bool:
    """The choices, or moves of them, are an output of the graph: its experts may run in a later graph
    (a graph break after the router), and the break is then the reason to report, not the router."""
    return any(user.op == "output" for node in _moves_of(ids) for user in node.users)


def _reaching_products(graph: torch.fx.Graph) -> set[Node]:
    """The nodes a matrix product of the graph depends on (the products included)."""
    found: set[Node] = set()
    for node in reversed(graph.nodes):
        if is_call(node, *_PROJECTIONS) or any(user in found for user in node.users):
            found.add(node)
    return found


_ROW_PICKS = frozenset({aten.index.Tensor, aten.index_select.default, aten.index_put.default,
                        aten.index_put_.default, aten._unsafe_index_put.default, aten.masked_select.default})
_INDEX_LISTS = frozenset({aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                          aten._unsafe_index_put.default})
_MASKINGS = frozenset({aten.mul.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
                       aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default})


def _steers_experts(reader: Node, scored: set[Node], to_products: set[Node]) -> bool:
    """What `reader` made of the choices picks rows of the tokens the router scored, or masks values with
    a boolean or integer mask, on the way to a matrix product of this graph: the choices decide what an
    expert computes. Choices turned into float data (a codebook's one-hot, a sparse code, an embedding
    of chosen tokens) are not expert choices."""
    derived, frontier = {reader}, [reader]
    while frontier:  # every value made from the choices first: an index is read wherever the walk meets it
        for user in frontier.pop().users:
            if user not in derived:
                derived.add(user)
                frontier.append(user)
    return any(node in to_products and (_picks_scored_rows(node, derived, scored) or _masks_with(node, derived))
               for node in derived)


def _picks_scored_rows(node: Node, derived: set[Node], scored: set[Node]) -> bool:
    """`node` indexes a tensor made from what the router scored (the tokens) with indices made from the
    choices."""
    if not is_call(node, *_ROW_PICKS) or not isinstance(node.args[0], Node):
        return False
    index_args = node.args[1] if is_call(node, *_INDEX_LISTS) else node.args[1:]  # a list, or (dim, index) / mask
    indices = [i for i in _flat(index_args) if isinstance(i, Node)]
    return any(i in derived for i in indices) and bool(set(ancestors(node.args[0], limit=256)) & scored)


def _masks_with(node: Node, derived: set[Node]) -> bool:
    """`node` masks a value with a boolean or integer tensor made from the choices."""
    if not is_call(node, *_MASKINGS):
        return False
    masks = [a for a in _flat(node.args) if isinstance(a, Node) and a in derived]
    return any(d is not None and not d.is_floating_point for d in (dtype(m) for m in masks))


def _flat(args) -> list:
    return [x for a in args for x in (a if isinstance(a, list | tuple) else [a])]


def _reaches(ids: Node, targets: set[Node]) -> bool:
    """Whether anything in `targets` is `ids` or depends on it."""
    return bool(targets) and _any_depends_on(ids, targets.__contains__)


def _any_depends_on(start: Node, predicate) -> bool:
    """Whether `predicate` holds for `start` or a node that depends on it."""
    frontier, seen = [start], {start}
    while frontier:
        node = frontier.pop()
        if predicate(node):
            return True
        for user in node.users:
            if user not in seen:
                seen.add(user)
                frontier.append(user)
    return False
