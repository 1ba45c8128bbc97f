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
    const_int,
    is_call,
    is_cast,
    is_getitem,
    shape,
    slot_table,
    strip_casts,
    strip_shape_ops,
    within,
)
from .biases import bias_fields
from .biases import with_bias as _with_bias
from .finder import Finder, each_anchor
from .matches import Decline, ExpertsMatch, ExpertWeights
from .mlp import stacked_gate, stacked_weight
from .sentinels import through_id_clamp, through_sentinel_mask

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


def _feeds_from_grouped_mm(node: Node) -> bool:
    """Cheap pre-filter: a grouped_mm within a few steps above the sum."""
    return within(node, 10, is_grouped_mm)


def match_at(out: Node) -> ExpertsMatch | Decline:
    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    combine = _read_combine(out)
    if isinstance(combine, tuple) and isinstance(combine[0], str):
        return no(*combine)
    top_k, weighted, perm = combine
    bounds: list[int] = []  # the expert count each sentinel mask tests against (transformers 5.17)

    def unmask(node: Node) -> Node:
        source, bound = through_sentinel_mask(node, perm)
        if bound is not None:
            bounds.append(bound)
        return source

    down_out, slot_weights = _split_product(weighted, unmask)
    down_mm, down_bias, down_bias_ids = _with_bias(down_out) if down_out is not None else (None, None, None)
    if down_mm is None or not is_grouped_mm(down_mm):
        return no("routing weights do not multiply the output of the down projection", weighted)
    flat_weights = _gathered_by(slot_weights, perm)
    if flat_weights is None:
        return no("routing weights are not permuted like the tokens", slot_weights)
    down_in, down_w, offs = _grouped_args(down_mm)
    num_experts = _offsets_bins(offs)
    gate = stacked_gate(down_in)
    if isinstance(gate, str):
        return no(gate, down_in)
    gate_up_mm, up_bias, up_bias_ids = _with_bias(unmask(gate.gate_up_output))
    biases = _read_biases(gate.swiglu, (up_bias, up_bias_ids), (down_bias, down_bias_ids), num_experts, perm)
    if isinstance(biases, tuple):
        return no(biases[0], biases[1] if biases[1] is not None else gate.gate_up_output)
    if not is_grouped_mm(gate_up_mm):
        return no("gate/up is not produced by a grouped matmul", gate_up_mm)
    rows, gate_up_w, offs_up = _grouped_args(gate_up_mm)
    if offs_up is not offs:
        return no("the two grouped matmuls use different group offsets", gate_up_mm)
    slots = _read_slots(offs, perm, unmask(rows), flat_weights, top_k)
    if isinstance(slots[0], str):
        return no(*slots)
    hidden_states, ids, weights = slots
    stacks = _stacks(gate_up_w, down_w, num_experts, bounds)
    if isinstance(stacks[0], str):
        return no(stacks[0], {"weights": gate_up_w, "offsets": offs}.get(stacks[1], stacks[1]))
    return ExpertsMatch(
        form=FORM,
        output=_final_output(out),
        hidden=hidden_states,
        ids=ids,
        weights=weights,
        num_experts=num_experts,
        top_k=top_k,
        activation=gate.activation,
        gate_up=stacks[0],
        down=stacks[1],
        **bias_fields(gate.swiglu, up_bias, down_bias),
        assumes_ids_in_range=bool(bounds) or biases,
    )


def _read_slots(offs: Node, perm: Node, rows: Node, flat_weights: Node, top_k: int) -> tuple:
    """(x, ids [T, k], weights [T, k]) that the sorted rows, offsets and weights were made from, else
    (why not, where)."""
    ids_flat = _offsets_source(offs, perm)
    if ids_flat is None:
        return "group offsets are not the per-expert counts of the sorted ids", offs
    hidden_states = _rows_source(rows, perm, top_k)
    if hidden_states is None:
        return "the grouped rows are not the tokens repeated per slot (x[perm // k])", rows
    ids, weights = slot_table(ids_flat, top_k), slot_table(flat_weights, top_k)
    if ids is None or weights is None or shape(weights) != shape(ids):
        return "routing ids and weights are not [T, k] tensors of the same shape", ids_flat
    return hidden_states, ids, weights


