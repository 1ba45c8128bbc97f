"""Dense and soft mixtures of experts (every expert on every token, weighted by a softmax, nothing
selected) are declined with that reason, in each spelling: a loop of weighted sums, a stack combined by a
batched matmul (multi-gate MMoE), slots mixed from the tokens (Soft MoE). The same layers with a top-k
between the softmax and the combine are never called dense, and parallel projections that are not
experts (q/k/v of attention) are not read as a mixture.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

DENSE = "dense mixture of experts: all 4 experts run on every token"
SOFT = "soft mixture of experts: the 4 experts read softmax-weighted mixtures of all tokens"


class Expert(torch.nn.Module):
    def __init__(self, hidden, gated=True):
        super().__init__()
        self.gated = gated
        self.gate = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        if self.gated:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.gate(x)))


class Mixture(torch.nn.Module):
    """out = sum_e c_e * expert_e(x), c = softmax(router(x)) (dense) or its top-2 scattered back."""

    def __init__(self, spelling, hidden=8, experts=4, top_k=None):
        super().__init__()
        self.spelling, self.top_k = spelling, top_k
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        gated = not spelling.startswith("plain")
        self.experts = torch.nn.ModuleList(Expert(hidden, gated=gated) for _ in range(experts))

    def table(self, x):
        probs = self.router(x).softmax(-1)
        if self.top_k is None:
            return probs
        weights, ids = probs.topk(self.top_k, -1)
        return torch.zeros_like(probs).scatter(-1, ids, weights)

    def forward(self, x):
        table = self.table(x)
        if self.spelling.endswith("loop"):
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                out = out + table[:, e : e + 1] * expert(x)
            return out
        stacked = torch.stack([expert(x) for expert in self.experts], 1)  # [T, E, H]
        return torch.bmm(table.unsqueeze(1), stacked).squeeze(1)


class SoftMixture(torch.nn.Module):
    """Soft MoE: slots are softmax-weighted mixtures of the tokens; each expert runs on its slots."""

    def __init__(self, hidden=8, experts=4, slots=2):
        super().__init__()
        self.slot_embeds = torch.nn.Parameter(torch.randn(experts, slots, hidden))
        self.experts = torch.nn.ModuleList(Expert(hidden, gated=False) for _ in range(experts))

    def forward(self, x):  # x: [B, N, H]
        logits = torch.einsum("bnd,esd->bnes", x, self.slot_embeds)
        dispatch = logits.softmax(dim=1)
        combine = logits.reshape(*logits.shape[:2], -1).softmax(dim=-1)
        slots = torch.einsum("bnd,bnes->besd", x, dispatch)
        outs = torch.stack([expert(slots[:, e]) for e, expert in enumerate(self.experts)], 1)  # [B, E, S, H]
        return torch.einsum("bxd,bnx->bnd", outs.flatten(1, 2), combine)


class StackedAttention(torch.nn.Module):
    """q, k, v projections stacked and a softmax over their products: parallel projections, not experts."""

    def __init__(self, hidden=8):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(3))

    def forward(self, x):
        q, k, v = torch.stack([self.q(x), self.k(x), self.v(x)]).unbind(0)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


@pytest.mark.parametrize("spelling", ["loop", "stack", "plain_mlps", "plain_loop"])
def test_dense_mixtures_are_declined_as_dense(spelling):
    torch.manual_seed(0)
    model, inputs = Mixture(spelling).eval(), (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert [d.reason[: len(DENSE)] for d in report.declined] == [DENSE], str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("spelling", ["loop", "stack", "plain_loop"])
def test_a_top_k_between_the_softmax_and_the_combine_is_not_dense(spelling):
    torch.manual_seed(0)
    model, inputs = Mixture(spelling, top_k=2).eval(), (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not any("mixture of experts" in d.reason for d in report.declined), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_soft_moe_is_declined_as_soft():
    torch.manual_seed(0)
    model, inputs = SoftMixture().eval(), (torch.randn(2, 5, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert [d.reason[: len(SOFT)] for d in report.declined] == [SOFT], str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_stacked_attention_projections_are_no_mixture():
    torch.manual_seed(0)
    model, inputs = StackedAttention().eval(), (torch.randn(2, 5, 8),)
    report, _, _ = run_hpu_moe(model, inputs)
    assert report.declined == [], str(report)
