"""LongCat-Flash's MoE with zero-computation experts: nn.Identity experts mixed into the routed ModuleList.

Mirrors huggingface/transformers `src/transformers/models/longcat_flash/modeling_longcat_flash.py` at commit
6cade29 ("Add LongCat-Flash (#40730)", Meituan's LongCat-Flash as first merged; the hub repository's remote
code is not among the stored copies), read from a snapshot of the AutumnAurelium/transformers fork whose
history holds that upstream commit (the transformers snapshot itself is over the size limit),
next to `configuration_longcat_flash.py` at the same commit. Read: `LongcatFlashMLP`,
`LongcatFlashTopkRouter` (`__init__`, `get_topk_indices`, `forward`), `LongcatFlashMoE` (`__init__`, `moe`,
`forward`), and how `LongcatFlashDecoderLayer` calls it (as a shortcut branch: `self.mlp(h)` on the first
post-attention-normed state, added to the residual stream only at the end of the second sublayer).
The router scores E = n_routed_experts + zero_expert_num experts: it flattens [B, S, H] to [T, H], runs a
float32 `F.linear` with its `classifier` Linear's weight (the classifier's bias, off by default, is never
applied), takes a softmax over all E, and in `get_topk_indices` (under `@torch.no_grad()`) adds the
`e_score_correction_bias` buffer (zeros) for the choice only and takes an unsorted top-k; the weights are the
gathered softmax scores times `routed_scaling_factor` -- no renormalisation. The MoE's experts are
`n_routed_experts` SwiGLU MLPs followed by `zero_expert_num` `nn.Identity()` modules in one ModuleList: a
token routed to a zero expert gets its own input back, weighted. `moe()` starts from `zeros_like(tokens,
dtype=weights.dtype)`, one-hots the ids over `len(self.experts)` classes and permutes to [E, T, k], then
`for expert_idx in range(len(self.experts))` takes `token_indices, weight_indices = torch.where(mask)` and,
`if token_indices.numel() > 0`, multiplies the expert's (or the identity's) output on those rows by
`topk_weights[token_indices, weight_indices]` and `index_add_`s it; the sum is cast back to the input dtype.
`forward` routes the [B, S, H] input, views it flat, runs `moe` and views the result back to [B, S, H].
Experts are `down(act(gate(x)) * up(x))` of `expert_ffn_hidden_size`, act `ACT2FN["silu"]`, here `nn.SiLU`.
Tiny sizes keep the released 2:1 ratio of real to zero experts: 8 SwiGLU experts and 4 identities, top-3
(so some tokens reach an identity), scaling 6.0 as released (the real layer: 512 + 256 experts, top-12,
expert width 2048).
Left out: the decoder's two dense MLPs, attentions and norms around the shortcut, and the `PretrainedConfig`
base (a plain local class carries the fields the layer reads). Nothing in the layer is distributed or a
custom kernel. longcat_flash_fused_experts.py mirrors the same file as transformers ships it now (fused
expert weights, the identity experts a branch on the expert id).
Constructs: `nn.Identity` zero-computation experts in the same ModuleList as the MLP experts (the expert
count, one-hot width and loop length include them), `@torch.no_grad()` on a router helper, a registered
correction-bias buffer used for the choice only, unnormalised scaled softmax weights, a `for expert_idx in
range(len(self.experts))` loop with `torch.where(mask)` and a host read `if token_indices.numel() > 0`,
`index_add_` into a float32 `zeros_like` buffer with a final dtype cast, `F.linear` on a Linear's weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "huggingface/transformers",
    "src/transformers/models/longcat_flash/modeling_longcat_flash.py",
    "6cade29278c4aee3f174f8950f97a3873bdb212f",
    "LongcatFlashMoE.moe",
)
HIDDEN, INTER, EXPERTS, ZERO_EXPERTS, TOP_K = 16, 8, 8, 4, 3


class LongcatFlashConfig:
    """The MoE fields of LongcatFlashConfig the layer reads."""

    def __init__(
        self,
        hidden_size=HIDDEN,
        hidden_act="silu",
        ffn_hidden_size=4 * HIDDEN,
        expert_ffn_hidden_size=INTER,
        n_routed_experts=EXPERTS,
        zero_expert_num=ZERO_EXPERTS,
        moe_topk=TOP_K,
        routed_scaling_factor=6.0,
        router_bias=False,
    ):
        self.hidden_size, self.hidden_act = hidden_size, hidden_act
        self.ffn_hidden_size, self.expert_ffn_hidden_size = ffn_hidden_size, expert_ffn_hidden_size
        self.n_routed_experts, self.zero_expert_num = n_routed_experts, zero_expert_num
        self.moe_topk, self.routed_scaling_factor = moe_topk, routed_scaling_factor
        self.router_bias = router_bias


class LongcatFlashMLP(nn.Module):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size if hidden_size is None else hidden_size
        self.intermediate_size = config.ffn_hidden_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LongcatFlashTopkRouter(nn.Module):
    """Softmax over real and zero experts; the correction bias steers the choice only."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.moe_topk
        self.n_routed_experts = config.n_routed_experts + (config.zero_expert_num or 0)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))
        self.router_bias = getattr(config, "router_bias", False)
        self.classifier = nn.Linear(config.hidden_size, self.n_routed_experts, bias=self.router_bias)

    @torch.no_grad()
    def get_topk_indices(self, scores):
        scores_for_choice = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)
        return torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.config.hidden_size)
        router_logits = F.linear(
            hidden_states.type(torch.float32), self.classifier.weight.type(torch.float32)
        )
        scores = router_logits.softmax(dim=-1)
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights


class LongcatFlashMoE(nn.Module):
    """Routed SwiGLU experts followed by zero-computation (identity) experts."""

    def __init__(self, config=None):
        super().__init__()
        config = config or LongcatFlashConfig()
        self.intermediate_size = config.expert_ffn_hidden_size
        self.config = config
        self.experts = nn.ModuleList(
            [
                LongcatFlashMLP(config, intermediate_size=self.intermediate_size)
                for _ in range(config.n_routed_experts)
            ]
            + [nn.Identity() for _ in range(config.zero_expert_num)]
        )
        self.router = LongcatFlashTopkRouter(config)

    def moe(self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = torch.nn.functional.one_hot(topk_indices, num_classes=len(self.experts))
        expert_mask = expert_mask.permute(2, 0, 1)  # [E, T, k]

        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_output = expert(hidden_states[token_indices])
                final_hidden_states.index_add_(0, token_indices, expert_output * expert_weights.unsqueeze(-1))

        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.router(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        return self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)


def build():
    return tiny(LongcatFlashMoE, HIDDEN)
