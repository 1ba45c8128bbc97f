"""Gradients of the portable fused MoE op, so that a fused layer trains.

For each routed pair (token t, expert e, router weight r) the forward adds r * y to out[t], with
y = down(h), h = act(gate(x)) * up(x). Given dout, with b = dout[t] W_down^T:

    dr = <b, h>  (= <dout[t], y>, without recomputing y)        dh = r * b
    dW_down += h^T (r * dout[t]),  d_up = dh * act(g),  d_gate = act'(g) * dh * up,
    dW_gate += x^T d_gate,  dW_up += x^T d_up,  dx[t] += d_gate W_gate^T + d_up W_up^T

over each expert's rows only. The forward saves its inputs and the backward recomputes the gate/up
projection (the Gaudi bridge's `recomp` pair), so a fused layer holds no activations between forward
and backward (the option `recompute=False` saves them instead: backend_passes.SaveActivations).
Over stacked bfloat16 weights the backward is written in traceable ops, grouped matmuls for dX and for
the weight gradients, so AOTAutograd records it in the backward graph and inductor fuses the
elementwise work around them. Otherwise (per-expert lists, other dtypes, the GPT-OSS form) it is one
opaque op per overload, `mixture_of_experts_recomp_bwd.*`, named and ordered after the bridge's, which
runs grouped matmuls where the stacks allow, else a loop over the experts that received rows. Either
way it returns the gradients of hidden_states, router_weights and every weight role, in schema order,
flattened (a list role gives one tensor per expert).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .op_groups import SortedPairs, accumulation_dtype, grouped_mm_applies, sort_pairs, sum_slots
from .reference import ACTIVATIONS
from .stacks import stacked_view

aten = torch.ops.aten

_ROUTED = "Tensor grad_tokens_in, Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights"
_TAIL = "bool permuted_weights, str activation, int experts_min, int experts_max"
BACKWARD_SCHEMAS = {
    "default": f"mixture_of_experts_recomp_bwd({_ROUTED}, Tensor[] w1, Tensor[] w2, Tensor[] w3, {_TAIL}) -> Tensor[]",
    "fused_weights": f"mixture_of_experts_recomp_bwd.fused_weights({_ROUTED}, Tensor[] w12, Tensor[] w3, {_TAIL}) "
    "-> Tensor[]",
    "stacked": f"mixture_of_experts_recomp_bwd.stacked({_ROUTED}, Tensor w1, Tensor w2, Tensor w3, {_TAIL}) "
    "-> Tensor[]",
    "stacked_fused_weights": f"mixture_of_experts_recomp_bwd.stacked_fused_weights({_ROUTED}, Tensor w12, "
    f"Tensor w3, {_TAIL}) -> Tensor[]",
    "bias_fused_weights": f"mixture_of_experts_recomp_bwd.bias_fused_weights({_ROUTED}, Tensor[] w12, "
    "Tensor[] w3, Tensor[] w12_bias, Tensor[] w3_bias, *, bool permuted_weights, int experts_min, "
    "int experts_max, float alpha, float limit) -> Tensor[]",
}
# How many weight roles each forward overload takes after (hidden_states, table, router_weights), and
# whether they are per-expert lists.
ROLES = {
    "default": (3, True),
    "fused_weights": (2, True),
    "stacked": (3, False),
    "stacked_fused_weights": (2, False),
    "bias_fused_weights": (4, True),
}


def activation_backward(name: str, grad: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """d act(gate) / d gate applied to `grad`, for the kernel's activations (ATen's own backward ops)."""
    if name == "silu":
        return aten.silu_backward(grad, gate)
    if name == "gelu":  # the tanh form: the kernel's gelu
        return aten.gelu_backward(grad, gate, approximate="tanh")
    if name == "relu":
        return aten.threshold_backward(grad, gate, 0)
    raise ValueError(f"mixture_of_experts backward: unknown activation {name!r}")


# ---------------------------------------------------------------------------------------------------
# One gated MLP's backward, written once over two kinds of matmul: plain ones for one expert's rows,
# or grouped ones over all experts' sorted rows (then the weights are stacks [E, in, out]).


@dataclass(frozen=True)
class Matmuls:
    """x @ W for activations, and x^T @ dy for weight gradients, per expert or grouped by expert."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    weight_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


PLAIN = Matmuls(forward=torch.matmul, weight_grad=lambda x, dy: x.transpose(-2, -1) @ dy)


def grouped(offsets: torch.Tensor) -> Matmuls:
    return Matmuls(
        forward=lambda x, w: torch._grouped_mm(x, w, offs=offsets),
        weight_grad=lambda x, dy: torch._grouped_mm(x.transpose(-2, -1), dy, offs=offsets),
    )


