"""Every expert module run on every token, the outputs stacked (`torch.stack([e(x) for e in experts], 1)`)
and combined by a [T, E] routing table or picked at each token's ids (hand-written MoE blocks)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from tests.loop_models import E, H, PresentIds


class StackedPicks(PresentIds):
    """`y.gather(1, ids[..., None].expand(-1, -1, H))` weighted and summed over the slots."""

    spelling = "gather"

    def forward(self, x):
        w, ids = self.route(x)
        y = torch.stack([expert(x) for expert in self.experts], dim=1)  # [T, E, H]
        if self.spelling == "gather":
            picked = torch.gather(y, 1, ids[..., None].expand(-1, -1, H))
        else:
            picked = y[torch.arange(x.shape[0])[:, None], ids]
        return (picked * w[..., None]).sum(1)


class StackedIndexPicks(StackedPicks):
    """`y[arange(T)[:, None], ids]`."""

    spelling = "index"


class StackedTable(PresentIds):
    """`(y * table[..., None]).sum(1)`, the table scattered from the ids and weights, the modules stacked in
    reverse order: column e weights module E - 1 - e, which the probes find."""

    def forward(self, x):
        w, ids = self.route(x)
        table = torch.zeros(x.shape[0], E, dtype=w.dtype).scatter(1, ids, w)
        y = torch.stack([expert(x) for expert in reversed(self.experts)], dim=1)
        return (y * table[..., None]).sum(1)


class StackedSoftmax(PresentIds):
    """Every expert weighted by a softmax over all of them: a dense mixture, not fused."""

    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        y = torch.stack([expert(x) for expert in self.experts], dim=1)
        return (y * probs[..., None]).sum(1)


@pytest.mark.parametrize("tokens", [6, 1], ids=["default", "decode"])
@pytest.mark.parametrize("cls", [StackedPicks, StackedIndexPicks, StackedTable], ids=lambda c: c.__name__)
def test_stacked_expert_outputs_are_fused(cls, tokens):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(tokens, H),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert report.fused[0].form == "stacked_outputs", str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_strict_mode_fuses_picks_and_refuses_a_table():
    """A pick reads only the routed experts' outputs; a table product reads every expert's (a NaN in an
    unrouted expert reaches eager's output, never the kernel's)."""
    torch.manual_seed(0)
    inputs = (torch.randn(6, H),)
    _, _, picks = run_hpu_moe(StackedPicks().eval(), inputs, strict=True)
    _, _, table = run_hpu_moe(StackedTable().eval(), inputs, strict=True)
    assert (len(picks.fused_nodes()), len(table.fused_nodes())) == (1, 0)


def test_a_softmax_over_every_expert_is_not_fused():
    torch.manual_seed(0)
    model = StackedSoftmax().eval()
    inputs = (torch.randn(6, H),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
