"""Routing ids that come into the graph as an input: their range is not proved, so they are never trusted.

An experts module compiled on its own (routing computed elsewhere, ids handed over by a framework) gives the
passes ids of any value. The fused call then keeps what the layer as written does with an id outside its
experts: where it compares ids with expert numbers, such an id contributes nothing (as in the kernel);
where it indexes its stacks (`w[ids]`), a negative id counts from the end and an id past the end raises;
where it raises (`one_hot`) or gives the id no defined meaning (a sort and a histogram: grouped_mm leaves
those rows uninitialised), the call raises, checked on the device with no host synchronisation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig
from transformers.models.mixtral import modeling_mixtral

from form_catalog._common import init_weights
from moe_passes.explain import explain, explain_and_run
from tests.helpers import RecordingInner, assert_close_for_dtype

E, H, INTER, T = 4, 16, 8, 3
ROOT = Path(__file__).resolve().parent.parent


class GatheredEinsum(torch.nn.Module):
    """gpt-fast's experts on weights gathered per slot, fed ids from outside."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(E, INTER, H, generator=g)) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(E, H, INTER, generator=g))

    def forward(self, x, w, ids):
        gate = F.silu(torch.einsum("ti,taoi->tao", x, self.w1[ids]))
        up = torch.einsum("ti,taoi->tao", x, self.w3[ids])
        return torch.einsum("tai,ta->ti", torch.einsum("tao,taio->tai", gate * up, self.w2[ids]), w)


class PickedOutputs(GatheredEinsum):
    """JetStream's Mixtral: every expert on every token, each token's outputs picked at its ids."""

    def forward(self, x, w, ids):
        h = F.silu(torch.einsum("ti,eoi->teo", x, self.w1)) * torch.einsum("ti,eoi->teo", x, self.w3)
        y = torch.einsum("teo,eio->tei", h, self.w2)
        return torch.einsum("tai,ta->ti", y[torch.arange(x.shape[0])[:, None], ids], w)


class TransformersExperts(torch.nn.Module):
    """transformers' MixtralExperts (batched_mm or grouped_mm), called with ids and weights."""

    def __init__(self, implementation: str):
        super().__init__()
        config = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E)
        config._experts_implementation = implementation
        self.experts = modeling_mixtral.MixtralExperts(config)
        init_weights(self, seed=0)

    def forward(self, x, w, ids):
        return self.experts(x, ids, w)


class ExpertLoop(torch.nn.Module):
    """A loop over a ModuleList of experts (`first`..`first`+count-1 of the router's), masks by `==`, by
    `one_hot(ids, router_experts)` or by a [T, router_experts] table scattered from the ids."""

    def __init__(self, one_hot: bool = False, first: int = 0, count: int = E, router_experts: int = E,
                 scatter: bool = False):
        super().__init__()
        self.one_hot, self.first, self.router_experts, self.scatter = one_hot, first, router_experts, scatter
        self.gate = torch.nn.ModuleList(torch.nn.Linear(H, INTER, bias=False) for _ in range(count))
        self.up = torch.nn.ModuleList(torch.nn.Linear(H, INTER, bias=False) for _ in range(count))
        self.down = torch.nn.ModuleList(torch.nn.Linear(INTER, H, bias=False) for _ in range(count))
        init_weights(self, seed=0)

    def forward(self, x, w, ids):
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, self.router_experts) if self.one_hot else None
        table = torch.zeros(x.shape[0], self.router_experts).scatter(1, ids, w) if self.scatter else None
        for e in range(len(self.gate)):
            chosen = mask[..., self.first + e] if self.one_hot else ids == self.first + e
            share = table[:, self.first + e, None] if self.scatter else (w * chosen).sum(-1, keepdim=True)
            out = out + share * self.down[e](F.silu(self.gate[e](x)) * self.up[e](x))
        return out


def compiled(model, target: str = "portable"):
    """`model` compiled with hpu_moe on valid ids (the graph later calls reuse): (fn, recorder, x, w,
    whether its layer was fused). The only decline allowed: transformers releases whose experts clamp ids
    onto their experts themselves (5.17's expert-parallel sentinel handling, tests/test_sentinels.py)."""
    recorder = RecordingInner("eager")
    torch._dynamo.reset()
    options = {"inner": recorder, "target": target}
    x, w, ids = torch.randn(T, H), torch.rand(T, 2), torch.tensor([[0, 1]] * T)
    with torch.no_grad():
        report, output = explain_and_run(model, x, w, ids, options=options)
        assert_close_for_dtype(output, model(x, w, ids))
    fused = len(recorder.fused_nodes())
    assert fused == 1 or (fused == 0 and "clamp or mask ids outside" in report.declined[0].reason), str(report)
    fn = torch.compile(model, backend="hpu_moe", options=options)
    with torch.no_grad():
        fn(x, w, ids)
    return fn, recorder, x, w, bool(fused)


CASES = {
    # model, {bad id: "eager" (the fused call gives eager's result) or "raises" (eager raises too, or
    # gives the id no defined meaning)}
    "gathered_einsum": (GatheredEinsum, {-1: "eager", -E: "eager", E: "raises", -E - 1: "raises"}),
    "picked_outputs": (PickedOutputs, {-1: "eager", -E: "eager", E: "raises", -E - 1: "raises"}),
    "batched_mm": (lambda: TransformersExperts("batched_mm"), {-1: "eager", E: "raises"}),
    "grouped_mm": (lambda: TransformersExperts("grouped_mm"), {-1: "raises", E: "raises"}),
    "loop_eq": (ExpertLoop, {-1: "eager", E: "eager", 100: "eager"}),
    "loop_one_hot": (lambda: ExpertLoop(one_hot=True), {-1: "raises", E: "raises"}),
}


