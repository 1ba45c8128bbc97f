"""Every expert on every token, then each token's chosen outputs picked at its ids and weighted.

JetStream-PyTorch's Mixtral writes its long-sequence experts this way: `y = einsum(...)` over all experts
([T, E, D]), `y[arange(T)[:, None], ids]` ([T, k, D]), then `einsum("tai,ta->ti", picked, weights)`.
That is the kernel's sum as written, so the dense-einsum finder fuses it (and strict mode too: an
unrouted expert's output is never read). The pick is written here the ways people write it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_passes.printer import is_fused_moe
from tests.helpers import run_hpu_moe

E, K, H, INTER, T = 6, 2, 16, 8, 7


class PickedExperts(nn.Module):
    """Top-k softmax routing, SwiGLU experts as token-major einsums over stacked weights, and a pick."""

    def __init__(self, pick: str, top_k: int = K):
        super().__init__()
        self.pick, self.top_k = pick, top_k
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, INTER, H) / H**0.5)
        self.w3 = nn.Parameter(torch.randn(E, INTER, H) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, INTER) / INTER**0.5)

    def forward(self, x):
        weights, ids = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        h = F.silu(torch.einsum("ti,eoi->teo", x, self.w1)) * torch.einsum("ti,eoi->teo", x, self.w3)
        y = torch.einsum("teo,eio->tei", h, self.w2)
        rows = torch.arange(x.shape[0])
        if self.pick == "index":
            return torch.einsum("tai,ta->ti", y[rows.unsqueeze(1), ids], weights)
        if self.pick == "expert_major":
            return torch.einsum("tai,ta->ti", y.transpose(0, 1)[ids, rows[:, None]], weights)
        if self.pick == "gather":
            return (y.gather(1, ids[..., None].expand(-1, -1, H)) * weights[..., None]).sum(1)
        if self.pick == "shifted_rows":  # token t reads token t+1's outputs: not the kernel's sum
            return torch.einsum("tai,ta->ti", y[rows.roll(1).unsqueeze(1), ids], weights)
        raise ValueError(self.pick)


def _run(model, strict=False):
    torch.manual_seed(0)
    x = torch.randn(T, H)
    with torch.no_grad():
        expected = model(x)
        report, output, recorder = run_hpu_moe(model, (x,), strict=strict)
    fused_calls = [n for g in recorder.graphs for n in g.graph.nodes if is_fused_moe(n)]
    return report, output, expected, fused_calls


@pytest.mark.parametrize("pick", ["index", "expert_major", "gather"])
@pytest.mark.parametrize("top_k", [1, K])
def test_picked_outputs_fuse_into_one_call(pick, top_k):
    report, output, expected, calls = _run(PickedExperts(pick, top_k))
    assert [f.form for f in report.fused] == ["dense_einsum"] and len(calls) == 1, report
    torch.testing.assert_close(output, expected)


def test_strict_mode_fuses_a_pick_since_unrouted_outputs_are_never_read():
    report, output, expected, calls = _run(PickedExperts("index"), strict=True)
    assert len(calls) == 1 and not report.declined, report
    torch.testing.assert_close(output, expected)


def test_outputs_picked_at_other_tokens_rows_are_left_as_written():
    report, output, expected, calls = _run(PickedExperts("shifted_rows"))
    assert not calls and not report.fused, report
    torch.testing.assert_close(output, expected)
