"""Gaudi static-shape MoE: every expert on every token, weighted by a scattered [T, E] table.

Mirrors `StaticFusedMOE.forward` of HabanaAI/vllm-hpu-extension (`vllm_hpu_extension/ops.py`, the
Mixtral-era dense fallback later renamed into `VllmMixtureOfExpertsOp`): routing softmax(fp32) → top-k
→ renormalise → cast; `padded = zeros(B, E).scatter_(-1, ids, w).reshape(-1, B, E).permute(2, 0, 1)
.unsqueeze(-1)`; for each expert `x @ w13[e].T` → `silu(h[..., :I]) * h[..., I:]` → `@ w2[e].T`,
times `padded[e]`, accumulated into `zeros(1, B, D)` with `+=`. Weights are stacked like vLLM's
`w13_weight [E, 2I, H]` (gate rows first) and `w2_weight [E, H, I]`.

The rewrite must turn each layer into ONE `fused_weights` call (gate and up live in one tensor):
the kernel then computes only the routed tokens instead of all E experts on all tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="fused_weights")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class StaticMoE(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.num_experts = e
        self.router = Router(cfg)
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2_weight = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden_states = x.reshape(-1, shape[-1])
        tokens, width = hidden_states.shape
        routing_weights, selected_experts = self.router(hidden_states)
        final_hidden_states = torch.zeros((1, tokens, width), dtype=x.dtype, device=x.device)
        padded_weights = torch.zeros((tokens, self.num_experts), dtype=x.dtype, device=x.device)
        padded_weights.scatter_(-1, selected_experts, routing_weights)
        padded_weights = padded_weights.reshape(-1, tokens, self.num_experts)
        padded_weights = padded_weights.permute(2, 0, 1).unsqueeze(-1)
        for expert_idx in range(self.num_experts):
            padded_weight = padded_weights[expert_idx]
            current_state_static = hidden_states.reshape(-1, width)
            w_output = torch.matmul(current_state_static, self.w13_weight[expert_idx].transpose(0, 1))
            w_output = silu_and_mul(w_output)
            w_output = torch.matmul(w_output, self.w2_weight[expert_idx].transpose(0, 1))
            final_hidden_states += w_output * padded_weight
        return final_hidden_states.view(shape)


def build(**overrides):
    cfg = settings(overrides, allowed=tuple(k for k in settings({}) if k != "activation"))
    return finish(TinyDecoder(StaticMoE, cfg), cfg)
