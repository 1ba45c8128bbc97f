"""Batched-GEMM experts: transformers 5.x `batched_mm_experts_forward`, and per-row gathered weights in any row order the index algebra reads.

    xs = x.repeat_interleave(k);  W = W_gate_up[ids.view(-1)]          (a gathered copy per slot)
    h = bmm(W, xs[..., None]) -> act(gate half) * up half
    y = bmm(W_down[ids.view(-1)], h[..., None]) * w.view(-1)[:, None]
    out = y.view(T, k, H).sum(1)

Hand-written code spells the same with the slot rows made by a view (`x[:, None].expand(T, k,
H).reshape(-1, 1, H)`), gate and up as two stacks, weights kept [E, out, in] and gathered as
`W[ids].transpose(1, 2)`, and the weights applied after the view (`(y.view(T, k, H) * w[..., None]).sum(1)`).
The anchor is the final `sum` over the k slots. Slot s of the flat tensors is token s // k, slot
s % k, which is what `repeat_interleave` and `view(-1)` of [T, k] both give; the checks below make sure
the three flat tensors (rows, ids, weights) are indexed that way.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import (
    const_int,
    dtype,
    is_call,
    shape,
    slot_table,
    strip_casts,
    strip_shape_ops,
    through_trailing_cast,
    within,
)
from .biases import bias_fields
from .biases import with_bias as _with_bias
from .finder import Finder, each_anchor
from .gemm_tail import StackedLinear, expert_weights, read_gated_tail, stack_count
from .matches import IDS_WEIGHTS_SHAPES, UNSCALED_OUTPUTS, Decline, ExpertsMatch, NoMatch
from .sentinels import through_id_clamp, through_weight_mask
from .slots import SLOTS, Combine, IndexMap, SlotAlgebra, SlotCombines, Step, compose, same_shape

aten = torch.ops.aten
FORM = "batched_mm"


def _near_bmm_of_gathered_weights(node: Node) -> bool:
    return within(node, 10, lambda n: is_call(n, aten.bmm.default) and any(_gathered(a) for a in n.args))


def _gathered(node: Node) -> tuple[Node, Node, bool] | None:
    """(stacked weight, flat ids, transposed) when node = W[ids_flat], or W[ids_flat].transpose(1, 2)
    (weights kept [E, out, in], nn.Linear's layout, and multiplied as [in, out])."""
    node = _in_order(strip_casts(node))
    transposed = is_call(node, aten.transpose.int) and len(shape(node) or ()) == 3 and (
        sorted(d % 3 for d in node.args[1:3]) == [1, 2])
    if transposed:
        node = _in_order(strip_casts(node.args[0]))
    if is_call(node, aten.index.Tensor) and len(node.args[1]) == 1 and len(shape(node.args[0])) == 3:
        return node.args[0], node.args[1][0], transposed
    return None


_MOVES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.default, aten.permute.default, aten.transpose.int, aten.clone.default)


def _in_order(node: Node) -> Node:
    """The tensor `node` shows with the same elements in the same order, only size-1 dims added,
    dropped or moved: einsum reaches the graph as such views and permutes (a pair of transposes that
    cancel, a row [N, H] viewed [N, 1, H])."""
    while is_call(node, *_MOVES) and isinstance(node.args[0], Node):
        after = shape(node)
        if is_call(node, aten.permute.default, aten.transpose.int):
            order, source = list(range(len(after or ()))), node  # a run of permutes, composed
            while is_call(source, aten.permute.default, aten.transpose.int) and isinstance(source.args[0], Node):
                step = _permutation(source)
                if step is None or len(step) != len(order):
                    return node
                order, source = [step[d] for d in order], source.args[0]
            moved = [d for d, size in zip(order, after, strict=True) if const_int(size) != 1]
            if moved != sorted(moved):
                return node
            node = source
            continue
        before = shape(node.args[0])
        if before is None or after is None or not same_shape(
                [d for d in before if const_int(d) != 1], [d for d in after if const_int(d) != 1]):
            return node
        node = node.args[0]
    return node


