"""A router whose experts no form reads is named in the report (passes/unread_routing.py), with what its
choices feed; top-k and argmax that are not routers (sampling, greedy decoding) are not, and a layer a
finder read is not named twice."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from tests.loop_models import SeparateGatedExpert

H, E, K = 8, 4, 2


class PerRowLoopMoE(torch.nn.Module):
    """Routing per batch row, as a projector between a vision tower and a language model might write it."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(SeparateGatedExpert() for _ in range(E))

    def forward(self, x):  # [B, N, H]
        probs = self.router(x).softmax(-1)
        weights, chosen = probs.topk(K)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for b in range(x.shape[0]):
            for e, expert in enumerate(self.experts):
                rows, slot = torch.where(chosen[b] == e)
                out[b][rows] += weights[b][rows, slot, None] * expert(x[b][rows])
        return out


class NeuronClusterMask(torch.nn.Module):
    """A dense MLP whose hidden neurons are masked by clusters a top-k picks (MoEfication-like)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(H, 4 * H)
        self.down = torch.nn.Linear(4 * H, H)
        self.scorer = torch.nn.Linear(H, E, bias=False)
        self.register_buffer("clusters", (torch.arange(4 * H)[None] % E == torch.arange(E)[:, None]).float())

    def forward(self, x):
        picked = self.scorer(x).topk(K, dim=-1).indices
        keep = F.embedding(picked, self.clusters).sum(-2) > 0
        return self.down(F.relu(self.up(x)) * keep)


class SamplingHead(torch.nn.Module):
    """Top-k over a vocabulary's logits, then a token picked among the k: the ids are tokens, not experts."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(H, 50, bias=False)
        self.embed = torch.nn.Embedding(50, H)

    def forward(self, x):
        values, ids = self.head(x).topk(5)
        token = ids.gather(-1, values.softmax(-1).argmax(-1, keepdim=True))
        return self.embed(token.squeeze(-1)) + x


class GreedyHead(torch.nn.Module):
    """Greedy decoding that stops at an end token: argmax of logits compared with a number."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(H, 50, bias=False)

    def forward(self, x):
        token = self.head(x).argmax(-1)
        return x * (token == 3).unsqueeze(-1)


class TopkAttention(torch.nn.Module):
    """Sparse attention keeping each query's top-k keys: scores are `q @ k.T`, both sides projected."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(H, H, bias=False) for _ in range(3))

    def forward(self, x):  # [N, H], N keys
        keys, values = self.k(x), self.v(x)
        picked = (self.q(x) @ keys.T).topk(K, dim=-1).indices  # [N, K]
        return (keys[picked] * values[picked]).sum(1) @ self.v.weight


class TokenChoiceByLayer(torch.nn.Module):
    """Mixture-of-depths: a scorer picks the top-k tokens of a sequence to run an MLP on; the ids are
    positions, gathered as rows."""

    def __init__(self):
        super().__init__()
        self.scorer = torch.nn.Linear(H, 1, bias=False)
        self.mlp = SeparateGatedExpert()

    def forward(self, x):  # [S, H]
        picked = self.scorer(x).squeeze(-1).topk(K).indices
        return x.index_add(0, picked, self.mlp(x.index_select(0, picked)))


class SparseCode(torch.nn.Module):
    """A top-k sparse autoencoder: the kept activations, scattered into the code, are data for the decoder."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode = torch.nn.Linear(H, 32), torch.nn.Linear(32, H)

    def forward(self, x):
        pre = self.encode(x)
        kept, at = pre.topk(4)
        return self.decode(torch.zeros_like(pre).scatter(-1, at, F.relu(kept)))


class CodebookLookup(torch.nn.Module):
    """Vector quantisation: the nearest code's one-hot times the codebook."""

    def __init__(self):
        super().__init__()
        self.codes = torch.nn.Parameter(torch.randn(16, H))

    def forward(self, x):
        nearest = (x @ self.codes.T).argmax(-1)
        return F.one_hot(nearest, 16).to(x.dtype) @ self.codes


