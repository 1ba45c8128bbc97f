"""Time-MoE's TimeMoeSparseExpertsLayer: Mixtral-style one-hot mask loop plus a sigmoid-gated shared expert.

Mirrors Time-MoE/Time-MoE `time_moe/models/modeling_time_moe.py` at commit d3524fd
(`TimeMoeSparseExpertsLayer`, `TimeMoeTemporalBlock`), the decoder FFN of the Time-MoE time-series foundation
models when `use_dense` is off. Tokens are flattened to [T, H]; a bias-free nn.Linear gives the router
logits, a float32 softmax over experts is taken and its top-k probabilities kept; the `norm_topk_prob`
branch (renormalising by their sum) is hard-wired off in the constructor, as in the original, and the
weights are cast back to the input dtype. A zero [T, H] buffer is allocated and a [E, k, T] mask is built
with one_hot(...).permute(2, 1, 0). For every expert index, `torch.where(mask[e])` gives (slot, token) ids,
the tokens are gathered with `x[None, top_x].reshape(-1, H)`, run through the expert (a SwiGLU block of
width intermediate_size // top_k), scaled by `w[top_x, idx, None]`, cast to the input dtype and
`index_add_`-ed into the buffer -- with no empty-expert skip. A shared expert (a SwiGLU block of the full
intermediate_size) runs on all tokens and is scaled by sigmoid of a one-output bias-free linear gate; it is
added to the routed sum, the result is reshaped to [B, S, H] and returned with the router logits.
Left out: nothing of the forward. The config object is replaced by constructor arguments, and the
`ACT2FN[config.hidden_act]` lookup by SiLU, the default and the value in the released checkpoints
(Time-MoE-50M/200M use 8 experts, top-2). The config intermediate size is 16 here, so each routed expert is
8 wide and the shared expert 16.
Constructs: loop `for expert_idx in range(self.num_experts)` indexing an nn.ModuleList, `torch.where(mask)`
gathers with a `[None, top_x]` index, an `if self.norm_topk_prob:` in-place renormalisation branch (False),
dtype casts, `index_add_` into a preallocated buffer, a sigmoid-gated shared expert, (output, logits) return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "Time-MoE/Time-MoE",
    "time_moe/models/modeling_time_moe.py",
    "d3524fdaa5c0e83a29a6cc01828194dd870ec7b6",
    "TimeMoeSparseExpertsLayer.forward",
)
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 16, 16, 8, 2


class TimeMoeTemporalBlock(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_state):
        return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


class TimeMoeSparseExpertsLayer(nn.Module):
    def __init__(
        self,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    ):
        super().__init__()
        self.top_k = num_experts_per_tok
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.norm_topk_prob = False
        moe_intermediate_size = intermediate_size // self.top_k
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            [TimeMoeTemporalBlock(hidden_size, moe_intermediate_size) for _ in range(self.num_experts)]
        )
        self.shared_expert = TimeMoeTemporalBlock(hidden_size, intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)

        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)

        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))

        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output

        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


def build():
    return tiny(TimeMoeSparseExpertsLayer, HIDDEN)