def _stacks(gate_up_w: Node, down_w: Node, num_experts: int | None, bounds: list[int]) -> tuple:
    """(gate_up, down) ExpertWeights of [E, ., .] stacks of the histogram's E experts, else (why not,
    "weights" or "offsets": which to point at)."""
    gate_up, gate_up_out_in = stacked_weight(gate_up_w)
    down, down_out_in = stacked_weight(down_w)
    if len(shape(gate_up)) != 3 or len(shape(down)) != 3:
        return "expert weights are not stacked [E, ., .] tensors", "weights"
    if const_int(shape(gate_up)[0]) != num_experts or const_int(shape(down)[0]) != num_experts:
        return "the number of stacked experts differs from the histogram bins", "offsets"
    if any(bound != num_experts for bound in bounds):
        return "rows are masked against another expert count than the experts held", "offsets"
    return ExpertWeights(stacked=gate_up, out_in=gate_up_out_in), ExpertWeights(stacked=down, out_in=down_out_in)


def _read_combine(out: Node) -> tuple[int, Node, Node] | tuple[str, Node | None]:
    """(k, the weighted expert rows, the sort permutation) of `y[inverse(perm)].view(T, k, H).sum(1)`,
    else (why not, where)."""
    view = out.args[0]
    if list(out.args[1]) not in ([1], [-2]) or len(shape(view)) != 3:
        return "the k-slot reduction is not a sum over dim 1 of a [T, k, H] view", None
    top_k = const_int(shape(view)[1])
    unpermuted = strip_shape_ops(view)
    if not (is_call(unpermuted, aten.index.Tensor) and len(unpermuted.args[1]) == 1):
        return "expert outputs are not gathered back to token order before the sum", unpermuted
    weighted, inverse = unpermuted.args[0], unpermuted.args[1][0]
    perm = _inverse_of(inverse)
    if perm is None:
        return "the gather back to token order is not the inverse of the sort permutation", inverse
    if not is_call(weighted, aten.mul.Tensor):
        return "routing weights do not scale the expert outputs", weighted
    return top_k, weighted, perm


def _read_biases(swiglu, up: tuple, down: tuple, num_experts: int, perm: Node) -> bool | tuple[str, Node | None]:
    """Whether the expert biases (GPT-OSS's clamped swiglu only) are gathered with sorted ids clamped to
    0..E-1 (transformers 5.17); (why not, where) when they are not read as the kernel reads them."""
    (up_bias, up_bias_ids), (down_bias, down_bias_ids) = up, down
    if (up_bias is None) != (swiglu is None) or (down_bias is None) != (swiglu is None):
        return "expert biases come only with GPT-OSS's clamped swiglu in the fused kernel", None
    if swiglu is None:
        return False
    up_bias_ids, up_clamped = through_id_clamp(up_bias_ids, num_experts)
    down_bias_ids, down_clamped = through_id_clamp(down_bias_ids, num_experts)
    if not (_is_sorted_ids(up_bias_ids, perm) and _is_sorted_ids(down_bias_ids, perm)):
        return "expert biases are not gathered with the sorted expert ids", up_bias_ids
    return up_clamped or down_clamped


def _final_output(out: Node) -> Node:
    """Include a trailing `.to(hidden dtype)` in the region: the fused call already returns that dtype."""
    users = list(out.users)
    if len(users) == 1 and is_cast(users[0]):
        return users[0]
    return out


