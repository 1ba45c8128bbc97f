"""The portable twin of the Gaudi fused MoE kernel: `torch.ops.moe_passes.mixture_of_experts`.

Why it exists: off Gaudi there is no `torch.ops.hpu.mixture_of_experts`, yet the rewrite must still
have a target, and every behaviour of the rewrite must be testable on CPU and CUDA. This op has the
same overloads, schemas and semantics as the bridge's (see the project's op contract), so a graph
rewritten for one runs on the other.

The kernel computes only routed (token, expert) pairs: the pairs are sorted by expert once, counted
with one host sync, and each expert that received tokens runs its MLP on exactly those rows; the
weighted results are summed in float32. Fake kernels let the op flow through dynamo, AOTAutograd and
inductor as one opaque, functional call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from . import kernels, reference

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


def _intermediate_size(name: str, weight: torch.Tensor, hidden: int, permuted: bool, parts: int) -> int:
    """The intermediate size I read off the first gate (or fused gate/up) weight."""
    if weight.dim() != 2:
        raise MoEInputError(f"{name}[0] must be 2-D, got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape if permuted else weight.shape[::-1]
    if in_features != hidden or out_features % parts:
        layout = "[out, in]" if permuted else "[in, out]"
        raise MoEInputError(
            f"{name}[0] has shape {tuple(weight.shape)}; with permuted_weights={permuted} it must be "
            f"{layout} with in = hidden size {hidden}" + (" and an even out size" if parts > 1 else "")
        )
    return out_features // parts


# ---------------------------------------------------------------------------------------------------
# The kernel: group the routed pairs by expert, run each routed expert once on its rows.


def _routed_groups(
    table: torch.Tensor, router_weights: torch.Tensor, experts_min: int, count: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(local expert, pair slots, router weights) for each expert of the range that received tokens.

    A slot is token * top_k + position in the token's routing row.

    Ids outside the range go to one extra bucket that is never run, so nothing but the counts
    leaves the device.
    """
    local = table.reshape(-1).long() - experts_min
    outside = (local < 0) | (local >= count)
    local = local.masked_fill(outside, count)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=count + 1).tolist()  # the one host sync
    flat_weights = router_weights.reshape(-1)
    start = 0
    for expert, routed in enumerate(counts[:count]):
        if routed:
            slots = order[start : start + routed]
            yield expert, slots, flat_weights[slots]
        start += routed


def _linear(x: torch.Tensor, weight: torch.Tensor, permuted: bool) -> torch.Tensor:
    """x @ W for W stored [out, in] (permuted) or [in, out]."""
    return F.linear(x, weight) if permuted else x @ weight


