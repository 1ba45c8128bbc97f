"""Near miss: Llama4's all-expert batched matmul with the routing weights applied to the INPUT.

Mirrors transformers 5.23.0 (release wheel) `src/transformers/models/llama4/modeling_llama4.py`:
`Llama4Router` (top-k on the logits, `full_like(logits, -inf).scatter_(1, ids, values)`, then a float32
sigmoid: dense [T, E] scores, zero for experts not chosen), `Llama4TextMoe.forward`
(`routed_in = x.repeat(E, 1) * scores.T.reshape(-1, 1)`, experts, `.reshape(E, T, H).sum(0)`) and
`Llama4TextExperts.forward` (`bmm(routed_in.view(E, -1, H), gate_up_proj [E, H, 2I])` → `up * act(gate)`
→ `bmm(., down_proj [E, I, H])`). Llama4's shared expert is left out.

Every expert runs on every token, pre-scaled: MLP(w * x) != w * MLP(x) for a non-linear MLP, and the
kernel weights expert outputs. The rewrite must leave each layer untouched and report it declined,
naming the input scaling.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ACTIVATIONS, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=0, declined=2, reason="scale each expert's input")


class Llama4Router(nn.Linear):
    """`Llama4Router`: dense [T, E] sigmoid scores of the top-k logits (zero elsewhere)."""

    def __init__(self, cfg: dict):
        super().__init__(cfg["hidden"], cfg["num_experts"], bias=False)
        self.top_k = cfg["top_k"]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = super().forward(hidden_states)
        top_values, top_ids = torch.topk(router_logits, self.top_k, dim=1)
        scores = torch.full_like(router_logits, float("-inf")).scatter_(1, top_ids, top_values)
        return torch.sigmoid(scores.float()).to(router_logits.dtype)


class Llama4Experts(nn.Module):
    """`Llama4TextExperts`: transposed stacks, all experts on all (pre-scaled) tokens."""

    def __init__(self, cfg: dict):
        super().__init__()
        e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.num_experts, self.hidden_size = e, h
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.act_fn = ACTIVATIONS[cfg["activation"]]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
        gate_up = torch.bmm(hidden_states, self.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        next_states = torch.bmm(up * self.act_fn(gate), self.down_proj)
        return next_states.view(-1, self.hidden_size)


class Llama4Moe(nn.Module):
    """`Llama4TextMoe` without the shared expert."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.router = Llama4Router(cfg)
        self.experts = Llama4Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden_states = x.reshape(-1, shape[-1])
        router_scores = self.router(hidden_states)
        routed_in = hidden_states.repeat(router_scores.shape[1], 1)
        routed_in = routed_in * router_scores.transpose(0, 1).reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0)
        return out.view(shape)


def build(**overrides):
    """(TinyDecoder of Llama4Moe layers, (x [1, T, H],)); all DEFAULTS but the routing keys (Llama4's own)."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(Llama4Moe, cfg), cfg)
