"""Experts on weights and biases gathered per slot (`w[ids]`, `b[ids]`) with GPT-OSS's clamped swiglu.

OpenAI's gpt-oss reference MLP (corpus entry `gpt_oss_torch_reference`) computes each slot's expert with
einsums over `mlp1_weight[ids]` plus `mlp1_bias[ids]`, the clamped swiglu on interleaved gate/up columns,
`mlp2_weight[ids]` plus `mlp2_bias[ids]`, and sums the slots with the routing weights: the fused op's
`bias_fused_weights` overload. Here the same computation is written as another author would, with the
variants that must be declined and why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

HIDDEN, INTER, EXPERTS = 16, 8, 4


def clamped_swiglu(gate_up, alpha=1.702, limit=7.0):
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GatheredBiasedExperts(nn.Module):
    def __init__(self, top_k: int, swiglu: bool = True):
        super().__init__()
        self.top_k, self.swiglu = top_k, swiglu
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5)
        self.b_in = nn.Parameter(torch.randn(EXPERTS, 2 * INTER) / 4)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) / INTER**0.5)
        self.b_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN) / 4)

    def forward(self, x):
        rows = x.reshape(-1, HIDDEN)
        logits = self.router(rows)
        top = logits.topk(self.top_k, dim=-1)
        weights, ids = top.values.softmax(dim=-1), top.indices
        h = torch.einsum("tkoh,th->tko", self.w_in[ids], rows) + self.b_in[ids]
        if self.swiglu:
            h = clamped_swiglu(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        y = torch.einsum("tkhi,tki->tkh", self.w_out[ids], h)
        y = y + self.b_out[ids]
        return torch.einsum("tkh,tk->th", y, weights).view_as(x)


@pytest.mark.parametrize("top_k", [2, 1])
@pytest.mark.parametrize("tokens", [7, 1])
def test_gathered_weights_and_biases_fused_and_equal(top_k, tokens):
    torch.manual_seed(0)
    model = GatheredBiasedExperts(top_k).eval()
    inputs = (torch.randn(1, tokens, HIDDEN),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1 and not report.declined, str(report)
    assert "bias_fused_weights" in str(recorder.fused_nodes()[0].target), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_gathered_biases_without_the_clamped_swiglu_are_declined_with_the_reason():
    torch.manual_seed(0)
    model = GatheredBiasedExperts(2, swiglu=False).eval()
    inputs = (torch.randn(1, 7, HIDDEN),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert [d.reason for d in report.declined] == [
        "GPT-OSS-style biases without its clamped swiglu on interleaved gate/up columns"
    ], str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
