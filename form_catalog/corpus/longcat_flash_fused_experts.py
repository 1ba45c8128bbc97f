"""LongCat-Flash's `LongcatFlashMoE` as transformers ships it now: zero-computation (identity) experts share the
routed experts' fused-weight loop, with `.item()` expert ids and an empty-expert skip.

Mirrors huggingface/transformers `src/transformers/models/longcat_flash/modeling_longcat_flash.py` at commit
0205eec (`LongcatFlashTopkRouter`, `LongcatFlashExperts`, `LongcatFlashMoE`), the newest stored version of the
file; it is the transformers port of meituan-longcat/LongCat-Flash-Chat's remote code (the hub repository
itself is not among the stored copies, and no GitHub copy of its `modeling_longcat_flash.py` was found).
longcat_flash_moe.py mirrors the same file as first merged (a ModuleList of MLPs and `nn.Identity`s); here
the experts are two fused Parameters and the identity experts are a branch on the expert id.
`LongcatFlashMoE.forward` keeps the input shape, calls the router, views the tokens [T, H] and hands them,
with the ids and weights, to the experts module. The router views the input [T, H], scores it with
`F.linear` of the float32 tokens and the float32 `classifier.weight` (the classifier's bias, off by default,
is never read), softmaxes over routed + zero experts, picks the unsorted top-k of the scores plus the
`e_score_correction_bias` buffer in a `@torch.no_grad()` method, gathers the unbiased scores and multiplies
them by `routed_scaling_factor` (no renormalisation), returning (weights cast to the logits' dtype, ids).
The experts hold one `gate_up_proj` Parameter [routed + zero, 2I, H] (as written, rows for the zero experts
too) and one `down_proj` Parameter [routed, H, I]. Their forward starts from `zeros_like`, returns it at once
`if top_k_index.numel() == 0`, builds `one_hot(ids, routed + zero).permute(2, 1, 0)`, takes
`expert_hit = greater(mask.sum((-1, -2)), 0).nonzero()` and loops over its rows: `expert_idx =
int(expert_idx_tensor.item())`, `torch.where(mask[expert_idx].squeeze(0))` for (slot, token) ids,
`if token_idx.numel() == 0: continue`, gathers the tokens, and then either passes them through the
`nn.Identity` expert (`expert_idx >= num_routed_experts or gate_up_proj is None`) or runs the SwiGLU on the
expert's slices (`F.linear(x, gate_up_proj[e]).chunk(2)`, `act(gate) * up`, `F.linear(h, down_proj[e])`);
either way it multiplies by `top_k_weights[token_idx, selection_idx, None]` and `index_add_`s into the
buffer with a dtype cast. Tiny sizes: 4 routed + 2 zero experts, top-2, expert width 8 (LongCat-Flash:
512 + 256, top-12, width 2048); `routed_scaling_factor` 6.0 and "silu" kept. The bias buffer is zeros as
constructed.
Left out: the config's attention / MLA / dense-MLP fields and the `PretrainedConfig` base (a plain local
class carries the fields the layer reads), and the rest of the shortcut-connected decoder layer (two MLA
sublayers, two dense MLPs); nothing in the layer is distributed.
Constructs: a `@torch.no_grad()` method inside routing, an early `return` on `numel() == 0`, a loop over the
rows of a `nonzero()` tensor, `int(t.item())` expert ids, `torch.where(mask)`, `if numel() == 0: continue`,
a Python branch on the host id picking an `nn.Identity` expert or a fused-weight SwiGLU indexed by that id,
`index_add_` into a `zeros_like` buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "huggingface/transformers",
    "src/transformers/models/longcat_flash/modeling_longcat_flash.py",
    "0205eec1d869591488aa74eda3f2da23610c28d9",
    "LongcatFlashMoE.forward",
)
HIDDEN, EXPERT_FFN, ROUTED, ZERO, TOP_K = 16, 8, 4, 2, 2


class LongcatFlashConfig:
    """The fields the MoE layer reads (LongCat-Flash-Chat's values where the tiny sizes allow)."""

    def __init__(self):
        self.hidden_size = HIDDEN
        self.expert_ffn_hidden_size = EXPERT_FFN
        self.n_routed_experts = ROUTED
        self.zero_expert_num = ZERO
        self.num_experts_per_tok = TOP_K
        self.num_local_experts = ROUTED
        self.routed_scaling_factor = 6.0
        self.router_bias = False
        self.hidden_act = "silu"


class LongcatFlashTopkRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_local_experts
        self.hidden_dim = config.hidden_size
        self.n_routed_experts = config.n_routed_experts + (config.zero_expert_num or 0)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.router_bias = getattr(config, "router_bias", False)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))
        self.classifier = nn.Linear(config.hidden_size, self.n_routed_experts, bias=self.router_bias)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.hidden_dim)
        logits = F.linear(hidden_states.type(torch.float32), self.classifier.weight.type(torch.float32))
        scores = logits.softmax(dim=-1)
        ids = self.get_topk_indices(scores)
        weights = scores.gather(1, ids) * self.routed_scaling_factor
        return weights.to(logits.dtype), ids

    @torch.no_grad()
    def get_topk_indices(self, scores):
        for_choice = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)
        return torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False)[1]


class LongcatFlashExperts(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.expert_ffn_hidden_size
        self.hidden_size = config.hidden_size
        self.num_routed_experts = config.n_routed_experts
        self.zero_expert_num = config.zero_expert_num or 0
        self.total_experts = self.num_routed_experts + self.zero_expert_num
        self.act_fn = nn.SiLU()  # ACT2FN["silu"]
        self.identity_expert = nn.Identity()
        if self.num_routed_experts > 0:
            self.gate_up_proj = nn.Parameter(
                torch.empty(self.total_experts, 2 * self.intermediate_size, self.hidden_size)
            )
            self.down_proj = nn.Parameter(
                torch.empty(self.num_routed_experts, self.hidden_size, self.intermediate_size)
            )
        else:
            self.register_parameter("gate_up_proj", None)
            self.register_parameter("down_proj", None)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        if top_k_index.numel() == 0:
            return out
        mask = F.one_hot(top_k_index, num_classes=self.total_experts).permute(2, 1, 0)
        expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
        for hit in expert_hit:
            expert_idx = int(hit.item())
            selection_idx, token_idx = torch.where(mask[expert_idx].squeeze(0))
            if token_idx.numel() == 0:
                continue
            state = hidden_states[token_idx]
            if expert_idx >= self.num_routed_experts or self.gate_up_proj is None:
                expert_out = self.identity_expert(state)
            else:
                gate, up = F.linear(state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
                expert_out = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            expert_out = expert_out * top_k_weights[token_idx, selection_idx, None]
            out.index_add_(0, token_idx, expert_out.to(hidden_states.dtype))
        return out


class LongcatFlashMoE(nn.Module):
    """A mixed expert module containing zero compute (identity) experts."""

    def __init__(self, config: LongcatFlashConfig | None = None):
        super().__init__()
        config = config or LongcatFlashConfig()
        self.intermediate_size = config.expert_ffn_hidden_size
        self.config = config
        self.experts = LongcatFlashExperts(config)
        self.router = LongcatFlashTopkRouter(config)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        topk_weights, topk_indices = self.router(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        return self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)


def build():
    return tiny(LongcatFlashMoE, HIDDEN)