def _gated_mlp_backward(x, dout_rows, r, gate_up_io, down_io, activation: str, mm: Matmuls):
    """(dx, d gate_up roles, d down, d r) for rows x with upstream dout_rows and router weights r.

    Weights are in [in, out] form (`gate_up_io` is (gate, up) or (fused gate|up,)); the weight
    gradients come back in the same form. The expert's output y = h W_down is never recomputed: the
    router weight's gradient <dout, h W_down> is read as <dout W_downᵀ, h>, and dout W_downᵀ is the
    product the down projection's backward needs anyway (scaled by r).
    """
    projected = [mm.forward(x, w) for w in gate_up_io]
    gate, up = projected[0].chunk(2, dim=-1) if len(projected) == 1 else projected
    activated = ACTIVATIONS[activation](gate)
    h = activated * up
    scale = r.to(x.dtype).unsqueeze(-1)
    back_through_down = mm.forward(dout_rows, down_io.transpose(-2, -1))
    d_router = (back_through_down * h).sum(-1, dtype=accumulation_dtype(x.dtype))
    d_down = mm.weight_grad(h, dout_rows * scale)
    dh = back_through_down * scale
    d_up = dh * activated
    d_gate = activation_backward(activation, dh * up, gate)
    if len(gate_up_io) == 1:
        d_fused = torch.cat([d_gate, d_up], dim=-1)
        d_gate_up = [mm.weight_grad(x, d_fused)]
        dx = mm.forward(d_fused, gate_up_io[0].transpose(-2, -1))
    else:
        d_gate_up = [mm.weight_grad(x, d_gate), mm.weight_grad(x, d_up)]
        dx = mm.forward(d_gate, gate_up_io[0].transpose(-2, -1)) + mm.forward(d_up, gate_up_io[1].transpose(-2, -1))
    return dx, d_gate_up, d_down, d_router


