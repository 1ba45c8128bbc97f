"""The hit-expert-loop adapter: what it proves from the source, and that the adapted loop is the same.

The catalog's `hf4_hit_expert_loop` is transformers 4.55's Mixtral block; real transformers 4.55 / 4.57
models are tested in tests/test_transformers4.py. Here: the cases the equivalence argument names
(top-1 routing, experts no token chose, one token), what plain dynamo and eager still run, and the
declines, each naming the construct that stopped the proof.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from form_catalog import catalog
from form_catalog.hf4_hit_expert_loop import HitExpertLoopMoE
from moe_passes.adapters import hit_expert_loops
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from tests.loop_models import GatedExpert

FORM = catalog()["hf4_hit_expert_loop"]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(top_k=1),  # one-element index tensors: shapes differ from int indexing
        dict(tokens=1),  # decode: one token, most experts not chosen
        dict(num_experts=8, tokens=2, top_k=2),  # at least 4 of 8 experts not chosen
        dict(tokens=1, top_k=1, num_experts=6),
        dict(dtype=torch.bfloat16, tokens=5),
    ],
    ids=["top1", "one_token", "unchosen_experts", "one_token_top1", "bf16"],
)
@pytest.mark.parametrize("form", ["hf4_hit_expert_loop", "gpt_oss4_hit_loop"])
def test_adapted_loop_is_fused_and_equal(form, overrides):
    """gpt_oss4_hit_loop: `expert_idx = expert_idx[0]` and a sentinel class skipped by `continue`."""
    model, inputs = catalog()[form].build(**overrides)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 2, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_unchosen_experts_really_occur_in_the_decode_case():
    model, (x,) = FORM.build(tokens=1, num_experts=8)
    weights, ids = model.moes[0].router(x.view(-1, x.shape[-1]))
    assert ids.unique().numel() < 8


def test_plain_dynamo_and_eager_keep_the_original_loop():
    model, inputs = FORM.build()
    run_hpu_moe(model, inputs)  # installs the adapter on the class
    assert "form_catalog.hf4_hit_expert_loop.HitExpertLoopMoE" in hit_expert_loops_adapted()
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(*inputs)
    assert explanation.graph_break_count > 0  # other backends trace the hit loop as written
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops  # the hpu_moe compile restored it


def hit_expert_loops_adapted() -> dict[str, str]:
    from moe_passes.adapters import adapted_classes

    return {name: how for name, how in adapted_classes().items() if how == hit_expert_loops.NAME}


# ---------------------------------------------------------------------------------------------------
# Variants: defined here so that their source can be read. Each differs from the catalog block in one
# construct; those the proof cannot cover are declined with that construct named.


class WeightsBeforeExpert(HitExpertLoopMoE):
    """Adapted (the loop is equivalent), then declined by the passes: weights scale the expert's input."""

    def forward(self, x):
        batch, seq, hidden_dim = x.shape
        hidden_states = x.view(-1, hidden_dim)
        routing_weights, selected_experts = self.router(hidden_states)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, expert_layer(current_state))
        return final_hidden_states.reshape(batch, seq, hidden_dim)


class AnyHitTest(HitExpertLoopMoE):
    """`M.any(dims)` is a hit test for any mask; index_put_ with accumulate=True accumulates."""

    def forward(self, x):
        batch, seq, hidden_dim = x.shape
        hidden_states = x.view(-1, hidden_dim)
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = selected_experts.T.unsqueeze(0) == torch.arange(self.num_experts)[:, None, None]
        hit = mask.any(dim=(1, 2)).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](hidden_states[token]) * routing_weights[token, slot, None]
            out.index_put_((token,), y, accumulate=True)
        return out.reshape(batch, seq, hidden_dim)


class ConditionalBody(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            y = self.experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None]
            if expert_idx == 0:
                y = y * 2
            out.index_add_(0, top_x, y)
        return out.view(x.shape)


class SkipsAnExpertByIndex(HitExpertLoopMoE):
    """`if expert_idx == 0: continue`: skips the same hit rows as before, and nothing for the others."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            if expert_idx == 0:
                continue
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            out.index_add_(0, top_x, self.experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None])
        return out.view(x.shape)


class CountsCalls(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        calls = []
        for expert_idx in expert_hit:
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            calls.append(expert_idx)
            out.index_add_(0, top_x, self.experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None])
        return out.view(x.shape) * len(calls)


class SignedMask(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = (selected_experts.T.unsqueeze(0) == torch.arange(self.num_experts)[:, None, None]).int()
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](hidden_states[token]) * routing_weights[token, slot, None])
        return out.view(x.shape)


class CancellingMask(HitExpertLoopMoE):
    """A signed mask whose row for expert 0 sums to zero while it has entries: the original never visits
    expert 0, so neither may the copy (it reads the mask gated by the hit test)."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = (selected_experts.T.unsqueeze(0) == torch.arange(self.num_experts)[:, None, None]).int()
        mask = torch.cat([mask[:1] - mask[:1].roll(1, dims=-1), mask[1:]])
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](hidden_states[token]) * routing_weights[token, slot, None])
        return out.view(x.shape)


class SignedMaskReadWhole(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = (selected_experts.T.unsqueeze(0) == torch.arange(self.num_experts)[:, None, None]).int()
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](hidden_states[token]) * routing_weights[token, slot, None] * mask.sum()
            out.index_add_(0, token, y)
        return out.view(x.shape)


