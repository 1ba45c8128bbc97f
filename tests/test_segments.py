"""Segmented experts (transformers 4.x GraniteMoE, GraniteMoE-Shared, JetMoE): what is fused and what not.

The catalog's `granite4_segments` mirrors the 4.x block; real 4.55 / 4.57 models are in
tests/test_transformers4.py (JetMoE 5.x too: tests/test_transformers_models.py). Here: the cases the
equivalence argument names (top-1, one token, experts no token chose), the per-compile scalar capture
the adapter switches on, and near misses that must be declined with the construct named.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from form_catalog import catalog
from form_catalog.granite4_segments import SegmentGate, SegmentMoE
from moe_passes.adapters import hit_expert_loops
from tests.helpers import (
    assert_close_for_dtype,
    backward_like_eager,
    dynamo_breaks_on_tolist,
    eager_output,
    run_hpu_moe,
    skip_unless_dynamo_slices_for,
)

FORM = catalog()["granite4_segments"]


@pytest.mark.parametrize(
    "overrides",
    [dict(top_k=1), dict(tokens=1), dict(num_experts=8, tokens=2), dict(dtype=torch.bfloat16, tokens=5)],
    ids=["top1", "one_token", "unchosen_experts", "bf16"],
)
def test_segments_are_fused_and_equal(overrides):
    model, inputs = FORM.build(**overrides)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert [f.form for f in report.fused] == ["segments", "segments"], str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
    assert not torch._dynamo.config.capture_scalar_outputs  # switched on for that compile only


def test_without_the_adapter_nothing_is_fused_where_the_count_read_breaks_the_graph():
    """The count read breaks the graph, and nothing is fused (torch 2.9's dynamo keeps it in the graph
    instead, where the canonical trace reads it and the layer is fused); either way eager's numbers."""
    model, inputs = FORM.build(layers=1)
    report, output, recorder = run_hpu_moe(model, inputs, adapters=False)
    breaks = dynamo_breaks_on_tolist()
    assert not breaks or (report.graph_break_count > 0 and not recorder.fused_nodes()), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_only_count_reads_switch_scalar_capture_on():
    def counts(self, gates):
        sizes = gates.long().sum(0)
        sizes = sizes.tolist()
        return sizes

    def other(self, x):
        return x.max(1).values.tolist()

    assert hit_expert_loops.analyse(counts)[2].captures_scalars
    assert not hit_expert_loops.analyse(other)[2].captures_scalars


# ---------------------------------------------------------------------------------------------------
# Near misses: each changes what the block computes in one construct; the graph is captured with the
# user's setting so that the finder, not dynamo, must tell them apart.


class DescendingGate(SegmentGate):
    def forward(self, hidden_states):
        perm, _, _, sizes = super().forward(hidden_states)
        logits = self.layer(hidden_states).float()
        weights, ids = logits.topk(self.top_k, dim=1)
        weights = torch.softmax(weights, dim=1).type_as(hidden_states)
        _, perm = ids.flatten().sort(0, descending=True)  # expert E-1 first: not the counts' order
        return perm, perm.div(self.top_k, rounding_mode="trunc"), weights.flatten()[perm], sizes


class ShiftedCountsGate(SegmentGate):
    def forward(self, hidden_states):
        perm, batch_index, gates, sizes = super().forward(hidden_states)
        return perm, batch_index, gates, sizes[1:] + sizes[:1]  # sizes of another expert


class SwappedCountsGate(SegmentGate):
    def forward(self, hidden_states):
        top_k_logits, ids = self.layer(hidden_states).float().topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        swapped = torch.where(ids == 0, 1, torch.where(ids == 1, 0, ids))  # experts 0 and 1 counted swapped
        counts = torch.zeros(ids.shape[0], self.num_experts).scatter(1, swapped, 1).long().sum(0)
        _, perm = ids.flatten().sort(0)
        return perm, perm.div(self.top_k, rounding_mode="trunc"), top_k_gates.flatten()[perm], counts.tolist()


class UngatedMoE(SegmentMoE):
    """One projection, an activation, another projection: not act(gate) * up."""

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size = self.router(layer_input)
        hidden_states = self.activation(self.input_linear(layer_input[batch_index], expert_size))
        hidden_states = hidden_states[:, : hidden_states.shape[-1] // 2]
        expert_outputs = self.output_linear(hidden_states, expert_size) * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, emb_size), dtype=expert_outputs.dtype)
        return zeros.index_add(0, batch_index, expert_outputs).view(bsz, length, emb_size)


