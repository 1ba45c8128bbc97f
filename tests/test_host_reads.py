"""Per-expert counts read on the host away from the expert loop, written as other authors would.

- Counts returned by a TorchScript routing function, read with `.tolist()` in a router method and handed
  to the experts as split sizes (JetMoE's original `MoE`; the corpus entry `jetmoe_original` mirrors it).
- Sizes gathered into a tensor with `x.new_tensor([...])` for load statistics (labml's switch), which
  dynamo before torch 2.11 refuses with data-dependent sizes and the traced copy spells as `torch.tensor`.
- A prefix cut at a count of true elements, `order[:(ids < E).sum().item()]` (LongCat-Flash's
  deterministic MoE), which dynamo before torch 2.11 refuses and the copy spells as a narrow.
"""

from __future__ import annotations

import ast
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_passes.adapters.count_loops import counts_returned
from moe_passes.adapters.host_reads import (
    CutToCount,
    NewTensorOfList,
    StateSizes,
    cut_to_count,
    link_parents,
    sizes_at_least_zero,
    split_size_lists,
    tensor_like,
    true_counts,
)
from moe_passes.adapters.source_ast import bindings
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe


@torch.jit.script
def route(k: int, num_experts: int, weights: torch.Tensor, ids: torch.Tensor):
    table = torch.zeros([weights.size(0), num_experts], dtype=weights.dtype, device=weights.device)
    sizes = table.scatter(1, ids, 1).long().sum(0)
    _, order = ids.flatten().sort(0)
    return weights.flatten()[order], order.div(k, rounding_mode="trunc"), sizes


@torch.jit.script
def route_by_bincount(k: int, num_experts: int, weights: torch.Tensor, ids: torch.Tensor):
    _, order = ids.flatten().sort(0)
    return weights.flatten()[order], order.div(k, rounding_mode="trunc"), torch.bincount(ids.flatten())


class StackedLinears(nn.Module):
    def __init__(self, experts: int, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, outputs, inputs) / inputs**0.5)

    def forward(self, rows, sizes):
        return torch.cat([F.linear(piece, self.weight[i]) for i, piece in enumerate(rows.split(sizes, dim=0))])


class HandedCountsMoE(nn.Module):
    def __init__(self, hidden=16, inter=8, experts=6, k=2):
        super().__init__()
        self.k, self.experts = k, experts
        self.router = nn.Linear(hidden, experts, bias=False)
        self.up = StackedLinears(experts, hidden, 2 * inter)
        self.down = StackedLinears(experts, inter, hidden)

    def gate(self, x):
        weights, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        self.slot_weights, self.rows_of, sizes = route(self.k, self.experts, weights, ids)
        self.sizes = sizes.tolist()

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        self.gate(x)
        gate, up = self.up(x[self.rows_of], self.sizes).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up, self.sizes) * self.slot_weights[:, None]
        return torch.zeros_like(x).index_add(0, self.rows_of, out).view(shape)


class BincountSizesMoE(HandedCountsMoE):
    """The sizes are a bincount: their number depends on the data, so no host list of them is captured."""

    def gate(self, x):
        weights, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        self.slot_weights, self.rows_of, sizes = route_by_bincount(self.k, self.experts, weights, ids)
        self.sizes = sizes.tolist()


def _inputs():
    torch.manual_seed(0)
    return (torch.randn(2, 5, 16),)


def test_counts_a_scripted_router_returns_are_split_sizes_fused_and_equal():
    model = HandedCountsMoE().eval()
    inputs = _inputs()
    with torch.no_grad():
        report, output, recorder = run_hpu_moe(model, inputs)
        expected = eager_output(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, expected)
    assert not torch._dynamo.config.capture_scalar_outputs  # on for the hpu_moe compile only


def test_bincount_sizes_are_not_taken_for_counts():
    model = BincountSizesMoE().eval()
    inputs = _inputs()
    with torch.no_grad():
        report, output, _ = run_hpu_moe(model, inputs)
        expected = eager_output(model, inputs)
    assert report.graph_break_count > 0 and not report.fused, str(report)
    assert_close_for_dtype(output, expected)


def test_a_returned_count_bound_again_is_not_one():
    source = (
        "def gate(self, x):\n"
        "    a, b, sizes = route(1, 4, x, x)\n"
        "    sizes = sizes + 1\n"
        "    c, d, kept = route(1, 4, x, x)\n"
    )
    fn_def = ast.parse(source).body[0]

    def gate(self, x):  # the globals the names resolve in
        return route(1, 4, x, x)

    assert counts_returned(gate, fn_def, bindings(fn_def)) == {"kept"}

    table = {
        "route": lambda x: (x, x.sum(0)),  # its source line alone does not parse: no counts read
    }
    fn_def = ast.parse("def gate(self, x):\n    a, sizes = route(x)\n").body[0]
    with_lambda = types.FunctionType(gate.__code__, {**gate.__globals__, "route": table["route"]})
    assert counts_returned(with_lambda, fn_def, bindings(fn_def)) == set()