def _permutation(node: Node) -> list[int] | None:
    """For each dim of a permute's or transpose's result, the dim of its input."""
    rank = len(shape(node) or ())
    if is_call(node, aten.permute.default):
        return [d % rank for d in node.args[1]]
    order = list(range(rank))
    a, b = (d % rank for d in node.args[1:3])
    order[a], order[b] = order[b], order[a]
    return order


def _one_row_each(node: Node, dim: int) -> Node | None:
    """The rows of a [N, 1, in] (dim 1) or [N, in, 1] (dim 2) batch of single-row matrices: x of
    `x.unsqueeze(dim)`, or the batch itself (the slot rows made by a view, `x[:, None].expand(T, k,
    H).reshape(-1, 1, H)`, or a product of such batches), which the row readers see through."""
    if is_call(node, aten.unsqueeze.default) and node.args[1] % 3 == dim:
        return node.args[0]
    dims = shape(node)
    if dims is None or len(dims) != 3 or const_int(dims[dim]) != 1:
        return None
    rows = _in_order(node)
    return rows if len(shape(rows) or ()) == 2 else node


def _batched_linear(output: Node) -> StackedLinear | None:
    """bmm(W[ids], x[..., None]) or bmm(x[:, None], W[ids]) (+ bias[ids]) as a stacked projection."""
    node, bias, bias_ids = _with_bias(strip_casts(output))
    node = strip_shape_ops(_in_order(strip_shape_ops(node)))
    if not is_call(node, aten.bmm.default):
        return None
    left, right = node.args
    gathered = _gathered(right)
    if gathered is not None and (rows := _one_row_each(left, 1)) is not None:
        out_in = gathered[2]
    else:
        gathered = _gathered(left)
        if gathered is None or (rows := _one_row_each(right, 2)) is None:
            return None
        out_in = not gathered[2]
    return StackedLinear(node, rows, gathered[0], out_in, gathered[1], bias, bias_ids)


def _read_down(out: Node) -> tuple[int, StackedLinear, Node] | NoMatch:
    """(k, the batched down projection, the slot weights) of `(bmm(W_down[ids], h) [+ b] * w).view(T, k,
    H).sum(1)`, else why not."""
    view = out.args[0]
    if list(out.args[1]) not in ([1], [-2]) or len(shape(view)) != 3:
        return NoMatch("the k-slot reduction is not a sum over dim 1 of a [T, k, H] view")
    top_k = const_int(shape(view)[1])
    weighted = strip_shape_ops(view)
    if not is_call(weighted, aten.mul.Tensor):
        return NoMatch(UNSCALED_OUTPUTS, weighted)
    for a, b in ((weighted.args[0], weighted.args[1]), (weighted.args[1], weighted.args[0])):
        down = _batched_linear(a) if isinstance(a, Node) and isinstance(b, Node) else None
        if down is not None:
            return top_k, down, b
    return NoMatch("routing weights do not multiply the output of a batched down projection", weighted)


def match_at(out: Node) -> ExpertsMatch | Decline:
    read = _read_down(out) if is_call(out, aten.sum.dim_IntList) else NoMatch("no k-slot sum")
    if isinstance(read, NoMatch):  # rows in another order, or another combine: read with the slot algebra
        routed = _match_routed_rows(out)  # its decline read further than the slot sum's, where it has one
        return routed if routed is not None or not is_call(out, aten.sum.dim_IntList) else read.decline(FORM, out)
    return _match_slot_sum(out, *read)


