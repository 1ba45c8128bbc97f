"""vllm-omni's LingBot-VLA 2.0 `TokenMoeBlock`, dense path: every expert on every token, einsum combine.

Mirrors YongZhuIntel/vllm-omni `vllm_omni/diffusion/models/lingbot_vla_v2/modeling_lingbot_vla_v2.py` at
commit 049203c (`TokenMoeBlock.forward`, `GroupedExperts.forward_dense`, `SharedExpertMLP`), the action
expert's token MoE, configured as `moe_implementation="dense"` (the module's documented upstream eager
path; the config field's default, read at 1e157bb of `config.py`, is "gather") with that config's other
defaults: sigmoid router, `routed_scaling_factor` 4.0, no shared-expert gate. The router runs
`F.linear(hidden_flat.float(), self.gate.weight.float())` inside `torch.amp.autocast(..., enabled=False)`,
takes a sigmoid (softmax when `router_activation` is not "sigmoid"), adds the `e_score_correction_bias`
buffer for the choice only, gathers the unbiased scores of the top-k, renormalises them (+1e-20), scales
them when the factor is not 1.0 and casts them to the input dtype. The grouped experts (stacked
`gate_proj`/`up_proj` [E, I, D] and `down_proj` [E, D, I], nn.Linear layout) run every token through
every expert with three einsums ("td,eid->eti", "eti,edi->etd"), build a [T, E] weight table as
`(F.one_hot(selected_experts, E).to(w.dtype) * routing_weights.unsqueeze(-1)).sum(dim=1)` and contract
the expert axis with `torch.einsum("etd,te->td", ...)`. The shared SwiGLU expert is added and the result
reshaped to [B, S, D]. The bias buffer is zeros as constructed (the release checkpoint loads trained
values). The real block has 32 experts, top-4, expert width 512, shared width 704.
`forward_gather` (the per-expert `torch.where` / `index_add_` loop with an empty-expert skip) and the
shared-expert gate (off in the release checkpoint) are kept behind their flags, not taken.
Left out: nothing of the block (the rest of the file is the VLM, attention and flow-matching code).
Constructs: `torch.amp.autocast(enabled=False)` around the router, a config string branch, bias-for-choice
top-k with gathered weights, stacked expert parameters used through `einsum`, a one-hot [T, k, E] table
summed to [T, E], an `einsum` combine over all experts, a shared expert.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("YongZhuIntel/vllm-omni", "vllm_omni/diffusion/models/lingbot_vla_v2/modeling_lingbot_vla_v2.py",
                "049203c46b1a72f490cbb84cf703a0107a8f3e09", "GroupedExperts.forward_dense")
HIDDEN, INTER, EXPERTS, TOP_K, SHARED_INTER = 16, 8, 8, 2, 12


class SharedExpertMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward_gather(self, hidden_flat, routing_weights, selected_experts):
        out = torch.zeros_like(hidden_flat)
        for expert in range(self.num_experts):
            token_idx, slot_idx = torch.where(selected_experts == expert)
            if token_idx.numel() == 0:
                continue
            x = hidden_flat[token_idx]
            inter = F.silu(F.linear(x, self.gate_proj[expert])) * F.linear(x, self.up_proj[expert])
            y = F.linear(inter, self.down_proj[expert])
            out.index_add_(0, token_idx, y * routing_weights[token_idx, slot_idx].unsqueeze(-1))
        return out

    def forward_dense(self, hidden_flat, routing_weights, selected_experts):
        gate = torch.einsum("td,eid->eti", hidden_flat, self.gate_proj)
        up = torch.einsum("td,eid->eti", hidden_flat, self.up_proj)
        expert_out = torch.einsum("eti,edi->etd", F.silu(gate) * up, self.down_proj)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).to(routing_weights.dtype)
        weights = (expert_mask * routing_weights.unsqueeze(-1)).sum(dim=1)
        return torch.einsum("etd,te->td", expert_out, weights.to(expert_out.dtype))


class TokenMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden_size = config.expert_hidden_size
        self.num_experts = config.token_num_experts
        self.top_k = config.token_top_k
        self.norm_topk_prob = True
        self.router_activation = config.router_activation
        self.routed_scaling_factor = config.routed_scaling_factor
        self.moe_implementation = config.moe_implementation
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts), persistent=True)
        self.gate = nn.Linear(hidden_size, self.num_experts, bias=False)
        self.experts = GroupedExperts(self.num_experts, hidden_size, config.token_moe_intermediate_size)
        self.shared_expert = SharedExpertMLP(hidden_size, config.token_shared_intermediate_size)
        self.use_shared_expert_gate = config.use_shared_expert_gate
        if self.use_shared_expert_gate:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, seq_len, hidden_dim = hidden_states.shape
        hidden_flat = hidden_states.reshape(-1, hidden_dim)

        with torch.amp.autocast(hidden_flat.device.type, enabled=False):
            router_logits = F.linear(hidden_flat.float(), self.gate.weight.float())

        if self.router_activation == "sigmoid":
            routing_scores = router_logits.sigmoid()
        else:
            routing_scores = F.softmax(router_logits, dim=1, dtype=torch.float)

        scores_for_choice = routing_scores + self.e_score_correction_bias.unsqueeze(0)
        _, selected_experts = torch.topk(scores_for_choice, self.top_k, dim=-1)
        routing_weights = routing_scores.gather(1, selected_experts)
        if self.norm_topk_prob:
            routing_weights = routing_weights / (routing_weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scaling_factor != 1.0:
            routing_weights = routing_weights * self.routed_scaling_factor
        routing_weights = routing_weights.to(hidden_states.dtype)

        if self.moe_implementation == "dense":
            routed = self.experts.forward_dense(hidden_flat, routing_weights, selected_experts)
        else:
            routed = self.experts.forward_gather(hidden_flat, routing_weights, selected_experts)

        shared = self.shared_expert(hidden_flat)
        if self.use_shared_expert_gate:
            shared = F.sigmoid(self.shared_expert_gate(hidden_flat)) * shared
        return (routed.to(hidden_flat.dtype) + shared).reshape(batch_size, seq_len, hidden_dim)


CONFIG = SimpleNamespace(
    expert_hidden_size=HIDDEN, token_num_experts=EXPERTS, token_top_k=TOP_K, token_moe_intermediate_size=INTER,
    token_shared_intermediate_size=SHARED_INTER, router_activation="sigmoid", routed_scaling_factor=4.0,
    use_shared_expert_gate=False, moe_implementation="dense")


def build():
    return tiny(lambda: TokenMoeBlock(CONFIG), HIDDEN)
