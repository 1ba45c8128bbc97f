"""transformers 5.17's expert-parallel sentinel handling (id clamps, row masks): fused only when the
routing shows that every id is one of the experts held."""

from __future__ import annotations

import torch

from form_catalog import hf517_batched_mm, hf517_grouped_mm
from form_catalog._common import init_weights
from form_catalog._stacked_experts import StackedExperts
from tests.helpers import assert_close_for_dtype, run_hpu_moe

CFG = dict(num_experts=4, hidden=16, intermediate=8, activation="silu")


class ExpertsOnGivenIds(torch.nn.Module):
    """Experts run on ids and weights handed in from outside: nothing shows the ids lie in 0..E-1."""

    def __init__(self, experts_forward, dtype=torch.float32):
        super().__init__()
        self.experts = StackedExperts(CFG, experts_forward).to(dtype)
        init_weights(self, seed=0)

    def forward(self, x, ids, weights):
        return self.experts(x, ids, weights)


def test_clamped_ids_without_routing_are_declined_and_left_equal():
    model = ExpertsOnGivenIds(hf517_batched_mm.batched_mm_experts_forward).eval()
    x = torch.randn(5, 16)
    ids = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 1], [0, 1]])
    weights = torch.rand(5, 2)
    report, output, recorder = run_hpu_moe(model, (x, ids, weights))
    assert not report.fused and not recorder.fused_nodes(), str(report)
    assert len(report.declined) == 1 and "expert-parallel sentinels" in report.declined[0].reason
    with torch.no_grad():
        assert_close_for_dtype(output, model(x, ids, weights))


def test_masked_rows_without_routing_are_declined_and_left_equal():
    model = ExpertsOnGivenIds(hf517_grouped_mm.grouped_mm_experts_forward, torch.bfloat16).eval()
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 1], [0, 1]])
    weights = torch.rand(5, 2, dtype=torch.bfloat16)
    report, output, recorder = run_hpu_moe(model, (x, ids, weights))
    assert not report.fused and not recorder.fused_nodes(), str(report)
    assert len(report.declined) == 1 and "expert-parallel sentinels" in report.declined[0].reason
    with torch.no_grad():
        assert_close_for_dtype(output, model(x, ids, weights))
