"""AFMoE (Arcee Trinity) as first merged into transformers: a sorted dispatch walked by unique_consecutive counts.

Mirrors huggingface/transformers `src/transformers/models/afmoe/modeling_afmoe.py` at commit cac0a28
("Add afmoe model (#42168)", the commit that brought Arcee's AFMoE, the architecture of the Trinity models,
into transformers), read from a snapshot of the AutumnAurelium/transformers fork whose history holds that
upstream commit (the transformers snapshot itself is over the size limit), next to `configuration_afmoe.py`
at the same commit. The `modeling_afmoe.py` remote code of the arcee-ai hub repositories is not among the
stored copies. Read: `AfmoeMLP`, `AfmoeTokenChoiceRouter`, `AfmoeExperts` (`__init__`, `forward`),
`AfmoeMoE` (`__init__`, `forward`), and how `AfmoeDecoderLayer` calls it (`pre_mlp_layernorm`, the MoE,
`post_mlp_layernorm`, then the residual).
The router flattens [B, S, H] to [T, H], scores it with its bias-free `gate` Linear cast to float32 and a
sigmoid, picks the top-k of `scores + expert_bias` (the bias steers the choice only), gathers the unbiased
scores, divides them by their sum + 1e-20 and multiplies by `route_scale`. The MoE block views the tokens
flat, routes, views weights and ids back to [B, S, k], runs the shared expert (`moe_intermediate_size *
num_shared_experts` wide) on the flat tokens and views it back, and adds the routed output, which
`AfmoeExperts` -- an `nn.ModuleList` subclass with its own `forward` -- computes from the [B, S, H] input:
it returns `new_zeros` at once `if seq_len == 0`; otherwise it repeats each token's row index k times
(`arange(T).repeat_interleave(k)`), flattens ids and weights, orders all three by a stable `argsort` of the
ids, gathers the token rows with `index_select`, and walks
    zip(unique_ids.tolist(), counts.tolist())      # torch.unique_consecutive(ids, return_counts=True)
skipping `if count == 0: continue` (never true: unique ids have counts of at least one), running
`self[expert_id]` on the contiguous slice and writing it back into a `zeros_like` buffer by slice
assignment; the buffer is scaled by the sorted weights in float32, cast back, and `scatter_add_`ed into a
[T, H] zero tensor at the token indices expanded over H. Experts and the shared expert are
`down(act(gate(x)) * up(x))` with `ACT2FN["silu"]`, here `nn.SiLU`. `expert_bias` is a frozen parameter
(`requires_grad=False`, zeros at init; the shell draws it like any other weight, so it matters here).
Tiny sizes: 8 experts, top-2, two shared experts (the config's default count), `route_scale` 1.0 (the
default); the config's defaults are 64 experts, top-6.
Left out: the decoder's pre/post MLP RMSNorms and the `PretrainedConfig` base (a plain local class carries
the fields the layer reads). Nothing in the layer is distributed or a custom kernel.
Constructs: an `nn.ModuleList` subclass with a `forward` indexed as `self[expert_id]`, an early return on
`seq_len == 0`, `repeat_interleave` token ids, stable argsort reordering of ids / tokens / weights,
`index_select` gather, `unique_consecutive(return_counts=True)` read to the host with `.tolist()` and walked
by `zip`, `if count == 0: continue`, host-int slice bounds and slice assignment into a buffer, float32
weighting, `scatter_add_` combine over `expand_as` indices, a frozen bias parameter steering the choice only,
a shared expert, 3D [B, S, k] routing tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "huggingface/transformers",
    "src/transformers/models/afmoe/modeling_afmoe.py",
    "cac0a28c83cf87b7a05495de3177099c635ba852",
    "AfmoeExperts.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


class AfmoeConfig:
    """The MoE fields of AfmoeConfig the layer reads."""

    def __init__(
        self,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        moe_intermediate_size=INTER,
        hidden_act="silu",
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        num_shared_experts=SHARED,
        route_scale=1.0,
    ):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.moe_intermediate_size, self.hidden_act = moe_intermediate_size, hidden_act
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.num_shared_experts, self.route_scale = num_shared_experts, route_scale


class AfmoeMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class AfmoeTokenChoiceRouter(nn.Module):
    """Sigmoid token-choice top-k; the expert bias only steers which experts are picked."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.route_scale = config.route_scale
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)

    def forward(self, hidden_states: torch.Tensor, expert_bias: torch.Tensor):
        _, _, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        scores = torch.sigmoid(self.gate(hidden_states).to(torch.float32))
        _, selected_experts = torch.topk(scores + expert_bias, k=self.top_k, dim=1)
        top_scores = scores.gather(dim=1, index=selected_experts)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        top_scores = top_scores * self.route_scale
        return top_scores, selected_experts