@pytest.mark.parametrize("case", CASES)
def test_ids_from_outside_the_graph_keep_what_the_layer_does_with_them(case):
    if case in ("batched_mm", "grouped_mm") and not hasattr(modeling_mixtral, "MixtralExperts"):
        pytest.skip("transformers before 5 has no MixtralExperts module (optimum-habana pins 4.55.4)")
    build, expected = CASES[case]
    model = build().eval()
    fn, recorder, x, w, fused = compiled(model)
    graphs = len(recorder.graphs)
    with torch.no_grad():
        for bad, outcome in expected.items():
            ids = torch.tensor([[0, bad], [2, 1], [bad, 3]])
            if not fused:  # left as written: what eager does, where eager's result is defined
                if outcome == "eager":
                    assert_close_for_dtype(fn(x, w, ids), model(x, w, ids))
            elif outcome == "eager":
                assert_close_for_dtype(fn(x, w, ids), model(x, w, ids))
            else:
                with pytest.raises(RuntimeError, match=r"hpu_moe: a routing id of .* lies outside 0\.\.3"):
                    fn(x, w, ids)
    assert len(recorder.graphs) == graphs  # no recompile: one graph serves every id


def test_the_report_says_how_ids_from_outside_are_checked():
    report = explain(GatheredEinsum().eval(), torch.randn(T, H), torch.rand(T, 2), torch.tensor([[0, 1]] * T),
                     options={"target": "portable", "inner": "eager"})
    (fused,) = report.fused
    assert fused.ids_checked == "0..3, negative ids wrapped (aten.index)"
    assert "routing ids from outside the graph checked at run time: 0..3, negative ids wrapped" in str(report)


def test_out_of_window_ids_of_an_expert_parallel_rank_contribute_nothing():
    # Rank 0 of 2 holds experts 0..1 of 4; ids of rank 1's experts reach it and must add nothing, exactly
    # as the loop as written; an id the router cannot produce is dropped the same way (the loop compares).
    model = ExpertLoop(count=2, router_experts=4).eval()
    recorder = RecordingInner("eager")
    fn = torch.compile(model, backend="hpu_moe", options={"inner": recorder, "target": "portable"})
    x, w = torch.randn(T, H), torch.rand(T, 2)
    with torch.no_grad():
        for ids in ([[0, 1]] * T, [[2, 0], [1, 3], [3, 2]], [[5, 0], [-1, 3], [1, 9]]):
            assert_close_for_dtype(fn(x, w, torch.tensor(ids)), model(x, w, torch.tensor(ids)))
    (node,) = recorder.fused_nodes()
    assert (node.kwargs.get("experts_min", node.args[-2]), node.kwargs.get("experts_max", node.args[-1])) == (0, 1)
    assert not any("assert_async" in str(n.target) for n in recorder.graphs[0].graph.nodes)


@pytest.mark.parametrize("read_by", ["one_hot", "aten.scatter"])
def test_a_rank_reading_ids_from_outside_with_a_bound_checks_to_the_router_width(read_by):
    # one_hot(ids, 4) and a scatter into [T, 4] raise outside 0..3 in eager; ids of the other rank's
    # experts are valid and add nothing.
    model = ExpertLoop(one_hot=read_by == "one_hot", scatter=read_by != "one_hot", count=2, router_experts=4).eval()
    fn = torch.compile(model, backend="hpu_moe", options={"inner": "eager", "target": "portable"})
    x, w = torch.randn(T, H), torch.rand(T, 2)
    with torch.no_grad():
        ids = torch.tensor([[2, 0], [1, 3], [3, 2]])
        assert_close_for_dtype(fn(x, w, torch.tensor([[0, 1]] * T)), model(x, w, torch.tensor([[0, 1]] * T)))
        assert_close_for_dtype(fn(x, w, ids), model(x, w, ids))
        with pytest.raises(RuntimeError, match=rf"lies outside 0\.\.3.*\({read_by}\)"):
            fn(x, w, torch.tensor([[2, 4]] * T))


GAUDI_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from tests import hpu_contract
    hpu_contract.register_fake_gaudi_bridge()
    from tests.test_unbounded_ids import GatheredEinsum, compiled
    model = GatheredEinsum().eval()
    fn, recorder, x, w, _ = compiled(model, "hpu")
    ids = torch.tensor([[0, -1], [2, 1], [-1, 1]])  # no id twice in a row once wrapped
    with torch.no_grad():
        error = (fn(x, w, ids) - model(x, w, ids)).abs().max().item()
        try:
            fn(x, w, torch.tensor([[0, 4]] * 3))
            raised = None
        except RuntimeError as e:
            raised = str(e)
    ops = [str(n.target) for n in recorder.graphs[0].graph.nodes if n.op == "call_function"]
    print(json.dumps({{"error": error, "raised": raised, "ops": ops, "calls": len(hpu_contract.CALLS)}}))
    """
)


def test_the_gaudi_lowering_checks_ids_from_outside_too():
    code = GAUDI_SCRIPT.format(root=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["error"] < 1e-4 and out["calls"] >= 2
    assert out["raised"] is not None and "lies outside 0..3" in out["raised"]
    fused = next(i for i, op in enumerate(out["ops"]) if op.startswith("hpu.mixture_of_experts"))
    assert "aten._assert_async.msg" in out["ops"][:fused]