class BeamEnd(torch.nn.Module):
    """A beam step that stops beams at an end token: the top-k tokens compared with one number."""

    def __init__(self):
        super().__init__()
        self.head, self.cell = torch.nn.Linear(H, 50, bias=False), torch.nn.Linear(H, H)

    def forward(self, x):
        tokens = self.head(x).log_softmax(-1).topk(3).indices
        done = (tokens == 2).any(-1, keepdim=True)
        return self.cell(x.masked_fill(done, 0.0))


class ExpertsChooseTokens(torch.nn.Module):
    """Expert-choice routing: scores transposed to [E, T], each expert picks tokens (not k of E experts)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(SeparateGatedExpert() for _ in range(E))

    def forward(self, x):  # [T, H], T > E
        weights, rows = self.gate(x).softmax(-1).T.topk(2)
        out = torch.zeros_like(x)
        for e in range(E):
            out = out.index_add(0, rows[e], self.experts[e](x[rows[e]]) * weights[e, :, None])
        return out


class SoftmaxTopkLoop(torch.nn.Module):
    """A loop the finders read and fuse."""

    def __init__(self, experts=SeparateGatedExpert):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(experts() for _ in range(E))

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


class _Ungated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _routing_declines(report):
    return [d for d in report.declined if d.form == "routing"]


class MaxRoutedIntoTransposedBuffer(torch.nn.Module):
    """Top-1 by `max` (Switch Transformers' choice), experts stored through a [B, S] mask into a buffer laid
    out [S, B, H] (not contiguous as [B, S, H]): no view flattens its rows, so no finder reads the stores."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(SeparateGatedExpert() for _ in range(E))

    def forward(self, x):  # [B, S, H]
        probs, chosen = self.router(x).softmax(-1).max(dim=-1, keepdim=True)
        mask = F.one_hot(chosen.squeeze(-1), E).bool()
        out = x.new_zeros(x.shape[1], x.shape[0], H).transpose(0, 1)
        for e in range(E):
            out[mask[:, :, e]] = self.experts[e](x[mask[:, :, e]])
        return probs * out


class GreedyMaxHead(GreedyHead):
    """Greedy decoding by `max` over the vocabulary: the ids are tokens."""

    def forward(self, x):
        _, token = self.head(x).max(dim=-1)
        return x * (token == 3).unsqueeze(-1)


class ArgmaxLoopIntoTransposedBuffer(MaxRoutedIntoTransposedBuffer):
    """Top-1 by argmax, each expert's tokens picked by `ids == e` for every e: a loop over the experts."""

    def forward(self, x):  # [B, S, H]
        probs = self.router(x).softmax(-1)
        ids = probs.argmax(dim=-1)
        out = x.new_zeros(x.shape[1], x.shape[0], H).transpose(0, 1)
        for e in range(E):
            out[ids == e] = self.experts[e](x[ids == e]) * probs[ids == e][:, e:e + 1]
        return out


class GreedyTwoStops(GreedyHead):
    """Greedy decoding that stops at either of two end tokens: an argmax compared with a few numbers."""

    def forward(self, x):
        token = self.head(x).argmax(-1)
        return x * ((token == 2) | (token == 3)).unsqueeze(-1)


def _run(model, *inputs):
    torch.manual_seed(0)
    model = model.eval()
    report, output, _ = run_hpu_moe(model, inputs)
    assert_close_for_dtype(output, eager_output(model, inputs))
    return report


def test_a_router_read_per_batch_row_is_named_with_the_comparison_that_reads_it():
    report = _run(PerRowLoopMoE(), torch.randn(2, 5, H))
    assert not report.fused, str(report)
    (declined,) = _routing_declines(report)
    assert "top-2 of 4" in declined.reason and "per batch row" in declined.reason, declined
    assert "a comparison with an expert number" in declined.reason, declined
    assert "test_unread_routing.py" in declined.stopped_at and "eq" in declined.stopped_at, declined


def test_a_neuron_mask_picked_by_a_top_k_is_named_with_its_table_lookup():
    report = _run(NeuronClusterMask(), torch.randn(5, H))
    (declined,) = _routing_declines(report)
    assert "embedding of a table with a row per expert" in declined.reason, declined
    assert "embedding" in declined.stopped_at


def test_a_router_choosing_by_max_is_named_where_no_finder_reads_its_stores():
    report = _run(MaxRoutedIntoTransposedBuffer(), torch.randn(2, 5, H))
    assert not report.fused, str(report)
    (declined,) = _routing_declines(report)
    assert "max of 4" in declined.reason and "one_hot" in declined.reason, declined
    report = _run(ArgmaxLoopIntoTransposedBuffer(), torch.randn(2, 5, H))
    (declined,) = _routing_declines(report)
    assert "argmax of 4" in declined.reason and "a comparison with an expert number" in declined.reason, declined


def test_sampling_greedy_decoding_sparse_attention_and_token_picks_are_not_taken_for_routers():
    for model in (SamplingHead(), GreedyHead(), GreedyMaxHead(), GreedyTwoStops(), TopkAttention(), TokenChoiceByLayer(), SparseCode(),
                  CodebookLookup(), BeamEnd(), ExpertsChooseTokens()):
        report = _run(model, torch.randn(5, H))
        assert not _routing_declines(report) and not report.fused, str(report)


def test_a_fused_layer_and_a_layer_a_finder_declined_are_not_named_again():
    fused = _run(SoftmaxTopkLoop(), torch.randn(5, H))
    assert len(fused.fused) == 1 and not fused.declined, str(fused)
    declined = _run(SoftmaxTopkLoop(_Ungated), torch.randn(5, H))
    assert not declined.fused and declined.declined and not _routing_declines(declined), str(declined)


class _RouterThenExperts(torch.nn.Module):
    """Experts a dense mask loop with mixed activations (declined by its finder), a projection after the
    layer."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(SeparateGatedExpert() for _ in range(E))
        self.experts[0].forward = lambda x, m=self.experts[0]: m.w2(F.gelu(m.w1(x)) * m.w3(x))
        self.head = torch.nn.Linear(H, H)

    def forward(self, x):
        weights, ids = self.router(x).softmax(-1).topk(K)
        out = torch.zeros_like(x)
        for e in range(E):
            out = out + self.experts[e](x) * (weights * (ids == e)).sum(-1, keepdim=True)
        return self.head(out)


class _BrokenAfterOneExpert(SoftmaxTopkLoop):
    """Expert 0 in the router's graph, a print, experts 1 to 3 in the next graph: the break is the reason."""

    def run(self, e, x, weights, ids, out):
        token, slot = torch.where(ids == e)
        out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), K)
        out = torch.zeros_like(x)
        self.run(0, x, weights, ids, out)
        print("one expert done")
        self.run(1, x, weights, ids, out)
        self.run(2, x, weights, ids, out)
        self.run(3, x, weights, ids, out)
        return out