def _sum_slots(per_slot: torch.Tensor, tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T * k, H] float32 contributions in slot order -> [T, H]: a plain reduction over k.

    Cheaper than `index_add_` into [T, H] (serial on CPU, atomic on CUDA) and the same float32 sum.
    """
    return per_slot.view(tokens, top_k, per_slot.shape[-1]).sum(1).to(dtype)


def _combine(hidden_states, table, router_weights, experts_min: int, count: int, expert: ExpertFn):
    """sum over routed pairs of router_weight * expert(x), accumulated in float32."""
    tokens, top_k = table.shape
    per_slot = torch.zeros(tokens * top_k, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
    for index, slots, weights in _routed_groups(table, router_weights, experts_min, count):
        y = expert(index, hidden_states.index_select(0, slots // top_k))
        per_slot[slots] = y.float() * weights.float().unsqueeze(-1)
    return _sum_slots(per_slot, tokens, top_k, hidden_states.dtype)


# The grouped path: when the per-expert weights are views of one stacked tensor (what the rewrite
# emits: `unbind` of a stacked parameter), the stacked tensor is recovered without a copy and all
# experts run in two grouped matmuls, with no host sync. Used on CUDA (where the Triton kernel does not
# apply) and CPU; the loop above is the fallback.
GROUPED_DEVICES = {"cuda", "cpu"}
GROUPED_DTYPES = {"cuda": (torch.bfloat16,), "cpu": (torch.bfloat16, torch.float32)}  # what each device's
# torch._grouped_mm takes
# On CPU the grouped path wins while experts get few rows each, the loop of plain matmuls beyond
# (timed with 8 experts, top-2, float32, 2 threads: 16 rows 1.41 vs 1.70 ms, 64 rows 15.0 vs 15.9 ms,
# 512 rows 25.9 vs 18.4 ms per call).
CPU_GROUPED_MAX_ROWS = 128


def _stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The [E, ...] tensor that `tensors` are consecutive equal-stride slices of, or None.

    Cheap enough to run on every call with E = 128 lists: addresses first (an integer each), then one
    metadata comparison per tensor. The strided view is taken over the first tensor's storage, whose
    bounds torch checks, so tensors that merely lie evenly spaced in memory are never read as one.
    """
    first = tensors[0]
    pointers = [t.data_ptr() for t in tensors]
    step = pointers[1] - pointers[0] if len(tensors) > 1 else first.numel() * first.element_size()
    if step <= 0 or step % first.element_size() or pointers != list(range(pointers[0], pointers[-1] + 1, step)):
        return None
    shape, strides, dtype = first.shape, first.stride(), first.dtype
    if not all(t.shape == shape and t.stride() == strides and t.dtype == dtype for t in tensors):
        return None
    try:
        return first.as_strided(
            (len(tensors), *shape), (step // first.element_size(), *strides), first.storage_offset()
        )
    except RuntimeError:  # past the end of the first tensor's storage: separate allocations
        return None


def _grouped_fused(
    hidden_states, table, router_weights, w12, w3, permuted: bool, act, experts_min: int, count: int
):
    """`.fused_weights` with two grouped matmuls, or None when this path does not apply."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if (
        grouped_mm is None
        or hidden_states.device.type not in GROUPED_DEVICES
        or hidden_states.dtype not in GROUPED_DTYPES.get(hidden_states.device.type, ())
    ):
        return None
    if hidden_states.device.type == "cpu" and table.numel() > CPU_GROUPED_MAX_ROWS * count:
        return None  # many rows per expert: the loop's plain matmuls are faster on CPU
    gate_up, down = _stacked_view(w12), _stacked_view(w3)
    if gate_up is None or down is None:
        return None
    if permuted:  # grouped_mm takes [E, in, out]
        gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    top_k = table.shape[1]
    local = table.reshape(-1).long() - experts_min
    outside = (local < 0) | (local >= count)
    local = local.masked_fill(outside, count)  # out-of-range pairs sort last, past every group
    order = torch.argsort(local, stable=True)
    offsets = torch.cumsum(torch.bincount(local, minlength=count + 1)[:count], 0, dtype=torch.int32)
    rows = order // top_k
    try:
        h = grouped_mm(hidden_states.index_select(0, rows), gate_up, offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        y = grouped_mm(act(gate) * up, down, offs=offsets)
    except RuntimeError:  # shapes or alignment the grouped kernel does not take: use the loop
        return None
    weights = router_weights.reshape(-1)[order].float().unsqueeze(-1)
    # Rows past the last group are left unwritten by grouped_mm: select, never multiply, them away.
    contribution = torch.where(outside[order].unsqueeze(-1), 0.0, y.float() * weights)
    per_slot = torch.empty_like(contribution).index_copy_(0, order, contribution)  # back to slot order
    return _sum_slots(per_slot, *table.shape, hidden_states.dtype)


def _swiglu_expert(gate_up: Callable, down: Sequence[torch.Tensor], act, permuted: bool) -> ExpertFn:
    def expert(index: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up(index, x)
        return _linear(act(gate) * up, down[index], permuted)

    return expert


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
    inter = _intermediate_size("w1", w1[0], hidden, permuted_weights, parts=1)
    stacks = [_stacked_view(w) for w in (w1, w2, w3)] if hidden_states.is_cuda else [None] * 3
    for name, weights, stack in (("w1", w1, stacks[0]), ("w2", w2, stacks[1])):
        _check_list(name, weights, _layout(inter, hidden, permuted_weights), dtype, stack is not None)
    _check_list("w3", w3, _layout(hidden, inter, permuted_weights), dtype, stacks[2] is not None)
    if all(stack is not None for stack in stacks):
        fused = kernels.fused_moe_cuda(
            hidden_states, expert_routing_table, router_weights, *stacks, permuted_weights, activation,
            experts_min,
        )
        if fused is not None:
            return fused

    def gate_up(index: int, x: torch.Tensor):
        return _linear(x, w1[index], permuted_weights), _linear(x, w2[index], permuted_weights)

    expert = _swiglu_expert(gate_up, w3, act, permuted_weights)
    return _combine(hidden_states, expert_routing_table, router_weights, experts_min, count, expert)


def _check_fused(hidden_states, w12, w3, permuted: bool, count: int, stacks=(None, None)) -> int:
    """Check the fused gate/up and down lists (`stacks`: their stacked views, if known); returns I."""
    _check_lengths({"w12": w12, "w3": w3}, count)
    hidden, dtype = hidden_states.shape[1], hidden_states.dtype
    inter = _intermediate_size("w12", w12[0], hidden, permuted, parts=2)
    _check_list("w12", w12, _layout(2 * inter, hidden, permuted), dtype, stacks[0] is not None)
    _check_list("w3", w3, _layout(hidden, inter, permuted), dtype, stacks[1] is not None)
    return inter


def _gate_and_up(stacked: torch.Tensor, inter: int, permuted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a stacked fused weight ([E, 2I, H] permuted, else [E, H, 2I])."""
    if permuted:
        return stacked[:, :inter], stacked[:, inter:]
    return stacked[..., :inter], stacked[..., inter:]


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
    stacks = (_stacked_view(w12), _stacked_view(w3)) if hidden_states.is_cuda else (None, None)
    inter = _check_fused(hidden_states, w12, w3, permuted_weights, count, stacks)
    if stacks[0] is not None and stacks[1] is not None:
        fused = kernels.fused_moe_cuda(
            hidden_states,
            expert_routing_table,
            router_weights,
            *_gate_and_up(stacks[0], inter, permuted_weights),
            stacks[1],
            permuted_weights,
            activation,
            experts_min,
        )
        if fused is not None:
            return fused
    grouped = _grouped_fused(
        hidden_states,
        expert_routing_table,
        router_weights,
        w12,
        w3,
        permuted_weights,
        act,
        experts_min,
        count,
    )
    if grouped is not None:
        return grouped

    def gate_up(index: int, x: torch.Tensor):
        return _linear(x, w12[index], permuted_weights).chunk(2, dim=-1)

    expert = _swiglu_expert(gate_up, w3, act, permuted_weights)
    return _combine(hidden_states, expert_routing_table, router_weights, experts_min, count, expert)


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


IMPLEMENTATIONS = {
    "default": mixture_of_experts,
    "fused_weights": mixture_of_experts_fused_weights,
    "bias_fused_weights": mixture_of_experts_bias_fused_weights,
}


# ---------------------------------------------------------------------------------------------------
# Registration.


def _fake(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Shape and dtype only: the output is always like hidden_states, so symbolic shapes just flow."""
    return hidden_states.new_empty(hidden_states.shape)


def _is_defined(overload: str = "") -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::mixture_of_experts", overload)
    except RuntimeError:
        return False
    return True


def _register() -> torch.library.Library | None:
    """Define the three overloads with CPU and CUDA kernels and fake kernels, once per process."""
    if _is_defined():
        return None  # another copy of this module already owns the definition
    library = torch.library.Library(NAMESPACE, "DEF")
    for overload, schema in SCHEMAS.items():
        library.define(schema)
        name = "mixture_of_experts" + ("" if overload == "default" else f".{overload}")
        for device in ("CPU", "CUDA"):
            library.impl(name, IMPLEMENTATIONS[overload], device)
        torch.library.register_fake(f"{NAMESPACE}::{name}", _fake, lib=library)
    return library


# Keep the library object alive for the life of the process (dropping it unregisters the op), and
# reuse it when the module is executed again (importlib.reload).
_LIBRARY = globals().get("_LIBRARY") or _register()
OP = torch.ops.moe_passes.mixture_of_experts
