"""Batched-GEMM experts: transformers 5.x `batched_mm_experts_forward`.

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
from .slots import SLOTS, SlotAlgebra

aten = torch.ops.aten
FORM = "batched_mm"


def _near_bmm_of_gathered_weights(node: Node) -> bool:
    return within(node, 10, lambda n: is_call(n, aten.bmm.default) and any(_gathered(a) for a in n.args))


def _gathered(node: Node) -> tuple[Node, Node, bool] | None:
    """(stacked weight, flat ids, transposed) when node = W[ids_flat], or W[ids_flat].transpose(1, 2)
    (weights kept [E, out, in], nn.Linear's layout, and multiplied as [in, out])."""
    node = strip_casts(node)
    transposed = is_call(node, aten.transpose.int) and sorted(d % 3 for d in node.args[1:3]) == [1, 2]
    if transposed:
        node = strip_casts(node.args[0])
    if is_call(node, aten.index.Tensor) and len(node.args[1]) == 1 and len(shape(node.args[0])) == 3:
        return node.args[0], node.args[1][0], transposed
    return None


def _one_row_each(node: Node, dim: int) -> Node | None:
    """The rows of a [N, 1, in] (dim 1) or [N, in, 1] (dim 2) batch of single-row matrices: x of
    `x.unsqueeze(dim)`, or the batch itself (the slot rows made by a view, `x[:, None].expand(T, k,
    H).reshape(-1, 1, H)`, or a product of such batches), which the row readers see through."""
    if is_call(node, aten.unsqueeze.default) and node.args[1] % 3 == dim:
        return node.args[0]
    dims = shape(node)
    return node if dims is not None and len(dims) == 3 and const_int(dims[dim]) == 1 else None


def _batched_linear(output: Node) -> StackedLinear | None:
    """bmm(W[ids], x[..., None]) or bmm(x[:, None], W[ids]) (+ bias[ids]) as a stacked projection."""
    node, bias, bias_ids = _with_bias(strip_casts(output))
    node = strip_shape_ops(node)
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
    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    read = _read_down(out)
    if isinstance(read, NoMatch):
        return read.decline(FORM, out)
    top_k, down, slot_weights = read
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
    if weights is None or shape(weights) != shape(ids):
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


# The k-slot sum that ends the region anchors it.
FINDER = Finder(
    FORM, (aten.sum.dim_IntList,), each_anchor(_near_bmm_of_gathered_weights), match_at, priority=20
)
