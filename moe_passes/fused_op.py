"""The portable twin of the Gaudi fused MoE kernel: `torch.ops.moe_passes.mixture_of_experts`.

Same overloads, schemas and semantics as `hpu::mixture_of_experts` (see the project's op contract), so
the rewrite can target it off Gaudi and every behaviour can be tested on CPU and CUDA. The kernel
computes only routed (token, expert) pairs: pairs are sorted by expert once, counted with one host
sync, and each expert that received tokens runs its MLP on exactly those rows. Fake kernels make the op
flow through dynamo, AOTAutograd and inductor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "relu")

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


def _activation(name: str):
    if name == "silu":
        return F.silu
    if name == "relu":
        return F.relu
    if name == "gelu":  # the Gaudi kernel's gelu is the tanh approximation
        return lambda t: F.gelu(t, approximate="tanh")
    raise ValueError(f"mixture_of_experts: activation must be one of {ACTIVATIONS}, got {name!r}")


def _check_inputs(hidden_states, table, router_weights, weight_lists, experts_min, experts_max):
    if hidden_states.dim() != 2:
        raise ValueError(
            f"mixture_of_experts: hidden_states must be [T, H], got {tuple(hidden_states.shape)}"
        )
    if table.dim() != 2 or table.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"mixture_of_experts: expert_routing_table must be [T, k] with T={hidden_states.shape[0]}, "
            f"got {tuple(table.shape)}"
        )
    if table.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"mixture_of_experts: expert_routing_table must be int64 or int32, got {table.dtype}"
        )
    if router_weights.shape != table.shape:
        raise ValueError(
            f"mixture_of_experts: router_weights {tuple(router_weights.shape)} must match the routing table "
            f"{tuple(table.shape)}"
        )
    count = experts_max - experts_min + 1
    if count < 1:
        raise ValueError(f"mixture_of_experts: empty expert range [{experts_min}, {experts_max}]")
    for name, weights in weight_lists.items():
        if len(weights) != count:
            raise ValueError(
                f"mixture_of_experts: {name} holds {len(weights)} experts but the range "
                f"[{experts_min}, {experts_max}] holds {count}"
            )
        shapes = {tuple(w.shape) for w in weights}
        if len(shapes) != 1 or len(next(iter(shapes))) not in (1, 2):
            raise ValueError(
                f"mixture_of_experts: every tensor of {name} must share one 2-D shape, got {shapes}"
            )


def _routed_groups(table: torch.Tensor, router_weights: torch.Tensor, experts_min: int, count: int):
    """Yield (local expert, token rows, weights) for each expert in range that received tokens."""
    top_k = table.shape[1]
    local = table.reshape(-1).long() - experts_min
    in_range = (local >= 0) & (local < count)
    slots = torch.nonzero(in_range).squeeze(-1)
    local = local[slots]
    order = torch.argsort(local, stable=True)
    slots, local = slots[order], local[order]
    counts = torch.bincount(local, minlength=count).tolist()  # the one host sync
    flat_weights = router_weights.reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            chosen = slots[start : start + n]
            yield expert, chosen // top_k, flat_weights[chosen]
        start += n


def _linear(x: torch.Tensor, weight: torch.Tensor, permuted: bool) -> torch.Tensor:
    """x @ W with W given [out, in] (permuted) or [in, out]."""
    return F.linear(x, weight) if permuted else x @ weight


def _run(hidden_states, table, router_weights, experts_min, experts_max, expert_fn):
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    count = experts_max - experts_min + 1
    for expert, rows, weights in _routed_groups(table, router_weights, experts_min, count):
        y = expert_fn(expert, hidden_states[rows])
        out.index_add_(0, rows, y.float() * weights.float().unsqueeze(-1))
    return out.to(hidden_states.dtype)


def mixture_of_experts(
    hidden_states,
    expert_routing_table,
    router_weights,
    w1,
    w2,
    w3,
    permuted_weights,
    activation,
    experts_min,
    experts_max,
):
    act = _activation(activation)
    _check_inputs(
        hidden_states,
        expert_routing_table,
        router_weights,
        {"w1": w1, "w2": w2, "w3": w3},
        experts_min,
        experts_max,
    )

    def expert(e, x):
        gate = _linear(x, w1[e], permuted_weights)
        up = _linear(x, w2[e], permuted_weights)
        return _linear(act(gate) * up, w3[e], permuted_weights)

    return _run(hidden_states, expert_routing_table, router_weights, experts_min, experts_max, expert)


def mixture_of_experts_fused_weights(
    hidden_states,
    expert_routing_table,
    router_weights,
    w12,
    w3,
    permuted_weights,
    activation,
    experts_min,
    experts_max,
):
    act = _activation(activation)
    _check_inputs(
        hidden_states, expert_routing_table, router_weights, {"w12": w12, "w3": w3}, experts_min, experts_max
    )

    def expert(e, x):
        gate, up = _linear(x, w12[e], permuted_weights).chunk(2, dim=-1)
        return _linear(act(gate) * up, w3[e], permuted_weights)

    return _run(hidden_states, expert_routing_table, router_weights, experts_min, experts_max, expert)


def mixture_of_experts_bias_fused_weights(
    hidden_states,
    expert_routing_table,
    router_weights,
    w12,
    w3,
    w12_bias,
    w3_bias,
    *,
    permuted_weights,
    experts_min,
    experts_max,
    chunk_size=0,
    total_experts=0,
    alpha=1.702,
    limit=7.0,
):
    _check_inputs(
        hidden_states,
        expert_routing_table,
        router_weights,
        {"w12": w12, "w3": w3, "w12_bias": w12_bias, "w3_bias": w3_bias},
        experts_min,
        experts_max,
    )

    def expert(e, x):
        gate_up = _linear(x, w12[e], permuted_weights) + w12_bias[e]
        gate, up = gate_up[:, 0::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
        glu = gate * torch.sigmoid(alpha * gate)
        return _linear((up + 1) * glu, w3[e], permuted_weights) + w3_bias[e]

    return _run(hidden_states, expert_routing_table, router_weights, experts_min, experts_max, expert)


IMPLEMENTATIONS = {
    "default": mixture_of_experts,
    "fused_weights": mixture_of_experts_fused_weights,
    "bias_fused_weights": mixture_of_experts_bias_fused_weights,
}


def _fake(hidden_states, *args, **kwargs):
    return hidden_states.new_empty(hidden_states.shape)


def _register() -> torch.library.Library:
    library = torch.library.Library("moe_passes", "DEF")
    for overload, schema in SCHEMAS.items():
        library.define(schema)
        qualified = "moe_passes::mixture_of_experts" + ("" if overload == "default" else f".{overload}")
        for device in ("CPU", "CUDA"):
            library.impl(qualified.split("::")[1], IMPLEMENTATIONS[overload], device)
        torch.library.register_fake(qualified, _fake, lib=library)
    return library


_LIBRARY = _register()
OP = torch.ops.moe_passes.mixture_of_experts