class FormattedKeys(torch.nn.Module):
    """transformers 5.x Switch Transformers: experts in a ModuleDict keyed `expert_{i}`, looked up with the
    row's element formatted into the key, under a hit test over a mask handed in (not seen to be one-hot)."""

    def __init__(self, missing: int | None = None):
        super().__init__()
        self.gate = torch.nn.Linear(8, 6, bias=False)
        self.experts = torch.nn.ModuleDict(
            {f"expert_{i}": GatedExpert(8) for i in range(6) if i != missing})
        self.register_buffer("never", torch.zeros(6).index_fill_(0, torch.tensor([missing or 0]), -1e4)
                             if missing is not None else torch.zeros(6))

    def forward(self, x):
        weights, ids = torch.topk((self.gate(x) + self.never).softmax(-1), 2)
        return self.run_experts(x, F.one_hot(ids, 6), weights)

    def run_experts(self, x, selected, weights):
        out = torch.zeros_like(x)
        expert_mask = selected.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            slot, token = torch.where(expert_mask[expert_idx].squeeze(0))
            y = self.experts[f"expert_{expert_idx[0]}"](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class RowsNotFromTheMask(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            top_x = torch.arange(hidden_states.shape[0])
            out.index_add_(0, top_x, self.experts[expert_idx](hidden_states) * 0.5)
        return out.view(x.shape)


class LastExpertUsedAfter(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            y = self.experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None]
            out.index_add_(0, top_x, y)
        return out.view(x.shape) + y.sum()


class ExtraClassNoSkip(HitExpertLoopMoE):
    """transformers 5.x DBRX: one_hot over E + 1 classes (an expert-parallel sentinel), no `continue` for
    the extra class: the original only visits it by raising IndexError, so the rewrite stops at E."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            idx, top_x = torch.where(expert_mask[expert_idx])
            out.index_add_(0, top_x, self.experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None])
        return out.view(x.shape)


class ExpertBuiltInTheBody(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            experts = list(self.experts)
            out.index_add_(0, top_x, experts[expert_idx](hidden_states[top_x]) * routing_weights[top_x, idx, None])
        return out.view(x.shape)


DECLINED = {
    ConditionalBody: "an `if` statement in the loop body (`if expert_idx == 0:`)",
    CountsCalls: "a call in the loop body (`calls.append(expert_idx)`)",
    SignedMaskReadWhole: "the loop reads it other than as mask[e]",
    RowsNotFromTheMask: "the accumulated rows are not the non-zero entries",
    LastExpertUsedAfter: "y, bound in the loop body, is read outside the loop",
    ExpertBuiltInTheBody: "its length cannot be read before the loop",
}


@pytest.mark.parametrize("cls", list(DECLINED), ids=lambda c: c.__name__)
def test_loops_the_source_does_not_prove_equivalent_are_left_with_the_construct_named(cls):
    assert hit_expert_loops.traceable_forward_of(cls) is None
    reason = hit_expert_loops.declined_classes()[f"{cls.__module__}.{cls.__qualname__}"]
    assert DECLINED[cls] in reason, reason
    assert "line " in reason


def _swap(model, cls):
    for moe in model.moes:
        moe.__class__ = cls


def test_an_adapted_loop_the_passes_decline_runs_unfused_and_equal():
    model, inputs = FORM.build(layers=1, tokens=3, num_experts=6)
    _swap(model, WeightsBeforeExpert)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_count == 1 and not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("cls", [SignedMask, CancellingMask], ids=lambda c: c.__name__)
def test_a_sum_test_over_a_mask_of_any_sign_reads_the_mask_gated_by_it(cls):
    """The copy visits every expert and reads mask[e] where the test held, else nothing: SignedMask is
    fused; CancellingMask's expert 0 (entries, zero sum) is skipped as the original skips it."""
    model, inputs = FORM.build(layers=1, tokens=5, num_experts=6)
    _swap(model, cls)
    report, output, _ = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    expected = eager_output(model, inputs)
    assert_close_for_dtype(output, expected)
    if cls is CancellingMask:  # the case is real: expert 0 has entries and the original skips it
        hidden = inputs[0].view(-1, inputs[0].shape[-1])
        _, ids = model.moes[0].router(hidden)
        assert (ids == 0).any() and (ids == 0).sum() < ids.shape[0]
    else:
        assert len(report.fused) == 1, str(report)


@pytest.mark.parametrize("missing", [None, 5])
def test_experts_keyed_by_the_formatted_row_are_fused(missing):
    """With a key missing (an expert no token can pick: the gate has 6 outputs, one key is absent and
    never hit with these inputs), the copy skips that row as the original never visits it."""
    torch.manual_seed(0)
    model = FormattedKeys(missing).eval()
    inputs = (torch.randn(5, 8),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, len(report.fused)) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_any_hit_test_and_index_put_are_adapted_and_fused():
    model, inputs = FORM.build(layers=1, tokens=3, num_experts=6)
    _swap(model, AnyHitTest)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("loop", ["hit_experts", "range_loop", "guarded_range_loop"])
def test_adapters_off_leave_the_loop_as_written(loop):
    """Each kind of loop the adapter handles breaks the graph, and nothing fuses, without it."""
    if loop == "range_loop":
        model, inputs = catalog()["hf4_sparse_loop"].build(layers=1)  # its DYNAMO_CONFIG not applied
    else:
        model, inputs = FORM.build(layers=1)
        if loop == "guarded_range_loop":
            _swap(model, GuardedRangeLoop)
    report, output, recorder = run_hpu_moe(model, inputs, adapters=False)
    assert report.graph_break_count > 0 and not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", ["hf4_sparse_loop", "mixtral4_sparse_loop"])
def test_range_loops_need_no_dynamo_setting_under_hpu_moe(name):
    """The range(E) loops' torch.where is captured for hpu_moe's own trace (their DYNAMO_CONFIG unset)."""
    model, inputs = catalog()[name].build()
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 2, str(report)
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("overrides", [dict(), dict(tokens=1, num_experts=6)], ids=["default", "decode"])
def test_a_continue_on_the_expert_index_is_kept_static_and_the_rest_fused(overrides):
    """Expert 0 skipped: the loop is traced without a data-dependent branch and fused over experts 1..E-1
    (the kernel's experts_min, as for one rank's experts), equal to eager."""
    model, inputs = FORM.build(layers=1, **overrides)
    _swap(model, SkipsAnExpertByIndex)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("overrides", [dict(), dict(tokens=1, top_k=1)], ids=["default", "decode_top1"])
def test_rows_beyond_the_indexed_containers_are_not_visited(overrides):
    model, inputs = FORM.build(layers=1, **overrides)
    _swap(model, ExtraClassNoSkip)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_the_report_names_a_loop_left_as_written():
    model, inputs = FORM.build(layers=1)
    _swap(model, ConditionalBody)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count > 0 and not recorder.fused_nodes()
    named = [a for a in report.advice if a.startswith("expert loop left as written")]
    assert len(named) == 1 and "an `if` statement in the loop body" in named[0], report.advice
    assert_close_for_dtype(output, eager_output(model, inputs))


class GuardedRangeLoop(HitExpertLoopMoE):
    """transformers 4.55 DeepSeek-V3 / GLM-4-MoE / dots1: a `moe` method looping over every expert, the
    work under `if token_indices.numel() > 0:` (a data-dependent branch: dynamo breaks the graph)."""

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = torch.nn.functional.one_hot(topk_indices, num_classes=len(self.experts))
        expert_mask = expert_mask.permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            mask = expert_mask[expert_idx]
            token_indices, weight_indices = torch.where(mask)
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_input = hidden_states[token_indices]
                expert_output = expert(expert_input)
                weighted_output = expert_output * expert_weights.unsqueeze(-1)
                final_hidden_states.index_add_(0, token_indices, weighted_output)
        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        return self.moe(hidden_states, selected_experts, routing_weights).view(x.shape)


class GuardWithAnotherEffect(GuardedRangeLoop):
    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = torch.nn.functional.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            token_indices, weight_indices = torch.where(expert_mask[expert_idx])
            if token_indices.numel() > 0:
                final_hidden_states.index_add_(0, token_indices, self.experts[expert_idx](hidden_states[token_indices]))
                final_hidden_states += 0.1  # runs only for experts some token chose
        return final_hidden_states.type(hidden_states.dtype)


class SkipEmptyRangeLoop(HitExpertLoopMoE):
    """transformers 4.x Jamba / PhiMoE: `if top_x.shape[0] == 0: continue` before the work."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            current_state = hidden_states[None, top_x].reshape(-1, x.shape[-1])
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.view(x.shape)


@pytest.mark.parametrize("overrides", [dict(), dict(tokens=1, num_experts=6), dict(top_k=1)], ids=["default", "decode", "top1"])
@pytest.mark.parametrize("cls", [GuardedRangeLoop, SkipEmptyRangeLoop], ids=lambda c: c.__name__)
def test_emptiness_guards_are_removed_and_the_loop_fused(cls, overrides):
    model, inputs = FORM.build(layers=1, **overrides)
    _swap(model, cls)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_a_guard_over_another_effect_is_kept_with_its_graph_break():
    model, inputs = FORM.build(layers=1, tokens=2, num_experts=6)
    _swap(model, GuardWithAnotherEffect)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count > 0 and not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class GuardOnOtherRows(GuardedRangeLoop):
    """The guard tests the rows of one mask, the accumulation uses another's: not removable."""

    def moe(self, hidden_states, topk_indices, topk_weights):
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = torch.nn.functional.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        first_slot = expert_mask[:, :, :1]
        for expert_idx in range(len(self.experts)):
            first_tokens, _ = torch.where(first_slot[expert_idx])
            token_indices, weight_indices = torch.where(expert_mask[expert_idx])
            if first_tokens.numel() > 0:
                expert_output = self.experts[expert_idx](hidden_states[token_indices])
                final_hidden_states.index_add_(0, token_indices, expert_output * topk_weights[token_indices, weight_indices, None])
        return final_hidden_states.type(hidden_states.dtype)


def test_a_guard_on_other_rows_than_the_accumulation_is_kept():
    # traced as written: a kept test of selected rows under captured shapes could make dynamo raise
    assert "moe" not in hit_expert_loops.adaptations_of(GuardOnOtherRows)
    model, inputs = FORM.build(layers=1, tokens=2, num_experts=6)
    _swap(model, GuardOnOtherRows)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count > 0 and not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


# --- only expert loops are adapted ---


class ClusterLoop(torch.nn.Module):
    """Rows picked by a range test per cluster (adaptive softmax style): not one expert's tokens."""

    def __init__(self):
        super().__init__()
        self.cutoffs = [2, 5]
        self.tail = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in self.cutoffs)

    def forward(self, x, target):
        out = torch.zeros_like(x)
        bounds = [0, *self.cutoffs]
        for i in range(len(bounds) - 1):
            mask = (target >= bounds[i]) & (target < bounds[i + 1])
            rows = mask.nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            out.index_add_(0, rows, self.tail[i](x.index_select(0, rows)))
        return out


class PerSequenceLoop(torch.nn.Module):
    """A loop over zipped per-sequence data selecting marked tokens: no expert index."""

    def forward(self, states, token_ids, marks):
        picked = []
        for data, ids, mark in zip(states, token_ids, marks, strict=True):
            picked.append(data[(ids == mark).nonzero(as_tuple=True)[0]])
        return picked


class SpanPerModuleLoop(torch.nn.Module):
    """Per module of a list, the positions from its start on (a bound that changes with the module) and
    the tokens whose score passes a threshold in a batch loop: spans and sequences, no expert's tokens."""

    def __init__(self):
        super().__init__()
        self.starts = [0, 3]
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in self.starts)

    def forward(self, x, scores):
        positions = torch.arange(x.size(0))
        out = torch.zeros_like(x)
        for i, block in enumerate(self.blocks):
            span = positions >= self.starts[i]
            out[span] += block(x[span])
        for b in range(scores.size(0)):
            out[b][scores[b] > 0] = 0
        return out


