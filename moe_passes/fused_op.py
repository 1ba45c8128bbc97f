"""The portable twin of the Gaudi fused MoE kernel: `torch.ops.moe_passes.mixture_of_experts`.

Why it exists: off Gaudi there is no `torch.ops.hpu.mixture_of_experts`, yet the rewrite must still
have a target, and every behaviour of the rewrite must be testable on CPU and CUDA. This op has the
bridge's overloads, schemas and semantics (see the project's op contract), so a graph rewritten for
one runs on the other, plus two overloads of its own that take each weight role as one stacked
[E, ...] tensor (what the rewrite emits for the portable target when the weights are stacked).

On CUDA (bfloat16/float16) it runs the fused Triton kernel (`kernels/`); elsewhere grouped matmuls
over the stacked weights, or a loop over the experts that received tokens. Fake kernels let the op
flow through dynamo, AOTAutograd and inductor as one functional call; on CUDA inductor sees through
the stacked overloads to the Triton kernels and launches them from its own generated code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from . import kernels, op_backward, reference
from .op_groups import accumulation_dtype, grouped_mm_applies, sort_pairs, sum_slots
from .stacks import stacked_view

NAMESPACE = "moe_passes"
ACTIVATIONS = tuple(reference.ACTIVATIONS)

SCHEMAS = {
    "default": "mixture_of_experts(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, "
    "Tensor[] w1, Tensor[] w2, Tensor[] w3, bool permuted_weights, str activation, int experts_min, "
    "int experts_max) -> Tensor",
    "fused_weights": "mixture_of_experts.fused_weights(Tensor hidden_states, Tensor expert_routing_table, "
    "Tensor router_weights, Tensor[] w12, Tensor[] w3, bool permuted_weights, str activation, "
    "int experts_min, int experts_max) -> Tensor",
    "bias_fused_weights": "mixture_of_experts.bias_fused_weights(Tensor hidden_states, "
    "Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, Tensor[] w3, Tensor[] w12_bias, "
    "Tensor[] w3_bias, *, bool permuted_weights, int experts_min, int experts_max, int chunk_size=0, "
    "int total_experts=0, float alpha=1.702, float limit=7.0) -> Tensor",
}
# The portable target's own overloads: `.default` and `.fused_weights` with each weight role passed as
# one stacked [E, ...] tensor instead of a list of per-expert tensors.
STACKED_SCHEMAS = {
    "stacked": "mixture_of_experts.stacked(Tensor hidden_states, Tensor expert_routing_table, "
    "Tensor router_weights, Tensor w1, Tensor w2, Tensor w3, bool permuted_weights, str activation, "
    "int experts_min, int experts_max) -> Tensor",
    "stacked_fused_weights": "mixture_of_experts.stacked_fused_weights(Tensor hidden_states, "
    "Tensor expert_routing_table, Tensor router_weights, Tensor w12, Tensor w3, bool permuted_weights, "
    "str activation, int experts_min, int experts_max) -> Tensor",
}

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


class MoEInputError(ValueError):
    """Inputs the fused MoE op cannot accept; the message names the argument at fault."""

    def __init__(self, message: str):
        super().__init__(f"mixture_of_experts: {message}")


# ---------------------------------------------------------------------------------------------------
# Validation: the bridge rejects these inputs too, so fail early with a message that names the culprit.


def activation_function(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation applied to the gate projection (the one table: reference.ACTIVATIONS)."""
    if name in reference.ACTIVATIONS:
        return reference.ACTIVATIONS[name]
    raise MoEInputError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def _check_routing(hidden_states: torch.Tensor, table: torch.Tensor, router_weights: torch.Tensor) -> None:
    if hidden_states.dim() != 2:
        raise MoEInputError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    if not hidden_states.is_floating_point():
        raise MoEInputError(f"hidden_states must be floating point, got {hidden_states.dtype}")
    if table.dim() != 2 or table.shape[0] != hidden_states.shape[0]:
        raise MoEInputError(
            f"expert_routing_table must be [T, k] with T={hidden_states.shape[0]}, got shape {tuple(table.shape)}"
        )
    if table.dtype not in (torch.int64, torch.int32):
        raise MoEInputError(f"expert_routing_table must hold int64 (or int32) expert ids, got {table.dtype}")
    if router_weights.shape != table.shape:
        raise MoEInputError(
            f"router_weights has shape {tuple(router_weights.shape)} but the routing table has "
            f"{tuple(table.shape)}; they must match"
        )
    if not router_weights.is_floating_point():
        raise MoEInputError(f"router_weights must be floating point, got {router_weights.dtype}")


