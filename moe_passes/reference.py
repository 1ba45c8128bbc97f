"""The Gaudi bridge's reference semantics of `mixture_of_experts`, as a dense loop: the test oracle.

Dense on purpose (every expert on every token, weighted by a scattered [T, E] table), in float32,
exactly like the bridge's eager reference; the portable op must agree with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": lambda t: F.gelu(t, approximate="tanh"),
}


def _padded(table: torch.Tensor, weights: torch.Tensor, experts_max: int) -> torch.Tensor:
    width = max(experts_max + 1, int(table.max()) + 1 if table.numel() else 0)
    padded = torch.zeros(table.shape[0], width, dtype=torch.float32, device=table.device)
    return padded.scatter_(-1, table.long(), weights.float())


def _as_in_out(weight: torch.Tensor, permuted: bool) -> torch.Tensor:
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
    act = _ACTIVATIONS[activation]
    x = hidden_states.float()
    padded = _padded(expert_routing_table, router_weights, experts_max)
    out = torch.zeros_like(x)
    for e in range(len(w1)):
        gate, up, down = (_as_in_out(w[e], permuted_weights) for w in (w1, w2, w3))
        out += (act(x @ gate) * (x @ up)) @ down * padded[:, experts_min + e : experts_min + e + 1]
    return out.to(hidden_states.dtype)


def _split_fused(w12, permuted: bool):
    """Gate and up halves of each fused weight: gate rows first ([2I, H] permuted, [H, 2I] not)."""
    dim = 0 if permuted else 1
    halves = [w.chunk(2, dim=dim) for w in w12]
    return [h[0] for h in halves], [h[1] for h in halves]


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
    x = hidden_states.float()
    padded = _padded(expert_routing_table, router_weights, experts_max)
    out = torch.zeros_like(x)
    for e in range(len(w12)):
        gate_up = x @ _as_in_out(w12[e], permuted_weights) + w12_bias[e].float()
        gate, up = gate_up[:, 0::2].clamp(max=limit), gate_up[:, 1::2].clamp(-limit, limit)
        hidden = (up + 1) * (gate * torch.sigmoid(alpha * gate))
        y = hidden @ _as_in_out(w3[e], permuted_weights) + w3_bias[e].float()
        out += y * padded[:, experts_min + e : experts_min + e + 1]
    return out.to(hidden_states.dtype)
