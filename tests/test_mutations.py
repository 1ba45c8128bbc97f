"""Near misses of every fused catalog form: one small semantic change must stop the rewrite.

Each mutation keeps shapes (so the model still runs) but changes what the block computes, so that one
fused call would compute something else: the routing weight applied to the expert's input, an expert's
output or a routing-weight intermediate also used outside the sum, one expert with another activation
or a bias, tokens gathered for another k, the k slots summed along the wrong axis. The mutated block
must reach the inner backend untouched (no fused call) and equal eager.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from form_catalog import catalog, dynamo_config
from form_catalog._gpt_oss4 import GptOss4Experts
from form_catalog._stacked_experts import SparseMoeBlock
from form_catalog.hf_batched_mm import batched_linear
from form_catalog.hf_grouped_mm import _grouped_mm, _tokens_per_expert
from form_catalog.modulelist_dense_mask import MaskedLoopMoE, expert_weight
from form_catalog.static_dense_loop import StaticMoE, expert_matmul, silu_and_mul
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe

FORMS = catalog()
# Forms captured only through an adapter have their own near misses (tests/test_hit_expert_loops.py):
# the mutated forwards here are written as the range(E) loop, not as the adapted source.
# Forms mirrored from other code bases keep their source's own forward (they say `MUTATED = False`), which
# the mutated forwards below (written per catalog family) do not reproduce; their near misses are the
# fuzz's spelling dimension (tests/fuzz_models.py) and their own near-miss forms.
FUSED = [
    name
    for name, form in FORMS.items()
    if form.EXPECTED.fused and not getattr(form, "ADAPTER", None) and getattr(form, "MUTATED", True)
]
TAP = 0.1  # the weight of a value tapped out of the MoE region

COMMON = ("weights_before_mlp", "expert_output_escapes", "weight_intermediate_escapes", "other_activation")
MUTATIONS = {
    "batched": (*COMMON, "bias_in_one_expert", "rows_tiled", "wrong_sum_axis"),
    "grouped": (*COMMON, "bias_in_one_expert", "wrong_k", "wrong_sum_axis"),
    "dense": (*COMMON, "bias_in_one_expert"),
    "sparse": (*COMMON, "bias_in_one_expert"),
    "dense_bmm": ("weights_before_mlp", "expert_output_escapes", "weight_intermediate_escapes", "bias_in_one_expert",
                  "wrong_table_column", "wrong_sum_axis"),
}


def family(model) -> str:
    moe = model.moes[0]
    if isinstance(getattr(moe, "experts", None), GptOss4Experts):
        return "dense_bmm"
    if isinstance(moe, SparseMoeBlock):
        return "grouped" if moe.experts._experts_forward.__name__.startswith("grouped") else "batched"
    if isinstance(moe, StaticMoE | MaskedLoopMoE):
        return "dense"
    return "sparse"


# ---------------------------------------------------------------------------------------------------
# Mutated expert computations. `odd(e)` marks the one expert a per-expert mutation changes.


def _gate(experts, gate_up, odd):
    """`apply_gate`, except that rows of the odd expert use ReLU when asked to (other_activation)."""
    if odd is None:
        return experts.apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.where(odd[:, None], F.relu(gate), experts.act_fn(gate)) * up


def batched(mutation):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.size(-1)
        tokens, hidden = hidden_states.shape
        ids, weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
        if mutation == "rows_tiled":  # [x0, x1, x0, x1] instead of [x0, x0, x1, x1]
            rows = hidden_states.repeat(k, 1)
        else:
            rows = hidden_states.repeat_interleave(k, dim=0)
        if mutation == "weights_before_mlp":
            rows = rows * weights.unsqueeze(-1)
        bias = self.gate_up_proj_bias[ids] if self.has_bias else None
        out = batched_linear(rows, self.gate_up_proj[ids], bias, self.is_transposed)
        out = _gate(self, out, ids == 0 if mutation == "other_activation" else None)
        bias = self.down_proj_bias[ids] if self.has_bias else None
        out = batched_linear(out, self.down_proj[ids], bias, self.is_transposed)
        if mutation == "bias_in_one_expert":
            out = out + TAP * (ids == 0).unsqueeze(-1)
        weighted = out if mutation == "weights_before_mlp" else out * weights.unsqueeze(-1)
        return _combine(mutation, weighted, out, weights, tokens, k, hidden).to(hidden_states.dtype)

    forward.__name__ = "batched_mm_experts_forward"
    return forward


def grouped(mutation):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.size(-1)
        tokens, hidden = hidden_states.shape
        sorted_ids, perm = torch.sort(top_k_index.reshape(-1))
        weights = top_k_weights.reshape(-1)[perm]
        offsets = torch.cumsum(_tokens_per_expert(sorted_ids, self.num_experts), dim=0, dtype=torch.int32)
        rows = hidden_states[perm // (k + 1 if mutation == "wrong_k" else k)]
        if mutation == "weights_before_mlp":
            rows = rows * weights.unsqueeze(-1).to(rows.dtype)
        out = _grouped_mm(rows, self.gate_up_proj.transpose(-2, -1), offsets)
        out = _gate(self, out, sorted_ids == 0 if mutation == "other_activation" else None)
        out = _grouped_mm(out, self.down_proj.transpose(-2, -1), offsets)
        if mutation == "bias_in_one_expert":
            out = out + TAP * (sorted_ids == 0).unsqueeze(-1)
        weighted = out if mutation == "weights_before_mlp" else out * weights.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0), device=perm.device)
        result = _combine(mutation, weighted[inverse], out[inverse], weights[inverse], tokens, k, hidden)
        return result.to(hidden_states.dtype)

    forward.__name__ = "grouped_mm_experts_forward"
    return forward


def _combine(mutation, weighted, out, weights, tokens, k, hidden):
    """Sum the k slots per token (or along the wrong axis), plus whatever the mutation taps out."""
    if mutation == "wrong_sum_axis":
        return weighted.view(k, tokens, hidden).sum(dim=0)
    result = weighted.view(tokens, k, hidden).sum(dim=1)
    if mutation == "expert_output_escapes":
        result = result + TAP * out.view(tokens, k, hidden)[:, 0]
    if mutation == "weight_intermediate_escapes":
        result = result + TAP * weighted.view(tokens, k, hidden)[:, 0]
    return result


def dense(mutation):
    """StaticMoE / MaskedLoopMoE forward: every expert on every token, scaled by its weight column."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        if isinstance(self, StaticMoE):
            padded = self.padded_routing_weights(ids, weights, x)
            columns = [padded[e].reshape(-1, 1) for e in range(self.num_experts)]
        else:
            columns = [expert_weight(weights, ids, e) for e in range(len(self.experts))]
        out, tap = torch.zeros_like(x), None
        for e, column in enumerate(columns):
            y = _expert(self, e, x * column if mutation == "weights_before_mlp" else x, mutation)
            weighted = y if mutation == "weights_before_mlp" else y * column
            if e == 0:
                tap = {"expert_output_escapes": y, "weight_intermediate_escapes": column}.get(mutation)
            out = out + weighted
        return (out if tap is None else out + TAP * tap).view(shape)

    return forward


