"""Routers and stacked expert weights in spellings found by the third sweep (`python
tools/spelling_sweep.py --stacked`): each test is one construct that sweep found unfused or failing,
written here as its code base would, and fails without the change that handles it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import (
    assert_close_for_dtype,
    backward_like_eager,
    eager_output,
    run_hpu_moe,
    torch_release,
)

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
    if torch_release() < (2, 10):  # torch 2.9's make_fx loses the count's unbacked symbol at its assert
        inputs = (torch.randn(7, H),)
        report, output, _ = run_hpu_moe(model, inputs)
        assert "canonical trace cannot follow `aten::_assert_scalar`" in str(report), str(report)
        assert_close_for_dtype(output, eager_output(model, inputs))
        return
    for tokens in (7, 3):
        _fused_and_equal(model, tokens, "segments")


class SigmoidRouterGatheredEinsum(nn.Module):
    """DeepSeek-V3's gate (sigmoid scores, a correction bias for the choice only, renormalised with
    1e-20, scaled) over weights gathered per slot in einsums, combined as `(y * w[..., None]).sum(1)`."""

    def __init__(self):
        super().__init__()
        self.weight = _param(E, H)
        self.register_buffer("e_score_correction_bias", torch.randn(E) * 0.1)
        self.w_gate, self.w_up, self.w_down = _param(E, H, INTER), _param(E, H, INTER), _param(E, INTER, H)

    def forward(self, x):
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        _, ids = torch.topk(scores + self.e_score_correction_bias, k=K, dim=-1, sorted=False)
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * 2.5
        g = torch.einsum("th,tkhi->tki", x, self.w_gate[ids])
        u = torch.einsum("th,tkhi->tki", x, self.w_up[ids])
        y = torch.einsum("tki,tkih->tkh", F.silu(g) * u, self.w_down[ids])
        return (y * w.unsqueeze(-1)).sum(dim=1)


class SlotRowsBatchedMatmul(nn.Module):
    """Weights gathered per slot and multiplied with `torch.bmm`: the slot rows made by a view
    (`x[:, None].expand(T, k, H).reshape(-1, 1, H)`), gate and up two stacks (or, `transposed`, kept
    [E, out, in] and used as `.transpose(1, 2)`), the weights applied after `.view(T, k, H)`."""

    def __init__(self, transposed: bool = False, tiled: bool = False):
        super().__init__()
        self.transposed, self.tiled = transposed, tiled
        self.gate = nn.Linear(H, E, bias=False)
        shapes = ((E, INTER, H), (E, INTER, H), (E, H, INTER)) if transposed else ((E, H, INTER),) * 2 + ((E, INTER, H),)
        self.w1, self.w3, self.w2 = (_param(*s) for s in shapes)

    def _stack(self, weight, flat):
        return weight[flat].transpose(1, 2) if self.transposed else weight[flat]

    def forward(self, x):
        tokens = x.shape[0]
        w, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)
        if self.tiled:  # slot-major copies: row s is token s % T, not the slot s of ids.reshape(-1)
            xs = x.repeat(K, 1).unsqueeze(1)
        else:
            xs = x.unsqueeze(1).expand(tokens, K, H).reshape(tokens * K, 1, H)
        h = F.silu(torch.bmm(xs, self._stack(self.w1, flat))) * torch.bmm(xs, self._stack(self.w3, flat))
        y = torch.bmm(h, self._stack(self.w2, flat)).view(tokens, K, H)
        return (y * w[..., None]).sum(1)


def test_gathered_einsum_experts_with_the_combine_written_as_a_weighted_sum_are_fused():
    """`(y * w[..., None]).sum(1)` is the same combine as `einsum("tkh,tk->th", y, w)`: it was declined
    ("the combine is not sum_a weights[t, a] * ...")."""
    torch.manual_seed(0)
    model = SigmoidRouterGatheredEinsum().eval()
    _fused_and_equal(model, 7, "gathered_einsum")
    backward_like_eager(model, (torch.randn(5, H),))


def test_batched_matmul_experts_on_slot_rows_made_by_a_view_are_fused():
    """Rows [T * k, 1, H] made by a view (not `unsqueeze`), gate and up as two stacks, the weights
    applied after the view: was declined ("routing weights do not multiply the output of a batched
    down projection")."""
    torch.manual_seed(0)
    for transposed in (False, True):
        model = SlotRowsBatchedMatmul(transposed=transposed).eval()
        _fused_and_equal(model, 7, "batched_mm")
    backward_like_eager(model, (torch.randn(5, H),))


def test_batched_matmul_on_slot_major_copies_of_the_tokens_is_not_fused():
    """`x.repeat(k, 1)` puts token s % T in row s; the ids, flattened, name slot s of token s // k: the
    rows do not line up with the experts they are multiplied by, and the layer is left as written."""
    torch.manual_seed(0)
    model = SlotRowsBatchedMatmul(tiled=True).eval()
    inputs = (torch.randn(7, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and "repeated k times" in str(report), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class DenseExpertsTable(nn.Module):
    """Every expert on every token over stacked weights, weighted by a [T, E] table: built as
    `zeros_like(probs).scatter(1, ids, w)` and read by `einsum("eth,te->th")` (Qwen's unnormalised
    top-k), `(y * table.t()[..., None]).sum(0)` (Grok-1's), or built as `(one_hot(ids) * w[..., None]).sum(1)`
    over `x.expand(E, T, H)` and batched matmuls."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate, self.w_up, self.w_down = _param(E, H, INTER), _param(E, H, INTER), _param(E, INTER, H)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = probs.topk(K, dim=-1)
        if self.spelling == "expand":
            table = (F.one_hot(ids, E).to(x.dtype) * w[..., None]).sum(1)
            xe = x.expand(E, x.shape[0], H)
            y = torch.bmm(F.silu(torch.bmm(xe, self.w_gate)) * torch.bmm(xe, self.w_up), self.w_down)
            return (table.t()[..., None] * y).sum(0)
        table = torch.zeros_like(probs).scatter(1, ids, w)
        g = torch.einsum("th,ehi->eti", x, self.w_gate)
        u = torch.einsum("th,ehi->eti", x, self.w_up)
        y = torch.einsum("eti,eih->eth", F.silu(g) * u, self.w_down)
        if self.spelling == "einsum":
            return torch.einsum("eth,te->th", y, table)
        if self.spelling == "transposed_thrice":  # .t().t() is the table again
            return (y * table.t().t().t()[..., None]).sum(0)
        return (y * table.t()[..., None]).sum(0)


def test_dense_experts_weighted_by_a_table_scattered_into_zeros_like_the_scores_are_fused():
    """`zeros_like(probs)` reads only the size of probs: the table is made from the ids and weights alone
    (it was no candidate). A transposed table (`table.t()[..., None]`) is read as [E, T], also where T
    equals E, where the labels alone cannot tell the two orders apart."""
    torch.manual_seed(0)
    for spelling in ("einsum", "transposed", "transposed_thrice", "expand"):
        model = DenseExpertsTable(spelling).eval()
        for tokens in (7, E):
            _fused_and_equal(model, tokens, "dense_einsum")
    backward_like_eager(DenseExpertsTable("transposed"), (torch.randn(5, H),))


class RowsGatheredWeights(nn.Module):
    """Each row multiplied by weights gathered at its own expert id, the rows in some order and brought
    back to the tokens by some combine:
    - "flat": row s is token s // k (`arange(T)[:, None].expand(T, k).reshape(-1)`), per-row einsums,
      `index_put_(..., accumulate=True)` (a near miss: "unsorted_ids" gathers the weights of the
      sorted rows by the unsorted ids);
    - "sorted": rows sorted by expert (`x[order // k]`), `torch.bmm`, weights scaled per row, a
      `scatter_add_` by token (a near miss: "unsorted_weights" scales by the unsorted weights);
    - "unsorted": the same rows put back in slot order with `index_copy`, then `(y.view(T, k, H) *
      w[..., None]).sum(1)`."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate, self.w_up, self.w_down = _param(E, H, INTER), _param(E, H, INTER), _param(E, INTER, H)

    def _experts(self, rows, ids):
        h = F.silu(torch.einsum("nh,nhi->ni", rows, self.w_gate[ids])) * torch.einsum("nh,nhi->ni", rows, self.w_up[ids])
        return torch.einsum("ni,nih->nh", h, self.w_down[ids])

    def forward(self, x):
        tokens = x.shape[0]
        w, ids = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)
        out = torch.zeros_like(x)
        if self.spelling == "flat":
            token = torch.arange(tokens, device=x.device).unsqueeze(1).expand(tokens, K).reshape(-1)
            y = self._experts(x[token], flat) * w.reshape(-1, 1)
            return out.index_put_((token,), y, accumulate=True)
        order = flat.argsort()
        token = order // K
        chosen = flat if self.spelling == "unsorted_ids" else flat[order]
        ys = self._experts(x[token], chosen)
        if self.spelling == "unsorted":
            y = torch.empty_like(ys).index_copy_(0, order, ys)
            return (y.view(tokens, K, H) * w[..., None]).sum(1)
        scale = w.reshape(-1) if self.spelling == "unsorted_weights" else w.reshape(-1)[order]
        return out.scatter_add_(0, token[:, None].expand(-1, H), ys * scale.unsqueeze(-1))


def test_rows_multiplied_by_weights_gathered_at_their_own_ids_are_fused_in_any_order():
    """Rows read and combined through the slot algebra (a token map made of arange, a sort by expert and
    its inverse), each row's weights gathered by the id of the slot it holds: these were no candidate or
    declined ("routing weights do not multiply the output of a batched down projection")."""
    torch.manual_seed(0)
    for spelling in ("flat", "sorted", "unsorted"):
        model = RowsGatheredWeights(spelling).eval()
        for tokens in (7, 1):
            _fused_and_equal(model, tokens, "batched_mm")
    backward_like_eager(RowsGatheredWeights("sorted"), (torch.randn(5, H),))


@pytest.mark.parametrize(("spelling", "reason"), [
    ("unsorted_ids", "not gathered by the id of the slot the row holds"),
    ("unsorted_weights", "not permuted like the rows"),
])
def test_rows_whose_weights_or_scales_follow_another_order_are_declined(spelling, reason):
    torch.manual_seed(0)
    model = RowsGatheredWeights(spelling).eval()
    inputs = (torch.randn(7, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and reason in str(report), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class MaskedSoftmaxLoop(nn.Module):
    """Every expert on every token, weighted by a softmax over logits masked to -inf: below the k-th
    largest (`top_k_masked`, OLMoE-like routing written without topk's ids), or at padded positions
    (an attention-style mask: still a dense mixture)."""

    def __init__(self, top_k_masked: bool):
        super().__init__()
        self.top_k_masked = top_k_masked
        self.gate = nn.Linear(H, E, bias=False)
        self.w1, self.w3, self.w2 = _param(E, H, INTER), _param(E, H, INTER), _param(E, INTER, H)

    def forward(self, x):
        logits = self.gate(x)
        if self.top_k_masked:
            masked = logits.masked_fill(logits < torch.topk(logits, K, dim=-1).values[:, -1:], float("-inf"))
        else:
            masked = logits.masked_fill(x[:, :E] == 0, float("-inf"))
        gates = torch.softmax(masked, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            out = out + gates[:, e, None] * ((F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e])
        return out


@pytest.mark.parametrize(("top_k_masked", "reason"), [
    (True, "masked by a selection"),
    (False, "dense mixture of experts"),
])
def test_a_softmax_over_logits_masked_below_the_kth_is_declined_for_its_ties(top_k_masked, reason):
    """Masking below the k-th largest logit is top-k routing except at ties, where it keeps more than k
    experts: declined with that reason, not as a dense mixture "with no top-k selection"."""
    torch.manual_seed(0)
    model = MaskedSoftmaxLoop(top_k_masked).eval()
    inputs = (torch.randn(7, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and reason in str(report), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class BiasedDenseExperts(nn.Module):
    """Every expert on every token with biased projections (`torch.baddbmm`, or `bmm(...) + b[:, None]`),
    combined by a [T, E] table: the kernel's plain overload has no biases."""

    def __init__(self, baddbmm: bool):
        super().__init__()
        self.baddbmm = baddbmm
        self.gate = nn.Linear(H, E, bias=False)
        self.w1, self.w3, self.w2 = _param(E, H, INTER), _param(E, H, INTER), _param(E, INTER, H)
        self.b2 = _param(E, H)

    def forward(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), K, dim=-1)
        table = torch.zeros_like(self.gate(x)).scatter(-1, ids, w)
        xe = x.unsqueeze(0).expand(E, *x.shape)
        h = F.silu(torch.bmm(xe, self.w1)) * torch.bmm(xe, self.w3)
        y = torch.baddbmm(self.b2.unsqueeze(1), h, self.w2) if self.baddbmm else torch.bmm(h, self.w2) + self.b2[:, None]
        return (y * table.t().unsqueeze(-1)).sum(0)


@pytest.mark.parametrize("baddbmm", [True, False], ids=["baddbmm", "bmm_plus_bias"])
def test_dense_experts_with_biases_are_declined_for_them(baddbmm):
    """They were no candidate at all; the report now names the biases."""
    torch.manual_seed(0)
    model = BiasedDenseExperts(baddbmm).eval()
    inputs = (torch.randn(7, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and "expert biases" in str(report), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class NearMisses(nn.Module):
    """Layers that compute something else than the kernel, in spellings next to fused ones (an
    adversarial review of the changes above): each must run as written."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.gate = nn.Linear(H, E, bias=False)
        self.w_gate, self.w_up, self.w_down = _param(E, H, INTER), _param(E, H, INTER), _param(E, INTER, H)

    def forward(self, x):
        tokens = x.shape[0]
        probs = F.softmax(self.gate(x), dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        flat = ids.reshape(-1)
        if self.case == "product_of_sums":  # (sum_a y) * (sum_a w): no sum of products
            g = torch.einsum("th,tkhi->tki", x, self.w_gate[ids])
            y = torch.einsum("tki,tkih->tkh", F.silu(g) * torch.einsum("th,tkhi->tki", x, self.w_up[ids]), self.w_down[ids])
            return y.sum(1) * w.sum(1, keepdim=True)
        if self.case == "untransposed_table":  # transpose(0, 0) is no transpose (T == E below)
            table = torch.zeros_like(probs).scatter(1, ids, w)
            g = torch.einsum("th,ehi->eti", x, self.w_gate)
            y = torch.einsum("eti,eih->eth", F.silu(g) * torch.einsum("th,ehi->eti", x, self.w_up), self.w_down)
            return (y * table.transpose(0, 0)[..., None]).sum(0)
        order = flat.argsort()
        token = order // K
        rows = x[token]  # the sorted ids written at each use: equal nodes, one value
        h = F.silu(torch.einsum("nh,nhi->ni", rows, self.w_gate[flat[order]]))
        ys = torch.einsum("ni,nih->nh", h * torch.einsum("nh,nhi->ni", x[token], self.w_up[flat[order]]), self.w_down[flat[order]])
        ys = ys * w.reshape(-1)[order].unsqueeze(-1)
        if self.case == "narrow_scatter":  # an index one column wide adds only column 0 of each row
            return torch.zeros_like(x).scatter_add_(0, token[:, None], ys)
        return torch.zeros(tokens + 1, H).index_add_(0, token, ys)  # "longer_buffer": one more row than tokens


def test_near_misses_are_read_far_enough_to_be_near():
    """The near misses below the combine are read up to it: the rows and ids written at each use are
    one value each (their decline names the combine, not a difference of ids)."""
    torch.manual_seed(0)
    for case in ("narrow_scatter", "longer_buffer"):
        report, _, _ = run_hpu_moe(NearMisses(case).eval(), (torch.randn(7, H),))
        assert "choose each row's expert differently" not in str(report), str(report)


@pytest.mark.parametrize("case", ["product_of_sums", "untransposed_table", "narrow_scatter", "longer_buffer"])
def test_near_misses_of_the_new_spellings_run_as_written(case):
    torch.manual_seed(0)
    model = NearMisses(case).eval()
    inputs = (torch.randn(E, H),)  # T == E: the table's two orders have one shape
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and not report.fallbacks, str(report)
    torch.testing.assert_close(output, eager_output(model, inputs))


def test_rows_gathered_weights_are_fused_with_dynamic_shapes():
    """Under dynamic shapes `i[:, None]` reaches the graph as a slice over every element, then the
    unsqueeze; canonicalization reads the whole slice as the tensor itself."""
    from moe_passes.explain import explaining

    torch.manual_seed(0)
    model = RowsGatheredWeights("sorted").eval()
    with explaining({"inner": "eager", "target": "portable"}) as session, torch.no_grad():
        compiled = session.compile(model, dynamic=True)
        for tokens in (7, 5, 3):
            x = torch.randn(tokens, H)
            assert_close_for_dtype(compiled(x), model(x))
    assert [f.form for f in session.report.fused] == ["batched_mm"], str(session.report)


class BatchedCapacityExperts(nn.Module):
    """GShard-style top-1 dispatch with capacity T (nothing dropped), the experts batched matmuls over
    the [E, C, H] slots."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.w1, self.w3, self.w2 = _param(E, H, INTER), _param(E, H, INTER), _param(E, INTER, H)

    def forward(self, x):
        gates = F.softmax(self.gate(x), dim=1)
        mask = F.one_hot(gates.argmax(dim=1), E)
        slot = F.one_hot(((mask.cumsum(0) - 1) * mask).sum(1), x.shape[0]).to(x.dtype)
        combine = torch.einsum("se,sc->sec", gates * mask, slot)
        dispatched = torch.einsum("sec,sm->ecm", combine.bool().to(x.dtype), x)
        y = torch.bmm(F.silu(torch.bmm(dispatched, self.w1)) * torch.bmm(dispatched, self.w3), self.w2)
        return torch.einsum("sec,ecm->sm", combine, y)


def test_capacity_dispatch_to_batched_experts_is_declined_for_the_batching():
    """It was declined with "the experts' outputs are not joined along the expert dim", which names no
    construct of the layer."""
    torch.manual_seed(0)
    model = BatchedCapacityExperts().eval()
    inputs = (torch.randn(7, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and "batched matmuls over all their slots" in str(report), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


@pytest.mark.parametrize(("put_back", "reason"), [
    ("overwrite", "in a way that does not add each row to its token once"),
    ("forward", "not brought back to the tokens their rows were read from"),
])
def test_sorted_rows_put_back_wrongly_are_declined_with_the_combine_named(put_back, reason):
    """An overwriting `index_put` (a token's second slot replaces its first) and `ys[order]` where the
    inverse permutation was meant: declined at the combine, not with the slot-sum reader's reason."""
    class PutBack(RowsGatheredWeights):
        def forward(self, x):
            w, ids = torch.topk(F.softmax(self.gate(x), dim=-1), K, dim=-1)
            flat = ids.reshape(-1)
            order = flat.argsort()
            ys = self._experts(x[order // K], flat[order])
            if put_back == "overwrite":
                ys = ys * w.reshape(-1)[order].unsqueeze(-1)
                return torch.zeros_like(x).index_put_((order // K,), ys)
            return (ys[order].view(x.shape[0], K, H) * w[..., None]).sum(1)

    torch.manual_seed(0)
    model = PutBack("sorted").eval()
    inputs = (torch.randn(7, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert not report.fused and reason in str(report), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class ReturnsItsRoutingTable(nn.Module):
    """GPT-OSS's MLP (its transformers form): the [T, E] table scattered from the top-k softmax weights
    both weights the dense experts and is returned beside the output."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E)
        self.gate_up_proj, self.gate_up_proj_bias = _param(E, H, 2 * INTER), _param(E, 2 * INTER)
        self.down_proj, self.down_proj_bias = _param(E, INTER, H), _param(E, H)

    def forward(self, x):
        top, ids = torch.topk(self.router(x), K, dim=-1)
        scores = torch.zeros(x.shape[0], E).scatter_(1, ids, F.softmax(top, dim=1))
        gate_up = torch.bmm(x.repeat(E, 1).view(E, -1, H), self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
        gate, up = gate_up[..., ::2].clamp(max=7.0), gate_up[..., 1::2].clamp(min=-7.0, max=7.0)
        y = torch.bmm((up + 1) * (gate * torch.sigmoid(gate * 1.702)), self.down_proj) + self.down_proj_bias[..., None, :]
        return (y * scores.transpose(0, 1)[..., None]).sum(0), scores


def test_a_routing_table_the_layer_also_returns_does_not_stop_the_fusion():
    """The table is routing (made from the ids and weights alone): it stays, computed once, for the
    caller. It was declined as "an intermediate value of the expert region escapes it"."""
    torch.manual_seed(0)
    model = ReturnsItsRoutingTable().eval()
    inputs = (torch.randn(7, H),)
    report, output, _ = run_hpu_moe(model, inputs)
    assert [f.form for f in report.fused] == ["dense_bmm"], str(report)
    expected = eager_output(model, inputs)
    assert_close_for_dtype(output[0], expected[0])
    torch.testing.assert_close(output[1], expected[1])
