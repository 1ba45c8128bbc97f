"""Grok-1's PyTorch port `MoeBlock`: softmax top-2 without renormalisation, GELU-gated experts, list gathers.

Mirrors EfficientMoE/MoE-Infinity `moe_infinity/models/modeling_grok/modeling_grok1.py` at commit 7fbe68f
(`MoeBlock.forward`, `MoeMLP`), the hpcai-tech/grok-1 hub remote code `modeling_grok1.py` as MoE-Infinity
vendors it (the hub repository itself is not among the stored copies). The block flattens tokens to
[T, H], scores them with a bias-free linear gate, softmaxes in float32 over the experts, takes the top-2
probabilities as weights (no renormalisation, unlike Mixtral) and casts them back to the input dtype.
Experts are `MoeMLP`s: linear_1(gelu(linear(x)) * linear_v(x)) (linear = gate, linear_v = up, linear_1 =
down, exact-erf GELU). The choices are one-hot encoded to an [E, k, T] mask; a loop over every expert
takes `idx, top_x = torch.where(mask[e])`, skips an expert no token chose, reads both index tensors to
Python lists with `.tolist()`, gathers the rows with those lists, runs the expert, scales by
`weights[top_x_list, idx_list]` and `index_add_`s into the output. It returns (output, router_logits).
The decoder's pre/post-MoE RMSNorms and Grok's attention soft-capping lie outside the block. Left out:
nothing of the forward.
Constructs: loop over range(num_experts), `torch.where(mask)`, `if top_x.shape[0] == 0: continue`,
`.tolist()` gathers with Python lists, `index_add_`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("EfficientMoE/MoE-Infinity", "moe_infinity/models/modeling_grok/modeling_grok1.py",
                "7fbe68f9d28fc8e3cf52d5c0d27315129672220b", "MoeBlock.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class MoeMLP(nn.Module):
    def __init__(self, hidden_dim: int, ffn_dim: int):
        super().__init__()
        self.linear_v = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.linear_1 = nn.Linear(ffn_dim, hidden_dim, bias=False)
        self.linear = nn.Linear(hidden_dim, ffn_dim, bias=False)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.linear_1(self.act_fn(self.linear(x)) * self.linear_v(x))


class MoeBlock(nn.Module):
    def __init__(self, hidden_dim: int = HIDDEN, ffn_dim: int = INTER, num_experts: int = EXPERTS,
                 top_k: int = TOP_K):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = nn.Linear(hidden_dim, num_experts, bias=False)
        self.experts = nn.ModuleList(MoeMLP(hidden_dim, ffn_dim) for _ in range(num_experts))

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden)
        router_logits = self.gate(hidden_states)

        probs = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights.to(hidden_states.dtype)

        out = torch.zeros((batch * seq, hidden), dtype=hidden_states.dtype, device=hidden_states.device)
        mask = F.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            expert = self.experts[e]
            slot, rows = torch.where(mask[e])
            if rows.shape[0] == 0:
                continue
            rows_list = rows.tolist()
            slot_list = slot.tolist()
            picked = hidden_states[None, rows_list].reshape(-1, hidden)
            y = expert(picked) * weights[rows_list, slot_list, None]
            out.index_add_(0, rows, y.to(hidden_states.dtype))
        return out.reshape(batch, seq, hidden), router_logits


def build():
    return tiny(MoeBlock, HIDDEN)
