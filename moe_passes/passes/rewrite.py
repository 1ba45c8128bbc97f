"""Replace one matched expert region by one fused MoE call.

The call is inserted just before the region's output (every input of the call is an ancestor of that
output, so it dominates the insertion point); the region's intermediate nodes become dead and are
removed by dead-code elimination afterwards.
"""

from __future__ import annotations

import torch
from torch._guards import detect_fake_mode
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from .. import lowering, weight_stacks
from ..fx_utils import Emitter, dtype, shape, val
from .matches import ExpertsMatch, ExpertWeights, IdsCheck
from .slots import same_shape

aten = torch.ops.aten


def _out_rows(emit: Emitter, weight: Node, weights: ExpertWeights) -> Node:
    """`weight` (one expert's, or the stack) cut to the role's output features (a view)."""
    if weights.out_rows is None:
        return weight
    start, stop = weights.out_rows
    return emit.call(aten.slice.Tensor, (weight, -2 if weights.out_in else -1, start, stop))


def _weight_list(emit: Emitter, weights: ExpertWeights, want_out_in: bool) -> list[Node]:
    """One 2-D node per expert, laid out [out, in] when `want_out_in` (views, never copies)."""
    if weights.stacked is not None:
        stacked = _out_rows(emit, weights.stacked, weights)
        if weights.out_in != want_out_in:
            stacked = emit.call(aten.transpose.int, (stacked, -2, -1))
        count = shape(stacked)[0]
        return emit.getitems(emit.call(aten.unbind.int, (stacked, 0)), int(count))
    nodes = [_out_rows(emit, n, weights) for n in weights.per_expert]
    if weights.out_in != want_out_in:
        nodes = [emit.call(aten.t.default, (n,)) for n in nodes]
    return nodes


def _weight_stack(emit: Emitter, weights: ExpertWeights, want_out_in: bool) -> Node:
    """The stacked [E, ., .] weight, laid out [E, out, in] when `want_out_in` (a view, never a copy)."""
    stacked = _out_rows(emit, weights.stacked, weights)
    if weights.out_in != want_out_in:
        return emit.call(aten.transpose.int, (stacked, -2, -1))
    return stacked


def _as_2d(emit: Emitter, node: Node, last: int) -> Node:
    if len(shape(node)) == 2:
        return node
    return emit.call(aten.reshape.default, (node, [-1, last]))


def _cast(emit: Emitter, node: Node, to: torch.dtype) -> Node:
    if dtype(node) == to:
        return node
    return emit.call(aten._to_copy.default, (node,), {"dtype": to})


def _checked(emit: Emitter, ids: Node, check: IdsCheck) -> Node:
    """The ids the call takes where no op of the graph bounds them: negative ids wrapped as the region's
    indexing wraps them, then every id asserted in range on the device (no host synchronisation)."""
    if check.wrap is not None:
        negative = emit.call(aten.lt.Scalar, (ids, 0))
        ids = emit.call(aten.where.self, (negative, emit.call(aten.add.Tensor, (ids, check.wrap)), ids))
    above = emit.call(aten.ge.Scalar, (ids, check.low))
    inside = emit.call(aten.bitwise_and.Tensor, (above, emit.call(aten.le.Scalar, (ids, check.high))))
    emit.call(aten._assert_async.msg, (emit.call(aten.all.default, (inside,)), check.message))
    return ids


def _weights_at_ids(emit: Emitter, table: Node, ids: Node) -> Node:
    """table.gather(1, ids): each token's weights read at its ids from the [T, E] table. An id outside
    the table (a sentinel the kernel skips) reads a clamped column, whose weight the kernel never uses."""
    width = shape(table)[-1]
    inside = emit.call(aten.clamp.default, (ids, 0, width - 1))
    return emit.call(aten.gather.default, (_as_2d(emit, table, width), 1, inside))


def _sizes_for(emit: Emitter, output: Node, hidden: Node) -> list:
    """`output`'s shape as reshape arguments: a symbolic size is never written as a bare SymInt (the
    graph's code could not name it) but as -1 when it is the only one, else read off the hidden states
    of the same shape."""
    sizes = list(val(output).shape)
    symbolic = [i for i, size in enumerate(sizes) if not isinstance(size, int)]
    if len(symbolic) == 1:
        sizes[symbolic[0]] = -1
    elif symbolic:
        if not same_shape(shape(hidden), shape(output)):
            raise ValueError("the region's output has several symbolic sizes unlike the hidden states")
        for i in symbolic:
            sizes[i] = emit.call(aten.sym_size.int, (hidden, i))
    return sizes


def rewrite_experts(graph: Graph, match: ExpertsMatch, target: str) -> Node:
    """Emit the fused call for `match` and route the region's users to it; returns the fused node."""
    fake_mode = detect_fake_mode([val(match.output)])
    emit = Emitter(graph, fake_mode)
    roles = [r for r in (match.gate_up, match.gate, match.up, match.down) if r is not None]  # biases excluded
    permuted = any(r.out_in for r in roles)

    with graph.inserting_before(match.output):
        hidden_shape = shape(match.hidden)
        x = _as_2d(emit, match.hidden, hidden_shape[-1])
        ids = _cast(emit, _as_2d(emit, match.ids, match.top_k), torch.int64)
        if match.ids_check is not None:
            ids = _checked(emit, ids, match.ids_check)
        weights = _weights_at_ids(emit, match.weights, ids) if match.weights_at_ids else match.weights
        weights = _cast(emit, _as_2d(emit, weights, match.top_k), dtype(x))
        values = {"hidden_states": x, "expert_routing_table": ids, "router_weights": weights}
        overload = match.overload
        stacked = weight_stacks.stacked_overload(target, overload)
        if stacked is not None and all(r.stacked is not None for r in roles):
            overload, pass_weights = stacked, _weight_stack  # no per-expert views for the call to unpack
        else:
            pass_weights = _weight_list
        if match.gate_up is not None:
            values["w12"] = pass_weights(emit, match.gate_up, permuted)
        else:
            values["w1"] = pass_weights(emit, match.gate, permuted)
            values["w2"] = pass_weights(emit, match.up, permuted)
        values["w3"] = pass_weights(emit, match.down, permuted)
        if match.gate_up_bias is not None:  # bias_fused_weights: biases are 1-D, never transposed
            values["w12_bias"] = _weight_list(emit, match.gate_up_bias, match.gate_up_bias.out_in)
            values["w3_bias"] = _weight_list(emit, match.down_bias, match.down_bias.out_in)
            values.update(alpha=match.alpha, limit=match.limit)
        values.update(
            permuted_weights=permuted,
            activation=match.activation,
            experts_min=match.experts_min,
            experts_max=match.experts_max,
        )
        if match.router_experts is not None:  # newer Gaudi bridges take the global expert count
            values["total_experts"] = match.router_experts
        op = lowering.fused_overload(target, overload)
        args, kwargs = lowering.call_arguments(op, values)
        fused = graph.call_function(op, args, kwargs)  # the one node the region becomes
        with fake_mode:
            fused.meta["val"] = op(*map_arg(args, val), **map_arg(kwargs, val))
        result = fused
        # Compared without guarding: a size made from data (a count read on the host) that is not known
        # to equal its twin is taken to differ, and the result reshaped.
        if not same_shape(shape(match.output), shape(fused)):
            result = emit.call(aten.reshape.default, (result, _sizes_for(emit, match.output, match.hidden)))
        result = _cast(emit, result, dtype(match.output))
    match.output.replace_all_uses_with(result)
    return fused