class AddedIntoTheInput(SegmentMoE):
    """The expert outputs are added into the input rows, not into zeros: the layer's output is x + MoE(x)."""

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size = self.router(layer_input)
        hidden_states = self.input_linear(layer_input[batch_index], expert_size)
        chunked = hidden_states.chunk(2, dim=-1)
        hidden_states = self.activation(chunked[0]) * chunked[1]
        expert_outputs = self.output_linear(hidden_states, expert_size) * batch_gates[:, None]
        return layer_input.index_add(0, batch_index, expert_outputs).view(bsz, length, emb_size)


class GateSecond(SegmentMoE):
    """dolomite-engine's GLU: `x[0] * act(x[1])`, the gate in the second half of the joined projection."""

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size = self.router(layer_input)
        hidden_states = self.input_linear(layer_input[batch_index], expert_size)
        chunked = hidden_states.chunk(2, dim=-1)
        hidden_states = chunked[0] * self.activation(chunked[1])
        expert_outputs = self.output_linear(hidden_states, expert_size) * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, emb_size), dtype=expert_outputs.dtype)
        return zeros.index_add(0, batch_index, expert_outputs).view(bsz, length, emb_size)


class UnequalParts(SegmentMoE):
    """A joined projection of 3 features cut into 1 and 2 (`h[:, :1] * act(h[:, 1:])`, broadcast): no
    halves, so neither order is a gated MLP of two equal halves."""

    gate_second = True

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size = self.router(layer_input)
        h = self.input_linear(layer_input[batch_index], expert_size)
        h = h[:, :1] * self.activation(h[:, 1:]) if self.gate_second else self.activation(h[:, :1]) * h[:, 1:]
        expert_outputs = self.output_linear(h, expert_size) * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, emb_size), dtype=expert_outputs.dtype)
        return zeros.index_add(0, batch_index, expert_outputs).view(bsz, length, emb_size)


@pytest.mark.parametrize("gate_second", [True, False])
def test_a_joined_projection_cut_into_unequal_parts_is_declined(gate_second):
    model, inputs = FORM.build(layers=1)
    moe = model.moes[0]
    moe.__class__ = UnequalParts
    moe.gate_second = gate_second
    experts, _, hidden = moe.input_linear.weight.shape
    with torch.no_grad():  # 3 joined features, 2 into the down projection
        moe.input_linear.weight = torch.nn.Parameter(torch.randn(experts, 3, hidden) * 0.1)
        moe.output_linear.weight = torch.nn.Parameter(torch.randn(experts, hidden, 2) * 0.1)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes() and report.declined, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class SortedBeforeABreak(SegmentMoE):
    """The routing sorted in one graph, the experts run in the next (a graph break between them)."""

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        _, batch_index, batch_gates, expert_size = self.router(layer_input)
        torch._dynamo.graph_break()
        hidden_states = self.input_linear(layer_input[batch_index], expert_size)
        chunked = hidden_states.chunk(2, dim=-1)
        hidden_states = self.activation(chunked[0]) * chunked[1]
        expert_outputs = self.output_linear(hidden_states, expert_size) * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, emb_size), dtype=expert_outputs.dtype)
        return zeros.index_add(0, batch_index, expert_outputs).view(bsz, length, emb_size)


NEAR_MISSES = {
    "descending_sort": (DescendingGate, None, "not ordered by sorting the flat expert ids"),
    "sizes_in_another_order": (ShiftedCountsGate, None, "is not the run of sorted slots routed to it"),
    "counts_of_other_ids": (SwappedCountsGate, None, "is not the run of sorted slots routed to it"),
    "ungated_experts": (None, UngatedMoE, "not act(gate) * up of joined segments"),
    "sorted_before_a_break": (None, SortedBeforeABreak, "indices this graph receives as an input"),
}


