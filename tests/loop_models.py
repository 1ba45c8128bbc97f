"""Expert-loop test models shared by several test files (a test file imported by another is imported
twice under pytest, once per module name, and its classes' decisions would be counted twice)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

H, E, K = 8, 4, 2


class GatedExpert(torch.nn.Module):
    """SiLU-gated MLP with one fused gate/up projection, halved with `chunk`."""

    def __init__(self, hidden):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SeparateGatedExpert(torch.nn.Module):
    """SiLU-gated MLP with Mixtral's separate w1 (gate), w3 (up) and w2 (down) projections."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(H, 2 * H, bias=False)
        self.w3 = torch.nn.Linear(H, 2 * H, bias=False)
        self.w2 = torch.nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PresentIds(torch.nn.Module):
    """`for e in ids.unique().tolist()` with `index_add_` at `torch.where(ids == e)`."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(SeparateGatedExpert() for _ in range(E))

    def route(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K)
        return weights / weights.sum(-1, keepdim=True), ids

    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out