class ValueHistogram(torch.nn.Module):
    """A histogram over the values' own range handed to a method: counts of no experts."""

    def forward(self, x):
        counts = torch.histc(x, bins=4, min=float(x.min()), max=float(x.max()))
        return self.combine(counts.tolist())

    def combine(self, counts):
        return sum(counts)


@pytest.mark.parametrize("cls", [ClusterLoop, PerSequenceLoop, SpanPerModuleLoop, ValueHistogram,
                                 torch.nn.AdaptiveLogSoftmaxWithLoss])
def test_loops_that_select_no_experts_tokens_are_not_adapted(cls):
    assert hit_expert_loops.adaptations_of(cls) == {}


def test_torch_observer_histograms_are_not_expert_counts():
    from torch.ao.quantization.observer import HistogramObserver

    assert hit_expert_loops.adaptations_of(HistogramObserver) == {}


class OffsetIdLoop(torch.nn.Module):
    """`ids == start + e` (a rank's window) is still one expert's mask: adapted (shapes captured)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, ids, weights, start: int = 0):
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            expert_id = start + e
            token, slot = (ids == expert_id).nonzero(as_tuple=True)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


def test_a_mask_of_an_offset_expert_id_is_an_expert_loop():
    assert set(hit_expert_loops.adaptations_of(OffsetIdLoop)) == {"forward"}


class ZippedMaskLoop(torch.nn.Module):
    """Per-expert masks zipped with the experts (LitGPT's spelling, written afresh): `masks[e]` is
    expert e's [T, k] mask, selected with `torch.where`; `boolean_index` selects rows by `mask.any(-1)`."""

    def __init__(self, hidden=8, experts=4, top_k=2, boolean_index=False):
        super().__init__()
        self.top_k, self.boolean_index = top_k, boolean_index
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(GatedExpert(hidden) for _ in range(experts))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        masks = F.one_hot(ids, len(self.experts)).permute(2, 0, 1).bool()
        out = torch.zeros_like(x)
        for mask, expert in zip(masks, self.experts[:], strict=True):
            if self.boolean_index:
                picked = mask.any(-1)
                out[picked] += (weights * mask)[picked].sum(-1, keepdim=True) * expert(x[picked])
            else:
                token, slot = torch.where(mask)
                out[token] += weights[token, slot, None] * expert(x[token])
        return out


@pytest.mark.parametrize("boolean_index", [False, True], ids=["where", "boolean_index"])
def test_masks_zipped_with_the_experts_are_captured_and_fused(boolean_index):
    torch.manual_seed(0)
    model = ZippedMaskLoop(boolean_index=boolean_index).eval()
    inputs = (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class MaskAnyGuard(torch.nn.Module):
    """`if mask.any():` around one expert's work, with an `elif self.training:` arm (minimind's skip of an
    expert no token chose, written afresh): removable."""

    def __init__(self, hidden=8, experts=4, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(GatedExpert(hidden) for _ in range(experts))

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = ids == e
            if chosen.any():
                rows = chosen.any(dim=-1).nonzero().flatten()
                out.index_add_(0, rows, expert(x[rows]) * weights[chosen].unsqueeze(-1))
            elif self.training:
                out[0, 0] += 0 * sum(p.sum() for p in expert.parameters())
        return out


class GuardOnAnotherMask(MaskAnyGuard):
    """The guard tests another mask than the one the rows come from: kept."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = ids == e
            first = ids[:, :1] == e
            if first.any():
                rows = chosen.any(dim=-1).nonzero().flatten()
                out.index_add_(0, rows, expert(x[rows]) * weights[chosen].unsqueeze(-1))
        return out


class GuardWithADataElif(MaskAnyGuard):
    """The other arm's test reads the data (`elif x.sum() > 0:`): kept."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = ids == e
            if chosen.any():
                rows = chosen.any(dim=-1).nonzero().flatten()
                out.index_add_(0, rows, expert(x[rows]) * weights[chosen].unsqueeze(-1))
            elif x.sum() > 0:
                out[0, 0] += 1.0
        return out


class MaskReboundBeforeTheGuard(MaskAnyGuard):
    """The rows come from the first `chosen`; the guard tests a re-bound one (slot 0 only): kept."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = ids == e
            rows = chosen.any(dim=-1).nonzero().flatten()
            weight = (weights * chosen).sum(-1, keepdim=True)
            chosen = ids[:, :1] == e
            if chosen.any():
                out.index_add_(0, rows, expert(x[rows]) * weight[rows])
        return out


class RowsReboundInsideTheGuard(MaskAnyGuard):
    """An emptiness guard on rows re-bound inside it to more rows: the accumulation's rows are not the
    tested ones, so the guard is kept (the rows' earlier binding is forgotten at the re-binding)."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel() > 0:
                token = torch.cat([token, token[:1]])
                slot = torch.cat([slot, slot[:1]])
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class SkipUnlessAny(MaskAnyGuard):
    """`if not torch.any(mask): continue` before the expert's work (TensorRT-LLM's `VanillaMoE`): removable."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = ids == e
            if not torch.any(chosen):
                continue
            token, slot = torch.where(chosen)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class SkipUnlessAnyOtherMask(SkipUnlessAny):
    """The skip tests the first slot's mask, the rows come from both: kept."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen, first = ids == e, ids[:, :1] == e
            if not torch.any(first):
                continue
            token, slot = torch.where(chosen)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


@pytest.mark.parametrize("tokens", [6, 1], ids=["default", "decode"])
@pytest.mark.parametrize("cls", [MaskAnyGuard, SkipUnlessAny], ids=lambda c: c.__name__)
def test_a_mask_any_guard_is_removed_and_the_loop_fused(tokens, cls):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(tokens, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize(
    "cls", [GuardOnAnotherMask, GuardWithADataElif, MaskReboundBeforeTheGuard, RowsReboundInsideTheGuard,
            SkipUnlessAnyOtherMask],
    ids=lambda c: c.__name__,
)
def test_a_mask_guard_the_source_does_not_prove_is_kept(cls):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert report.graph_break_count > 0 and not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_the_training_arm_of_a_mask_guard_runs_as_written():
    from tests.helpers import backward_like_eager

    torch.manual_seed(0)
    report = backward_like_eager(MaskAnyGuard(), (torch.randn(6, 8),))
    assert report.graph_break_count > 0, str(report)  # `elif self.training:` keeps the data-dependent test


class HostReadInTheBody(MaskAnyGuard):
    """An `.item()` in the loop body breaks the graph inside the loop: dynamo gives up on the method and
    runs it eagerly, the adapter's switches included."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            scale = float(token.numel() > 0) + weights.sum().item() * 0
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None] * scale)
        return out


def test_a_method_dynamo_gives_up_on_reports_only_the_users_breaks():
    """The switches run as plain Python there (compiled as frames of their own, they broke on dynamo's
    internals, and the report named this package's lines as breaks), also after `torch._dynamo.reset()`."""
    torch.manual_seed(0)
    model = HostReadInTheBody().eval()
    inputs = (torch.randn(6, 8),)
    for _ in range(2):
        torch._dynamo.reset()
        report, output, _ = run_hpu_moe(model, inputs)
        assert report.graph_breaks and all("moe_passes" not in b.location for b in report.graph_breaks), str(report)
        assert_close_for_dtype(output, eager_output(model, inputs))


class HitBySlotZeroRowsByAll(MaskAnyGuard):
    """The hit test reads the first slot's ids, the rows every slot's (`tokens[flat == e]`): an expert
    chosen only in the second slot is never visited by the original. Kept."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        tokens = torch.arange(x.shape[0]).repeat_interleave(self.top_k)
        flat, flat_weights = ids.flatten(), weights.flatten()
        mask = ids[:, 0][None, :] == torch.arange(len(self.experts))[:, None]
        hit = mask.any(dim=1).nonzero()
        out = torch.zeros_like(x)
        for e in hit:
            chose = flat == e
            token = tokens[chose]
            out.index_add_(0, token, self.experts[e](x[token]) * flat_weights[chose, None])
        return out


class HitReadAfterTheLoop(MaskAnyGuard):
    """The loop variable read after a hit loop: the last expert hit, not the last expert (which the
    router here never picks). Kept."""

    def forward(self, x):
        scores = self.router(x).softmax(-1) * torch.tensor([1.0, 1.0, 1.0, 0.0])
        weights, ids = torch.topk(scores, self.top_k)
        mask = F.one_hot(ids, num_classes=len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(x)
        expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in expert_hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out * (e + 1)


@pytest.mark.parametrize("cls", [HitBySlotZeroRowsByAll, HitReadAfterTheLoop], ids=lambda c: c.__name__)
def test_a_hit_loop_the_source_does_not_prove_is_kept(cls):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(1, 8),)  # one token: its second expert is not hit by the first slot
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class SkipWhenSumIsZero(MaskAnyGuard):
    """`if chosen.sum() == 0: continue`, `chosen` a comparison: no slot set, the same test as `any`."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = ids == e
            if chosen.sum() == 0:
                continue
            token, slot = torch.where(chosen)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class SkipWhenTorchSumItemIsZero(MaskAnyGuard):
    """`if torch.sum(chosen).item() == 0: continue`, read on the host: the same test again."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            chosen = ids.eq(e)
            if torch.sum(chosen).item() == 0:
                continue
            token, slot = torch.where(chosen)
            out[token] += self.experts[e](x[token]) * weights[token, slot, None]
        return out


class BooleanRowsAccumulated(MaskAnyGuard):
    """`out[rows] += y` at a boolean row mask (`rows = chosen.any(-1)`), skipped when no row is set."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = ids == e
            rows = chosen.any(-1)
            if not rows.any():
                continue
            out[rows] += expert(x[rows]) * (weights * chosen).sum(-1, keepdim=True)[rows]
        return out


class SkipWhenNotIn(MaskAnyGuard):
    """`if e not in ids: continue` (a tensor's `in` is `(ids == e).any()`), the weights picked with
    `masked_select`."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            if e not in ids:
                continue
            token, _ = torch.where(ids == e)
            picked = torch.masked_select(weights, ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * picked[:, None])
        return out


class SkipWhenNotInOtherIds(MaskAnyGuard):
    """The skip tests the first slot's ids, the rows come from both slots': kept."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        first = ids[:, 0]
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            if e not in first:
                continue
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


class SkipWhenSignedSumIsZero(MaskAnyGuard):
    """The skip sums a signed score, zero also where slots are set: kept, and the report says so."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            score = (ids == e).float() - (ids == (e + 1) % len(self.experts)).float()
            if score.sum() == 0:
                continue
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out


@pytest.mark.parametrize(
    "cls", [SkipWhenSumIsZero, SkipWhenTorchSumItemIsZero, BooleanRowsAccumulated, SkipWhenNotIn],
    ids=lambda c: c.__name__,
)
def test_a_skip_on_a_boolean_mask_sum_is_removed_and_the_loop_fused(cls):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize(("cls", "named"), [(SkipWhenSignedSumIsZero, "score.sum() == 0"),
                                             (SkipWhenNotInOtherIds, "the skip tests first")])
def test_a_skip_on_another_test_is_kept_and_named(cls, named):
    torch.manual_seed(0)
    model = cls().eval()
    inputs = (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes() and report.graph_count > 1, str(report)
    if report.graph_breaks:  # dynamo 2.9 splits the frame at a tensor's `in` without a break record
        assert any("keeps its `if` as written" in a and named in a for a in report.advice), report.advice
    assert_close_for_dtype(output, eager_output(model, inputs))


class IndexSelectRows(MaskAnyGuard):
    """Rows gathered with `torch.index_select(x, 0, token)`, added back with the functional `index_add`."""

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            token, slot = torch.where(ids == e)
            out = out.index_add(0, token, self.experts[e](torch.index_select(x, 0, token)) * weights[token, slot, None])
        return out


def test_rows_gathered_with_index_select_are_fused():
    torch.manual_seed(0)
    model = IndexSelectRows().eval()
    inputs = (torch.randn(6, 8),)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class UngatedLoop(torch.nn.Module):
    """Megatron / nomic-embed experts: fc2(act(fc1(x))) with biases, no gate projection."""

    def __init__(self, activation):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), activation, torch.nn.Linear(16, 8)) for _ in range(4))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        for e in range(4):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


@pytest.mark.parametrize(("activation", "named"), [(torch.nn.GELU(), "gelu"), (torch.nn.SiLU(), "silu")])
def test_ungated_experts_are_declined_with_their_form_named(activation, named):
    torch.manual_seed(0)
    model, inputs = UngatedLoop(activation).eval(), (torch.randn(5, 8),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert report.graph_count == 1 and not report.fused and len(report.declined) == 1, str(report)
    assert f"an ungated MLP, down({named}(up(x)))" in report.declined[0].reason, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class HitList(torch.nn.Module):
    """SmallThinker's remote code: the hit experts read to the host as Python ints, then looped over."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 8, bias=False)
        self.experts = torch.nn.ModuleList(GatedExpert(8) for _ in range(8))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=8).permute(2, 1, 0)
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero(as_tuple=True)[0].tolist()
        for e in hit:
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


class HitListOfTheFunction(HitList):
    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=8).permute(2, 1, 0)
        hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0, as_tuple=True)[0].tolist()
        for e in hit:
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


@pytest.mark.parametrize("cls", [HitList, HitListOfTheFunction], ids=lambda c: c.__name__)
def test_a_loop_over_the_hit_experts_read_as_ints_is_one_graph_and_fused(cls):
    torch.manual_seed(0)
    model, inputs = cls().eval(), (torch.randn(3, 8),)  # 3 tokens, top-2 of 8: some unchosen
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, len(recorder.fused_nodes())) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class OneHotChangedInPlace(HitExpertLoopMoE):
    """A one-hot mask made signed in place before the hit test: not known non-negative any more."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        mask[0] -= mask[0].roll(1, dims=-1).clone()
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, self.experts[e](hidden_states[token]) * routing_weights[token, slot, None])
        return out.view(x.shape)


def test_a_one_hot_mask_changed_in_place_is_read_gated():
    model, inputs = FORM.build(layers=1, tokens=5, num_experts=6)
    _swap(model, OneHotChangedInPlace)
    report, output, _ = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))



class TokenDropout(torch.nn.Module):
    """NLLB-MoE's token dropout: `if <fixed test>:` arms that change the iteration's own new tensor."""

    def __init__(self):
        super().__init__()
        self.p = 0.25
        self.gate = torch.nn.Linear(8, 6, bias=False)
        self.experts = torch.nn.ModuleList(GatedExpert(8) for _ in range(6))
        self.drop = torch.nn.Dropout(self.p)

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, 6).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * weights[token, slot, None]
            if self.p > 0:
                if self.training:
                    y = self.drop(y)
                else:
                    y *= 1 - self.p
            out.index_add_(0, token, y)
        return out


class RowsBoundInAnArm(TokenDropout):
    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, 6).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * weights[token, slot, None]
            if self.training:  # rows only in one arm: after the `if`, they are not known to be rows
                token = torch.arange(x.shape[0])[: y.shape[0]]
            else:
                slot, token = torch.where(mask[e].squeeze(0))
            out.index_add_(0, token, y)
        return out


class AccumulatesInAnArm(TokenDropout):
    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, 6).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * weights[token, slot, None]
            if not self.training:
                out.index_add_(0, token, y)
            out.index_add_(0, token, y)
        return out


class ChangesAnOuterTensor(TokenDropout):
    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), 2)
        out = torch.zeros_like(x)
        total = torch.zeros(())
        mask = F.one_hot(ids, 6).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.experts[e](x[token]) * weights[token, slot, None]
            if self.p > 0:
                total += y.sum()
            out.index_add_(0, token, y)
        return out + total


@pytest.mark.parametrize(("cls", "named"), [
    (TokenDropout, None),
    (RowsBoundInAnArm, "indexed with the expert's number under `if self.training`, whose arm may not run"),
    (AccumulatesInAnArm, "accumulates or skips under `if not self.training`"),
    (ChangesAnOuterTensor, "(`total += y.sum()`)"),
], ids=lambda c: getattr(c, "__name__", ""))
def test_arms_of_a_fixed_test_are_read_as_the_body(cls, named):
    """Each arm is proved from the state before the `if`, and only what both leave holds after it."""
    torch.manual_seed(0)
    model, inputs = cls().eval(), (torch.randn(3, 8),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
    if named is None:
        assert (report.graph_count, report.graph_break_count) == (1, 0), str(report)
    else:
        reason = hit_expert_loops.declined_classes()[f"{cls.__module__}.{cls.__qualname__}"]
        assert named in reason, reason


# ---------------------------------------------------------------------------------------------------
# Decorated forwards: hpu_moe traces a copy of the wrapper whose cell holds the adapted method, where the
# wrapper does nothing with the method but call it.

CALLS: list[int] = []
SCALES: dict = {}


def counted(fn):
    """A user's decorator: counts the calls, holds the method in its closure."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        CALLS.append(1)
        return fn(self, *args, **kwargs)

    return wrapper


def through_its_own_attribute(fn):
    """A decorator whose wrapper reaches the method through `__wrapped__`, not through a cell."""

    def wrapper(self, *args, **kwargs):
        return wrapper.__wrapped__(self, *args, **kwargs)

    return functools.update_wrapper(wrapper, fn)


def scaled_by_registry(fn):
    """A wrapper that reads what it wraps as a key and as an object with attributes."""
    SCALES[fn] = 2.0
    fn.offset = 1.0

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs) * SCALES.get(fn, 1.0) + getattr(fn, "offset", 0.0)

    return wrapper


def swappable(fn):
    """A wrapper whose function can be replaced later (`nonlocal`)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    def swap(new):
        nonlocal fn
        fn = new

    wrapper.swap = swap
    return wrapper


def _halved(self, x):
    return HitExpertLoopMoE.forward(self, x) * 0.5


class CountedForward(HitExpertLoopMoE):
    forward = counted(HitExpertLoopMoE.forward)


class CountedWithoutGrad(HitExpertLoopMoE):
    forward = torch.no_grad()(counted(HitExpertLoopMoE.forward))


class ReachedThroughAnAttribute(HitExpertLoopMoE):
    forward = through_its_own_attribute(HitExpertLoopMoE.forward)


class ScaledByRegistry(HitExpertLoopMoE):
    forward = scaled_by_registry(HitExpertLoopMoE.forward)


class Swappable(HitExpertLoopMoE):
    forward = swappable(HitExpertLoopMoE.forward)


class ExcludedFromTracing(HitExpertLoopMoE):
    forward = counted(torch.compiler.disable(HitExpertLoopMoE.forward))


@pytest.mark.parametrize("cls", [CountedForward, CountedWithoutGrad], ids=lambda c: c.__name__)
def test_a_decorated_forward_is_fused_and_its_wrapper_still_runs(cls):
    model, inputs = FORM.build(layers=1, tokens=5, num_experts=6)
    _swap(model, cls)
    CALLS.clear()
    report, output, recorder = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
    assert (report.graph_count, report.graph_break_count, len(recorder.fused_nodes())) == (1, 0, 1), str(report)
    assert CALLS, "the decorator's own code ran"


@pytest.mark.parametrize(("cls", "named"), [
    (ReachedThroughAnAttribute, "holds the function it wraps in 0 closure cells, not one"),
    (ScaledByRegistry, "wrapper scaled_by_registry.<locals>.wrapper reads `fn`, the function it wraps, other than "
                       "by calling it"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_a_wrapper_that_does_more_than_call_the_method_is_named(cls, named):
    """A copy of the method is another object: a wrapper that looks it up, reads it or reaches it other
    than through its closure would see the copy (a review's wrong outputs), so the method stays as written."""
    model, inputs = FORM.build(layers=1, tokens=5, num_experts=6)
    _swap(model, cls)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
    assert not recorder.fused_nodes(), str(report)
    reason = hit_expert_loops.declined_classes()[f"{cls.__module__}.{cls.__qualname__}"]
    assert named in reason, reason


def test_a_function_swapped_into_the_wrapper_later_runs_as_written():
    model, inputs = FORM.build(layers=1, tokens=5, num_experts=6)
    _swap(model, Swappable)
    run_hpu_moe(model, inputs)
    Swappable.forward.__moe_passes_original__.swap(_halved)
    try:
        report, output, _ = run_hpu_moe(model, inputs)
        assert_close_for_dtype(output, eager_output(model, inputs))
    finally:
        Swappable.forward.__moe_passes_original__.swap(HitExpertLoopMoE.forward.__moe_passes_original__)


def test_a_forward_excluded_from_tracing_stays_excluded():
    model, inputs = FORM.build(layers=1, tokens=5, num_experts=6)
    _swap(model, ExcludedFromTracing)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes()
    assert_close_for_dtype(output, eager_output(model, inputs))
    reason = hit_expert_loops.declined_classes()[f"{ExcludedFromTracing.__module__}.ExcludedFromTracing"]
    assert "excluded from tracing (torch.compiler.disable)" in reason, reason


class SqueezedHitList(HitExpertLoopMoE):
    """NemotronH's spelling: the hit list squeezed to 1-D, each element read with `.item()`, and a skip
    of experts with no rows."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().squeeze(-1)
        for e in hit:
            e = e.item()
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            out.index_add_(0, token, self.experts[e](hidden_states[token]) * routing_weights[token, slot, None])
        return out.view(x.shape)


class SqueezedHitReadAsATensor(HitExpertLoopMoE):
    """The element is also read as a tensor (0-dim here, [1]-shaped as a row of `nonzero`): as written."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().squeeze(-1)
        for e in hit:
            number = e.item()
            slot, token = torch.where(mask[number])
            y = self.experts[number](hidden_states[token]) * routing_weights[token, slot, None]
            out.index_add_(0, token, y * (e.dim() + 1))
        return out.view(x.shape)


class SqueezedHitReadAfterTheLoop(HitExpertLoopMoE):
    """The element and the number read from it are read after the loop (a review's wrong output: the copy
    visits every expert, so both would hold the last expert's, not the last hit one's)."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().squeeze(-1)
        rank = lambda: hit.dim()  # noqa: E731 - the construct under test: a read the loop does not see
        for e in hit:
            n = int(e.item())
            slot, token = torch.where(mask[n])
            out.index_add_(0, token, self.experts[n](hidden_states[token]) * routing_weights[token, slot, None])
        return (out * (e + n + rank())).view(x.shape)


class HitNumberReadAfterTheLoop(HitExpertLoopMoE):
    """`n = int(e[0])` read after the loop: the last hit expert's number in the original."""

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            n = int(e[0])
            slot, token = torch.where(mask[n])
            out.index_add_(0, token, self.experts[n](hidden_states[token]) * routing_weights[token, slot, None])
        return (out * n).view(x.shape)


@pytest.mark.parametrize(("cls", "fused"), [(SqueezedHitList, True), (SqueezedHitReadAsATensor, False),
                                             (SqueezedHitReadAfterTheLoop, False), (HitNumberReadAfterTheLoop, False)],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_a_squeezed_hit_list_read_as_numbers_is_fused(cls, fused):
    model, inputs = FORM.build(layers=1, tokens=1, num_experts=8)  # top-2 of 8: the last expert not hit
    assert model.moes[0].router(inputs[0].view(-1, inputs[0].shape[-1]))[1].max() < 7
    _swap(model, cls)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
    if fused:
        assert (report.graph_count, report.graph_break_count, len(recorder.fused_nodes())) == (1, 0, 1), str(report)
    else:
        assert not recorder.fused_nodes(), str(report)


class PostProcessedLoop(HitExpertLoopMoE):
    """The loop calls a helper of the class on each expert's output."""

    calls = 0

    def post(self, y):
        return y

    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        out = torch.zeros_like(hidden_states)
        mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            slot, token = torch.where(mask[e].squeeze(0))
            y = self.post(self.experts[e](hidden_states[token])) * routing_weights[token, slot, None]
            out.index_add_(0, token, y)
        return (out * (1 + self.calls)).view(x.shape)


class CountsInItsHelper(PostProcessedLoop):
    """Inherits the forward, overrides the helper with an effect per call: the base's copy (proved with
    the base's helper) would call it for experts no token chose (a review's wrong output)."""

    def post(self, y):
        self.calls += 1
        return y


class InheritsTheLoop(PostProcessedLoop):
    pass


@pytest.mark.parametrize(("cls", "fused"), [(PostProcessedLoop, True), (CountsInItsHelper, False),
                                             (InheritsTheLoop, True)], ids=lambda v: getattr(v, "__name__", ""))
def test_an_inherited_loop_is_decided_for_the_subclass(cls, fused):
    model, inputs = FORM.build(layers=1, tokens=1, num_experts=8)  # top-2 of 8: experts not hit
    _swap(model, cls)
    report, output, recorder = run_hpu_moe(model, inputs)
    model.moes[0].calls = 0  # the compiled run's count
    expected = eager_output(model, inputs)
    assert_close_for_dtype(output, expected)
    assert len(recorder.fused_nodes()) == (1 if fused else 0), str(report)


def doubled(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) * 2.0

    return wrapper


@doubled
def _doubled_hit_loop(layer, hidden_states, routing_weights, selected_experts):
    out = torch.zeros_like(hidden_states)
    mask = F.one_hot(selected_experts, num_classes=layer.num_experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        slot, token = torch.where(mask[e].squeeze(0))
        out.index_add_(0, token, layer.experts[e](hidden_states[token]) * routing_weights[token, slot, None])
    return out


class CallsADecoratedFunction(HitExpertLoopMoE):
    def forward(self, x):
        hidden_states = x.view(-1, x.shape[-1])
        routing_weights, selected_experts = self.router(hidden_states)
        return _doubled_hit_loop(self, hidden_states, routing_weights, selected_experts).view(x.shape)


def test_a_decorated_module_function_keeps_its_decorator():
    """A module function's copy was made from the source `inspect` gives, the wrapped function's: its
    dispatcher then dropped the decorator (a review's wrong output). Decorated module functions stay as written."""
    model, inputs = FORM.build(layers=1, tokens=5, num_experts=6)
    _swap(model, CallsADecoratedFunction)
    report, output, _ = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