@pytest.mark.parametrize("case", list(NEAR_MISSES))
def test_near_misses_are_declined_with_the_construct_named(case):
    gate_class, moe_class, reason = NEAR_MISSES[case]
    model, inputs = FORM.build(layers=1)
    moe = model.moes[0]
    if gate_class is not None:
        moe.router.__class__ = gate_class
    if moe_class is not None:
        moe.__class__ = moe_class
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_break_count == 0) == (case != "sorted_before_a_break"), str(report)
    assert not recorder.fused_nodes(), str(report)
    assert len(report.declined) == 1 and reason in report.declined[0].reason, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_a_glu_that_reads_the_gate_from_the_second_half_is_fused_with_the_halves_as_two_roles():
    """dolomite-engine's `x[0] * act(x[1])`: the gate is W[I:2I] of the joined weight, the up W[:I]; the
    call takes them as two views of W (w1 gate, w2 up)."""
    model, inputs = FORM.build(layers=1)
    model.moes[0].__class__ = GateSecond
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1 and not report.declined, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_a_glu_that_reads_the_gate_from_the_second_half_trains_like_eager():
    """Gradients reach both halves of the joined weight through the two views (backward_like_eager
    compares every parameter's gradient with the eager model's)."""
    model, inputs = FORM.build(layers=1)
    model.moes[0].__class__ = GateSecond
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        report = backward_like_eager(model, inputs)
    assert [f.training for f in report.fused] == [True], str(report)


GATE_SECOND_ON_GAUDI = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from tests import hpu_contract
    hpu_contract.register_fake_gaudi_bridge()
    from tests.test_segments import FORM, GateSecond
    from tests.helpers import eager_output
    from moe_passes.explain import explain_and_run
    model, inputs = FORM.build(layers=1)
    model.moes[0].__class__ = GateSecond
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        report, output = explain_and_run(model, *inputs, options={{"inner": "eager", "target": "hpu"}})
    print(json.dumps({{"calls": hpu_contract.CALLS,
                      "error": (output - eager_output(model, inputs)).abs().max().item()}}))
    """
)


def test_a_glu_that_reads_the_gate_from_the_second_half_lowers_to_the_gaudi_op_with_split_roles():
    code = GATE_SECOND_ON_GAUDI.format(root=str(Path(__file__).resolve().parent.parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (call,) = result["calls"]
    assert call["overload"] == "default" and call["num_weights"] == 4, call
    gate, up, down = call["weight_shapes"]
    out, into = (0, 1) if call["permuted_weights"] else (1, 0)
    assert gate == up and gate[out] == down[into], call  # halves of the joined weight, I features each
    assert result["error"] < 1e-5, result  # the bridge's reference takes w1 as the gate: the halves are right


class SplitModuleListMoE(torch.nn.Module):
    """Hand-written in the style of Megatron-core's SequentialMLP and transformers 4.x DeepSeek-V2: whole
    per-expert MLPs (a ModuleList) on `split(sorted rows, counts.tolist())`, `cat`, the rows put back in
    slot order with `out[perm] = y`, weighted and summed over the k slots."""

    in_place = False

    def __init__(self, cfg: dict):
        super().__init__()
        from form_catalog._common import GatedMLP, Router

        self.num_experts = cfg["num_experts"]
        self.router = Router(cfg)
        self.experts = torch.nn.ModuleList(
            GatedMLP(cfg["hidden"], cfg["intermediate"], cfg["activation"]) for _ in range(cfg["num_experts"])
        )

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)
        tokens_per_expert = torch.histc(ids.view(-1).float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        tokens_per_expert = tokens_per_expert.long()
        perm = ids.view(-1).argsort()
        sorted_rows = flat[perm // ids.shape[1]]
        pieces = sorted_rows.split(tokens_per_expert.tolist())
        outs = torch.cat([expert(piece) for expert, piece in zip(self.experts, pieces, strict=True)])
        unpermuted = torch.empty_like(outs)
        unpermuted[perm] = outs
        if self.in_place:  # transformers 4.x DeepSeek-V2: the weights multiplied in place on the view
            weighted = unpermuted.view(*ids.shape, -1).type(weights.dtype).mul_(weights.unsqueeze(dim=-1))
            return weighted.sum(dim=1).type(unpermuted.dtype).view(x.shape)
        return (unpermuted.view(*ids.shape, -1) * weights.unsqueeze(-1)).sum(dim=1).view(x.shape)


class InPlaceWeightedMoE(SplitModuleListMoE):
    in_place = True


@pytest.mark.parametrize("moe_class", [SplitModuleListMoE, InPlaceWeightedMoE], ids=["product", "in_place"])
@pytest.mark.parametrize("overrides", [dict(), dict(tokens=1, num_experts=6), dict(top_k=1)], ids=["default", "decode", "top1"])
def test_whole_expert_mlps_on_split_segments_put_back_by_the_permutation_are_fused(moe_class, overrides):
    from form_catalog._common import TinyDecoder, finish, settings

    cfg = settings({"layers": 1, **overrides})
    model, inputs = finish(TinyDecoder(moe_class, cfg), cfg)
    _assert_one_segments_layer_fused(model, inputs)


def _assert_one_segments_layer_fused(model, inputs):
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert [f.form for f in report.fused] == ["segments"], str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_outputs_added_into_another_tensor_are_not_fused():
    """index_add into the input rows, not into zeros: one fused call would drop the input."""
    model, inputs = FORM.build(layers=1)
    model.moes[0].__class__ = AddedIntoTheInput
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count == 0 and not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


# ---------------------------------------------------------------------------------------------------
# Megatron-core's expert-major permutation (form_catalog/megatron_sequential_mlp.py): other spellings of it


MEGATRON = catalog()["megatron_sequential_mlp"]


def _megatron_tables(moe, hidden):
    """Megatron's router and dense tables: (routing probs [T, E], routing map [T, E])."""
    probs, ids = moe.router(hidden)
    table = torch.zeros(hidden.shape[0], len(moe.local_experts), dtype=probs.dtype)
    return table.scatter(1, ids, probs), table.int().scatter(1, ids, 1).bool()


