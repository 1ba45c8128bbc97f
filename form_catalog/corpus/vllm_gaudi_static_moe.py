"""The Gaudi vLLM plugin's pure-PyTorch "static MoE": softmax/top-k routing scattered into a dense
[tokens, experts] weight table, then a Python loop over EVERY expert that runs all tokens through it and scales
the result by that expert's column of the table (zero for tokens that did not pick it).

Mirrors HabanaAI/vllm-hpu-extension `vllm_hpu_extension/ops.py` at commit
e1db53b906a3b11dae46aa18a79804aeec2f90b5 (the last commit holding `StaticFusedMOE`; the next one, 87ab1b8
"Add HPU fp8 DynamicMOE Op", dropped it; the extension later moved into vllm-project/vllm-gaudi as
`vllm_gaudi/extension/ops.py`, whose `VllmMixtureOfExpertsOp` / `DynamicFusedMOE` only call
`torch.ops.hpu.mixture_of_experts`). Mirrored: `silu_and_mul`, `MoeMatmul` (`forward` is
`torch.matmul(state, w[expert_id].transpose(0, 1))` on the stacked weight passed in, not on a weight of its own),
`calculate_routing_tensors` (softmax in float32 over dim 1, `torch.topk`, in-place `/=` renormalisation, cast back
to the hidden dtype) and `StaticFusedMOE.forward`. Of the two MoE classes in that file this is the one that does
not call `torch.ops.hpu.*`; its sibling `DynamicFusedMOE` does (the fused `mixture_of_experts` op), and was left
out. `htorch.core.mark_step()` (a Habana lazy-mode graph break between routing and the loop) was left out.
The module holding the weights and the gate is a stand-in for vLLM's `FusedMoE` layer and a Mixtral-style
caller (not part of this repository): a bias-free `nn.Linear` gate on `view(-1, hidden)` tokens, stacked
`w13_weight` [E, 2I, D] (gate and up projections concatenated) and `w2_weight` [E, D, I], passed to the op as
`(hidden_states, w1, w2, score, topk)` the way vLLM's HPU fused-MoE method does, and the result viewed back to
the input shape. Left out: vLLM itself, weight loading, tensor parallelism / all-reduce, fp8 paths.
Constructs: float32 softmax with `dtype=`, topk, in-place `/=`, `torch.zeros` + `scatter_` into a padded
[B, E] weight table, `reshape(-1, B, E).permute(2, 0, 1).unsqueeze(-1)` to [E, 1, B, 1], a Python `for` over all
experts indexing the stacked weights with a Python int, `matmul` with a transposed expert slice, a half-split
`silu_and_mul`, broadcast multiply by the padded weight, in-place `+=` into a [1, B, D] accumulator, final
`view(-1, D)`. Dense: every expert computes every token; nothing data-dependent reaches Python.
Sizes: hidden 16, intermediate 8, 8 experts, top-2, 7 tokens, one layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("HabanaAI/vllm-hpu-extension", "vllm_hpu_extension/ops.py",
                "e1db53b906a3b11dae46aa18a79804aeec2f90b5", "StaticFusedMOE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class MoeMatmul(torch.nn.Module):

    def __init__(self):
        super().__init__()

    def set_weight(self, w):
        self.weight = w

    def forward(self, state, expert_id, w):
        return torch.matmul(state, w[expert_id].transpose(0, 1))


def calculate_routing_tensors(score, topk, hidden_states_dtype):
    routing_weights = F.softmax(score, dim=1, dtype=torch.float32)
    routing_weights, selected_experts = torch.topk(routing_weights, topk, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states_dtype)
    return routing_weights, selected_experts


class StaticFusedMOE(torch.nn.Module):

    def __init__(self, num_total_experts):
        super().__init__()
        self.w13_list = torch.nn.ModuleList([MoeMatmul() for _ in range(num_total_experts)])
        self.w2_list = torch.nn.ModuleList([MoeMatmul() for _ in range(num_total_experts)])
        self.num_total_experts = num_total_experts

    def forward(self, hidden_states, w1, w2, score, topk):
        B, D = hidden_states.shape
        routing_weights, selected_experts = calculate_routing_tensors(score, topk, hidden_states.dtype)
        final_hidden_states = torch.zeros((1, B, D), dtype=hidden_states.dtype, device=hidden_states.device)
        padded_weights = torch.zeros((B, self.num_total_experts), dtype=hidden_states.dtype,
                                     device=hidden_states.device)
        padded_weights.scatter_(-1, selected_experts, routing_weights)
        padded_weights = padded_weights.reshape(-1, B, self.num_total_experts)
        padded_weights = padded_weights.permute(2, 0, 1).unsqueeze(-1)
        # (htorch.core.mark_step() here in the original: a Habana lazy-mode graph break)

        for expert_idx in range(self.num_total_experts):
            padded_weight = padded_weights[expert_idx]
            current_state_static = hidden_states.reshape(-1, D)
            w_output = self.w13_list[expert_idx](current_state_static, expert_idx, w1)
            w_output = silu_and_mul(w_output)
            w_output = self.w2_list[expert_idx](w_output, expert_idx, w2)
            current_hidden_states_static = w_output * padded_weight
            final_hidden_states += current_hidden_states_static

        return final_hidden_states.view(-1, D)


class HPUMixtralMoE(nn.Module):
    """Stand-in for vLLM's Mixtral MoE + `FusedMoE` layer on HPU: gate, stacked expert weights, static MoE op."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=INTER, num_experts=EXPERTS, top_k=TOP_K):
        super().__init__()
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.hpu_static_fused_moe = StaticFusedMOE(num_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_size)
        router_logits = self.gate(hidden_states)
        final_hidden_states = self.hpu_static_fused_moe(hidden_states, self.w13_weight, self.w2_weight,
                                                        router_logits, self.top_k)
        return final_hidden_states.view(orig_shape)


def build():
    return tiny(HPUMixtralMoE, HIDDEN)