class AfmoeExperts(nn.ModuleList):
    """The routed experts as a ModuleList that also knows how to dispatch to itself."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        for _ in range(self.num_experts):
            self.append(AfmoeMLP(config, intermediate_size=config.moe_intermediate_size))

    def forward(
        self, hidden_states: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor
    ):
        """hidden_states [B, S, H]; selected_experts and routing_weights [B, S, k]."""
        batch_size, seq_len, hidden_dim = hidden_states.shape
        if seq_len == 0:
            return hidden_states.new_zeros(batch_size, 0, hidden_dim)
        hidden_states_flat = hidden_states.view(-1, hidden_dim)
        top_k = selected_experts.shape[-1]

        # One row per (token, choice), so the experts can be visited in order.
        token_indices = torch.arange(
            hidden_states_flat.shape[0], device=hidden_states.device, dtype=torch.long
        ).repeat_interleave(top_k)
        expert_indices = selected_experts.reshape(-1)
        routing_weights = routing_weights.reshape(-1)

        sorting = torch.argsort(expert_indices, stable=True)
        token_indices = token_indices[sorting]
        expert_indices = expert_indices[sorting]
        routing_weights = routing_weights[sorting]

        dispatched_tokens = hidden_states_flat.index_select(0, token_indices)
        expert_outputs = torch.zeros_like(dispatched_tokens)

        unique_experts, counts = torch.unique_consecutive(expert_indices, return_counts=True)
        start = 0
        for expert_id, count in zip(unique_experts.tolist(), counts.tolist()):  # noqa: B905 - as written
            if count == 0:
                continue
            end = start + count
            expert_outputs[start:end] = self[expert_id](dispatched_tokens[start:end])
            start = end

        weighted_outputs = (expert_outputs.to(torch.float32) * routing_weights.unsqueeze(-1)).to(
            hidden_states.dtype
        )
        aggregated = torch.zeros_like(hidden_states_flat)
        scatter_indices = token_indices.unsqueeze(-1).expand_as(weighted_outputs)
        aggregated.scatter_add_(0, scatter_indices, weighted_outputs)
        return aggregated.view(batch_size, seq_len, hidden_dim)


class AfmoeMoE(nn.Module):
    """Routed experts plus always-on shared experts."""

    def __init__(self, config=None):
        super().__init__()
        config = config or AfmoeConfig()
        self.config = config
        self.router = AfmoeTokenChoiceRouter(config)
        self.shared_experts = AfmoeMLP(config, config.moe_intermediate_size * config.num_shared_experts)
        self.experts = AfmoeExperts(config)
        self.expert_bias = nn.Parameter(
            torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, hidden_states):
        batch_size, seq_len, hidden_dim = hidden_states.shape
        hidden_states_flat = hidden_states.view(-1, hidden_dim)

        top_scores, selected_experts = self.router(hidden_states, self.expert_bias)
        top_scores = top_scores.view(batch_size, seq_len, self.config.num_experts_per_tok)
        selected_experts = selected_experts.view(batch_size, seq_len, self.config.num_experts_per_tok)

        shared_output = self.shared_experts(hidden_states_flat).view(batch_size, seq_len, hidden_dim)
        routed_output = self.experts(hidden_states, selected_experts, top_scores)
        return shared_output + routed_output


def build():
    return tiny(AfmoeMoE, HIDDEN)