def _expert(moe, e, x, mutation):
    odd = e == 0
    if isinstance(moe, StaticMoE):
        h = expert_matmul(x, moe.w13_weight, e)
        half = h.shape[-1] // 2
        h = (
            F.relu(h[..., :half]) * h[..., half:]
            if odd and mutation == "other_activation"
            else silu_and_mul(h)
        )
        y = expert_matmul(h, moe.w2_weight, e)
    else:
        y = moe.experts[e](x)
    return y + TAP if odd and mutation == "bias_in_one_expert" else y


def sparse(mutation):
    """The transformers 4.x loop (and DeepSeek-V3's expert-parallel one): routed rows per expert."""

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.router(flat)
        out = torch.zeros_like(flat)
        mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
        first = getattr(self, "start", 0)
        tap = None
        for e in range(first, getattr(self, "end", self.num_experts)):
            slot, token = torch.where(mask[e])
            rows, w = flat[token], weights[token, slot, None]
            y = self.experts[e](rows * w if mutation == "weights_before_mlp" else rows)
            if e == first and mutation == "bias_in_one_expert":
                y = y + TAP
            weighted = y if mutation == "weights_before_mlp" else y * w
            if e == first and mutation in ("expert_output_escapes", "weight_intermediate_escapes"):
                tap = torch.zeros_like(flat).index_add(
                    0, token, y if mutation.startswith("expert") else weighted
                )
            out.index_add_(0, token, weighted.to(flat.dtype))
        return (out if tap is None else out + TAP * tap).view(shape)

    return forward


