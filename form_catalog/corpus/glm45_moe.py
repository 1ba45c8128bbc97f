"""GLM-4.5's `Glm4MoeMoE` as transformers ships it: sigmoid group-limited routing, a fused-weight expert
loop over `nonzero()` rows guarded by a tensor-valued `if`, and a shared expert.

Stands in for GRIN-MoE (microsoft/GRIN-MoE's `modeling_grinmoe.py` is in none of the stored copies; the
microsoft/GRIN-MoE GitHub repository holds only the paper and a demo, and its SparseMixer block is the one
phi35_moe.py already mirrors). Mirrors huggingface/transformers
`src/transformers/models/glm4_moe/modeling_glm4_moe.py` at commit 000c33f (`Glm4MoeMLP`, `Glm4MoeTopkRouter`,
`Glm4MoeNaiveMoe`, `Glm4MoeMoE.route_tokens_to_experts` / `forward`), the newest stored version, which is
what `AutoModelForCausalLM` runs for zai-org's GLM-4.5 / 4.6 checkpoints.
`Glm4MoeMoE.forward` keeps the input (the residual for the shared expert) and its shape, gets the router
logits, routes, views the tokens [T, H], runs the routed experts, views back and adds
`shared_experts(residuals)` on the 3-D input. The router (`Glm4MoeTopkRouter`) is a bare [E, H] Parameter
and a float32 `e_score_correction_bias` buffer; its forward views [T, H] and returns `F.linear` of the
float32 tokens and weight. `route_tokens_to_experts` takes the sigmoid, adds the bias for the choice only,
scores each of `n_group` groups by the sum of its two best biased scores, keeps the `topk_group` best
groups (`topk(sorted=False)`, a `zeros_like` mask `scatter_`-ed with 1, expanded to the experts), fills the
other experts' biased scores with 0.0, takes the unsorted top-k, gathers the unbiased sigmoid scores and,
`if self.norm_topk_prob`, divides them in place by their sum + 1e-20, then multiplies by
`routed_scaling_factor`. The experts (`Glm4MoeNaiveMoe`) hold `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I] Parameters; their forward starts from `zeros_like` and, under `with torch.no_grad():`, builds
`one_hot(ids, E).permute(2, 1, 0)` and `expert_hit = greater(mask.sum((-1, -2)), 0).nonzero()`; it loops over
the rows of `expert_hit`, takes `expert_idx = expert_idx[0]` (a 0-d tensor), `if expert_idx ==
self.num_experts: continue` (a Python `if` on a tensor comparison; never true here), `torch.where(mask[e])`
for (slot, token) ids, gathers the tokens, `F.linear(x, gate_up_proj[e]).chunk(2)`, `act(gate) * up`,
`F.linear(h, down_proj[e])`, multiplies by `top_k_weights[token_idx, top_k_pos, None]` and `index_add_`s
into the buffer with a dtype cast. As written at this commit the routed experts' width is read from
`config.intermediate_size` (the shared expert's from `moe_intermediate_size * n_shared_experts`); here both
are 8. Tiny sizes: 8 routed experts in 4 groups, 2 groups kept, top-2, one shared expert (GLM-4.5: 160
experts, `n_group` = `topk_group` = 1, top-8, one shared expert); `routed_scaling_factor` 2.5,
`norm_topk_prob` True and "silu" kept. The bias buffer is zeros as constructed.
Left out: the config's attention / rope fields and the `PretrainedConfig` base (a plain local class
carries the fields the layer reads, `num_local_experts` standing for the config's attribute map to
`n_routed_experts`), and the dense MLP of the first `first_k_dense_replace` layers; nothing in the layer is
distributed.
Constructs: grouped top-k with `scatter_` on a `zeros_like` mask and `masked_fill`, an in-place `/=` under
`if norm_topk_prob`, a `with torch.no_grad():` block building the dispatch mask, a loop over the rows of a
`nonzero()` tensor, a Python `if` on a 0-d tensor comparison with `continue`, `torch.where(mask)`,
fused-weight SwiGLU indexed by a 0-d tensor, `index_add_` into a `zeros_like` buffer, a shared expert on
the un-flattened input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "huggingface/transformers",
    "src/transformers/models/glm4_moe/modeling_glm4_moe.py",
    "000c33fdfde12e1ffafbfcdb3c926df5727a00b6",
    "Glm4MoeMoE.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP = 16, 8, 8, 2, 4, 2


class Glm4MoeConfig:
    """The fields the MoE layer reads (GLM-4.5's values where the tiny sizes allow)."""

    def __init__(self):
        self.hidden_size = HIDDEN
        self.intermediate_size = INTER
        self.moe_intermediate_size = INTER
        self.n_routed_experts = EXPERTS
        self.num_local_experts = EXPERTS  # attribute_map: num_local_experts -> n_routed_experts
        self.num_experts_per_tok = TOP_K
        self.n_group = N_GROUP
        self.topk_group = TOPK_GROUP
        self.n_shared_experts = 1
        self.norm_topk_prob = True
        self.routed_scaling_factor = 2.5
        self.hidden_act = "silu"


class Glm4MoeMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Glm4MoeTopkRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty((self.n_routed_experts, config.hidden_size)))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(self.n_routed_experts, dtype=torch.float32)
        )

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.config.hidden_size)
        return F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))


class Glm4MoeNaiveMoe(nn.Module):
    """Expert weights stored as 3-D tensors."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim)
        )
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            state = hidden_states[token_idx]
            gate, up = F.linear(state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            expert_out = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            expert_out = expert_out * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))
        return out


class Glm4MoeMoE(nn.Module):
    """A mixed expert module containing shared experts."""

    def __init__(self, config: Glm4MoeConfig | None = None):
        super().__init__()
        config = config or Glm4MoeConfig()
        self.config = config
        self.experts = Glm4MoeNaiveMoe(config)
        self.gate = Glm4MoeTopkRouter(config)
        self.shared_experts = Glm4MoeMLP(
            config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )
        self.n_routed_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.top_k = config.num_experts_per_tok

    def route_tokens_to_experts(self, router_logits):
        scores = router_logits.sigmoid()
        for_choice = scores + self.gate.e_score_correction_bias
        per_group = self.n_routed_experts // self.n_group
        group_scores = for_choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.n_routed_experts)
        )
        for_choice = for_choice.masked_fill(~score_mask.bool(), 0.0)
        topk_indices = torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        router_logits = self.gate(hidden_states)
        topk_indices, topk_weights = self.route_tokens_to_experts(router_logits)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        return hidden_states + self.shared_experts(residuals)


def build():
    return tiny(Glm4MoeMoE, HIDDEN)