def _expert_count(experts_min: int, experts_max: int) -> int:
    count = experts_max - experts_min + 1
    if experts_min < 0 or count < 1:
        raise MoEInputError(f"expert range [{experts_min}, {experts_max}] (inclusive) is empty or negative")
    return count


def _check_lengths(lists: dict[str, Sequence[torch.Tensor]], count: int) -> None:
    """One tensor per expert of the inclusive range, in every list."""
    for name, tensors in lists.items():
        if len(tensors) != count:
            raise MoEInputError(
                f"{name} holds {len(tensors)} tensors but the expert range holds {count} experts "
                "(experts_max - experts_min + 1)"
            )


def _check_list(
    name: str, tensors: Sequence[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, uniform=False
) -> None:
    """Every tensor of one list has the expected shape and the hidden dtype.

    `uniform`: the list is known to be slices of one stacked tensor (same shape and dtype throughout),
    so checking the first tensor checks them all.
    """
    for index, tensor in enumerate(tensors[:1] if uniform else tensors):
        if tuple(tensor.shape) != shape:
            raise MoEInputError(f"{name}[{index}] has shape {tuple(tensor.shape)}, expected {shape}")
        if tensor.dtype != dtype:
            raise MoEInputError(f"{name}[{index}] is {tensor.dtype}, expected the hidden dtype {dtype}")


def _layout(out_features: int, in_features: int, permuted: bool) -> tuple[int, int]:
    """A weight's shape: [out, in] when permuted (like nn.Linear.weight), else [in, out]."""
    return (out_features, in_features) if permuted else (in_features, out_features)


def _intermediate_size(name: str, matrix: torch.Tensor | torch.Size, hidden: int, permuted: bool, parts: int) -> int:
    """The intermediate size I read off one expert's gate (or fused gate/up) matrix (or its shape)."""
    shape = tuple(matrix.shape if isinstance(matrix, torch.Tensor) else matrix)
    if len(shape) != 2:
        raise MoEInputError(f"{name} must be 2-D, got shape {shape}")
    out_features, in_features = shape if permuted else shape[::-1]
    if in_features != hidden or out_features % parts:
        layout = "[out, in]" if permuted else "[in, out]"
        raise MoEInputError(
            f"{name} has shape {shape}; with permuted_weights={permuted} it must be "
            f"{layout} with in = hidden size {hidden}" + (" and an even out size" if parts > 1 else "")
        )
    return out_features // parts


# ---------------------------------------------------------------------------------------------------
# The kernel: group the routed pairs by expert, run each routed expert once on its rows.


def _linear(x: torch.Tensor, weight: torch.Tensor, permuted: bool) -> torch.Tensor:
    """x @ W for W stored [out, in] (permuted) or [in, out]."""
    return F.linear(x, weight) if permuted else x @ weight


def _combine(hidden_states, table, router_weights, experts_min: int, count: int, expert: ExpertFn):
    """sum over routed pairs of router_weight * expert(x), accumulated in float32."""
    tokens, top_k = table.shape
    wide = accumulation_dtype(hidden_states.dtype)
    per_slot = torch.zeros(tokens * top_k, hidden_states.shape[1], dtype=wide, device=hidden_states.device)
    flat_weights = router_weights.reshape(-1)
    for index, slots in sort_pairs(table, experts_min, count).groups():
        y = expert(index, hidden_states.index_select(0, slots // top_k))
        per_slot[slots] = y.to(wide) * flat_weights[slots].to(wide).unsqueeze(-1)
    return sum_slots(per_slot, tokens, top_k, hidden_states.dtype)


# The grouped path: all experts in grouped matmuls over the stacked weights, with no host sync. Used on
# CUDA where the Triton kernel does not apply, and on CPU for few rows per expert (op_groups says where);
# the loop is the fallback.


def _grouped_fused(
    hidden_states, table, router_weights, gate_up: Sequence[torch.Tensor], down, permuted: bool, act,
    experts_min: int, count: int,
):
    """The op's result from grouped matmuls over stacked weights, or None when this path does not apply.

    `gate_up` is (fused gate/up stack,) or (gate stack, up stack).
    """
    if not grouped_mm_applies(hidden_states, table, count):
        return None
    if permuted:  # grouped_mm takes [E, in, out]
        gate_up, down = [w.transpose(-2, -1) for w in gate_up], down.transpose(-2, -1)
    pairs = sort_pairs(table, experts_min, count)
    offsets = pairs.offsets()
    rows = hidden_states.index_select(0, pairs.tokens)
    try:
        projected = [torch._grouped_mm(rows, w, offs=offsets) for w in gate_up]
        gate, up = projected[0].chunk(2, dim=-1) if len(projected) == 1 else projected
        y = torch._grouped_mm(act(gate) * up, down, offs=offsets)
    except RuntimeError:  # shapes or alignment the grouped kernel does not take: use the loop
        return None
    weights = router_weights.reshape(-1)[pairs.order].float().unsqueeze(-1)
    # Rows past the last group are left unwritten by grouped_mm: select, never multiply, them away.
    contribution = torch.where(pairs.outside_sorted(), 0.0, y.float() * weights)
    per_slot = torch.empty_like(contribution).index_copy_(0, pairs.order, contribution)  # back to slot order
    return sum_slots(per_slot, *table.shape, hidden_states.dtype)


def _swiglu_expert(gate_up: Callable, down: Sequence[torch.Tensor], act, permuted: bool) -> ExpertFn:
    def expert(index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(index, x)
        return _linear(act(gate) * up, down[index], permuted)

    return expert


def _gate_and_up(stacked: torch.Tensor, inter: int, permuted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a stacked fused weight ([E, 2I, H] permuted, else [E, H, 2I])."""
    if permuted:
        return stacked[:, :inter], stacked[:, inter:]
    return stacked[..., :inter], stacked[..., inter:]


def _run(hidden_states, table, router_weights, gate_up, down, permuted: bool, activation: str, experts_min: int,
         count: int, inter: int):
    """The op's result for checked stacked weights: the Triton kernel, else grouped matmuls, else the loop.

    `gate_up` is (fused gate/up stack,) or (gate stack, up stack); every stack is [E, out, in] when
    `permuted`, else [E, in, out].
    """
    act = activation_function(activation)
    gate, up = _gate_and_up(gate_up[0], inter, permuted) if len(gate_up) == 1 else gate_up
    fused = kernels.fused_moe_cuda(
        hidden_states, table, router_weights, gate, up, down, permuted, activation, experts_min
    )
    if fused is not None:
        return fused
    grouped = _grouped_fused(hidden_states, table, router_weights, gate_up, down, permuted, act, experts_min, count)
    if grouped is not None:
        return grouped

    def project(index: int, x: torch.Tensor):
        return _linear(x, gate[index], permuted), _linear(x, up[index], permuted)

    expert = _swiglu_expert(project, down, act, permuted)
    return _combine(hidden_states, table, router_weights, experts_min, count, expert)


def _check_stack(name: str, stack: torch.Tensor, count: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A stacked weight holds one [shape] matrix per expert of the range, in the hidden dtype."""
    if stack.dim() != 3 or stack.shape[0] != count or tuple(stack.shape[1:]) != shape:
        raise MoEInputError(
            f"{name} has shape {tuple(stack.shape)}, expected {(count, *shape)} "
            "(one matrix per expert of the range experts_min..experts_max)"
        )
    if stack.dtype != dtype:
        raise MoEInputError(f"{name} is {stack.dtype}, expected the hidden dtype {dtype}")


def mixture_of_experts(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    """`.default`: separate gate (w1), up (w2) and down (w3) weights per expert."""
    act = activation_function(activation)
    _check_routing(hidden_states, expert_routing_table, router_weights)
    count = _expert_count(experts_min, experts_max)
    _check_lengths({"w1": w1, "w2": w2, "w3": w3}, count)
    hidden, dtype = hidden_states.shape[1], hidden_states.dtype
    inter = _intermediate_size("w1[0]", w1[0], hidden, permuted_weights, parts=1)
    stacks = [stacked_view(w) for w in (w1, w2, w3)]
    for name, weights, stack in (("w1", w1, stacks[0]), ("w2", w2, stacks[1])):
        _check_list(name, weights, _layout(inter, hidden, permuted_weights), dtype, stack is not None)
    _check_list("w3", w3, _layout(hidden, inter, permuted_weights), dtype, stacks[2] is not None)
    if all(stack is not None for stack in stacks):
        return _run(hidden_states, expert_routing_table, router_weights, stacks[:2], stacks[2], permuted_weights,
                    activation, experts_min, count, inter)

    def gate_up(index: int, x: torch.Tensor):
        return _linear(x, w1[index], permuted_weights), _linear(x, w2[index], permuted_weights)

    expert = _swiglu_expert(gate_up, w3, act, permuted_weights)
    return _combine(hidden_states, expert_routing_table, router_weights, experts_min, count, expert)


def _check_fused(hidden_states, w12, w3, permuted: bool, count: int, stacks=(None, None)) -> int:
    """Check the fused gate/up and down lists (`stacks`: their stacked views, if known); returns I."""
    _check_lengths({"w12": w12, "w3": w3}, count)
    hidden, dtype = hidden_states.shape[1], hidden_states.dtype
    inter = _intermediate_size("w12[0]", w12[0], hidden, permuted, parts=2)
    _check_list("w12", w12, _layout(2 * inter, hidden, permuted), dtype, stacks[0] is not None)
    _check_list("w3", w3, _layout(hidden, inter, permuted), dtype, stacks[1] is not None)
    return inter


def mixture_of_experts_fused_weights(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    """`.fused_weights`: gate and up concatenated per expert, gate first ([2I, H] when permuted)."""
    act = activation_function(activation)
    _check_routing(hidden_states, expert_routing_table, router_weights)
    count = _expert_count(experts_min, experts_max)
    _check_lengths({"w12": w12, "w3": w3}, count)
    stacks = (stacked_view(w12), stacked_view(w3))
    inter = _check_fused(hidden_states, w12, w3, permuted_weights, count, stacks)
    if stacks[0] is not None and stacks[1] is not None:
        return _run(hidden_states, expert_routing_table, router_weights, stacks[:1], stacks[1], permuted_weights,
                    activation, experts_min, count, inter)

    def gate_up(index: int, x: torch.Tensor):
        return _linear(x, w12[index], permuted_weights).chunk(2, dim=-1)

    expert = _swiglu_expert(gate_up, w3, act, permuted_weights)
    return _combine(hidden_states, expert_routing_table, router_weights, experts_min, count, expert)


# The stacked overloads: the portable target's own (the Gaudi op has none). The rewrite hands them the
# stacked parameter itself, so a call does no work per expert on the host: no list of views to build,
# check or unpack, in eager as in the code inductor generates.


def _stacked_arguments(overload: str, arguments: Sequence) -> tuple:
    """Check a stacked overload's positional arguments; returns what `_run` takes."""
    if overload == "stacked":
        hidden_states, table, router_weights, w1, w2, w3, permuted, activation, experts_min, experts_max = arguments
        gate_up, down, names = (w1, w2), w3, ("w1", "w2")
    else:
        hidden_states, table, router_weights, w12, w3, permuted, activation, experts_min, experts_max = arguments
        gate_up, down, names = (w12,), w3, ("w12",)
    activation_function(activation)
    _check_routing(hidden_states, table, router_weights)
    count = _expert_count(experts_min, experts_max)
    hidden, dtype = hidden_states.shape[1], hidden_states.dtype
    parts = 2 if len(gate_up) == 1 else 1
    inter = _intermediate_size(f"{names[0]}[e]", gate_up[0].shape[1:], hidden, permuted, parts=parts)
    for name, stack in zip(names, gate_up, strict=True):
        _check_stack(name, stack, count, _layout(parts * inter, hidden, permuted), dtype)
    _check_stack("w3", down, count, _layout(hidden, inter, permuted), dtype)
    return hidden_states, table, router_weights, gate_up, down, permuted, activation, experts_min, count, inter


def mixture_of_experts_stacked(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    """`.stacked`: `.default` with each weight role stacked [E, ...] instead of listed per expert."""
    return _run(*_stacked_arguments("stacked", (
        hidden_states, expert_routing_table, router_weights, w1, w2, w3, permuted_weights, activation,
        experts_min, experts_max)))


def mixture_of_experts_stacked_fused_weights(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: torch.Tensor,
    w3: torch.Tensor,
    permuted_weights: bool,
    activation: str,
    experts_min: int,
    experts_max: int,
) -> torch.Tensor:
    """`.stacked_fused_weights`: `.fused_weights` with stacked [E, ...] gate/up and down weights."""
    return _run(*_stacked_arguments("stacked_fused_weights", (
        hidden_states, expert_routing_table, router_weights, w12, w3, permuted_weights, activation,
        experts_min, experts_max)))


def mixture_of_experts_bias_fused_weights(
    hidden_states: torch.Tensor,
    expert_routing_table: torch.Tensor,
    router_weights: torch.Tensor,
    w12: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    w12_bias: Sequence[torch.Tensor],
    w3_bias: Sequence[torch.Tensor],
    *,
    permuted_weights: bool,
    experts_min: int,
    experts_max: int,
    chunk_size: int = 0,
    total_experts: int = 0,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """`.bias_fused_weights` (GPT-OSS): interleaved gate/up with biases, clamped alpha-sigmoid GLU.

    `chunk_size` and `total_experts` only tune the Gaudi kernel's tiling; they do not change the result.
    """
    _check_routing(hidden_states, expert_routing_table, router_weights)
    count = _expert_count(experts_min, experts_max)
    inter = _check_fused(hidden_states, w12, w3, permuted_weights, count)
    _check_lengths({"w12_bias": w12_bias, "w3_bias": w3_bias}, count)
    _check_list("w12_bias", w12_bias, (2 * inter,), hidden_states.dtype)
    _check_list("w3_bias", w3_bias, (hidden_states.shape[1],), hidden_states.dtype)

    def expert(index: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = _linear(x, w12[index], permuted_weights) + w12_bias[index]
        gate = gate_up[:, 0::2].clamp(max=limit)
        up = gate_up[:, 1::2].clamp(-limit, limit)
        glu = gate * torch.sigmoid(alpha * gate)
        return _linear((up + 1) * glu, w3[index], permuted_weights) + w3_bias[index]

    return _combine(hidden_states, expert_routing_table, router_weights, experts_min, count, expert)


def saving_forward(overload: str) -> Callable:
    """The stacked overload `overload` written as grouped matmuls, for a training graph whose activations
    are saved rather than recomputed: AOTAutograd differentiates these ops with their own formulas (the
    partitioner keeps the projections for the backward, as it does for the layer as written), instead of
    this op's recompute backward. Where the grouped path does not apply, the op itself."""
    op = getattr(OP, overload)

    def forward(*args):
        hidden_states, table, router_weights, gate_up, down, permuted, activation, experts_min, count, inter = (
            _stacked_arguments(overload, args)
        )
        result = _grouped_fused(hidden_states, table, router_weights, gate_up, down, permuted,
                                activation_function(activation), experts_min, count)
        return op(*args) if result is None else result

    forward.__name__ = f"mixture_of_experts_{overload}_saving"
    return forward


IMPLEMENTATIONS = {
    "default": mixture_of_experts,
    "fused_weights": mixture_of_experts_fused_weights,
    "bias_fused_weights": mixture_of_experts_bias_fused_weights,
    "stacked": mixture_of_experts_stacked,
    "stacked_fused_weights": mixture_of_experts_stacked_fused_weights,
}


# ---------------------------------------------------------------------------------------------------
# Registration.


def _fake(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Shape and dtype only: the output is always like hidden_states, so symbolic shapes just flow."""
    return hidden_states.new_empty(hidden_states.shape)


def plain_tensors(types) -> bool:
    """Whether a FunctionalTensorMode rule sees plain (fake or functional) tensors only, no subclass: the
    case where an op may be traced into its Triton launches."""
    return all(issubclass(t, (torch._subclasses.FakeTensor, FunctionalTensor)) or t is torch.Tensor for t in types)


def _trace_into_kernel(mode, func, types, args, kwargs):
    """AOTAutograd's functionalization of a stacked overload: on CUDA, its Triton launches.

    Registered as the overloads' FunctionalTensorMode rule (what `torch.library.triton_op` does for the
    ops it defines), so inductor receives the allocations and `wrap_triton` kernel launches instead of
    an opaque call, and launches the kernels from its generated code. Anything the kernel does not
    cover (CPU, float32, tensor subclasses) stays the opaque op.
    """
    hidden_states = args[0]
    if plain_tensors(types) and not kwargs and hidden_states.is_cuda:
        with mode:  # the functional tensors may only be used under their mode
            hidden_states, table, router_weights, gate_up, down, permuted, activation, experts_min, count, inter = (
                _stacked_arguments(func._overloadname, args)
            )
            gate, up = _gate_and_up(gate_up[0], inter, permuted) if len(gate_up) == 1 else gate_up
            if kernels.kernel_applies(hidden_states, activation, gate, up):
                return kernels.traced_fused_moe(
                    hidden_states, table, router_weights, gate, up, down, permuted, activation, experts_min
                )
    return mode.__torch_dispatch__(func, types, args, kwargs)


def _register_kernel_tracing(library: torch.library.Library) -> bool:
    """Give inductor the stacked overloads' Triton launches where this torch can (feature-detected)."""
    if not kernels.wrap_triton_available():
        return False
    for overload in STACKED_SCHEMAS:
        torch.library.register_torch_dispatch(
            f"{NAMESPACE}::mixture_of_experts.{overload}", FunctionalTensorMode, _trace_into_kernel, lib=library
        )
    return True


def _is_defined(overload: str = "") -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::mixture_of_experts", overload)
    except RuntimeError:
        return False
    return True


def _register() -> torch.library.Library | None:
    """Define the overloads with CPU and CUDA kernels and fake kernels, once per process.

    Each forward overload gets its autograd formula and backward op (op_backward.py); the stacked
    overloads also get inductor's view of the Triton kernel (`_trace_into_kernel`).
    """
    if _is_defined():
        return None  # another copy of this module already owns the definition
    library = torch.library.Library(NAMESPACE, "DEF")
    for overload, schema in {**SCHEMAS, **STACKED_SCHEMAS}.items():
        library.define(schema)
        name = "mixture_of_experts" + ("" if overload == "default" else f".{overload}")
        for device in ("CPU", "CUDA"):
            library.impl(name, IMPLEMENTATIONS[overload], device)
        torch.library.register_fake(f"{NAMESPACE}::{name}", _fake, lib=library)
    for overload, schema in op_backward.BACKWARD_SCHEMAS.items():
        library.define(schema)
        name = "mixture_of_experts_recomp_bwd" + ("" if overload == "default" else f".{overload}")
        for device in ("CPU", "CUDA"):
            library.impl(name, op_backward.BACKWARD_IMPLEMENTATIONS[overload], device)
        torch.library.register_fake(f"{NAMESPACE}::{name}", op_backward.backward_fake, lib=library)
    for overload in IMPLEMENTATIONS:
        name = "mixture_of_experts" + ("" if overload == "default" else f".{overload}")
        torch.library.register_autograd(
            f"{NAMESPACE}::{name}", op_backward.autograd_formula(overload),
            setup_context=op_backward.setup_context, lib=library,
        )
    _register_kernel_tracing(library)
    return library


# Keep the library object alive for the life of the process (dropping it unregisters the op), and
# reuse it when the module is executed again (importlib.reload).
_LIBRARY = globals().get("_LIBRARY") or _register()
OP = torch.ops.moe_passes.mixture_of_experts
