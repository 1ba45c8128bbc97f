"""Dense all-expert batched matmuls: every token goes through every expert.

Output-weighted (transformers 4.x GPT-OSS off CPU, and 4.55 on every device):

    xs = x.repeat(E, 1).view(E, T, H)                        # every token, once per expert
    y = bmm(act(bmm(xs, W_gate_up) [+ b1]), W_down) [+ b2]   # [E, T, H]
    out = (y.view(E, ..., H) * c).sum(0)                     # c[e, t] = table[t, e]

with `table = zeros(T, E).scatter_(1, ids, w)`: zero except at each token's top-k experts, so
out[t] = sum_j w[t, j] * MLP_{ids[t, j]}(x[t]), the kernel's semantics. Which column of the table scales
which expert is checked by evaluating c on probe tables (probe.py).

Input-weighted (transformers Llama4: `x.repeat(E, 1) * scores` before the bmm) is declined: the fused
kernel scales each expert's OUTPUT, and with a non-linear MLP, MLP(w * x) != w * MLP(x).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import SHAPE_ONLY_OPS, const_int, is_call, shape, strip_casts, strip_shape_ops
from . import probe
from .biases import bias_fields
from .expert_terms import is_zero_init
from .finder import Finder, each_anchor
from .matches import (
    BIASES_NEED_SWIGLU,
    IDS_WEIGHTS_SHAPES,
    Decline,
    ExpertsMatch,
    ExpertWeights,
    NoMatch,
    unprobeable,
)
from .mlp import stacked_gate, stacked_weight
from .slots import same_shape

aten = torch.ops.aten
FORM = "dense_bmm"

REASON = (
    "routing weights scale each expert's input (x.repeat(E) * scores before the expert bmm, as in Llama4); "
    "the fused kernel weights outputs, and with a non-linear MLP the two are not equal"
)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default, aten.contiguous.default)
_SCATTERS = (aten.scatter.src, aten.scatter.value)


def _input_scaled_repeat(node: Node) -> bool:
    """`rows * scores` with rows every token once per expert: `x.repeat(E, 1)` (transformers Llama4) or
    `gather(x, 0, arange(T) expanded over the experts)` (Meta's Llama 4 reference)."""
    node = strip_shape_ops(node)
    while is_call(node, aten.detach.default, aten.alias.default):  # `routed_in.detach()`
        node = strip_shape_ops(node.args[0])
    if not is_call(node, aten.mul.Tensor):
        return False
    return any(isinstance(a, Node) and (is_call(strip_shape_ops(a), aten.repeat.default) or _gathers_every_token(a))
               for a in node.args)


def _gathers_every_token(node: Node) -> bool:
    """gather(x, 0, index) whose index is `arange` expanded (each row index repeated along the hidden dim
    and the whole range once per expert)."""
    node = strip_shape_ops(node)
    if not (is_call(node, aten.gather.default) and node.args[1] == 0):
        return False
    index = node.args[2]
    while isinstance(index, Node) and not is_call(index, aten.arange.default, aten.arange.start):
        if not is_call(index, *SHAPE_ONLY_OPS):
            return False
        index = index.args[0]
    return isinstance(index, Node)


def _is_candidate(node: Node) -> bool:
    """A sum over the expert dim, or a bmm of stacked weights whose inputs are scaled (Llama4)."""
    if is_call(node, aten.sum.dim_IntList):
        return _sums_leading_dim(node)
    inputs, weights = node.args
    return (
        len(shape(weights) or ()) == 3
        and strip_shape_ops(weights).op == "placeholder"
        and _input_scaled_repeat(inputs)
    )


def _read(node: Node) -> ExpertsMatch | Decline | None:
    return Decline(FORM, REASON, node) if is_call(node, aten.bmm.default) else match_at(node)


def _sums_leading_dim(node: Node) -> bool:
    summed_shape = shape(node.args[0])
    dims = list(node.args[1])
    return bool(summed_shape) and len(dims) == 1 and dims[0] % len(summed_shape) == 0


def _through_views(node: Node) -> Node:
    """The node `node` is a row-major view of (reshapes keep the order of elements)."""
    while is_call(node, *_VIEWS):
        node = node.args[0]
    return node


def _with_bias(node: Node) -> tuple[Node, Node | None]:
    """(bmm, stacked [E, N] bias) for bmm(...) + bias[:, None, :]; (node, None) without a bias."""
    if is_call(node, aten.add.Tensor) and all(isinstance(a, Node) for a in node.args):
        for mm, bias in (node.args, node.args[::-1]):
            source = strip_shape_ops(bias)
            if is_call(mm, aten.bmm.default) and len(shape(source) or ()) == 2 and _per_expert_rows(bias):
                return mm, source
    return node, None


def _per_expert_rows(bias: Node) -> bool:
    """bias[:, None, :] broadcast over the tokens: [E, 1, N]."""
    bias_shape = shape(bias)
    return bias_shape is not None and len(bias_shape) == 3 and const_int(bias_shape[1]) == 1


def _weighted_experts(out: Node) -> tuple[Node, Node, Node] | None:
    """(bmm output plus bias, the coefficient, the [E, ..., H] product operand) of sum(y * c, 0)."""
    product = strip_casts(out.args[0])
    if not is_call(product, aten.mul.Tensor) or not all(isinstance(a, Node) for a in product.args):
        return None
    for operand, coefficient in (product.args, product.args[::-1]):
        source = _through_views(strip_casts(operand))
        if is_call(source, aten.bmm.default) or _with_bias(source)[1] is not None:
            return source, coefficient, operand
    return None


def _repeated_tokens(rows: Node, experts: int) -> Node | None:
    """x when the [E, T, H] batched rows are x ([T, H]) once per expert: x.repeat(E, 1).view(E, T, H)
    or x.unsqueeze(0).expand(E, T, H)."""
    rows_shape = shape(rows)
    source = _through_views(rows)
    if is_call(source, aten.repeat.default) and [const_int(r) for r in source.args[1]] == [experts, 1]:
        x = source.args[0]
    elif is_call(source, aten.expand.default) and is_call(source.args[0], aten.unsqueeze.default):
        x = source.args[0].args[0] if source.args[0].args[1] == 0 else None
    else:
        return None
    x_shape = shape(x) if x is not None else None
    if x_shape is None or len(x_shape) != 2 or rows_shape is None or len(rows_shape) != 3:
        return None
    same = [const_int(a) == const_int(b) for a, b in zip(rows_shape, (experts, *x_shape), strict=True)]
    return x if all(same) else None


def _routing_table(coefficient: Node) -> Node | None:
    """The one zero [T, E] table scattered along its expert dim that the coefficient derives from (the
    nearest scatters: earlier layers' tables lie behind them)."""
    scatters, seen, stack = [], set(), [coefficient]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_call(node, *_SCATTERS):
            scatters.append(node)
        else:
            stack.extend(node.all_input_nodes)
    tables = [n for n in scatters if is_zero_init(n.args[0]) and n.args[1] in (-1, 1) and len(shape(n)) == 2]
    return tables[0] if len(tables) == 1 and len(scatters) == 1 else None


def _scales_columns(coefficient: Node, operand: Node, table: Node, experts: int) -> NoMatch | None:
    """None when (operand * coefficient)[e] scales token t by table[t, e] for every probe table; else
    why not (stopped at the coefficient)."""
    tokens = probe.concrete(shape(table)[0])
    out_shape = tuple(int(probe.concrete(d)) for d in shape(operand))
    nodes = probe.slice_between(coefficient, {table})
    try:
        for columns in probe.column_probes(int(tokens), experts, strip_casts(table).meta["val"].dtype):
            value = probe.evaluate(nodes, {table: columns})[coefficient]
            full = value.expand(torch.broadcast_shapes(value.shape, out_shape)).reshape(experts, tokens, -1)
            if full.shape != (experts, tokens, full.shape[-1]) or not bool((full == full[..., :1]).all()):
                return NoMatch("the routing weight is not one value per expert and token", coefficient)
            if not torch.equal(full[..., 0].to(columns.dtype), columns.T):
                return NoMatch("expert e's output is not scaled by column e of the routing table", coefficient)
    except probe.NotProbeable as why:
        return NoMatch(unprobeable("the per-expert routing weight", why), coefficient)
    except RuntimeError:
        return NoMatch("the routing weight does not broadcast against the experts' outputs", coefficient)
    return None


def match_at(out: Node) -> ExpertsMatch | Decline | None:
    """The match for sum over experts of weighted dense expert outputs; None when `out` is not one."""
    found = _weighted_experts(out)
    if found is None:
        return None
    expert_out, coefficient, operand = found

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, out, at)

    down_mm, down_bias = _with_bias(expert_out)
    gate = stacked_gate(down_mm.args[0])
    if isinstance(gate, NoMatch):
        return gate.decline(FORM, out)
    gate_up_mm, up_bias = _with_bias(strip_shape_ops(gate.gate_up_output))
    if not is_call(gate_up_mm, aten.bmm.default):
        return no("gate/up is not a batched matmul", gate_up_mm)
    if (up_bias is None) != (gate.swiglu is None) or (down_bias is None) != (gate.swiglu is None):
        return no(BIASES_NEED_SWIGLU, gate_up_mm)
    gate_up, gate_up_out_in = stacked_weight(gate_up_mm.args[1])
    down, down_out_in = stacked_weight(down_mm.args[1])
    experts = const_int(shape(gate_up)[0]) if len(shape(gate_up) or ()) == 3 else None
    if experts is None or len(shape(down) or ()) != 3 or const_int(shape(down)[0]) != experts:
        return no("expert weights are not stacked [E, ., .] tensors of one expert count", gate_up_mm)
    hidden = _repeated_tokens(gate_up_mm.args[0], experts)
    if hidden is None:
        return no("the batched rows are not every token once per expert (x.repeat(E, 1))", gate_up_mm.args[0])
    operand_shape = shape(operand)
    if const_int(operand_shape[0]) != experts or const_int(operand_shape[-1]) != const_int(shape(hidden)[-1]):
        # a reshape that keeps the experts leading (and the hidden size last) keeps each expert's rows
        return no("the weighted expert outputs are not laid out [experts, ..., hidden]", operand)
    table = _routing_table(coefficient)
    if table is None:
        return no("the expert outputs are not weighted by a [T, E] table scattered from top-k", coefficient)
    ids, weights = strip_shape_ops(table.args[2]), strip_shape_ops(table.args[3])
    if not isinstance(weights, Node) or not same_shape(shape(ids), shape(weights)) or len(shape(ids)) != 2:
        return no(IDS_WEIGHTS_SHAPES, table)
    if const_int(shape(table)[1]) != experts or const_int(shape(table)[0]) != const_int(shape(hidden)[0]):
        return no("the routing table is not [tokens, experts held]", table)
    unscaled = _scales_columns(coefficient, operand, table, experts)
    if unscaled is not None:
        return unscaled.decline(FORM, out)
    return ExpertsMatch(
        form=FORM,
        output=out,
        hidden=hidden,
        ids=ids,
        weights=weights,
        num_experts=experts,
        top_k=const_int(shape(ids)[1]),
        activation=gate.activation,
        gate_up=ExpertWeights(stacked=gate_up, out_in=gate_up_out_in),
        down=ExpertWeights(stacked=down, out_in=down_out_in),
        **bias_fields(gate.swiglu, up_bias, down_bias),
    )


# The sum over the expert dim ends the region; a bmm of input-scaled rows is the Llama4 near miss.
FINDER = Finder(
    FORM, (aten.sum.dim_IntList, aten.bmm.default), each_anchor(_is_candidate), _read, priority=50,
    reads_every_expert=True,
)
