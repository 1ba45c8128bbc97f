"""Zero-computation (identity) experts after the routed ones, in a hit-expert loop (LongCat-Flash).

The loop reads the expert's number as a Python int (`e = int(row.item())`) and branches on it: the
identity arm for the experts past the routed ones, a gated MLP of stacked weights otherwise. The routed
experts' accumulation is fused over their range of ids (the kernel skips the others) and the identity
experts' adds stay as written. Written here the way such a layer is written, with a router that sends
some tokens to the identity experts.

The sort-based spelling (LongCat-Next's deterministic MoE) cuts the ids' ascending sort order at the
number of routed slots, `order[:(ids < R).sum().item()]`, which keeps exactly the slots of experts
0..R-1; with R expert segments and a zeros buffer to scatter back into, it is fused over that range.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_close_for_dtype, backward_like_eager, eager_output, run_hpu_moe

HIDDEN, INTER, ROUTED, ZERO, TOP_K = 16, 8, 4, 2, 2


class ZeroExpertMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.routed, self.total = ROUTED, ROUTED + ZERO
        self.router = nn.Linear(HIDDEN, self.total, bias=True)
        with torch.no_grad():
            self.router.bias[-ZERO:] += 0.5  # identity experts are chosen by some tokens
        self.gate_up = nn.Parameter(torch.randn(self.total, 2 * INTER, HIDDEN) / HIDDEN**0.5)
        self.down = nn.Parameter(torch.randn(self.routed, HIDDEN, INTER) / INTER**0.5)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.total).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
        for row in hit:
            e = int(row.item())
            slot, token = torch.where(mask[e].squeeze(0))
            if token.numel() == 0:
                continue
            rows = x[token]
            if e >= self.routed:
                y = rows
            else:
                gate, up = F.linear(rows, self.gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(shape)


class IdentityInTheMiddle(ZeroExpertMoE):
    """Expert 1 is an identity: a non-MLP link between MLP links is declined, never cut around."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, ROUTED)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.routed).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
        for row in hit:
            e = int(row.item())
            slot, token = torch.where(mask[e].squeeze(0))
            rows = x[token]
            if e == 1:
                y = rows
            else:
                gate, up = F.linear(rows, self.gate_up[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(shape)


class InlineChoice(ZeroExpertMoE):
    """The arm chosen by a conditional expression; each expert's activation taken from a plain list by
    its number (a list has no shape: it is measured with len)."""

    def __init__(self):
        super().__init__()
        self.activations = [F.silu] * self.total

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.total).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
        for row in hit:
            e = int(row.item())
            slot, token = torch.where(mask[e].squeeze(0))
            rows = x[token]
            gate, up = F.linear(rows, self.gate_up[e]).chunk(2, dim=-1)
            act = self.activations[e]
            y = rows if e >= self.routed else F.linear(act(gate) * up, self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(shape)


class CarriedFlag(ZeroExpertMoE):
    """The branch reads a flag the previous iteration set: visiting more experts would change it."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.total).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
        first = True
        for row in hit:
            e = int(row.item())
            slot, token = torch.where(mask[e].squeeze(0))
            if e >= 0 and first:
                y = x[token] * 2.0
            else:
                y = x[token]
            first = False
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view(shape)


def _run(model):
    torch.manual_seed(0)
    model = model.eval()
    inputs = (torch.randn(2, 9, HIDDEN),)
    with torch.no_grad():
        report, output, _ = run_hpu_moe(model, inputs)
        ids = model.router(inputs[0].reshape(-1, HIDDEN)).topk(TOP_K, dim=-1).indices
    return report, output, eager_output(model, inputs), ids


def test_routed_experts_fused_over_their_range_identity_experts_kept():
    torch.manual_seed(0)
    report, output, expected, ids = _run(ZeroExpertMoE())
    assert (ids >= ROUTED).any() and (ids < ROUTED).any()  # both kinds are chosen
    assert (report.graph_count, report.graph_break_count, len(report.fused)) == (1, 0, 1), str(report)
    fused = report.fused[0]
    assert (fused.experts_min, fused.num_experts, fused.router_experts) == (0, ROUTED, ROUTED + ZERO)
    assert_close_for_dtype(output, expected)


def test_identity_expert_between_mlps_is_declined_and_equal():
    torch.manual_seed(0)
    report, output, expected, _ = _run(IdentityInTheMiddle())
    assert not report.fused and report.declined, str(report)
    assert "not a gated MLP" in report.declined[0].reason
    assert_close_for_dtype(output, expected)


def test_conditional_expression_and_a_list_indexed_by_number_fused_and_equal():
    torch.manual_seed(0)
    report, output, expected, _ = _run(InlineChoice())
    assert (report.graph_break_count, len(report.fused)) == (0, 1), str(report)
    assert report.fused[0].num_experts == ROUTED
    assert_close_for_dtype(output, expected)


def test_branch_on_state_carried_between_experts_is_left_as_written():
    torch.manual_seed(0)
    report, output, expected, _ = _run(CarriedFlag())
    assert report.graph_break_count > 0 and not report.fused, str(report)
    assert_close_for_dtype(output, expected)


def _doubled_forward(self, x):
    """ZeroExpertMoE's forward with its output doubled: what a patch of the method might change."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
    out = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=self.total).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero(as_tuple=False)
    for row in hit:
        e = int(row.item())
        slot, token = torch.where(mask[e].squeeze(0))
        rows = x[token]
        if e >= self.routed:
            y = rows
        else:
            gate, up = F.linear(rows, self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out.view(shape) * 2.0


def test_a_method_replaced_after_its_class_was_adapted_is_decided_again():
    """A patch over a loaded class (LongCat-Next replaces `moe` on the class it finds in the model):
    the next compile traces the new method, not the copy made of the old one."""

    class Patched(ZeroExpertMoE):
        moe = getattr(ZeroExpertMoE.forward, "__moe_passes_original__", ZeroExpertMoE.forward)

        def forward(self, x):
            return self.moe(x)

    torch.manual_seed(0)
    model = Patched().eval()
    inputs = (torch.randn(2, 9, HIDDEN),)
    with torch.no_grad():
        report, _, _ = run_hpu_moe(model, inputs)
        assert report.fused, str(report)  # Patched.moe adapted
        Patched.moe = _doubled_forward
        torch._dynamo.reset()
        _, output, _ = run_hpu_moe(model, inputs)
        assert_close_for_dtype(output, eager_output(model, inputs))


def test_transformers_longcat_flash_every_layer_fused():
    """transformers' own LongcatFlash (hit-expert loop, `int(row.item())`, identity arm), tiny and random."""
    from moe_passes import tiny_models

    if "longcat_flash" not in tiny_models.model_types():
        pytest.skip("this transformers has no LongcatFlash")
    model = tiny_models.tiny_model("longcat_flash", None)
    ids = torch.randint(0, tiny_models.VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        report, output, _ = run_hpu_moe(model, (ids,))
        expected = model(ids).logits
    assert report.graph_break_count == 0 and len(report.fused) == 2, str(report)
    assert all(f.num_experts < f.router_experts for f in report.fused)  # routed experts only
    assert_close_for_dtype(tiny_models.output_tensor(output), expected)


class SortedPrefixMoE(nn.Module):
    """The routed slots kept by cutting the sort order at their count, split per expert, scattered back
    into `buffer` in slot order; the identity experts add their share after (LongCat-Next)."""

    def __init__(self, cut_below=ROUTED, buffer=torch.zeros, capacity=None):
        super().__init__()
        self.cut_below, self.buffer, self.capacity = cut_below, buffer, capacity
        self.router = nn.Linear(HIDDEN, ROUTED + ZERO, bias=True)
        with torch.no_grad():
            self.router.bias[-ZERO:] += 0.5
        self.gate = nn.Parameter(torch.randn(ROUTED, INTER, HIDDEN) / HIDDEN**0.5)
        self.up = nn.Parameter(torch.randn(ROUTED, INTER, HIDDEN) / HIDDEN**0.5)
        self.down = nn.Parameter(torch.randn(ROUTED, HIDDEN, INTER) / INTER**0.5)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        routed_slots = (flat < self.cut_below).sum().item()
        order = order[:routed_slots] if self.capacity is None else order[: self.capacity]
        counts = torch.zeros(ROUTED, dtype=torch.long).scatter_add_(0, flat[order], torch.ones_like(order))
        pieces = torch.split(x.index_select(0, order // TOP_K), counts.tolist())
        outputs = []
        for e in range(ROUTED):
            piece = pieces[e]
            outputs.append((F.silu(piece @ self.gate[e].t()) * (piece @ self.up[e].t())) @ self.down[e].t())
        slots = self.buffer(flat.shape[0], shape[-1], dtype=x.dtype)
        slots.index_copy_(0, order, torch.cat(outputs))
        out = (slots.view(-1, TOP_K, shape[-1]) * weights.unsqueeze(-1)).sum(1)
        identity = (weights * (ids >= ROUTED).to(weights.dtype)).sum(-1, keepdim=True)
        return (out + x * identity).view(shape)


def test_sort_order_cut_at_the_routed_count_fused_over_the_routed_range():
    torch.manual_seed(0)
    model, inputs = SortedPrefixMoE().eval(), (torch.randn(2, 9, HIDDEN),)
    with torch.no_grad():
        assert (model.router(inputs[0]).topk(TOP_K, dim=-1).indices >= ROUTED).any()  # identity slots exist
        report, output, _ = run_hpu_moe(model, inputs)
        assert len(report.fused) == 1 and report.graph_break_count == 0, str(report)
        # the identity experts are the layer's own, not another rank's: no rank is named
        assert f"{ROUTED} experts: ids 0..{ROUTED - 1} of the router's {ROUTED + ZERO}," in str(report)
        assert_close_for_dtype(output, eager_output(model, inputs))


def test_sort_order_cut_at_the_routed_count_trains_fused_like_eager():
    torch.manual_seed(0)
    report = backward_like_eager(SortedPrefixMoE(), (torch.randn(2, 9, HIDDEN),))
    assert len(report.fused) == 1 and report.graph_break_count == 0, str(report)


@pytest.mark.parametrize(
    "variant, reason",
    [
        ({"cut_below": ROUTED - 1}, "cut to those of ids below 3, and 4 experts read them"),
        ({"capacity": 7}, "sorted slots are cut before the rows are gathered"),
    ],
    ids=["cut-below-fewer-than-the-experts", "cut-at-a-capacity"],
)
def test_other_cuts_of_the_sort_order_are_declined(variant, reason):
    torch.manual_seed(0)
    model, inputs = SortedPrefixMoE(**variant).eval(), (torch.randn(2, 9, HIDDEN),)
    with torch.no_grad():
        report, output, _ = run_hpu_moe(model, inputs)
        assert not report.fused and reason in report.declined[0].reason, str(report)
        assert_close_for_dtype(output, eager_output(model, inputs))


def test_a_cut_scattered_back_into_an_uninitialised_buffer_is_not_fused():
    """The slots past the cut keep what the buffer held: from `torch.empty` that is not zero, and the
    kernel, which adds nothing for them, would differ. (Eager's output is then undefined: not compared.)"""
    torch.manual_seed(0)
    model, inputs = SortedPrefixMoE(buffer=torch.empty).eval(), (torch.randn(2, 9, HIDDEN),)
    with torch.no_grad():
        report, _, _ = run_hpu_moe(model, inputs)
    assert not report.fused and report.declined, str(report)


class CastKeyedSort(nn.Module):
    """Segments by the counts of the ids, rows ordered by a sort of `key(ids)`: a sort of the ids only
    where the cast keeps every id (`.bool()` sorts expert 0's slots first and leaves the rest in slot
    order)."""

    def __init__(self, key):
        super().__init__()
        self.key = key
        self.router = nn.Linear(HIDDEN, ROUTED, bias=False)
        self.gate = nn.Parameter(torch.randn(ROUTED, INTER, HIDDEN) / HIDDEN**0.5)
        self.up = nn.Parameter(torch.randn(ROUTED, INTER, HIDDEN) / HIDDEN**0.5)
        self.down = nn.Parameter(torch.randn(ROUTED, HIDDEN, INTER) / INTER**0.5)

    def forward(self, x):
        weights, ids = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        flat = ids.view(-1)
        order = torch.argsort(self.key(flat), stable=True)
        counts = torch.zeros(ROUTED, dtype=torch.long).scatter_add_(0, flat, torch.ones_like(flat))
        pieces = torch.split(x.index_select(0, order // TOP_K), counts.tolist())
        outputs = []
        for e in range(ROUTED):
            piece = pieces[e]
            outputs.append((F.silu(piece @ self.gate[e].t()) * (piece @ self.up[e].t())) @ self.down[e].t())
        slots = torch.zeros(flat.shape[0], x.shape[-1], dtype=x.dtype)
        slots.index_copy_(0, order, torch.cat(outputs))
        return (slots.view(-1, TOP_K, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize(
    "key, fused", [(lambda ids: ids.int(), True), (lambda ids: ids.bool(), False), (lambda ids: ids.to(torch.int8), False)],
    ids=["int32", "bool", "int8"],
)
def test_a_sort_of_ids_cast_to_a_dtype_that_may_lose_ids_is_no_sort_of_the_ids(key, fused):
    torch.manual_seed(0)
    model, inputs = CastKeyedSort(key).eval(), (torch.randn(9, HIDDEN),)
    with torch.no_grad():
        report, output, _ = run_hpu_moe(model, inputs)
        assert bool(report.fused) == fused, str(report)
        assert_close_for_dtype(output, eager_output(model, inputs))
