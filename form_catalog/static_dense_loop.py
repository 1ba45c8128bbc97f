"""Gaudi static-shape MoE: every expert on every token, weighted by a scattered [T, E] table.

Mirrors HabanaAI/vllm-hpu-extension `vllm_hpu_extension/ops.py` at commit e1db53b9 (2025-01-22, the
last one holding it; #81 replaced it by the fused `DynamicFusedMOE`): `StaticFusedMOE.forward` with
`calculate_routing_tensors`, `MoeMatmul.forward` and `silu_and_mul`. Routing is softmax(fp32) → top-k
→ renormalise → cast; `padded = zeros(B, E).scatter_(-1, ids, w).reshape(-1, B, E).permute(2, 0, 1)
.unsqueeze(-1)`; for each expert `x @ w13[e].T` → `silu(h[..., :I]) * h[..., I:]` → `@ w2[e].T`, times
`padded[e]`, accumulated into `zeros(1, B, D)` with `+=`. Weights are stacked like vLLM's
`w13_weight [E, 2I, H]` (gate rows first) and `w2_weight [E, H, I]`; the source hard-codes SiLU, so
this form takes no `activation` override.

The rewrite must turn each layer into ONE `fused_weights` call with w12 = w13_weight[e] and
w3 = w2_weight[e], as `VllmMixtureOfExpertsOp.forward` does by hand (same file; vendored into
vllm-project/vllm-gaudi `vllm_gaudi/extension/ops.py` at 091bbad): the kernel then computes the routed
tokens only, instead of all E experts on all tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="fused_weights")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM's gated activation on a concatenated [..., 2I] projection: silu(gate half) * up half."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def expert_matmul(state: torch.Tensor, stacked: torch.Tensor, expert_id: int) -> torch.Tensor:
    """`MoeMatmul.forward`: one expert's [out, in] slice of a stacked weight, applied as state @ W.T."""
    return torch.matmul(state, stacked[expert_id].transpose(0, 1))


class StaticMoE(nn.Module):
    """`StaticFusedMOE` with its router and the stacked weights it is handed, in one module."""

    def __init__(self, cfg: dict):
        super().__init__()
        e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.num_experts = e
        self.router = Router(cfg)
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2_weight = nn.Parameter(torch.empty(e, h, i))

    def padded_routing_weights(self, ids, weights, hidden_states: torch.Tensor) -> torch.Tensor:
        """[E, 1, T, 1]: expert e's routing weight per token (zero where e was not chosen)."""
        tokens = hidden_states.shape[0]
        padded = torch.zeros(
            (tokens, self.num_experts), dtype=hidden_states.dtype, device=hidden_states.device
        )
        padded.scatter_(-1, ids, weights)
        padded = padded.reshape(-1, tokens, self.num_experts)
        return padded.permute(2, 0, 1).unsqueeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden_states = x.reshape(-1, shape[-1])
        tokens, width = hidden_states.shape
        routing_weights, selected_experts = self.router(hidden_states)
        final_hidden_states = torch.zeros((1, tokens, width), dtype=x.dtype, device=x.device)
        padded_weights = self.padded_routing_weights(selected_experts, routing_weights, hidden_states)
        for expert_idx in range(self.num_experts):
            padded_weight = padded_weights[expert_idx]
            current_state_static = hidden_states.reshape(-1, width)
            w_output = expert_matmul(current_state_static, self.w13_weight, expert_idx)
            w_output = silu_and_mul(w_output)
            w_output = expert_matmul(w_output, self.w2_weight, expert_idx)
            final_hidden_states += w_output * padded_weight
        return final_hidden_states.view(shape)


def build(**overrides):
    """(TinyDecoder of StaticMoE layers, (x [1, T, H],)); all `_common.DEFAULTS` but `activation`."""
    cfg = settings(overrides, exclude=("activation",))
    return finish(TinyDecoder(StaticMoE, cfg), cfg)
