"""A sweep of MoE spellings written afresh, none of them from the catalog or the corpus: what
`backend="hpu_moe"` does with each (fused / declined with the reason / graphs and breaks), beside eager.

These are the ways hand-written MoE blocks select, skip, gather, combine and stack experts that the
project had no test for when the sweep was written (2026-11-28)
running it on an older commit measures
how the capture code generalises. Each block: 4 SiLU-gated experts of hidden size 8, top-2 routing, 7
tokens, inner backend eager, default dynamo settings.

    python tools/spelling_sweep.py            # markdown table on stdout
    python tools/spelling_sweep.py --tables   # the second sweep (2026-11-29): routing tables read per expert
    python tools/spelling_sweep.py --stacked  # the third (2026-11-29): routers and stacked expert weights
                                              # (tools/sweep_stacked_blocks.py)
    python tools/spelling_sweep.py --layers   # the fourth (2026-11-30): whole layers around the experts
                                              # (tools/sweep_layer_blocks.py)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

H, E, K = 8, 4, 2


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(H, 2 * H, bias=False)
        self.w3 = torch.nn.Linear(H, 2 * H, bias=False)
        self.w2 = torch.nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(H, E, bias=False)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(E))

    def route(self, x):
        w, ids = torch.topk(self.gate(x).softmax(-1), K)
        return w / w.sum(-1, keepdim=True), ids


class SumSkip(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = ids == e
            if mask.sum() == 0:
                continue
            token, slot = torch.where(mask)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class TorchSumSkip(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = ids == e
            if torch.sum(mask) == 0:
                continue
            token, slot = torch.where(mask)
            out[token] += expert(x[token]) * w[token, slot, None]
        return out


class ItemSkip(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = ids == e
            if mask.sum().item() == 0:
                continue
            token, slot = torch.where(mask)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class NonzeroAsTuple(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.shape[0] == 0:
                continue
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot].unsqueeze(-1))
        return out


class FlatMaskWeights(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            mask = ids == e
            tok = mask.any(-1)
            if not tok.any():
                continue
            y = self.experts[e](x[tok]) * (w * mask).sum(-1, keepdim=True)[tok]
            out[tok] += y
        return out


class WhileLoop(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        e = 0
        while e < E:
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
            e += 1
        return out


class RepeatInterleaveDispatch(Base):
    def forward(self, x):
        w, ids = self.route(x)
        xs = x.repeat_interleave(K, dim=0)
        flat = ids.view(-1)
        y = torch.empty_like(xs)
        for e in range(E):
            y[flat == e] = self.experts[e](xs[flat == e])
        return (y.view(-1, K, H) * w.unsqueeze(-1)).sum(1)


class SignedSumSkip(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            score = (ids == e).float() - (ids == (e + 1) % E).float()
            if score.sum() == 0:
                continue
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
        return out


class NonzeroColumns(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            idx = torch.nonzero(ids == e)
            tok, slot = idx[:, 0], idx[:, 1]
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot].unsqueeze(1))
        return out


class OneHotLastDim(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        m = F.one_hot(ids, E)
        for e in range(E):
            tok, slot = torch.where(m[..., e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class BoolWeights2D(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = (ids == i).any(dim=-1)
            wi = w[ids == i]
            out[mask] += wi[:, None] * expert(x[mask])
        return out


class NotInSkip(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            if e not in ids:
                continue
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class StackGather(Base):
    def forward(self, x):
        w, ids = self.route(x)
        y = torch.stack([expert(x) for expert in self.experts], dim=1)  # [T, E, H]
        picked = torch.gather(y, 1, ids[..., None].expand(-1, -1, H))
        return (picked * w[..., None]).sum(1)


class DenseMaskLoop(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            we = (w * (ids == e)).sum(-1, keepdim=True)
            out = out + we * self.experts[e](x)
        return out


class MaskedSelectWeights(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            m = ids == e
            tok = m.nonzero()[:, 0]
            we = torch.masked_select(w, m)
            out.index_add_(0, tok, self.experts[e](x[tok]) * we[:, None])
        return out


class StackTable(Base):
    def forward(self, x):
        w, ids = self.route(x)
        table = torch.zeros(x.shape[0], E).scatter(1, ids, w)
        y = torch.stack([expert(x) for expert in self.experts], dim=1)  # [T, E, H]
        return (y * table[..., None]).sum(1)


class StackEinsum(Base):
    def forward(self, x):
        w, ids = self.route(x)
        table = torch.zeros(x.shape[0], E).scatter(1, ids, w)
        y = torch.stack([expert(x) for expert in self.experts], dim=0)  # [E, T, H]
        return torch.einsum("eth,te->th", y, table)


class StackIndexPick(Base):
    def forward(self, x):
        w, ids = self.route(x)
        y = torch.stack([expert(x) for expert in self.experts], dim=1)  # [T, E, H]
        picked = y[torch.arange(x.shape[0])[:, None], ids]
        return (picked * w[..., None]).sum(1)


class SortSplitLoop(Base):
    """sort slots by expert, split by bincount, loop pieces (DeepSeek-like moe_infer with cat + scatter back)."""

    def forward(self, x):
        w, ids = self.route(x)
        flat = ids.view(-1)
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=E).tolist()
        rows = x[order // K]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            outs.append(self.experts[e](rows[start : start + n]))
            start += n
        y = torch.cat(outs)
        back = torch.empty_like(y)
        back[order] = y
        return (back.view(-1, K, H) * w[..., None]).sum(1)


class ScatterAddCombine(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            y = self.experts[e](x[tok]) * w[tok, slot][:, None]
            out.scatter_add_(0, tok[:, None].expand(-1, H), y)
        return out


class IndexSelectGather(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(ids == e)
            y = self.experts[e](torch.index_select(x, 0, tok)) * w[tok, slot].unsqueeze(-1)
            out = out.index_add(0, tok, y)
        return out


class Top1Argmax(Base):
    def forward(self, x):
        probs = self.gate(x).softmax(-1)
        w, ids = probs.max(-1)
        out = torch.zeros_like(x)
        for e in range(E):
            m = ids == e
            out[m] = self.experts[e](x[m]) * w[m, None]
        return out


class UniqueIds(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in ids.flatten().unique().tolist():
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class UniqueTensorIds(Base):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class SortedSlots(Base):
    def forward(self, x):
        w, ids = self.route(x)
        order = torch.argsort(ids.flatten())
        sorted_ids = ids.flatten()[order]
        tok, slot = torch.where(ids >= 0)
        tok, slot = tok[order], slot[order]
        rows, scales = x[tok], w[tok, slot, None]
        return self.run_experts(x, rows, scales, sorted_ids, tok)

    def run_experts(self, x, rows, scales, sorted_ids, tok):
        out = torch.zeros_like(x)
        for e in range(E):
            m = sorted_ids == e
            if not torch.any(m):
                continue
            out[tok[m]] += self.experts[e](rows[m]) * scales[m]
        return out


BLOCKS = [
    c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, Base) and c is not Base
]


# The second sweep (2026-11-29): dense [T, E] routing tables read per expert, and what the probes must not
# take for a routing weight. Each forward is written as a hand-written block would; the last four must
# never be fused (each computes something else than the kernel), and are written in spellings the
# adapter captured before this sweep, so that a wrong fusion shows.


class TableBase(Base):
    def table(self, x):
        w, ids = self.route(x)
        return torch.zeros(x.size(0), E, dtype=x.dtype).scatter(1, ids, w)


class ColumnAboveZero(TableBase):
    def forward(self, x):
        gates = self.table(x)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = gates[:, i] > 0
            out[chosen] += gates[chosen, i, None] * expert(x[chosen])
        return out


class BoolTableColumn(TableBase):
    def forward(self, x):
        gates = self.table(x)
        routed = gates.bool()
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = routed[:, i]
            out[chosen] = out[chosen] + gates[chosen, i].unsqueeze(-1) * expert(x[chosen])
        return out


class ColumnWhereSkip(TableBase):
    def forward(self, x):
        gates = self.table(x)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows, = torch.where(gates[:, i] > 0)
            if rows.numel() == 0:
                continue
            out.index_add_(0, rows, gates[rows, i, None] * expert(x[rows]))
        return out


class BoolScatterTable(TableBase):
    def forward(self, x):
        w, ids = self.route(x)
        routed = torch.zeros(x.size(0), E, dtype=torch.bool).scatter_(1, ids, True)
        gates = torch.zeros(x.size(0), E, dtype=x.dtype).scatter_(1, ids, w)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            sel = routed[:, i]
            out[sel] += expert(x[sel]) * gates[sel, i : i + 1]
        return out


class SummedWeightAboveZero(TableBase):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e in range(E):
            weight = ((ids == e) * w).sum(-1)
            rows = weight > 0
            out[rows] += self.experts[e](x[rows]) * weight[rows, None]
        return out


class AnySkipStoreAdd(TableBase):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            hit = ids == e
            tok = hit.any(-1)
            if not tok.any():
                continue
            out[tok] = out[tok] + w[hit][:, None] * expert(x[tok])
        return out


class ZippedHostCounts(TableBase):
    def forward(self, x):
        w, ids = self.route(x)
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=E).tolist()
        for e, (expert, n) in enumerate(zip(self.experts, counts)):  # noqa: B905 - as hand-written
            if n == 0:
                continue
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out


class ListOfRowOutputs(TableBase):
    def forward(self, x):
        w, ids = self.route(x)
        outs = []
        for e, expert in enumerate(self.experts):
            hit = ids == e
            tok = hit.any(-1).nonzero().flatten()
            outs.append((tok, expert(x[tok]) * (w * hit).sum(-1)[tok, None]))
        out = torch.zeros_like(x)
        for tok, y in outs:
            out.index_add_(0, tok, y)
        return out


class SignedTableAboveZero(TableBase):
    def forward(self, x):
        w, ids = self.gate(x).topk(K, dim=-1)  # raw logits as the weights: signed
        routed = torch.zeros(x.size(0), E, dtype=x.dtype).scatter(1, ids, w)
        chosen_table = routed > 0
        out = torch.zeros_like(x)
        for e in range(E):
            chosen = chosen_table[:, e]
            out[chosen] += routed[chosen, e, None] * self.experts[e](x[chosen])
        return out


class NextColumnWeight(TableBase):
    def forward(self, x):
        gates = self.table(x)
        chosen_table = gates > 0
        out = torch.zeros_like(x)
        for e in range(E):
            chosen = chosen_table[:, e]
            out[chosen] += gates[chosen, (e + 1) % E, None] * self.experts[e](x[chosen])
        return out


class TableCutAtThreshold(TableBase):
    def forward(self, x):
        gates = self.table(x)
        kept = gates > 0.3
        out = torch.zeros_like(x)
        for e in range(E):
            chosen = kept[:, e]
            out[chosen] += gates[chosen, e, None] * self.experts[e](x[chosen])
        return out


class TruncatedTable(TableBase):
    def forward(self, x):
        gates = self.table(x)
        kept = (gates * 4).long() > 0
        out = torch.zeros_like(x)
        for e in range(E):
            chosen = kept[:, e]
            out[chosen] += gates[chosen, e, None] * self.experts[e](x[chosen])
        return out


TABLE_BLOCKS = [c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, TableBase)
                and c is not TableBase]
BLOCKS = [c for c in BLOCKS if not issubclass(c, TableBase)]


def _first(value):
    """The layer's output, where it also returns an auxiliary loss or its routing."""
    return value[0] if isinstance(value, tuple) else value


