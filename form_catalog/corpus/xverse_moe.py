"""XVERSE-MoE's XverseMoEMLP: Mixtral-style one-hot mask loop with `.tolist()` gathers and shared experts.

Mirrors goingshr-debug/SMoE `models/xversemoe/model_path/modeling_xverse.py` at commit 5792f68 (`XverseMoEMLP`,
`XverseMLP`), a vendored copy of the remote code shipped with xverse/XVERSE-MoE-A4.2B (xverse-ai's own GitHub
repositories hold only READMEs and demos). The router is a bias-free nn.Linear kept in float32: tokens are
flattened and upcast, the logits go through a float32 softmax, the top-k probabilities are taken and
renormalised with a +1e-6 guard, then cast back to the input dtype. A [E, k, T] one-hot mask is built; for
each expert `torch.where(mask[e])` gives (slot, token) ids, the expert is skipped when it has no tokens
(`if top_x.shape[0] == 0: continue`), both id tensors are turned into Python lists with `.tolist()` and used
to gather the tokens (`x[None, top_x_list]`) and their weights (`w[top_x_list, idx_list, None]`), and the
weighted expert output is `index_add_`-ed into a zero buffer. The shared experts (one MLP of
`num_shared_experts` times the width) run on all tokens and are added; the layer returns
(output, router_logits). Left out: `pretraining_tp > 1` weight slicing in the MLP (a training-time
tensor-parallel emulation; the config value is 1). The real model has 64 experts, top-6, 2 shared.
Constructs: loop `for e, expert in enumerate(self.experts)`, `torch.where(mask)` gathers, an empty-expert
skip `if top_x.shape[0] == 0: continue`, `.tolist()` of the token and slot ids used as indices, `index_add_`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("goingshr-debug/SMoE", "models/xversemoe/model_path/modeling_xverse.py",
                "5792f689f8c5235fd787d530c4a625fa371c0c5f", "XverseMoEMLP.forward")
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


class XverseMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class XverseMoEMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.top_k, self.num_experts, self.num_shared_experts = TOP_K, EXPERTS, SHARED
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False, dtype=torch.float)
        self.experts = nn.ModuleList(XverseMLP(HIDDEN, INTER) for _ in range(EXPERTS))
        self.shared_experts = XverseMLP(HIDDEN, SHARED * INTER)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        out = torch.zeros((b * s, h), dtype=hidden_states.dtype, device=hidden_states.device)
        dtype = hidden_states.dtype
        hidden_states = hidden_states.view(-1, h).float()

        router_logits = self.router(hidden_states)
        probs = F.softmax(router_logits, dim=1, dtype=torch.float)
        probs, chosen = torch.topk(probs, self.top_k, dim=-1)
        mask = F.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)
        probs /= probs.sum(dim=-1, keepdim=True) + 1e-06
        probs = probs.to(dtype)
        hidden_states = hidden_states.to(dtype)

        for e, expert in enumerate(self.experts):
            slot, top_x = torch.where(mask[e])
            if top_x.shape[0] == 0:
                continue
            tokens, slots = top_x.tolist(), slot.tolist()
            y = expert(hidden_states[None, tokens].view(-1, h)) * probs[tokens, slots, None]
            out.index_add_(0, top_x, y)

        out = out.reshape(b, s, h)
        if self.num_shared_experts is not None:
            out = out + self.shared_experts(hidden_states.view(b, s, h))
        return out, router_logits


def build():
    return tiny(XverseMoEMLP, HIDDEN)
