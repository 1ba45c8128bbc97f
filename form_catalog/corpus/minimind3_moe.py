"""MiniMind-3's MOEFeedForward: nn.Linear softmax router and a per-expert `mask.any()` / `nonzero` / `index_add_` loop.

Mirrors jingyaogong/minimind `model/model_minimind.py` at commit d65ef2c (`MiniMindConfig` MoE fields,
`FeedForward`, `MOEFeedForward.forward`), the newest snapshot read; the layer is unchanged since the
"minimind-3" rewrite (101d7df) that replaced the older gate-class / `moe_infer` layer mirrored by
minimind_moe.py. The forward flattens [B, S, H] to tokens with `view`, scores them with a bias-free
`nn.Linear` gate and a softmax, takes the unsorted top-k and, when `norm_topk_prob` (on by default), divides
the weights by their sum + 1e-20. It starts from `zeros_like` of the flat tokens and loops over the experts:
`mask = (topk_idx == i)` ([T, k] booleans); when `mask.any()` holds, the expert's token rows are
`mask.any(dim=-1).nonzero().flatten()`, its weights are the boolean-mask gather `topk_weight[mask]` viewed
as a column (one per token, in token order, since a token's k ids are distinct), and the expert's output on
the gathered rows times the weights, cast to the buffer's dtype, is `index_add_`-ed into the buffer; an
expert with no tokens does nothing in eval (in training it adds 0 * the sum of its parameters in place to
`y[0, 0]`). After the loop, in training with `router_aux_loss_coef > 0` a load-balance loss (mean of
`one_hot` ids times the mean scores) is stored as `self.aux_loss`, otherwise a zero scalar from
`new_zeros(1).squeeze()`; the layer returns the buffer viewed back to [B, S, H]. Experts are SwiGLU MLPs
(`ACT2FN[hidden_act]` with the default "silu", here `nn.SiLU`) of `moe_intermediate_size`; the layer also
builds its own unused `act_fn`, kept. No shared experts, no dropout. The real defaults are 4 experts, top-1;
here top-2 (a config value) so the loop sees tokens with two experts.
Left out: the config's attention/rope/vocabulary fields and the `PretrainedConfig` base (a plain local class
carries the fields the layer reads); nothing in the layer is distributed.
Constructs: a `for i, expert in enumerate(self.experts)` loop, a host read `if mask.any():` skipping empty
experts, an `elif self.training` branch with an in-place index-put of a parameter sum, `nonzero()` token ids,
a boolean-mask gather of the weights, `index_add_` into a `zeros_like` buffer with a dtype cast, config
attributes read in forward, and a module attribute (`self.aux_loss`) written in forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "jingyaogong/minimind",
    "model/model_minimind.py",
    "d65ef2c00ebc6082f9df11541e1b191655eddb00",
    "MOEFeedForward.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 4, 2


class MiniMindConfig:
    def __init__(
        self,
        hidden_size=HIDDEN,
        hidden_act="silu",
        intermediate_size=None,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
        norm_topk_prob=True,
        router_aux_loss_coef=5e-4,
    ):
        self.hidden_size, self.hidden_act = hidden_size, hidden_act
        if intermediate_size is None:
            intermediate_size = math.ceil(hidden_size * math.pi / 64) * 64
        self.intermediate_size = intermediate_size
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size if moe_intermediate_size is not None else intermediate_size
        self.norm_topk_prob, self.router_aux_loss_coef = norm_topk_prob, router_aux_loss_coef


class FeedForward(nn.Module):
    def __init__(self, config: MiniMindConfig, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MOEFeedForward(nn.Module):
    def __init__(self, config: MiniMindConfig | None = None):
        super().__init__()
        config = config or MiniMindConfig()
        self.config = config
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [FeedForward(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.num_experts)]
        )
        self.act_fn = nn.SiLU()

    def forward(self, x):
        batch_size, seq_len, hidden_dim = x.shape
        x_flat = x.view(-1, hidden_dim)
        scores = F.softmax(self.gate(x_flat), dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.config.num_experts_per_tok, dim=-1, sorted=False)
        if self.config.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        y = torch.zeros_like(x_flat)
        for i, expert in enumerate(self.experts):
            mask = topk_idx == i
            if mask.any():
                token_idx = mask.any(dim=-1).nonzero().flatten()
                weight = topk_weight[mask].view(-1, 1)
                y.index_add_(0, token_idx, (expert(x_flat[token_idx]) * weight).to(y.dtype))
            elif self.training:
                y[0, 0] += 0 * sum(p.sum() for p in expert.parameters())
        if self.training and self.config.router_aux_loss_coef > 0:
            load = F.one_hot(topk_idx, self.config.num_experts).float().mean(0)
            self.aux_loss = (
                (load * scores.mean(0)).sum() * self.config.num_experts * self.config.router_aux_loss_coef
            )
        else:
            self.aux_loss = scores.new_zeros(1).squeeze()
        return y.view(batch_size, seq_len, hidden_dim)


def build():
    return tiny(MOEFeedForward, HIDDEN)