def _match_slot_sum(out: Node, top_k: int, down: StackedLinear, slot_weights: Node) -> ExpertsMatch | Decline:
    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    tail = read_gated_tail(down, _batched_linear, "a batched matmul of per-slot gathered weights", separate=True)
    if isinstance(tail, NoMatch):
        return tail.decline(FORM, out)
    same_ids = {strip_shape_ops(n) for n in (tail.up.bias_ids, down.chosen_by, down.bias_ids)}
    if tail.gate.swiglu is not None and len(same_ids) != 1:
        return no("expert biases are gathered with other ids than the weights", tail.up.bias_ids)
    stacks = expert_weights(tail, None)
    if isinstance(stacks, NoMatch):
        return stacks.decline(FORM, out, down.stack)
    num_experts = stack_count(tail)
    unclamped_ids, ids_clamped = through_id_clamp(down.chosen_by, num_experts)
    slot_weights, sentinels_dropped = through_weight_mask(slot_weights, unclamped_ids, num_experts)
    ids = slot_table(unclamped_ids, top_k)
    weights = slot_table(slot_weights, top_k, through_casts=True)
    if ids is None:
        return no(IDS_WEIGHTS_SHAPES, down.chosen_by)
    rows_read = SlotAlgebra(ids, top_k).hidden_rows(tail.rows)
    if rows_read is None or (rows_read.domain, rows_read.slot) != (SLOTS, ()):
        return no("the batched rows are not the tokens repeated k times (repeat_interleave)", tail.rows)
    if weights is None or not same_shape(shape(weights), shape(ids)):
        return no(IDS_WEIGHTS_SHAPES, down.chosen_by)
    return ExpertsMatch(
        form=FORM,
        output=through_trailing_cast(out),
        hidden=rows_read.hidden,
        ids=ids,
        weights=weights,
        num_experts=num_experts,
        top_k=top_k,
        activation=tail.gate.activation,
        **stacks,
        **bias_fields(tail.gate.swiglu, tail.up.bias, down.bias),
        sentinels="dropped" if ids_clamped and sentinels_dropped else "clamped" if ids_clamped else None,
        slots_scaled=True,
    )


def _match_routed_rows(out: Node) -> ExpertsMatch | Decline | None:
    """Rows in any order the slot algebra reads (x[perm // k] sorted by expert, x[token of each slot],
    repeated), each multiplied by its own gathered weights and brought back to the tokens by any combine
    it reads (index_add / scatter_add / index_put by token, a view-sum after unsorting): the expert each
    row is multiplied by must be the id of the slot the row holds, and the weight it is scaled by that
    slot's weight. None where `out` is no combine of a batched down projection."""
    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    down = _down_under(out)
    if down is None:
        return None
    routing = _routing_ids(down.chosen_by)
    if routing is None:
        return no("the experts' weights are not gathered by the routing ids at each row", down.chosen_by)
    ids, algebra = routing
    combine = SlotCombines(algebra).read(out)
    if combine is None and is_call(out, *_ADDS_BY_ROW):
        return no(f"the expert outputs are put back with `{out.target}` in a way that does not add each row to "
                  "its token once (into a buffer that is not zeros, without accumulating, or at other rows)", out)
    if combine is None:
        return None
    tail = read_gated_tail(down, _batched_linear, "a batched matmul of per-row gathered weights", separate=True)
    if isinstance(tail, NoMatch):
        return tail.decline(FORM, out)
    if tail.gate.swiglu is not None or any(p.bias is not None for p in (*tail.projections.values(), down)):
        return no("expert biases with rows in another order than the slots'", down.output)
    rows = algebra.hidden_rows(tail.rows)
    if rows is None:
        return no("the batched rows are not the tokens of the slots they are multiplied for", tail.rows)
    chosen = algebra.index(down.chosen_by)
    if chosen != IndexMap(rows.domain, compose(rows.slot, (Step("expert"),))):
        return no("a row's expert weights are not gathered by the id of the slot the row holds", down.chosen_by)
    if (combine.domain, combine.slot) != (rows.domain, rows.slot):
        return no("the expert outputs are not brought back to the tokens their rows were read from", combine.output)
    if not same_shape(shape(combine.output), shape(rows.hidden)):
        return no("the expert outputs are added into a buffer of another shape than the tokens'", combine.output)
    weights = _row_weights(combine, down, algebra)
    if isinstance(weights, NoMatch):
        return weights.decline(FORM, out)
    stacks = expert_weights(tail, None)
    if isinstance(stacks, NoMatch):
        return stacks.decline(FORM, out, down.stack)
    if not same_shape(shape(weights), shape(ids)):
        return no(IDS_WEIGHTS_SHAPES, down.chosen_by)
    return ExpertsMatch(
        form=FORM,
        output=through_trailing_cast(combine.output),
        hidden=rows.hidden,
        ids=ids,
        weights=weights,
        num_experts=stack_count(tail),
        top_k=algebra.top_k,
        activation=tail.gate.activation,
        **stacks,
    )