def test_a_layer_its_finder_declined_and_a_router_before_a_graph_break_are_not_named(capsys):
    declined = _run(_RouterThenExperts(), torch.randn(5, H))
    assert declined.declined and not _routing_declines(declined), str(declined)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        broken = _run(_BrokenAfterOneExpert(), torch.randn(5, H))
    assert broken.graph_break_count and not _routing_declines(broken), str(broken)


def test_forms_left_out_by_the_options_do_not_make_their_layers_look_unread():
    torch.manual_seed(0)
    model, inputs = SoftmaxTopkLoop().eval(), (torch.randn(5, H),)
    report, _, _ = run_hpu_moe(model, inputs, forms=["grouped_mm"])
    assert not report.fused and not _routing_declines(report), str(report)


def test_an_error_while_naming_routers_costs_no_fusion(monkeypatch):
    from moe_passes.passes import pipeline

    def broken(*_):
        raise RuntimeError("simulated")

    monkeypatch.setattr(pipeline, "unread_routings", broken)
    report = _run(SoftmaxTopkLoop(), torch.randn(5, H))
    assert len(report.fused) == 1, str(report)


def test_expert_choice_routing_is_declined_as_such():
    """The sparse-loop finder reads the loop (the rows `rows[e]` written twice are one index) and names
    what the kernel cannot do: experts choosing their tokens."""
    report = _run(ExpertsChooseTokens(), torch.randn(5, H))
    (declined,) = report.declined
    assert declined.form == "sparse_loop" and "expert-choice routing" in declined.reason, str(report)
    assert "aten.topk" in declined.stopped_at
