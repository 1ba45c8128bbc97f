"""Unsloth's patched Qwen3-MoE block: a nested `torch.compile`d router, then every expert via `torch.where` + `index_add_`.

Stands in for Microsoft GRIN-MoE's remote code (`modeling_grinmoe.py`), which is not among the stored GitHub
copies (microsoft/GRIN-MoE holds only the README, paper and a demo; the hub's file is mirrored nowhere stored);
its SparseMixer block is also the same code as Phi-3.5-MoE's, which `phi35_moe` already mirrors.
Mirrors unslothai/unsloth-zoo `unsloth_zoo/temporary_patches/qwen3_moe.py` at commit ce232d6 (`patch_qwen3_moe`:
the `router_forward` and `forward` it installs as `Qwen3MoeSparseMoeBlock.forward` when the installed
transformers is older than 5, i.e. has no `Qwen3MoeExperts`), the code Unsloth runs for every Qwen3-MoE model it
loads on transformers 4.x. The module the patch lands on is transformers' own: `Qwen3MoeSparseMoeBlock.__init__`
and `Qwen3MoeMLP` are re-typed from huggingface/transformers `src/transformers/models/qwen3_moe/modeling_qwen3_moe.py`
at commit 00d4b3d (gate Linear without bias, a ModuleList of SwiGLU MLPs of `moe_intermediate_size`).
`router_forward(self, hidden_states)` is decorated `@torch_compile(dynamic = True, fullgraph = True)`: the
bias-free `gate` Linear, a float32 softmax, `torch.topk(..., top_k)`, renormalisation by the sum when
`self.norm_topk_prob` (out of place here, unlike transformers' `/=`), a cast back to the input dtype, and
`router_scores = torch.zeros_like(router_logits, dtype=...).scatter_(1, selected_experts, routing_weights)`, a dense
[T, E] weight table; it returns (router_scores, selected_experts, router_logits). `forward(hidden_states)` reads
`is_3d = hidden_states.dim() == 3` and takes the sizes either way, views the tokens [T, H], calls `router_forward`,
allocates a float32 `torch.zeros((B * S, H))` buffer, and loops `for expert_idx in range(self.num_experts)` with no
skip: `token_idx, _ = torch.where(selected_experts == expert_idx)` (a 2-D mask: row ids of the tokens that chose the
expert in any slot), `hidden_states[token_idx].reshape(-1, H)`, the expert, times `router_scores[token_idx,
expert_idx, None]`, and `final_hidden_states.index_add_(0, token_idx, out.to(torch.float32))`. It reshapes when
3-D and returns `(final_hidden_states.to(hidden_states.dtype), router_logits)`; the decoder layer unpacks the
tuple and adds the residual (the shell does: it takes element 0).
Left out: the patch machinery (`patch_function`, the transformers-version probe, the GRPO `ForCausalLM.forward`
patch, the LoRA extractor for transformers 5), and two details of Unsloth's `torch_compile`: the inductor
`options=torch_compile_options` (tuning flags) and the wrapper that, under `fullgraph = True`, falls back to eager
once the recompile limit is hit (and `UNSLOTH_COMPILE_DISABLE`, off by default, which makes it a no-op). Here it is
a plain `torch.compile(dynamic=True, fullgraph=True)`. Also left out: attention, `Qwen3MoeRMSNorm` (the shell
supplies the norm and residual), `PretrainedConfig` (a plain local class), `ACT2FN` (its "silu" is `nn.SiLU()`).
Sizes: Qwen3-30B-A3B has hidden 2048, moe_intermediate 768, 128 experts, top-8, `norm_topk_prob` True; here
hidden 16, intermediate 8, 8 experts and top-2 (top-8 of 8 tiny experts would send every token to every expert).
Constructs: a nested `torch.compile(dynamic=True, fullgraph=True)` function called with the module as `self`,
float32 softmax + `topk` + config-valued renormalisation + dtype cast, a dense `zeros_like(...).scatter_` weight
table, a shape-valued `if is_3d` branch, a `range(E)` loop with no empty-expert skip, `torch.where` on a 2-D
equality mask with the slot ids discarded, tensor-index gathers, a float32 accumulator with in-place `index_add_`
and a final cast back, a `(hidden, router_logits)` tuple return.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("unslothai/unsloth-zoo", "unsloth_zoo/temporary_patches/qwen3_moe.py",
                "ce232d6cef9cb8cd34cd3727906131622177436b", "patch_qwen3_moe.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class Qwen3MoeConfig:
    """The MoE fields of transformers' `Qwen3MoeConfig` (defaults as there, sizes tiny)."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=4 * INTER, moe_intermediate_size=INTER,
                 hidden_act="silu", num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.hidden_act = hidden_act
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob


ACT2FN = {"silu": nn.SiLU()}


class Qwen3MoeMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size if intermediate_size is not None else config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


@torch.compile(dynamic=True, fullgraph=True)
def router_forward(self, hidden_states):
    router_logits = self.gate(hidden_states)

    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float32)
    routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
    if self.norm_topk_prob:  # only diff with mixtral sparse moe block!
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    # we cast back to the input dtype
    routing_weights = routing_weights.to(hidden_states.dtype)
    router_scores = torch.zeros_like(router_logits, dtype=hidden_states.dtype).scatter_(
        1, selected_experts, routing_weights
    )
    return router_scores, selected_experts, router_logits


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

        # gating
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(self.num_experts)]
        )

    # Unsloth's replacement forward (patch_function(Qwen3MoeSparseMoeBlock, "forward", forward))
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        is_3d = hidden_states.dim() == 3
        if is_3d:
            batch_size, sequence_length, hidden_dim = hidden_states.shape
        else:
            total_tokens, hidden_dim = hidden_states.shape
            batch_size = 1
            sequence_length = total_tokens

        hidden_states = hidden_states.view(-1, hidden_dim)
        router_scores, selected_experts, router_logits = router_forward(self, hidden_states)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=torch.float32, device=hidden_states.device
        )

        # Loop over all available experts in the model and perform the computation on each expert
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            token_idx, _ = torch.where(selected_experts == expert_idx)

            # Index the correct hidden states and compute the expert hidden state for
            # the current expert, weighted by its column of the dense router scores
            current_state = hidden_states[token_idx].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * router_scores[token_idx, expert_idx, None]

            # `index_add_` takes the tensor of token ids
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(torch.float32))

        if is_3d:
            final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states.to(hidden_states.dtype), router_logits


def build():
    return tiny(lambda: Qwen3MoeSparseMoeBlock(Qwen3MoeConfig()), HIDDEN)