def _nearest_above(start: Node, read, depth: int = 8):
    """The first non-None `read(n)` over the nodes `start` is computed from, nearest first (breadth
    first, `depth` levels up)."""
    frontier, seen = [start], set()
    for _ in range(depth):
        following = []
        for node in frontier:
            for arg in node.all_input_nodes:
                if arg not in seen:
                    seen.add(arg)
                    found = read(arg)
                    if found is not None:
                        return found
                    following.append(arg)
        frontier = following
    return None


def _down_under(out: Node) -> StackedLinear | None:
    """The batched down projection nearest under `out` (through its first operands and products)."""
    return _nearest_above(out, _batched_linear)


def _routing_ids(chosen_by: Node) -> tuple[Node, SlotAlgebra] | None:
    """([T, k] ids, their slot algebra) for the ids whose values `chosen_by` holds at each row: the
    nearest 2-D integer tensor above it in whose algebra `chosen_by` reads the ids."""
    def ids_read_by_chosen(arg: Node) -> tuple[Node, SlotAlgebra] | None:
        dims, kind = shape(arg), dtype(arg)
        if dims is None or len(dims) != 2 or kind is None or kind.is_floating_point or kind == torch.bool or (
                const_int(dims[1]) is None):
            return None
        algebra = SlotAlgebra(arg, const_int(dims[1]))
        found = algebra.index(chosen_by)
        return (arg, algebra) if isinstance(found, IndexMap) and found.steps and found.steps[-1] == Step("expert") else None

    return _nearest_above(chosen_by, ids_read_by_chosen)


def _row_weights(combine: Combine, down: StackedLinear, algebra: SlotAlgebra) -> Node | NoMatch:
    """The [T, k] routing weights: in the combine (a view-sum with w[..., None]) over the unscaled down
    projection, or multiplying the down projection per row (w.view(-1)[perm, None]), read at the rows'
    slots; else why not."""
    values = strip_casts(combine.values)
    if _batched_linear(values) == down:
        return combine.weights if combine.weights is not None else NoMatch(UNSCALED_OUTPUTS, values)
    if combine.weights is None and is_call(values, aten.mul.Tensor):
        for side, other in (values.args, values.args[::-1]):
            if isinstance(side, Node) and isinstance(other, Node) and _batched_linear(side) == down:
                read = algebra.slot_values(other)
                if read is None:
                    return NoMatch("the rows are scaled by something else than their slots' routing weights", other)
                if (read[1].domain, read[1].slot) == (combine.domain, combine.slot):
                    return read[0]
                return NoMatch("routing weights are not permuted like the rows", other)
    return NoMatch("the expert outputs are not added back to their tokens with their slot's weight", values)


_ADDS_BY_ROW = (aten.index_add.default, aten.scatter_add.default, aten.index_put.default)

# The k-slot sum that ends the region anchors it; rows in another order end in their combine.
FINDER = Finder(
    FORM,
    (aten.sum.dim_IntList, *_ADDS_BY_ROW),
    each_anchor(_near_bmm_of_gathered_weights),
    match_at,
    priority=20,
)