class MaskedSelectPermute(MEGATRON.SequentialMoE):
    """Megatron's earlier `permute` (still in code derived from it): the tokens of the expert-major
    map's true cells by `arange(T).expand(E, T).masked_select(map.T)`, the probs by `masked_select`."""

    unstable_sort = False

    def forward(self, x):
        hidden = x.view(-1, x.shape[-1])
        routing_probs, routing_map = _megatron_tables(self, hidden)
        counts = routing_map.sum(dim=0).long().cpu()
        mask = routing_map.T.contiguous()
        if self.unstable_sort:
            cells = mask.reshape(-1).argsort(descending=True)[: int(counts.sum().item())]
            token_of_row = cells % hidden.shape[0]
        else:
            tokens = torch.arange(hidden.shape[0]).unsqueeze(0).expand(len(self.local_experts), -1)
            token_of_row = tokens.masked_select(mask)
        permuted_probs = routing_probs.T.contiguous().masked_select(mask)
        permuted = hidden.index_select(0, token_of_row)
        sizes = counts.tolist()
        rows, row_probs = torch.split(permuted, sizes), torch.split(permuted_probs, sizes)
        outputs = [expert(r, p) for expert, r, p in zip(self.local_experts, rows, row_probs, strict=True)]
        index = token_of_row.unsqueeze(1).expand(-1, hidden.shape[-1])
        return torch.zeros_like(hidden).scatter_add_(0, index, torch.cat(outputs, dim=0)).view(x.shape)


class UnstableCellSort(MaskedSelectPermute):
    """A descending sort that is not stable: within an expert the cells come in any order, so the probs
    read by `masked_select` (row-major order) need not belong to the rows they scale."""

    unstable_sort = True


@pytest.mark.parametrize("moe_class", [None, MaskedSelectPermute], ids=["argsort_cells", "masked_select"])
@pytest.mark.parametrize("overrides", [dict(), dict(tokens=1, num_experts=6), dict(top_k=1)], ids=["default", "decode", "top1"])
def test_megatron_permutations_are_fused_and_equal(moe_class, overrides):
    if moe_class is None:  # the masked_select spelling has no slice
        skip_unless_dynamo_slices_for("megatron_sequential_mlp")
    model, inputs = MEGATRON.build(layers=1, **overrides)
    if moe_class is not None:
        model.moes[0].__class__ = moe_class
    _assert_one_segments_layer_fused(model, inputs)


def test_megatron_unstable_cell_sort_is_declined():
    skip_unless_dynamo_slices_for("megatron_sequential_mlp")
    model, inputs = MEGATRON.build(layers=1)
    model.moes[0].__class__ = UnstableCellSort
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count == 0 and not recorder.fused_nodes(), str(report)
    assert len(report.declined) == 1 and "not ordered by sorting" in report.declined[0].reason, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
