"""Grove MoE's `GroveMoeSparseMoeBlock`: two Mixtral-style expert loops, one over the routed experts and one
over the "adjugate" experts of their groups (`selected // 2`), summed as `0.05 * small + large`.

Mirrors inclusionAI/GroveMoE `src/transformers-4.51.3/src/transformers/models/qwen3_moe/modeling_qwen3_moe.py`
at commit 0b37d94 (`Qwen3MoeMLP`, `GroveMoeSparseMoeBlock`), the transformers 4.51.3 tree the repository
ships with the Grove classes added beside Qwen3-MoE's (GroveMoE is up-cycled from Qwen3-30B-A3B-Base).
The block views the tokens [T, H] and scores them with a bias-free `nn.Linear` gate. The weights come from
a float32 softmax of the logits, the choice from a separate float32 sigmoid of them: the top-k of the
sigmoid gives the experts, `selected // num_experts_per_group` (2, hard-coded) their groups, and the
softmax probabilities are gathered at the chosen experts, divided in place by their sum (always: the
config's `norm_topk_prob` is read in `__init__` but not in `forward`) and cast to the token dtype. The
`expert_bias` buffer is registered and never read. Large experts: a zero [T, H] buffer,
`one_hot(selected, E).permute(2, 1, 0)`, a loop over `range(num_experts)` with `torch.where(mask[e])` for
(slot, token) ids, `hidden[None, top_x].reshape(-1, H)`, the SwiGLU expert times
`routing_weights[top_x, idx, None]`, `index_add_` with a dtype cast; no empty-expert skip (empty experts
run on zero rows). Small (adjugate) experts: the same loop over `range(num_experts // 2)` on
`one_hot(group_selected, E // 2)`, each group's narrow SwiGLU (`parallel_expert_intermediate_size`, 128,
hard-coded) weighted by the routing weight of the chosen expert in that slot, so a token whose two chosen
experts share a group passes through that group's adjugate expert twice. The block returns
(0.05 * small + large reshaped to [B, S, H], router_logits). Tiny sizes: 8 experts in 4 groups, top-2,
expert width 8, adjugate width 4 (GroveMoE: 128 experts in 64 groups, top-8, widths 768 and 128); "silu"
kept.
Left out: the config's attention / rope fields and the `PretrainedConfig` base (a plain local class
carries the fields the layer reads), and the decoder layer's `mlp_only_layers` / `decoder_sparse_step`
choice of MoE versus dense MLP (this layer is an MoE one); nothing in the layer is distributed.
Constructs: softmax weights with a sigmoid choice, integer `//` grouping of expert ids, an in-place `/=`
normalisation, an unused registered buffer, two loops over `range(E)` and `range(E // 2)` with
`torch.where(mask)` and no empty skip, duplicate token rows in the second loop's `index_add_`, a constant
0.05 mix of the two buffers, a tuple return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "inclusionAI/GroveMoE",
    "src/transformers-4.51.3/src/transformers/models/qwen3_moe/modeling_qwen3_moe.py",
    "0b37d94962958696ac8e7ece704fcde4d6b37229",
    "GroveMoeSparseMoeBlock.forward",
)
HIDDEN, MOE_INTER, EXPERTS, TOP_K, ADJUGATE_INTER = 16, 8, 8, 2, 4


class Qwen3MoeConfig:
    """The fields the MoE layer reads (GroveMoE-Inst's values where the tiny sizes allow)."""

    def __init__(self):
        self.hidden_size = HIDDEN
        self.intermediate_size = 4 * HIDDEN
        self.moe_intermediate_size = MOE_INTER
        self.num_experts = EXPERTS
        self.num_experts_per_tok = TOP_K
        self.norm_topk_prob = True
        self.hidden_act = "silu"


class Qwen3MoeMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = (
            intermediate_size if intermediate_size is not None else config.intermediate_size
        )
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GroveMoeSparseMoeBlock(nn.Module):
    def __init__(self, config: Qwen3MoeConfig | None = None):
        super().__init__()
        config = config or Qwen3MoeConfig()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.num_experts_per_group = 2
        self.parallel_expert_intermediate_size = ADJUGATE_INTER  # 128 in the original
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))
        self.experts = nn.ModuleList(
            [
                Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size)
                for _ in range(self.num_experts)
            ]
        )
        self.chunk_experts = nn.ModuleList(
            [
                Qwen3MoeMLP(config, intermediate_size=self.parallel_expert_intermediate_size)
                for _ in range(self.num_experts // self.num_experts_per_group)
            ]
        )

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)

        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        choice_scores = torch.sigmoid(router_logits).to(torch.float)
        _, selected_experts = torch.topk(choice_scores, self.top_k, dim=-1)
        group_selected_experts = selected_experts // self.num_experts_per_group

        routing_weights = routing_weights.gather(-1, selected_experts)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        # the routed ("large") experts
        large = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = expert_layer(current_state) * routing_weights[top_x, idx, None]
            large.index_add_(0, top_x, current.to(hidden_states.dtype))

        # the adjugate ("small") experts, one per group of experts
        small = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        groups = self.num_experts // self.num_experts_per_group
        expert_mask = F.one_hot(group_selected_experts, num_classes=groups).permute(2, 1, 0)
        for expert_idx in range(groups):
            expert_layer = self.chunk_experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = expert_layer(current_state) * routing_weights[top_x, idx, None]
            small.index_add_(0, top_x, current.to(hidden_states.dtype))

        final = 0.05 * small + large
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


def build():
    return tiny(GroveMoeSparseMoeBlock, HIDDEN)
