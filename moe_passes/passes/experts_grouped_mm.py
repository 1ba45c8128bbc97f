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
from .matches import Decline, ExpertsMatch, ExpertWeights
from .mlp import stacked_gate, stacked_weight
from .sentinels import through_id_clamp, through_sentinel_mask
from .slots import Combine, IndexMap, Rows, SlotAlgebra, SlotCombines, Step, compose, sorted_ids, uncast

aten = torch.ops.aten
FORM = "grouped_mm"
INPUT_SCALED = (
    "routing weights scale each expert's input, not its output; the fused kernel weights outputs, and "
    "with a non-linear MLP the two are not equal"
)


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
    if not isinstance(read, tuple):
        return read if read is None else no(read, out.args[0])
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

    tail = _weighted_down(combine, algebra, unmask)
    if isinstance(tail[0], str):
        return no(*tail)
    down_mm, down_bias, down_bias_ids, table = tail
    down_in, down_w, offs = _grouped_args(down_mm)
    num_experts = _expert_count(offs, algebra)
    gate = stacked_gate(down_in, separate=True)
    if isinstance(gate, str):
        return no(gate, down_in)
    up = _gate_up_projections(gate, unmask, offs)
    if isinstance(up[0], str):
        return no(*up)
    rows, roles, up_bias, up_bias_ids = up
    biases = _read_biases(gate.swiglu, (up_bias, up_bias_ids), (down_bias, down_bias_ids), num_experts, algebra, order)
    if isinstance(biases, tuple):
        return no(biases[0], biases[1] if biases[1] is not None else gate.gate_up_output)
    if num_experts is None:
        return no("group offsets are not the per-expert counts of the sorted ids", offs)
    hidden = algebra.hidden_rows(unmask(rows))
    if hidden is None or (hidden.domain, hidden.slot) != (combine.domain, order):
        return no("the grouped rows are not the tokens repeated per slot (x[perm // k])", rows)
    stacks = _stacks(roles, down_w, num_experts, bounds)
    if isinstance(stacks, tuple):
        return no(stacks[0], {"weights": down_w, "offsets": offs}.get(stacks[1], stacks[1]))
    return ExpertsMatch(
        form=FORM,
        output=through_trailing_cast(combine.output),
        hidden=hidden.hidden,
        ids=ids,
        weights=table,
        num_experts=num_experts,
        top_k=algebra.top_k,
        activation=gate.activation,
        **stacks,
        **bias_fields(gate.swiglu, up_bias, down_bias),
        assumes_ids_in_range=bool(bounds) or biases,
    )


def _sorted_combine(out: Node) -> tuple[Node, SlotAlgebra, Combine] | str | None:
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
        return "expert outputs are not gathered back to token order before the sum"
    return None  # a scatter, add or bmm that combines nothing: another step of some region


def _perm_index(perm: Node) -> Node:
    """The index tensor of a permutation: argsort's result, or sort's second output."""
    if is_call(perm, aten.argsort.default, aten.argsort.stable):
        return perm
    return next((u for u in perm.users if is_getitem(u, 1)), perm)


def _weighted_down(combine: Combine, algebra: SlotAlgebra, unmask) -> tuple:
    """(down grouped_mm, its bias, its bias ids, the [T, k] weights) when the rows the combine sums are
    the down projection scaled by each slot's routing weight, else (why not, where)."""
    values = uncast(combine.values)
    if combine.weights is not None:
        down_out = unmask(values)
        down_mm, down_bias, down_bias_ids = _with_bias(down_out)
        if not is_grouped_mm(down_mm):
            return "routing weights do not multiply the output of the down projection", values
        return down_mm, down_bias, down_bias_ids, combine.weights
    if not is_call(values, aten.mul.Tensor):
        scaled = algebra.input_scaling(values)
        if scaled is not None:
            return INPUT_SCALED, scaled
        return "routing weights do not scale the expert outputs", values
    down_out, slot_weights = _split_product(values, unmask)
    down_mm, down_bias, down_bias_ids = _with_bias(down_out) if down_out is not None else (None, None, None)
    if down_mm is None or not is_grouped_mm(down_mm):
        return "routing weights do not multiply the output of the down projection", values
    read = algebra.slot_values(slot_weights)
    if read is None or read[1] != Rows(combine.domain, combine.slot):
        return "routing weights are not permuted like the tokens", slot_weights
    return down_mm, down_bias, down_bias_ids, read[0]


