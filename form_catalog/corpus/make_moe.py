"""makeMoE's `SparseMoE`: a noisy top-k router (noise even in eval) and a per-expert `nonzero` loop with capacity.

Mirrors AviSoori1x/makeMoE `makeMoE.py` at commit 44a3c85 (`NoisyTopkRouter.forward`, `SparseMoE.forward`,
`Expert`). The router projects the tokens to expert logits and, through a second linear, to a noise scale;
it adds `randn_like(logits) * softplus(noise_logits)` to the logits unconditionally (the original has no
training switch, so the layer is random in eval too), takes the top-k noisy logits, scatters them into a
tensor of -inf and softmaxes it, so every token's k weights sum to one and the others are zero. The layer
flattens the tokens, computes a fixed capacity int(B * S * k / E * capacity_factor) and loops over the
experts with `enumerate`: it marks the tokens that chose the expert (`(indices == i).any(-1)`), gathers
their positions with `torch.nonzero(...).squeeze(-1)`, truncates them to the capacity only when there are
more (`x[:cap] if x.numel() > cap else x`), skips the expert when none are left (`if numel() > 0`), runs the
ReLU MLP expert on the gathered rows, scales them by the expert's column of the router output and
`index_add_`s them into an update buffer, which is added to a zero output of the input's shape. Left out:
nothing of the forward (dropout is the identity in eval; the training loop and router logging hooks sit
outside the layer).
Constructs: `torch.randn_like` noise in eval (outputs differ call to call unless the RNG is reseeded),
`torch.nonzero` gathers, `.numel()` comparisons choosing a capacity truncation and an empty-expert skip,
a Python `enumerate` loop over the experts ModuleList, `index_add_` into a buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("AviSoori1x/makeMoE", "makeMoE.py", "44a3c85d5ae5bcef2d54cf1f23ea0d025e9e2f02",
                "SparseMoE.forward")
HIDDEN, EXPERTS, TOP_K, CAPACITY_FACTOR, DROPOUT = 16, 4, 2, 1.0, 0.1


class Expert(nn.Module):
    """Linear(H, 4H) -> ReLU -> Linear(4H, H) -> Dropout, as one nn.Sequential."""

    def __init__(self, n_embed):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_embed, 4 * n_embed), nn.ReLU(), nn.Linear(4 * n_embed, n_embed),
                                 nn.Dropout(DROPOUT))

    def forward(self, x):
        return self.net(x)


class NoisyTopkRouter(nn.Module):
    def __init__(self, n_embed, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.topkroute_linear = nn.Linear(n_embed, num_experts)
        self.noise_linear = nn.Linear(n_embed, num_experts)

    def forward(self, hidden):
        logits = self.topkroute_linear(hidden)
        scale = F.softplus(self.noise_linear(hidden))
        noisy = logits + torch.randn_like(logits) * scale
        best, chosen = noisy.topk(self.top_k, dim=-1)
        masked = torch.full_like(noisy, float("-inf")).scatter(-1, chosen, best)
        return F.softmax(masked, dim=-1), chosen


class SparseMoE(nn.Module):
    def __init__(self, n_embed=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, capacity_factor=CAPACITY_FACTOR):
        super().__init__()
        self.router = NoisyTopkRouter(n_embed, num_experts, top_k)
        self.experts = nn.ModuleList(Expert(n_embed) for _ in range(num_experts))
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.num_experts = num_experts

    def forward(self, x):
        batch, seq, _ = x.shape
        probs, chosen = self.router(x)
        out = torch.zeros_like(x)
        tokens = x.view(-1, x.size(-1))
        flat_probs = probs.view(-1, probs.size(-1))
        capacity = int((batch * seq * self.top_k / self.num_experts) * self.capacity_factor)
        acc = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            hit = (chosen == e).any(dim=-1).view(-1)
            rows = torch.nonzero(hit).squeeze(-1)
            kept = rows[:capacity] if rows.numel() > capacity else rows
            if kept.numel() > 0:
                y = expert(tokens[kept])
                acc.index_add_(0, kept, y * flat_probs[kept, e].unsqueeze(1))
        out += acc.view(batch, seq, -1)
        return out


def build():
    return tiny(SparseMoE, HIDDEN)
