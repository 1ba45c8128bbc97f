"""Never worse than backend="eager": data-dependent Python in MoE layers, each construct alone and beside a
loop the expert-loop adapter takes (a transformers 4.x hit-expert loop, which switches on the capture of
data-dependent shapes for the compile).

For every construct: if `backend="eager"` compiles and runs the layer, `backend="hpu_moe"` must too, with
eager's output. Whether the layer is fused is not asserted here (the corpus and the catalog pin that).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_passes.explain import explain_and_run
from tests.helpers import assert_close_for_dtype

E, H, INTER, K, T = 4, 16, 8, 2, 7


def expert_rows(layer, i, x, idx, top, w):
    return layer.experts[i](x[idx]) * w[idx, top, None]


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(H, INTER), nn.Linear(H, INTER), nn.Linear(INTER, H)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def tolist_skip(layer, x, ids, w):  # DeepSeek-V3 inference
    y = torch.zeros_like(x)
    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    for i in range(E):
        if counts[i] == 0:
            continue
        idx, top = torch.where(ids == i)
        y[idx] += expert_rows(layer, i, x, idx, top, w)
    return y


def numpy_counts(layer, x, ids, w):  # DeepSeek-MoE / -V2 moe_infer
    y = torch.zeros_like(x)
    counts = torch.bincount(ids.flatten(), minlength=E).cpu().numpy()
    for i, n in enumerate(counts):
        if n == 0:
            continue
        idx, top = torch.where(ids == i)
        y[idx] += expert_rows(layer, i, x, idx, top, w)
    return y


def item_skip(layer, x, ids, w):
    y = torch.zeros_like(x)
    for i in range(E):
        if (ids == i).sum().item() == 0:
            continue
        idx, top = torch.where(ids == i)
        y[idx] += expert_rows(layer, i, x, idx, top, w)
    return y


def split_sizes(layer, x, ids, w):  # sorted rows cut by host counts
    flat = ids.view(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=E).tolist()
    rows = x[order // K]
    outs = [layer.experts[i](part) for i, part in enumerate(rows.split(counts))]
    y = torch.empty_like(rows)
    y[order] = torch.cat(outs)
    return (y.view(-1, K, H) * w[..., None]).sum(1)


def bool_mask(layer, x, ids, w):  # rows repeated k times, written back by a boolean mask
    flat = ids.view(-1)
    h = x.repeat_interleave(K, dim=0)
    y = torch.empty_like(h)
    for i in range(E):
        y[flat == i] = layer.experts[i](h[flat == i])
    return (y.view(-1, K, H) * w[..., None]).sum(1)


def list_gather(layer, x, ids, w):  # transformers 4.3x Mixtral
    y = torch.zeros_like(x)
    mask = F.one_hot(ids, E).permute(2, 1, 0)
    for i in range(E):
        top, idx = torch.where(mask[i])
        if idx.shape[0] == 0:
            continue
        idx_list, top_list = idx.tolist(), top.tolist()
        y.index_add_(0, idx, layer.experts[i](x[None, idx_list].reshape(-1, H)) * w[idx_list, top_list, None])
    return y


def zip_masks(layer, x, ids, w):
    y = torch.zeros_like(x)
    for mask, expert in zip([ids == i for i in range(E)], layer.experts, strict=True):
        idx, top = torch.where(mask)
        y.index_add_(0, idx, expert(x[idx]) * w[idx, top, None])
    return y


@torch.no_grad()
def no_grad_method(layer, x, ids, w):
    y = torch.zeros_like(x)
    for i in range(E):
        idx, top = torch.where(ids == i)
        y[idx] += expert_rows(layer, i, x, idx, top, w)
    return y


def unique_loop(layer, x, ids, w):  # a loop over the ids present, read on the host
    y = torch.zeros_like(x)
    for i in ids.unique().tolist():
        idx, top = torch.where(ids == i)
        y[idx] += expert_rows(layer, i, x, idx, top, w)
    return y


def _sorted_by_host_sizes(layer, x, ids, w, variant: str):
    flat = ids.view(-1)
    order = flat.argsort(stable=True)
    counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1).long()
    y = layer.experts_at_host_sizes(x[order // K], counts, variant) * w.view(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, order // K, y)


def host_split(layer, x, ids, w):  # torchtune: a method splits at counts.tolist() (their capture is switched on)
    return _sorted_by_host_sizes(layer, x, ids, w, "plain")


def host_split_skip(layer, x, ids, w):  # ... then branches on a piece's size inside the loop
    return _sorted_by_host_sizes(layer, x, ids, w, "skip")


def host_split_range(layer, x, ids, w):  # ... or loops over a size read on the host
    return _sorted_by_host_sizes(layer, x, ids, w, "range")


def host_split_int(layer, x, ids, w):  # ... or converts a size to a Python int and compares it
    return _sorted_by_host_sizes(layer, x, ids, w, "int")


CONSTRUCTS = [tolist_skip, numpy_counts, item_skip, split_sizes, bool_mask, list_gather, zip_masks, no_grad_method,
              unique_loop, host_split, host_split_skip, host_split_range, host_split_int]


class Layer(nn.Module):
    """A router and E experts; `construct` computes the experts."""

    def __init__(self, construct):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.construct = construct

    def forward(self, x):
        x = x.view(-1, H)
        w, ids = torch.topk(torch.softmax(self.router(x), -1), K, dim=-1)
        return self.construct(self, x, ids, w)

    def experts_at_host_sizes(self, rows, counts, variant):
        """The experts on rows sorted by expert, split at the counts read on the host (a method: the
        expert-loop adapter reads methods, and switches scalar capture on for this split)."""
        sizes = counts.tolist()
        if variant == "range":
            for _ in range(sizes[0]):
                rows = rows * 1.0
        outs = []
        for i, part in enumerate(torch.split(rows, sizes)):
            if variant == "skip" and part.shape[0] == 0:
                outs.append(part)
                continue
            if variant == "int" and int(sizes[i]) > 2 * T * K:
                part = part * 2
            outs.append(self.experts[i](part))
        return torch.cat(outs)


class MixedLayer(Layer):
    """The hit loop written in `forward` itself, beside the construct (the adapter takes this method)."""

    def forward(self, x):
        x = x.view(-1, H)
        w, ids = torch.topk(torch.softmax(self.router(x), -1), K, dim=-1)
        y = self.construct(self, x, ids, w)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=E).permute(2, 1, 0)
        expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            idx, top_x = torch.where(mask[expert_idx].squeeze(0))
            out.index_add_(0, top_x, self.experts[expert_idx](x[top_x]) * w[top_x, idx, None])
        return y + out


@pytest.mark.parametrize("mixed", [False, True], ids=["alone", "beside_a_hit_loop"])
@pytest.mark.parametrize("construct", CONSTRUCTS, ids=lambda c: c.__name__)
def test_whatever_eager_compiles_hpu_moe_compiles_with_eagers_output(construct, mixed):
    torch.manual_seed(0)
    model = (MixedLayer if mixed else Layer)(construct).eval()
    x = torch.randn(1, T, H)
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        torch.compile(model, backend="eager")(x)  # the bar: if this raised, the construct would be out of scope
        report, output = explain_and_run(model, x, options={"inner": "eager", "target": "portable"})
    assert_close_for_dtype(output, expected)
    assert not report.fallbacks or all("internal error" not in f for f in report.fallbacks), str(report)


def test_splits_at_host_sizes_outside_an_expert_loop_are_left_as_written():
    """Only a split whose pieces an expert loop reads switches scalar capture on (vLLM's audio encoders
    cut a batch into its items with `split(lengths.tolist())`, and loop over their own mergers)."""
    from moe_passes.adapters import hit_expert_loops

    class Items(nn.Module):
        def forward(self, x, lengths):
            return [part.sum(0) for part in x.split(lengths.tolist())]

    class ItemsAndMergers(nn.Module):
        def __init__(self):
            super().__init__()
            self.mergers = nn.ModuleList(nn.Linear(H, H) for _ in range(2))

        def forward(self, x, lengths, layers):
            sizes = lengths.tolist()
            outs = []
            for idx, hidden in enumerate(layers):
                outs.append(self.mergers[idx](hidden).split(sizes))
            return x.split(sizes), outs

    assert hit_expert_loops.adaptations_of(Items) == {}
    assert hit_expert_loops.adaptations_of(ItemsAndMergers) == {}
    assert "experts_at_host_sizes" in hit_expert_loops.adaptations_of(Layer)


class PresentExpertsLoop(Layer):
    """The loop over the experts present written in the layer's own method, whose body selects tokens (so
    shapes are captured around it): `ids.unique().tolist()` runs over every expert; `unique(sorted=False)`
    is left as written and evaluated before shapes are captured (captured, its data-dependent length made
    dynamo raise where it unrolled the loop)."""

    def __init__(self, spelling):
        super().__init__(None)
        self.spelling = spelling

    def forward(self, x):
        x = x.view(-1, H)
        w, ids = torch.topk(torch.softmax(self.router(x), -1), K, dim=-1)
        y = torch.zeros_like(x)
        for i in (ids.unique().tolist() if self.spelling == "sorted" else ids.unique(sorted=False).tolist()):
            idx, top = torch.where(ids == i)
            y[idx] += self.experts[i](x[idx]) * w[idx, top, None]
        return y


@pytest.mark.parametrize("spelling", ["sorted", "unsorted"])
def test_a_loop_over_the_experts_present_in_an_adapted_method_runs_as_eager(spelling):
    torch.manual_seed(0)
    model = PresentExpertsLoop(spelling).eval()
    x = torch.randn(1, T, H)
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        torch.compile(model, backend="eager")(x)
        report, output = explain_and_run(model, x, options={"inner": "eager", "target": "portable"})
    assert_close_for_dtype(output, expected)


class OddSizeSkip(Layer):
    """A loop over every expert with a skip the proof does not take (`if len(rows) % 2: continue`): the `if`
    is kept, so the loop is traced as written; with data-dependent shapes captured around it dynamo would
    raise on that test instead of breaking the graph."""

    def __init__(self):
        super().__init__(None)

    def forward(self, x):
        x = x.view(-1, H)
        w, ids = torch.topk(torch.softmax(self.router(x), -1), K, dim=-1)
        y = torch.zeros_like(x)
        for i in range(E):
            idx, top = torch.where(ids == i)
            if len(idx) % 2:
                continue
            y.index_add_(0, idx, self.experts[i](x[idx]) * w[idx, top, None])
        return y


def test_a_kept_skip_on_a_size_of_the_rows_is_traced_as_written():
    torch.manual_seed(0)
    model, x = OddSizeSkip().eval(), torch.randn(1, T, H)
    with torch.no_grad():
        expected = model(x)
        report, output = explain_and_run(model, x, options={"inner": "eager", "target": "portable"})
    assert_close_for_dtype(output, expected)
    assert report.graph_break_count > 0 and not report.fused, str(report)
