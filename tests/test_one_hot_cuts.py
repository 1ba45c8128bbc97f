"""One-hots sized by a value read on the host and cut to a fixed width (adapters/one_hot_cuts.py).

tensor2tensor-style gating sizes the one-hot of each token's slot by the largest slot seen, read with
Python's `max`, and cuts it back to the capacity; dynamo breaks the graph at that host read. Written here
in my own words, with the capacity dispatch done per group ([G, S, E, C], each group with its own
capacity) and the experts as batched einsums, as that gating's users write it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_passes.adapters.one_hot_cuts import traced_copy
from tests.helpers import eager_output, run_hpu_moe

E, H, INTER = 4, 16, 8


def slot_one_hot(slots, capacity):
    """Wide enough for every slot, whatever the capacity; then cut to it."""
    widest = slots.max() + 1
    width = max(widest, capacity)
    return F.one_hot(slots, width)[..., :capacity]


def inline_slot_one_hot(slots, capacity):
    return torch.nn.functional.one_hot(slots, max(capacity, slots.max() + 1))[..., :capacity]


def unproved_width(slots, capacity, width):
    return F.one_hot(slots, max(width, slots.max() + 1))[..., :capacity]


def width_parameter_bound_sometimes(slots, capacity, width, auto):
    if auto:
        width = max(slots.max() + 1, capacity)
    return F.one_hot(slots, width)[..., :capacity]


def cut_moved_after_the_max(slots, capacity):
    width = max(slots.max() + 1, capacity)
    capacity = capacity + 2
    return F.one_hot(slots, width)[..., :capacity]


def one_hot(slots, classes):  # a module's own one_hot, smoothed: not torch's
    return F.one_hot(slots, classes).float() * 0.9 + 0.1 / classes


def own_one_hot_cut(slots, capacity):
    return one_hot(slots, max(slots.max() + 1, capacity))[..., :capacity]


@pytest.mark.parametrize("helper", [slot_one_hot, inline_slot_one_hot], ids=lambda f: f.__name__)
@pytest.mark.parametrize("capacity", [1, 3, 9])
def test_the_copy_is_the_same_one_hot(helper, capacity):
    copy = traced_copy(helper)
    assert copy is not None and copy is not helper
    slots = torch.randint(0, 6, (2, 5, 3))
    expected = helper(slots, capacity)
    assert copy(slots, capacity).dtype == expected.dtype and torch.equal(copy(slots, capacity), expected)


@pytest.mark.parametrize("helper", [unproved_width, width_parameter_bound_sometimes, cut_moved_after_the_max,
                                    own_one_hot_cut], ids=lambda f: f.__name__)
def test_a_width_not_shown_to_reach_the_cut_is_left_as_written(helper):
    # the width need not reach the cut (a parameter, `capacity` rebound), or the one_hot is not torch's
    assert traced_copy(helper) is None


def test_a_negative_cut_is_computed_as_written():
    copy, slots = traced_copy(slot_one_hot), torch.tensor([0, 1, 2])
    assert torch.equal(copy(slots, -1), slot_one_hot(slots, -1))


class GroupedDispatch(nn.Module):
    """Top-1 dispatch per group: slots from a running count within the group, one-hot cut to the
    capacity; experts as batched einsums over [E, G, C, M]."""

    def __init__(self, capacity_factor: float):
        super().__init__()
        self.router = nn.Parameter(torch.randn(H, E) / H**0.5)
        self.w_in = nn.Parameter(torch.randn(E, H, INTER) / H**0.5)
        self.w_out = nn.Parameter(torch.randn(E, INTER, H) / INTER**0.5)
        self.capacity_factor = capacity_factor

    def forward(self, x):
        groups, tokens, _ = x.shape
        capacity = max(int(tokens * self.capacity_factor / E), 1)
        probs = torch.einsum("gsm,me->gse", x, self.router).softmax(dim=-1)
        gate, expert = probs.max(dim=-1)
        chosen = F.one_hot(expert, E).float()
        slot = ((chosen.cumsum(dim=1) - 1) * chosen).sum(dim=-1)
        kept = (slot < capacity).float()
        combine = (gate * kept)[..., None, None] * chosen[..., None] * slot_one_hot(slot.long(), capacity)[..., None, :]
        dispatch = combine.bool().to(x.dtype)
        rows = torch.einsum("gsm,gsec->egcm", x, dispatch)
        out = torch.einsum("egcm,emh->egch", rows, self.w_in).relu()
        out = torch.einsum("egch,ehm->egcm", out, self.w_out)
        return torch.einsum("egcm,gsec->gsm", out, combine)


@pytest.mark.parametrize("capacity_factor, reason", [
    (1.0, "tokens past an expert's capacity are dropped"),  # C = 1 < 5 tokens a group
    (4.0, "dispatched in groups"),  # C = 5: nothing dropped, the grouped form is not rewritten
])
def test_a_grouped_dispatch_is_one_graph_and_declined(capacity_factor, reason):
    torch.manual_seed(0)
    model = GroupedDispatch(capacity_factor).eval()
    inputs = (torch.randn(2, 5, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    torch.testing.assert_close(output, eager_output(model, inputs))
    assert report.graph_count == 1 and report.graph_break_count == 0, str(report)
    assert not report.fused and len(report.declined) == 1, str(report)
    assert reason in report.declined[0].reason, str(report)


def test_eager_backend_still_breaks_at_the_host_read():
    """The copy is traced under hpu_moe only: other backends see the function as written."""
    torch._dynamo.reset()
    model = GroupedDispatch(1.0).eval()
    explained = torch._dynamo.explain(model)(torch.randn(2, 5, H))
    assert explained.graph_break_count >= 1