def measure(cls) -> dict:
    from moe_passes.explain import explain_and_run

    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(7, H)
    row = {
        "block": cls.__name__,
        "spelling": (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "",
    }
    with torch.no_grad():
        expected = model(x)
        torch._dynamo.reset()
        try:
            report, output = explain_and_run(model, x, options={"inner": "eager", "target": "portable"})
        except Exception as error:  # noqa: BLE001 - the outcome under test
            return {
                **row,
                "outcome": "RAISES",
                "detail": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}",
            }
    error = (_first(output) - _first(expected)).abs().max().item()
    # Experts computed in bf16 or fp16 round differently in the fused call, whatever dtype they return.
    narrow = [p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 1e-2}[narrow[0]] if narrow else 1e-5
    if report.fused:
        outcome = "fused" if error <= tolerance else "WRONG"
        detail = report.fused[0].form
    elif report.fallbacks:  # an internal error: the graph ran unrewritten
        outcome, detail = "internal error", report.fallbacks[0].splitlines()[0]
    elif report.declined:
        outcome, detail = "declined", report.declined[0].reason
    elif report.graph_break_count or report.graph_count != 1:
        outcome, detail = "not captured", ""
    else:
        outcome, detail = "no candidate", ""
    return {
        **row,
        "outcome": outcome,
        "detail": detail[:110],
        "graphs": report.graph_count,
        "breaks": report.graph_break_count,
        "error": error,
    }


def main() -> int:
    warnings.simplefilter("ignore")
    if "--stacked" in sys.argv[1:] or "--layers" in sys.argv[1:]:
        sys.path.insert(0, str(Path(__file__).parent))
        if "--stacked" in sys.argv[1:]:
            from sweep_stacked_blocks import BLOCKS as blocks
        else:
            from sweep_layer_blocks import BLOCKS as blocks
    else:
        blocks = TABLE_BLOCKS if "--tables" in sys.argv[1:] else BLOCKS
    rows = [measure(cls) for cls in blocks]
    print("| block | outcome | form or reason | graphs, breaks |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['block']} | {r['outcome']} | {r.get('detail', '')} | {r.get('graphs', '-')}, {r.get('breaks', '-')} |"
        )
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"\n{len(rows)} blocks: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if not any(r["outcome"] in ("RAISES", "WRONG", "internal error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
