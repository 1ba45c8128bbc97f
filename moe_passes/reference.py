"""The Gaudi bridge's reference semantics of `mixture_of_experts`: the test oracle.

Written literally after the bridge's eager reference loop, and dense on purpose: the router weights
are scattered into a [T, E] table and every expert of the weight lists runs on every token, in
float32, weighted by its column of that table. It is slow and obviously right, which is what an
oracle for the portable op (and for the test double of the Gaudi op) must be. Routed ids outside
[experts_min, experts_max] land in columns no expert reads, so they contribute zero. Like the bridge,
it assumes the ids of one token are distinct (top-k never repeats an expert): scatter keeps one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The activations the fused kernel implements, by the name its `activation` argument takes: the one table
# the portable op, its Triton kernel and the reference read. "gelu" is the tanh form, as on Gaudi's TPC
# (an exact-erf GELU is not the kernel's).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"mixture_of_experts reference: unknown activation {name!r}")
    return ACTIVATIONS[name]


def padded_router_weights(table: torch.Tensor, weights: torch.Tensor, experts_max: int) -> torch.Tensor:
    """[T, E] float32 table: column e holds each token's router weight for global expert e, else 0."""
    width = experts_max + 1
    if table.numel():
        width = max(width, int(table.max()) + 1)
    padded = torch.zeros(table.shape[0], width, dtype=torch.float32, device=table.device)
    return padded.scatter_(-1, table.long(), weights.float())


def _as_in_out(weight: torch.Tensor, permuted: bool) -> torch.Tensor:
    """The weight as a float32 [in, out] matrix, whichever layout it came in."""
    return (weight.t() if permuted else weight).float()


def mixture_of_experts_reference(
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
    """Dense reference of `.default`: w1 = gate, w2 = up, w3 = down."""
    act = _activation(activation)
    x = hidden_states.float()
    padded = padded_router_weights(expert_routing_table, router_weights, experts_max)
    out = torch.zeros_like(x)
    for e in range(len(w1)):
        gate, up, down = (_as_in_out(w[e], permuted_weights) for w in (w1, w2, w3))
        column = experts_min + e
        out += (act(x @ gate) * (x @ up)) @ down * padded[:, column : column + 1]
    return out.to(hidden_states.dtype)


def _split_fused(w12, permuted: bool):
    """Gate and up halves of each fused weight, gate first: rows when permuted, else columns."""
    dim = 0 if permuted else 1
    halves = [w.chunk(2, dim=dim) for w in w12]
    return [gate for gate, _ in halves], [up for _, up in halves]


def mixture_of_experts_fused_weights_reference(
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
    """Dense reference of `.fused_weights`: split w12 into gate and up, then as `.default`."""
    w1, w2 = _split_fused(w12, permuted_weights)
    return mixture_of_experts_reference(
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
    )


def mixture_of_experts_bias_fused_weights_reference(
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
    """Dense reference of `.bias_fused_weights` (GPT-OSS): interleaved gate/up, clamped GLU, biases."""
    x = hidden_states.float()
    padded = padded_router_weights(expert_routing_table, router_weights, experts_max)
    out = torch.zeros_like(x)
    for e in range(len(w12)):
        gate_up = x @ _as_in_out(w12[e], permuted_weights) + w12_bias[e].float()
        gate = gate_up[:, 0::2].clamp(max=limit)
        up = gate_up[:, 1::2].clamp(-limit, limit)
        hidden = (up + 1) * (gate * torch.sigmoid(alpha * gate))
        y = hidden @ _as_in_out(w3[e], permuted_weights) + w3_bias[e].float()
        column = experts_min + e
        out += y * padded[:, column : column + 1]
    return out.to(hidden_states.dtype)