def _router_grad(dout_rows: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (dout_rows * y).sum(-1, dtype=accumulation_dtype(y.dtype))


def _io(weight: torch.Tensor, permuted: bool) -> torch.Tensor:
    """A weight (or a stack) in [in, out] form: the stored [out, in] transposed when permuted."""
    return weight.transpose(-2, -1) if permuted else weight


class _Gradients:
    """The gradients being accumulated: per slot for dX and the router weights, per expert for weights."""

    def __init__(self, grad: torch.Tensor, hidden_states: torch.Tensor, top_k: int):
        wide = accumulation_dtype(hidden_states.dtype)
        self.tokens, self.top_k = hidden_states.shape[0], top_k
        pairs = self.tokens * top_k
        self.dx = torch.zeros(pairs, hidden_states.shape[1], dtype=wide, device=hidden_states.device)
        self.dr = torch.zeros(pairs, dtype=wide, device=hidden_states.device)
        self.grad = grad

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self.grad.index_select(0, slots // self.top_k)

    def add(self, slots: torch.Tensor, dx: torch.Tensor, dr: torch.Tensor) -> None:
        self.dx[slots] = dx.to(self.dx.dtype)
        self.dr[slots] = dr.to(self.dr.dtype)

    def hidden_and_router(self, hidden_dtype: torch.dtype, router_dtype: torch.dtype):
        return sum_slots(self.dx, self.tokens, self.top_k, hidden_dtype), self.dr.view(self.tokens, self.top_k).to(
            router_dtype
        )


def _as_stored(grad_io: torch.Tensor, permuted: bool) -> torch.Tensor:
    return grad_io.transpose(-2, -1).contiguous() if permuted else grad_io


def _grouped_backward(grad, hidden_states, pairs: SortedPairs, router_weights, gate_up, down, permuted, activation):
    """The stacked form's gradients from grouped matmuls, or None where the grouped kernel declines."""
    offsets = pairs.offsets()
    tokens = pairs.tokens
    x, dout_rows = hidden_states.index_select(0, tokens), grad.index_select(0, tokens)
    r = router_weights.reshape(-1)[pairs.order]
    gate_up_io = [_io(w, permuted) for w in gate_up]
    try:
        dx, d_gate_up, d_down, d_router = _gated_mlp_backward(
            x, dout_rows, r, gate_up_io, _io(down, permuted), activation, grouped(offsets)
        )
    except RuntimeError:  # shapes or alignment the grouped kernel does not take
        return None
    # Rows past the last group are left unwritten by grouped_mm: select, never multiply, them away.
    outside = pairs.outside_sorted()
    dx = torch.where(outside, 0.0, dx)
    dr = torch.where(outside[:, 0], 0.0, d_router)
    back = pairs.slot_order()  # gathered back to slot order, then summed over each token's k slots
    tokens_count, top_k = router_weights.shape
    d_hidden = sum_slots(dx.index_select(0, back), tokens_count, top_k, hidden_states.dtype)
    d_router = dr.index_select(0, back).view(tokens_count, top_k).to(router_weights.dtype)
    return [d_hidden, d_router, *(_as_stored(g, permuted) for g in d_gate_up), _as_stored(d_down, permuted)]


def _loop_backward(grad, hidden_states, pairs: SortedPairs, router_weights, roles, permuted, activation, count):
    """Per-expert lists (or stacks) of gate/up and down weights: one expert's rows at a time."""
    *gate_up, down = roles
    sums = _Gradients(grad, hidden_states, pairs.top_k)
    weight_grads = [[None] * count for _ in roles]
    flat_weights = router_weights.reshape(-1)
    for expert, slots in pairs.groups():
        x, dout_rows = hidden_states.index_select(0, slots // pairs.top_k), sums.rows(slots)
        dx, d_gate_up, d_down, d_router = _gated_mlp_backward(
            x, dout_rows, flat_weights[slots], [_io(w[expert], permuted) for w in gate_up],
            _io(down[expert], permuted), activation, PLAIN,
        )
        sums.add(slots, dx, d_router)
        for role, g in enumerate([*d_gate_up, d_down]):
            weight_grads[role][expert] = _as_stored(g, permuted)
    d_hidden, d_router = sums.hidden_and_router(hidden_states.dtype, router_weights.dtype)
    return d_hidden, d_router, [_fill_zeros(grads, weights) for grads, weights in zip(weight_grads, roles, strict=True)]


def _fill_zeros(grads: list, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zero gradients for the experts no row reached."""
    return [g if g is not None else torch.zeros_like(w) for g, w in zip(grads, weights, strict=True)]


def grouped_gradients(grad, hidden_states, table, router_weights, gate_up, down, permuted, activation,
                      experts_min, experts_max) -> list[torch.Tensor] | None:
    """[d hidden, d router weights, d gate/up stack(s), d down stack] from grouped matmuls over stacks, or
    None where that path does not apply. Traceable (no host sync): AOTAutograd records these ops in the
    backward graph, so inductor fuses the elementwise work around the grouped GEMMs."""
    count = experts_max - experts_min + 1
    if not grouped_mm_applies(hidden_states, table, count):
        return None
    pairs = sort_pairs(table, experts_min, count)
    return _grouped_backward(grad, hidden_states, pairs, router_weights, gate_up, down, permuted, activation)


def gated_backward(overload: str, grad, hidden_states, table, router_weights, *rest) -> list[torch.Tensor]:
    """`mixture_of_experts_recomp_bwd.{default, fused_weights, stacked, stacked_fused_weights}`."""
    roles_count, listed = ROLES[overload]
    roles, options = rest[:roles_count], rest[roles_count:]
    permuted, activation, experts_min, experts_max = options
    stacks = [stacked_view(list(r)) for r in roles] if listed else list(roles)
    if all(s is not None for s in stacks):
        result = grouped_gradients(grad, hidden_states, table, router_weights, stacks[:-1], stacks[-1], *options)
        if result is not None:
            if listed:  # one gradient per expert of each list
                return result[:2] + [g for stack in result[2:] for g in stack.unbind(0)]
            return result
    count = experts_max - experts_min + 1
    pairs = sort_pairs(table, experts_min, count)
    d_hidden, d_router, per_role = _loop_backward(
        grad, hidden_states, pairs, router_weights, roles, permuted, activation, count
    )
    if listed:
        return [d_hidden, d_router, *(g for grads in per_role for g in grads)]
    return [d_hidden, d_router, *(torch.stack(grads) for grads in per_role)]


def bias_backward(grad, hidden_states, table, router_weights, w12, w3, w12_bias, w3_bias, *, permuted_weights,
                  experts_min, experts_max, alpha, limit) -> list[torch.Tensor]:
    """`mixture_of_experts_recomp_bwd.bias_fused_weights` (GPT-OSS's clamped, interleaved GLU)."""
    count = experts_max - experts_min + 1
    pairs = sort_pairs(table, experts_min, count)
    sums = _Gradients(grad, hidden_states, pairs.top_k)
    grads = [[None] * count for _ in range(4)]
    flat_weights = router_weights.reshape(-1)
    wide = accumulation_dtype(hidden_states.dtype)
    for e, slots in pairs.groups():
        x, dout_rows = hidden_states.index_select(0, slots // pairs.top_k), sums.rows(slots)
        w12_io, w3_io = _io(w12[e], permuted_weights), _io(w3[e], permuted_weights)
        gate_up = x @ w12_io + w12_bias[e]
        gate_raw, up_raw = gate_up[:, 0::2], gate_up[:, 1::2]
        gate, up = gate_raw.clamp(max=limit), up_raw.clamp(-limit, limit)
        sig = torch.sigmoid(alpha * gate)
        glu = gate * sig
        h = (up + 1) * glu
        y = h @ w3_io + w3_bias[e]
        dy = (dout_rows.to(wide) * flat_weights[slots].to(wide).unsqueeze(-1)).to(x.dtype)
        dh = dy @ w3_io.transpose(-2, -1)
        d_up = (dh * glu) * ((up_raw >= -limit) & (up_raw <= limit))
        d_gate = (dh * (up + 1)) * (sig + gate * alpha * sig * (1 - sig)) * (gate_raw <= limit)
        d_gate_up = torch.stack([d_gate, d_up], dim=-1).flatten(-2)  # interleaved back: gate, up, gate, ...
        sums.add(slots, d_gate_up @ w12_io.transpose(-2, -1), _router_grad(dout_rows, y))
        for role, g in enumerate((x.transpose(-2, -1) @ d_gate_up, h.transpose(-2, -1) @ dy)):
            grads[role][e] = _as_stored(g, permuted_weights)
        grads[2][e], grads[3][e] = d_gate_up.sum(0), dy.sum(0)
    d_hidden, d_router = sums.hidden_and_router(hidden_states.dtype, router_weights.dtype)
    weights = (w12, w3, w12_bias, w3_bias)
    return [d_hidden, d_router, *(g for role, ws in zip(grads, weights, strict=True) for g in _fill_zeros(role, ws))]


def backward_fake(grad, hidden_states, table, router_weights, *rest, **kwargs) -> list[torch.Tensor]:
    """Shapes only: each gradient is shaped like its input."""
    tensors = [hidden_states, router_weights]
    for arg in rest:
        if isinstance(arg, torch.Tensor):
            tensors.append(arg)
        elif isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            tensors.extend(arg)
    return [t.new_empty(t.shape) for t in tensors]


BACKWARD_IMPLEMENTATIONS = {
    **{name: functools.partial(gated_backward, name) for name in ROLES if name != "bias_fused_weights"},
    "bias_fused_weights": bias_backward,
}


# ---------------------------------------------------------------------------------------------------
# The autograd formula of each forward overload: save the inputs, call the backward op, and hand its
# flat list back in the forward's argument structure.


def setup_context(ctx, inputs, output, keyword_only_inputs=None) -> None:
    """Save the inputs (recompute: nothing else), tensors through save_for_backward, lists flattened."""
    ctx.keyword_only = dict(keyword_only_inputs or {})
    tensors, layout = [], []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            layout.append(None)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            tensors.extend(value)
            layout.append(len(value))
        else:
            layout.append(("value", value))
    ctx.layout = layout
    ctx.save_for_backward(*tensors)


def _saved_inputs(ctx) -> list:
    """The forward's inputs again, from what setup_context saved."""
    saved, inputs = list(ctx.saved_tensors), []
    for item in ctx.layout:
        if item is None:
            inputs.append(saved.pop(0))
        elif isinstance(item, int):
            inputs.append(saved[:item])
            del saved[:item]
        else:
            inputs.append(item[1])
    return inputs


def autograd_formula(overload: str):
    """register_autograd's backward for one forward overload."""
    roles_count, listed = ROLES[overload]

    def backward(ctx, grad):
        backward_op = getattr(torch.ops.moe_passes.mixture_of_experts_recomp_bwd, overload)
        hidden_states, table, router_weights, *rest = _saved_inputs(ctx)
        roles, options = rest[:roles_count], rest[roles_count:]
        # Stacks: the grouped backward, traced into the backward graph where it applies. bfloat16 only:
        # grouped_mm's fake kernel takes no other dtype (the opaque op still runs float32 grouped on CPU).
        if not listed and hidden_states.dtype == torch.bfloat16:
            direct = grouped_gradients(grad, hidden_states, table, router_weights, roles[:-1], roles[-1], *options)
            if direct is not None:
                return (direct[0], None, direct[1], *direct[2:], *(None for _ in options))
        if overload == "bias_fused_weights":  # its options are keyword-only: no gradient slots
            keywords = {name: ctx.keyword_only[name] for name in ("experts_min", "experts_max", "alpha", "limit")}
            flat = backward_op(grad, hidden_states, table, router_weights, *roles,
                               permuted_weights=ctx.keyword_only["permuted_weights"], **keywords)
        else:
            flat = backward_op(grad, hidden_states, table, router_weights, *roles, *options)
        d_hidden, d_router, rest_grads = flat[0], flat[1], list(flat[2:])
        role_grads = []
        for role in roles:
            size = len(role) if listed else 1
            role_grads.append(rest_grads[:size] if listed else rest_grads[0])
            rest_grads = rest_grads[size:]
        return (d_hidden, None, d_router, *role_grads, *(None for _ in options))

    return backward