def _split_product(mul: Node, unmask) -> tuple[Node | None, Node | None]:
    """(down projection output, routing weights) of mul(grouped_mm [+ bias], w)."""
    for a, b in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        a_src = unmask(strip_casts(a)) if isinstance(a, Node) else None
        if a_src is not None and is_grouped_mm(_with_bias(a_src)[0]) and isinstance(b, Node):
            return a_src, b
    return None, None


def _is_sorted_ids(ids: Node, perm: Node) -> bool:
    """ids is the sorted-ids output of the sort that produced perm."""
    ids = strip_casts(ids)
    return is_getitem(ids, 0) and is_getitem(perm, 1) and ids.args[0] is perm.args[0]


def _inverse_of(inverse: Node) -> Node | None:
    """perm when `inverse` is index_put(empty_like(perm), [perm], arange(S)) (or scatter of arange)."""
    if is_call(inverse, aten.index_put.default) and len(inverse.args[1]) == 1:
        base, (perm,), values = inverse.args[:3]
        values = strip_shape_ops(values)  # one routed slot: arange(1) is viewed as a scalar
        if is_call(values, aten.arange.default, aten.arange.start) and _is_like(base, perm):
            return perm
    if is_call(inverse, aten.argsort.default, aten.argsort.stable):
        return inverse.args[0]
    return None


def _is_like(base: Node, perm: Node) -> bool:
    return is_call(base, aten.empty_like.default, aten.zeros_like.default) and base.args[0] is perm


def _gathered_by(node: Node, perm: Node) -> Node | None:
    """w_flat when `node` is w_flat[perm] (possibly unsqueezed / cast)."""
    node = strip_casts(node)
    if is_call(node, aten.index.Tensor) and len(node.args[1]) == 1 and node.args[1][0] is perm:
        return node.args[0]
    return None


def _sort_of(perm: Node) -> Node | None:
    if is_getitem(perm, 1) and is_call(perm.args[0], aten.sort.default, aten.sort.stable):
        return perm.args[0]
    return None


def _offsets_source(offs: Node, perm: Node) -> Node | None:
    """ids_flat when offs = cumsum(histc(sorted ids)) (or bincount) for the same sort as perm."""
    sort = _sort_of(perm)
    if sort is None or not is_call(offs, aten.cumsum.default):
        return None
    counts = strip_casts(offs.args[0])
    if not is_call(counts, aten.histc.default, aten.bincount.default):
        return None
    sorted_ids = strip_casts(counts.args[0])
    if not (is_getitem(sorted_ids, 0) and sorted_ids.args[0] is sort):
        return None
    return sort.args[0]


def _offsets_bins(offs: Node) -> int | None:
    counts = strip_casts(offs.args[0])
    if is_call(counts, aten.histc.default):
        given = list(counts.args[1:])  # make_fx drops trailing defaults: max=0 for one expert
        bins, low, high = given + [100, 0, 0][len(given) :]
        bins = const_int(bins)
        if bins is not None and low == 0 and high == bins - 1:
            return bins
        return None
    return const_int(counts.kwargs.get("minlength", counts.args[2] if len(counts.args) > 2 else None))


def _rows_source(rows: Node, perm: Node, top_k: int) -> Node | None:
    """x when rows = x[perm // k] (x possibly cast to the weight dtype)."""
    rows = strip_casts(rows)
    if not (is_call(rows, aten.index.Tensor) and len(rows.args[1]) == 1):
        return None
    token_of_slot = rows.args[1][0]
    if is_call(token_of_slot, aten.floor_divide.default, aten.div.Tensor_mode):
        if token_of_slot.args[0] is perm and const_int(token_of_slot.args[1]) == top_k:
            if is_call(token_of_slot, aten.div.Tensor_mode) and token_of_slot.kwargs.get(
                "rounding_mode"
            ) not in ("floor", "trunc"):
                return None
            return rows.args[0]
    return None


# The k-slot sum that ends the region anchors it.
FINDER = Finder(FORM, (aten.sum.dim_IntList,), each_anchor(_feeds_from_grouped_mm), match_at)