def test_new_tensor_of_a_list_becomes_tensor_like_and_keeps_dtype_and_device():
    tree = ast.parse("c = x.new_tensor([len(r) for r in rows])\nd = x.new_tensor([1, 2], dtype=torch.int8)\n")
    rewritten = ast.unparse(NewTensorOfList("helpers.tensor_like").visit(tree))
    assert rewritten.splitlines() == [
        "c = helpers.tensor_like(x, [len(r) for r in rows])",
        "d = x.new_tensor([1, 2], dtype=torch.int8)",
    ]
    like = torch.zeros(3, dtype=torch.float16)
    for data in ([3, 0, 2], [1.5, 2.0], ()):
        expected = like.new_tensor(data)
        made = tensor_like(like, data)
        assert (made.dtype, made.device, made.requires_grad) == (expected.dtype, expected.device, False)
        assert torch.equal(made, expected)


def test_prefix_cut_at_a_count_of_true_elements_becomes_a_narrow():
    source = (
        "def f(order, ids, k):\n"
        "    n = (ids < 4).sum().item()\n"
        "    m = int(((ids >= 0) & ~(ids == 2)).sum())\n"
        "    total = ids.sum().item()\n"
        "    return order[:n], order[:m], order[:total], order[:k]\n"
    )
    fn_def = ast.parse(source).body[0]
    counts = true_counts(fn_def, bindings(fn_def))
    assert counts == {"n", "m"}  # a sum of ids may be negative; k is not read on the host here
    bound_twice = ast.parse(
        "def f(order, ids, n=None):\n    if n is None:\n        n = (ids < 4).sum().item()\n    return order[:n]\n"
    ).body[0]
    assert true_counts(bound_twice, bindings(bound_twice)) == set()  # also a parameter: any int
    rewritten = ast.unparse(CutToCount("helpers.cut", counts).visit(fn_def)).splitlines()[-1]
    assert rewritten == "    return (helpers.cut(order, n), helpers.cut(order, m), order[:total], order[:k])"

    order = torch.arange(6).flip(0)
    for count in (0, 3, 6, 9):
        assert torch.equal(cut_to_count(order, count), order[:count])

    def kept(order, ids):
        return cut_to_count(order, (ids < 3).sum().item()) * 2

    ids = torch.tensor([0, 4, 1, 2, 5, 3])
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        compiled = torch.compile(kept, backend="eager", fullgraph=True)
        assert torch.equal(compiled(order, ids), order[:3] * 2)
        assert torch.equal(compiled(order, ids.clamp(max=2)), order * 2)


def _size_lists(source: str) -> frozenset[str]:
    fn_def = ast.parse(source).body[0]
    link_parents(fn_def)
    return split_size_lists(fn_def, bindings(fn_def))


def test_sizes_read_on_the_host_that_surely_reach_a_split_are_stated_at_least_zero():
    """torchtitan's `x[: sum(sizes)]` before `split(.., sizes)`: dynamo before torch 2.11 guards on the sign
    of the unbacked sum. Split raises on a negative size, so a read whose split is surely reached may
    state every size >= 0; a read that may not reach it (a return between, a conditional split, a `try`)
    is left alone."""
    source = (
        "def f(x, counts):\n"
        "    sizes = counts.tolist()\n"
        "    pad = x.shape[0] - sum(sizes)\n"
        "    parts = torch.split(x[: sum(sizes)], split_size_or_sections=sizes, dim=0)\n"
        "    return parts, pad\n"
    )
    assert _size_lists(source) == {"sizes"}
    fn_def = ast.parse(source).body[0]
    stated = StateSizes("helpers.state", frozenset({"sizes"})).visit(fn_def)
    stated = CutToCount("helpers.cut", frozenset(), frozenset({"sizes"})).visit(stated)
    assert ast.unparse(stated).splitlines()[1:4] == [
        "    sizes = helpers.state(counts.tolist())",
        "    pad = x.shape[0] - sum(sizes)",
        "    parts = torch.split(helpers.cut(x, sum(sizes)), split_size_or_sections=sizes, dim=0)",
    ]
    may_return = source.replace("    pad =", "    if x.numel() == 0:\n        return x, 0\n    pad =")
    conditional = source.replace("torch.split(x[: sum(sizes)], split_size_or_sections=sizes, dim=0)",
                                 "torch.split(x, sizes) if x.dim() else x")
    in_try = "def f(x, counts):\n    try:\n        s = counts.tolist()\n        return x.split(s)\n    except RuntimeError:\n        return x\n"
    bound_twice = source.replace("    pad =", "    sizes = [0] + sizes\n    pad =")
    stored_into = source.replace("    pad =", "    sizes[-1] = x.shape[0] - sum(sizes[:-1])\n    pad =")
    handed_on = source.replace("    pad =", "    log(sizes)\n    pad =")
    assert [_size_lists(s) for s in (may_return, conditional, in_try, bound_twice, stored_into, handed_on)] == [set()] * 6

    assert sizes_at_least_zero([0, 3, 1]) == [0, 3, 1] and sizes_at_least_zero(5) == 5
    with pytest.raises(RuntimeError):
        sizes_at_least_zero([2, -1])

    def pieces(x, counts):  # traced as the copy is: an unbacked sum bounds the cut, then split
        sizes = sizes_at_least_zero(counts.tolist())
        return [p * 2 for p in torch.split(cut_to_count(x, sum(sizes)), sizes)]

    x, counts = torch.arange(12.0).view(6, 2), torch.tensor([2, 0, 3])
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        got = torch.compile(pieces, backend="eager", fullgraph=True)(x, counts)
    assert [p.tolist() for p in got] == [p.tolist() for p in pieces(x, counts)]
