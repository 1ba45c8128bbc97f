"""Expert loops in a module function that a module holds in an attribute (`self.route = route`).

Skywork MoE++ keeps its gating, a loop over the experts with `torch.nonzero`, in a plain function its
router stores on itself and calls as `self.gate(...)`. Under hpu_moe the methods calling the attribute
trace the function's adapted copy while the attribute still holds that function. Written here in other
words than Skywork's.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import SwiGLU, eager_output, run_hpu_moe

E, H, INTER, K = 4, 16, 8, 2


def route(logits, k):
    """{expert: (token rows, their weights)} from a softmax top-k, one `where` per expert."""
    weights, chosen = logits.softmax(dim=-1).topk(k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    table = {}
    for e in range(logits.shape[-1]):
        rows, slots = torch.where(chosen == e)
        table[e] = (rows, weights[rows, slots])
    return table


def first_expert_only(logits, k):
    rows = torch.arange(logits.shape[0])
    return {0: (rows, torch.ones(logits.shape[0]))}


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, E, bias=False)
        self.assign = route

    def forward(self, x):
        return self.assign(self.proj(x), K)


class HeldRoutingMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = nn.ModuleList(SwiGLU(H, INTER) for _ in range(E))

    def forward(self, x):
        out = torch.zeros_like(x)
        for e, (rows, weight) in self.router(x).items():
            out.index_add_(0, rows, self.experts[e](x[rows]) * weight[:, None])
        return out


def test_a_loop_in_a_held_function_is_one_graph_and_fused():
    torch.manual_seed(0)
    model = HeldRoutingMoE().eval()
    inputs = (torch.randn(9, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    torch.testing.assert_close(output, eager_output(model, inputs))
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    assert len(report.fused) == 1 and report.fused[0].top_k == K, str(report)


def test_another_function_in_the_attribute_is_called_as_it_is():
    torch.manual_seed(0)
    model = HeldRoutingMoE().eval()
    model.router.assign = first_expert_only  # not the function __init__ stored: no copy of it is traced
    inputs = (torch.randn(9, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    torch.testing.assert_close(output, eager_output(model, inputs))
    assert not report.fused, str(report)
