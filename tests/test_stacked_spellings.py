"""Routers and stacked expert weights in spellings found by the third sweep (`python
tools/spelling_sweep.py --stacked`): each test is one construct that sweep found unfused or failing,
written here as its code base would, and fails without the change that handles it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

E, K, H, INTER = 4, 2, 8, 16


def _param(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.1)


class SortedSlicesOutMajor(nn.Module):
    """DeepSeek-V2/V3 remote code's `moe_infer` over stacked out-major weights: the counts read with
    `.cpu().numpy()`, and the unsorted rows viewed as `[*topk_ids.shape, -1]`, whose last size the trace
    knows only as a count of rows (an unbacked size)."""

    def __init__(self):
        super().__init__()
        self.weight = _param(E, H)
        self.gate_proj, self.up_proj, self.down_proj = _param(E, INTER, H), _param(E, INTER, H), _param(E, H, INTER)

    def forward(self, x):
        scores = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        topk_weight, topk_ids = torch.topk(scores, k=K, dim=-1, sorted=False)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        cnts = topk_ids.new_zeros((topk_ids.shape[0], E))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs, start_idx = [], 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            rows = sorted_tokens[start_idx:end_idx]
            h = F.silu(F.linear(rows, self.gate_proj[i])) * F.linear(rows, self.up_proj[i])
            outputs.append(F.linear(h, self.down_proj[i]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1)).sum(dim=1)


def _fused_and_equal(model, tokens: int = 7, form: str | None = None):
    torch.manual_seed(0)
    inputs = (torch.randn(tokens, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fallbacks, str(report)
    assert [f.form for f in report.fused] == [form] if form else len(report.fused) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
    return report


def test_sorted_slices_whose_output_size_is_a_count_of_rows_are_fused():
    """The fused call's [T, H] replaces an output whose H the trace knows only from the row count: the
    rewrite compares the shapes without guarding on it (it raised GuardOnDataDependentSymNode, and the
    graph ran unrewritten)."""
    torch.manual_seed(0)
    model = SortedSlicesOutMajor().eval()
    for tokens in (7, 3):
        _fused_and_equal(model, tokens, "segments")