def _gate_up_projections(gate, unmask, offs: Node) -> tuple:
    """(rows, {"gate_up": W} or {"gate": W1, "up": W3}, up bias, its ids) of the grouped projections that
    feed act(gate) * up, all with the down projection's offsets; else (why not, where)."""
    outputs = [gate.gate_up_output] if gate.gate_up_output is not None else [gate.gate_output, gate.up_output]
    projections = []
    for output in outputs:
        mm, bias, bias_ids = _with_bias(unmask(output))
        if not is_grouped_mm(mm):
            return "gate/up is not produced by a grouped matmul", mm
        rows, weight, offsets = _grouped_args(mm)
        if offsets is not offs:
            return "the two grouped matmuls use different group offsets", mm
        projections.append((strip_casts(unmask(rows)), weight, bias, bias_ids))
    if len({p[0] for p in projections}) != 1:
        return "gate and up read different rows", outputs[1]
    if len(projections) == 2 and any(p[2] is not None for p in projections):
        return "expert biases come only with GPT-OSS's clamped swiglu in the fused kernel", outputs[0]
    names = ("gate_up",) if len(projections) == 1 else ("gate", "up")
    roles = {name: p[1] for name, p in zip(names, projections, strict=True)}
    return projections[0][0], roles, projections[0][2], projections[0][3]


def _expert_count(offs: Node, algebra: SlotAlgebra) -> int | None:
    """E when the grouped offsets are the running sum of the per-expert counts of the ids."""
    if not is_call(offs, aten.cumsum.default) or (arguments(offs) or {}).get("dim") not in (0, -1):
        return None
    return algebra.expert_counts(offs.args[0])


def _stacks(roles: dict, down_w: Node, num_experts: int, bounds: list[int]) -> dict | tuple:
    """{role: ExpertWeights} for [E, ., .] stacks of the counts' E experts, else (why not, "weights" or
    "offsets": which to point at)."""
    found = {}
    for name, weight in {**roles, "down": down_w}.items():
        stacked, out_in = stacked_weight(weight)
        if len(shape(stacked) or ()) != 3:
            return "expert weights are not stacked [E, ., .] tensors", "weights"
        if const_int(shape(stacked)[0]) != num_experts:
            return "the number of stacked experts differs from the histogram bins", "offsets"
        found[name] = ExpertWeights(stacked=stacked, out_in=out_in)
    if any(bound != num_experts for bound in bounds):
        return "rows are masked against another expert count than the experts held", "offsets"
    return found


def _read_biases(swiglu, up: tuple, down: tuple, num_experts, algebra: SlotAlgebra, order) -> bool | tuple:
    """Whether the expert biases (GPT-OSS's clamped swiglu only) are gathered with sorted ids clamped to
    0..E-1 (transformers 5.17); (why not, where) when they are not read as the kernel reads them."""
    (up_bias, up_bias_ids), (down_bias, down_bias_ids) = up, down
    if (up_bias is None) != (swiglu is None) or (down_bias is None) != (swiglu is None):
        return "expert biases come only with GPT-OSS's clamped swiglu in the fused kernel", None
    if swiglu is None:
        return False
    up_bias_ids, up_clamped = through_id_clamp(up_bias_ids, num_experts)
    down_bias_ids, down_clamped = through_id_clamp(down_bias_ids, num_experts)
    sorted_ids = IndexMap(order[0].perm, compose(order, (Step("expert"),)))
    if not (algebra.index(up_bias_ids) == sorted_ids == algebra.index(down_bias_ids)):
        return "expert biases are not gathered with the sorted expert ids", up_bias_ids
    return up_clamped or down_clamped


def _split_product(mul: Node, unmask) -> tuple[Node | None, Node | None]:
    """(down projection output, routing weights) of mul(grouped_mm [+ bias], w)."""
    for a, b in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        a_src = unmask(strip_casts(a)) if isinstance(a, Node) else None
        if a_src is not None and is_grouped_mm(_with_bias(a_src)[0]) and isinstance(b, Node):
            return a_src, b
    return None, None


FINDER = Finder(FORM, ANCHORS, each_anchor(_feeds_from_grouped_mm), match_at)