def dense_bmm(mutation):
    """transformers 4.55 GPT-OSS's experts: every token through every expert, weighted by the score table."""

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        batch = hidden_states.shape[0]
        flat = hidden_states.reshape(-1, self.hidden_size)
        experts = routing_weights.shape[1]
        table = routing_weights.transpose(0, 1)
        if mutation == "wrong_table_column":  # expert e scaled by column e + 1
            table = table.roll(1, dims=0)
        column = table.reshape(experts, -1, 1)
        rows = flat.repeat(experts, 1).view(experts, -1, self.hidden_size)
        if mutation == "weights_before_mlp":
            rows = rows * column
        gate_up = torch.bmm(rows, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        y = torch.bmm((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), self.down_proj)
        y = y + self.down_proj_bias[..., None, :]
        if mutation == "bias_in_one_expert":
            y = y + TAP * (torch.arange(experts) == 0).to(y.dtype)[:, None, None]
        weighted = y if mutation == "weights_before_mlp" else y * column
        out = weighted.sum(dim=0)
        if mutation == "wrong_sum_axis":  # the [E, T, H] products re-read as [T, E, H]
            out = weighted.reshape(-1, experts, self.hidden_size).sum(dim=1)
        if mutation == "expert_output_escapes":
            out = out + TAP * y[0]
        if mutation == "weight_intermediate_escapes":
            out = out + TAP * weighted[0]
        return out.view(batch, -1, self.hidden_size)

    return forward


def mutate(model, mutation: str) -> None:
    """Swap each MoE layer's computation for the mutated one (and, for loops, one expert's activation)."""
    kind = family(model)
    for moe in model.moes:
        if kind == "dense_bmm":
            moe.experts.forward = types.MethodType(dense_bmm(mutation), moe.experts)
            continue
        if kind in ("batched", "grouped"):
            moe.experts._experts_forward = (batched if kind == "batched" else grouped)(mutation)
            continue
        moe.forward = types.MethodType((dense if kind == "dense" else sparse)(mutation), moe)
        if mutation == "other_activation" and not isinstance(moe, StaticMoE):
            first = moe.experts[getattr(moe, "start", 0)]
            name = "act" if hasattr(first, "act") else "act_fn"
            setattr(first, name, F.relu)


CASES = [
    (name, mutation)
    for name in FUSED
    for mutation in MUTATIONS[family(FORMS[name].build(layers=1)[0])]
    if not (name == "gpt_oss_experts" and mutation == "other_activation")  # one clamped swiglu, no act
]


@pytest.mark.parametrize("name, mutation", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_mutated_form_is_left_untouched_and_equal(name, mutation):
    form = FORMS[name]
    model, inputs = form.build(layers=1)
    mutate(model, mutation)
    with dynamo_config(form):
        report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes() and not report.fused, str(report)
    assert report.graph_count == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", FUSED)
def test_the_unmutated_forward_is_still_fused(name):
    """The mutated forwards are faithful copies: with no mutation the same code is fused and equal."""
    form = FORMS[name]
    model, inputs = form.build(layers=1)
    mutate(model, "none")
    with dynamo_config(form):
        report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_routing_weights_used_outside_the_block_do_not_stop_the_rewrite():
    """The routing weights are an input of the fused call, not an intermediate: other uses are fine."""
    model, inputs = FORMS["hf_batched_mm"].build(layers=1)
    moe = model.moes[0]

    def with_auxiliary_use(x):
        batch, seq, hidden = x.shape
        flat = x.view(-1, hidden)
        weights, ids = moe.gate(flat)
        out = moe.experts(flat, ids, weights) + TAP * weights[:, :1]  # e.g. an auxiliary signal
        return out.reshape(batch, seq, hidden)

    moe.forward = with_auxiliary_use
    report, output, recorder = run_hpu_moe(model, inputs)
    assert len(recorder.fused_nodes()) == 1, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize("name", ["modulelist_dense_mask", "static_dense_loop"])
def test_an_odd_last_expert_is_not_split_off_like_a_shared_expert(name):
    """A shared expert added after a dense loop stays beside the fused call; the loop's own last
    expert, weighted by the routing, is part of the region: an odd one declines the whole region."""
    form = FORMS[name]
    model, inputs = form.build(layers=1)
    moe = model.moes[0]
    if name == "modulelist_dense_mask":
        moe.experts[-1].act = F.relu
    else:
        moe.forward = types.MethodType(_last_expert_odd, moe)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert not recorder.fused_nodes(), str(report)
    assert report.declined, str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


def _last_expert_odd(self, x):
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, ids = self.router(x)
    padded = self.padded_routing_weights(ids, weights, x)
    out = torch.zeros_like(x)
    for e in range(self.num_experts):
        h = silu_and_mul(expert_matmul(x, self.w13_weight, e))
        if e == self.num_experts - 1:
            h = F.relu(h)  # an extra non-linearity in the last expert only
        out = out + expert_matmul(h, self.w2_weight, e) * padded[e].reshape(-1, 1)
    return out.view(shape)
