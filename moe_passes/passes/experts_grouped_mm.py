"""Grouped-GEMM experts: transformers 5.x `grouped_mm_experts_forward` (its default implementation).

    ids_s, perm = sort(ids.view(-1));  xs = x[perm // k];  ws = w.view(-1)[perm]
    offs = cumsum(histc(ids_s, bins=E, min=0, max=E-1), dtype=int32)
    h = grouped_mm(xs, W_gate_up^T, offs) -> act(gate half) * up half
    y = grouped_mm(h, W_down^T, offs) * ws[:, None]
    out = y[inverse(perm)].view(T, k, H).sum(1)

The anchor is the final `sum` over the k slots; every step back to the routing is checked, because a
region that differs anywhere (other offsets, another permutation) computes something else.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import (
    arguments,
    const_int,
    is_call,
    is_getitem,
    shape,
    strip_casts,
    through_trailing_cast,
    within,
)
from .biases import bias_fields
from .biases import with_bias as _with_bias
from .finder import Finder, each_anchor
from .gemm_tail import GatedTail, StackedLinear, expert_weights, read_gated_tail
from .matches import UNSCALED_OUTPUTS, Decline, ExpertsMatch, NoMatch
from .mlp import stacked_weight
from .sentinels import through_id_clamp, through_sentinel_mask
from .slots import (
    INPUT_SCALED,
    Combine,
    IndexMap,
    Rows,
    SlotAlgebra,
    SlotCombines,
    Step,
    compose,
    sorted_ids,
    uncast,
)

aten = torch.ops.aten
FORM = "grouped_mm"


# aten's grouped matmul, and the opaque loop transformers uses instead when compiling non-bf16 weights;
# matched by qualified name, so transformers need not be imported.
GROUPED_MM_OPS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})


def is_grouped_mm(node: object) -> bool:
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    return getattr(node.target, "name", lambda: "")() in GROUPED_MM_OPS


def _grouped_args(node: Node) -> tuple[Node, Node, Node] | None:
    args = list(node.args)
    offs = node.kwargs.get("offs", args[2] if len(args) > 2 else None)
    if len(args) < 2 or offs is None:
        return None
    return args[0], args[1], offs


# Where the combine back to tokens ends the region: the k-slot sum (view-sum, or a weighted bmm), or
# an add by token (index_add, scatter_add, accumulating index_put).
ANCHORS = (
    aten.sum.dim_IntList,
    aten.bmm.default,
    aten.index_add.default,
    aten.scatter_add.default,
    aten.index_put.default,
)


def _feeds_from_grouped_mm(node: Node) -> bool:
    """Cheap pre-filter: a grouped_mm within a few steps above the combine."""
    return within(node, 10, is_grouped_mm)


def match_at(out: Node) -> ExpertsMatch | Decline | None:
    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    read = _sorted_combine(out)
    if read is None:
        return None  # not a sorted region at all (another finder's combine)
    if isinstance(read, NoMatch):
        return read.decline(FORM, out)
    ids, algebra, combine = read
    order = combine.slot
    if len(order) != 1 or order[0].kind != "perm":
        return no("the rows summed per token are not the slots in the order of one sort of the ids", combine.values)
    perm_index = _perm_index(order[0].perm)
    bounds: list[int] = []  # the expert count each sentinel mask tests against (transformers 5.17)

    def unmask(node: Node) -> Node:
        source, bound = through_sentinel_mask(node, perm_index)
        if bound is not None:
            bounds.append(bound)
        return source

    weighted = _weighted_down(combine, algebra, unmask)
    if isinstance(weighted, NoMatch):
        return weighted.decline(FORM, out)
    down, table = weighted
    num_experts = _expert_count(down.chosen_by, algebra)
    tail = read_gated_tail(down, lambda output: _grouped_linear(output, unmask), "a grouped matmul", separate=True)
    if isinstance(tail, NoMatch):
        return tail.decline(FORM, out)
    biases = _read_biases(tail, num_experts, algebra, order)
    if isinstance(biases, NoMatch):
        return biases.decline(FORM, out)
    if num_experts is None:
        return no("group offsets are not the per-expert counts of the sorted ids", down.chosen_by)
    hidden = algebra.hidden_rows(unmask(tail.rows))
    if hidden is None or (hidden.domain, hidden.slot) != (combine.domain, order):
        return no("the grouped rows are not the tokens repeated per slot (x[perm // k])", tail.rows)
    stacks = expert_weights(tail, num_experts)
    if isinstance(stacks, NoMatch):
        return stacks.decline(FORM, out, down.chosen_by)
    if any(bound != num_experts for bound in bounds):
        return no("rows are masked against another expert count than the experts held", down.chosen_by)
    if algebra.routed_below is not None:  # read by the segments finder only
        return no(f"the sorted slots are cut to those of ids below {algebra.routed_below} (the routed experts)", combine.values)
    return ExpertsMatch(
        form=FORM,
        output=through_trailing_cast(combine.output),
        hidden=hidden.hidden,
        ids=ids,
        weights=table,
        num_experts=num_experts,
        top_k=algebra.top_k,
        activation=tail.gate.activation,
        **stacks,
        **bias_fields(tail.gate.swiglu, tail.up.bias, down.bias),
        sentinels="dropped" if bounds else "clamped" if biases else None,
    )


def _grouped_linear(output: Node, unmask, rows_as_read: bool = False) -> StackedLinear | None:
    """The grouped matmul (+ bias[ids]) `output` is, sentinel masks looked through; its rows likewise
    unless `rows_as_read` (the down projection's input is the gate, read as it stands)."""
    mm, bias, bias_ids = _with_bias(unmask(output))
    args = _grouped_args(mm) if is_grouped_mm(mm) else None
    if args is None:
        return None
    rows, weight, offs = args
    stack, out_in = stacked_weight(weight)
    rows = rows if rows_as_read else strip_casts(unmask(rows))
    return StackedLinear(mm, rows, stack, out_in, offs, bias, bias_ids)


def _sorted_combine(out: Node) -> tuple[Node, SlotAlgebra, Combine] | NoMatch | None:
    """(ids, their slot algebra, the combine `out` ends); why not (a k-slot sum that combines nothing);
    None when `out` is no candidate (no sort of ids above it, or a scatter that combines nothing)."""
    ids = sorted_ids(out)
    if ids is None:
        return None  # not a sorted region at all (another finder's combine)
    algebra = SlotAlgebra(ids, const_int(shape(ids)[1]))
    combine = SlotCombines(algebra).read(out)
    if combine is not None:
        return ids, algebra, combine
    if is_call(out, aten.sum.dim_IntList):
        return NoMatch("expert outputs are not gathered back to token order before the sum", out.args[0])
    return None  # a scatter, add or bmm that combines nothing: another step of some region


UNWEIGHTED_DOWN = "routing weights do not multiply the output of the down projection"


def _perm_index(perm: Node) -> Node:
    """The index tensor of a permutation: argsort's result, or sort's second output."""
    if is_call(perm, aten.argsort.default, aten.argsort.stable):
        return perm
    return next((u for u in perm.users if is_getitem(u, 1)), perm)


def _weighted_down(combine: Combine, algebra: SlotAlgebra, unmask) -> tuple[StackedLinear, Node] | NoMatch:
    """(the down projection, the [T, k] weights) when the rows the combine sums are the down projection
    scaled by each slot's routing weight, else why not."""
    values = uncast(combine.values)
    if combine.weights is not None:
        down = _grouped_linear(values, unmask, rows_as_read=True)
        if down is None:
            return NoMatch(UNWEIGHTED_DOWN, values)
        return down, combine.weights
    if not is_call(values, aten.mul.Tensor):
        scaled = algebra.input_scaling(values)
        if scaled is not None:
            return NoMatch(INPUT_SCALED, scaled)
        return NoMatch(UNSCALED_OUTPUTS, values)
    down, slot_weights = _split_product(values, unmask)
    if down is None:
        return NoMatch(UNWEIGHTED_DOWN, values)
    read = algebra.slot_values(slot_weights)
    if read is None or read[1] != Rows(combine.domain, combine.slot):
        return NoMatch("routing weights are not permuted like the tokens", slot_weights)
    return down, read[0]


def _expert_count(offs: Node, algebra: SlotAlgebra) -> int | None:
    """E when the grouped offsets are the running sum of the per-expert counts of the ids."""
    if not is_call(offs, aten.cumsum.default) or (arguments(offs) or {}).get("dim") not in (0, -1):
        return None
    return algebra.expert_counts(offs.args[0])


def _read_biases(tail: GatedTail, num_experts, algebra: SlotAlgebra, order) -> bool | NoMatch:
    """Whether the expert biases (GPT-OSS's clamped swiglu only) are gathered with sorted ids clamped to
    0..E-1 (transformers 5.17); why not when they are not read as the kernel reads them."""
    if tail.gate.swiglu is None:
        return False
    up_bias_ids, up_clamped = through_id_clamp(tail.up.bias_ids, num_experts)
    down_bias_ids, down_clamped = through_id_clamp(tail.down.bias_ids, num_experts)
    sorted_ids = IndexMap(order[0].perm, compose(order, (Step("expert"),)))
    if not (algebra.index(up_bias_ids) == sorted_ids == algebra.index(down_bias_ids)):
        return NoMatch("expert biases are not gathered with the sorted expert ids", up_bias_ids)
    return up_clamped or down_clamped


def _split_product(mul: Node, unmask) -> tuple[StackedLinear | None, Node | None]:
    """(down projection, routing weights) of mul(grouped_mm [+ bias], w)."""
    for a, b in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        down = _grouped_linear(strip_casts(a), unmask, rows_as_read=True) if isinstance(a, Node) else None
        if down is not None and isinstance(b, Node):
            return down, b
    return None, None


FINDER = Finder(FORM, ANCHORS, each_anchor(_feeds_from_grouped_mm), match_at, priority=10)
