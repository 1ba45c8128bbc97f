"""Random MoE blocks across the catalog's dimensions, and the differential check each must pass.

A `Case` names one block: routing form, k, E, H, I, activation, how the expert weights are stored,
which expert computation runs them (dense loops, the transformers 4.x sparse loop, the 5.x grouped and
batched GEMMs), dtype, shared expert, token count, static or dynamic shapes. `run_case` compiles the
block with `hpu_moe` (portable target, eager inner) and compares it with eager: every case must either
be fused (one fused call, equal within the dtype's tolerance) or left untouched with a reason in the
report; which of the two is predicted from the case (`expect_fused`), so a wrong decline fails too.

`cases()` is the hypothesis strategy; tests/test_fuzz.py runs a bounded budget of it and
tools/fuzz.py a long one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

from form_catalog._common import GatedMLP
from form_catalog.hf_batched_mm import batched_linear
from form_catalog.hf_grouped_mm import _grouped_mm, _tokens_per_expert
from form_catalog.near_miss_data_dependent_loop import eager_experts_forward
from moe_passes.backend import hpu_moe
from moe_passes.printer import is_fused_moe
from moe_passes.report import collecting

ROUTINGS = ("softmax_topk", "softmax_topk_renorm", "topk_softmax", "sigmoid_bias", "sigmoid_bias_renorm")
SUPPORTED_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda t: F.gelu(t, approximate="tanh"),  # the kernel's gelu
    "relu": F.relu,
}
UNSUPPORTED_ACTIVATIONS = {"gelu_exact": F.gelu, "elu": F.elu, "sigmoid": torch.sigmoid}
ACTIVATIONS = {**SUPPORTED_ACTIVATIONS, **UNSUPPORTED_ACTIVATIONS}
# Drawn twice as often as each unsupported one: most cases should exercise a rewrite.
ACTIVATION_DRAW = (*sorted(SUPPORTED_ACTIVATIONS) * 2, *sorted(UNSUPPORTED_ACTIVATIONS))
# expert computation -> weight storages it is written for
STORAGES = {
    "dense_mask": ("modulelist", "stacked", "transposed", "separate"),
    "dense_scatter": ("modulelist", "stacked", "transposed", "separate"),
    "dense_einsum": ("stacked", "transposed", "separate"),
    "sparse_loop": ("modulelist", "stacked", "transposed", "separate"),
    "segment_loop": ("modulelist", "stacked", "transposed", "separate"),
    "grouped_mm": ("stacked", "transposed", "separate"),
    "batched_mm": ("stacked", "transposed"),
    "hit_loop": ("stacked",),  # transformers 5.x `eager` experts handed in as a function: breaks the graph
}
SHARED = ("none", "plain", "gated")
# How each step of a sorted (grouped-GEMM) layer is spelled, drawn independently of the others, so that
# the generator writes layers no finder was written against. "hf" steps are transformers 5.x's own.
SPELLINGS = {
    "perm": ("sort", "sort_stable", "argsort", "argsort_stable"),
    "gather": ("index", "index_select", "gather"),
    # bincount is left out: its output size is data-dependent, so dynamo breaks the graph on it
    "counts": ("histc", "histc_to_E", "scatter_ones", "scatter_add_ones", "index_add_ones"),
    "weights": ("rows", "combine_mul", "combine_bmm"),
    "combine": (
        "inverse_index_put",
        "inverse_argsort",
        "index_put_back",
        "index_copy_back",
        "scatter_back",
        "index_add_by_token",
        "scatter_add_by_token",
        "index_put_by_token",
    ),
}
BY_TOKEN = ("index_add_by_token", "scatter_add_by_token", "index_put_by_token")
# Loops over sorted segments (DeepSeek-MoE 16B's `moe_infer`, Arctic): how each expert's segment is added back.
ACCUMULATIONS = ("index_add_", "index_put_", "scatter_add_", "scatter_reduce_")
# Dense loops: the [T, E] table of routing weights, in the spellings of that one step.
TABLE_SPELLINGS = ("scatter", "scatter_add", "one_hot_sum", "index_put")
# Dense einsums: how every expert's output reaches the result, by a [T, E] table (einsum, bmm_sum) or
# picked at each token's ids and weighted (JetStream's Mixtral: y[arange(T)[:, None], ids]).
PICKED_COMBINES = ("picked_index", "picked_expert_major", "picked_gather")
DENSE_COMBINES = ("einsum", "bmm_sum", *PICKED_COMBINES)
# Sparse loops: how each expert selects its tokens and writes its output back (a store at a boolean
# token mask, `out[mask] = y`, is an accumulation only for top-1: otherwise the masks overlap).
SELECTIONS = ("where_index_add", "mask_store", "sorted_slots")
# Batched rows: x repeated k times, in the spellings of that one step.
ROW_SPELLINGS = ("repeat_interleave", "index_arange", "index_select_arange")
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
SIGMOID_SCALE = 2.5  # DeepSeek-V3's routed_scaling_factor


@dataclass(frozen=True)
class Case:
    """One generated MoE block and how it is run."""

    experts: str
    storage: str
    routing: str
    router_fp32: bool
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    activation: str
    dtype: str
    shared: str
    tokens: int
    dynamic: bool
    seed: int
    second_tokens: int | None = None  # dynamic cases also run at this token count
    strict: bool = False  # options={"strict": True}
    # Loops over experts first_expert .. first_expert + held - 1 of the router's (expert parallelism);
    # held None: all of them.
    first_expert: int = 0
    held: int | None = None
    # (step, spelling) pairs from SPELLINGS (grouped_mm), ("rows", ...) (batched_mm), ("table", ...)
    # (dense_scatter, dense_einsum) and ("combine", ...) (dense_einsum); () for the transformers code the
    # form mirrors.
    spelling: tuple[tuple[str, str], ...] = ()

    def spelled(self, step: str, default: str) -> str:
        return dict(self.spelling).get(step, default)

    @property
    def expert_range(self) -> range:
        return range(self.first_expert, self.first_expert + (self.held or self.num_experts))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def replay(self) -> str:
        """Python that rebuilds this case, for failure messages."""
        return f"Case(**{asdict(self)!r})"


def expect_fused(case: Case) -> bool | None:
    """Whether the passes must fuse this block (they must decline it, with a reason, otherwise).

    None: either is right. Loops compiled for an empty batch give the routing checks no tokens to
    check (declined with that reason); a dynamic case that starts at 0 or 1 token is first compiled
    for that size (dynamo specialises 0 and 1), then recompiled for the second size.
    """
    if case.activation not in SUPPORTED_ACTIVATIONS or case.experts == "hit_loop":
        return False
    if case.strict and case.experts.startswith("dense_") and case.spelled("combine", "") not in PICKED_COMBINES:
        return False  # every expert on every token: strict refuses (a NaN in an unrouted expert would differ)
    if case.strict and case.dtype != "float32" and case.routing.startswith("sigmoid") and case.router_fp32:
        # float32 router weights scale bfloat16 expert outputs: a rounding strict refuses; a combine
        # spelled with the weights cast to the experts' dtype first rounds them itself (nothing to refuse)
        if case.spelled("weights", "rows") == "rows":
            return False
    if case.tokens == 0 and not case.experts.endswith("_mm"):
        return None
    if case.spelled("select", "") == "mask_store" and case.top_k > 1:
        return False  # a token in two experts' masks keeps only the last store: no MoE sum to fuse
    return True


@st.composite
def cases(draw) -> Case:
    experts = draw(st.sampled_from(sorted(STORAGES)))
    storage = draw(st.sampled_from(STORAGES[experts]))
    # A loop over one expert is no loop (nothing marks it as an MoE); the GEMM forms take E = 1.
    num_experts = draw(st.integers(1 if experts.endswith("_mm") else 2, 12))
    top_k = draw(st.integers(1, min(num_experts, 4)))
    grouped = experts == "grouped_mm"  # bfloat16 only, 16-byte strides (form_catalog/hf_grouped_mm.py)
    dtype = "bfloat16" if grouped else draw(st.sampled_from(("float32", "bfloat16")))
    size = st.sampled_from((8, 16, 24, 32)) if grouped else st.integers(1, 40)
    dynamic = draw(st.booleans())
    # Dynamo itself raises on a segment loop over no tokens with the user's capture flags (backend="eager"
    # too: PendingUnbackedSymbolNotFound), so that form starts at one token.
    tokens = draw(st.sampled_from((0, 1, 2, 3, 5, 7, 8, 13, 64, 129)[experts == "segment_loop":]))
    second = draw(st.sampled_from((1, 4, 9, 33))) if dynamic else None
    return Case(
        experts=experts,
        storage=storage,
        routing=draw(st.sampled_from(ROUTINGS)),
        router_fp32=draw(st.booleans()),
        num_experts=num_experts,
        top_k=top_k,
        hidden=draw(size),
        intermediate=draw(size),
        activation=draw(st.sampled_from(ACTIVATION_DRAW)),
        dtype=dtype,
        shared=draw(st.sampled_from(SHARED)),
        tokens=tokens,
        dynamic=dynamic,
        seed=draw(st.integers(0, 2**16)),
        second_tokens=second,
        strict=draw(st.booleans()),
        **_expert_range(draw, experts, num_experts),
        spelling=_spelling(draw, experts, storage),
    )


def _spelling(draw, experts: str, storage: str) -> tuple[tuple[str, str], ...]:
    """Each step's spelling drawn on its own (weights in the combine need a combine in slot order)."""
    if experts == "batched_mm":
        return (("rows", draw(st.sampled_from(ROW_SPELLINGS))),)
    if experts == "dense_scatter":
        return (("table", draw(st.sampled_from(TABLE_SPELLINGS))),)
    if experts == "sparse_loop":
        return (("select", draw(st.sampled_from(SELECTIONS))),)
    if experts == "segment_loop":
        return (("perm", draw(st.sampled_from(SPELLINGS["perm"]))), ("counts", draw(st.sampled_from(SPELLINGS["counts"]))),
                ("accumulate", draw(st.sampled_from(ACCUMULATIONS))))
    if experts == "dense_einsum":
        combine = draw(st.sampled_from(DENSE_COMBINES))
        return (("combine", combine),) if combine in PICKED_COMBINES else (("combine", combine), ("table", draw(st.sampled_from(TABLE_SPELLINGS))))
    if experts != "grouped_mm" or (storage != "separate" and draw(st.booleans())):
        return ()  # half the stacked grouped cases keep transformers' own spelling
    chosen = {step: draw(st.sampled_from(options)) for step, options in SPELLINGS.items()}
    if chosen["combine"] in BY_TOKEN:
        chosen["weights"] = "rows"
    return tuple(sorted(chosen.items()))


def _expert_range(draw, experts: str, num_experts: int) -> dict:
    """Loops may hold a contiguous part (two experts or more) of the router's experts."""
    if (
        experts not in ("dense_mask", "dense_scatter", "sparse_loop", "segment_loop")
        or num_experts < 3
        or draw(st.booleans())
    ):
        return {}
    held = draw(st.integers(2, num_experts - 1))
    return {"first_expert": draw(st.integers(0, num_experts - held)), "held": held}


# ---------------------------------------------------------------------------------------------------
# The block


class Router(nn.Module):
    """Softmax/top-k routings of `form_catalog/_common.route`, plus DeepSeek-V3's bias-corrected sigmoid."""

    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        self.gate = nn.Linear(case.hidden, case.num_experts, bias=False)
        self.register_buffer("correction_bias", torch.linspace(-0.1, 0.1, case.num_experts))

    def forward(self, x):
        c, logits = self.case, self.gate(x)
        if c.routing.startswith("sigmoid"):
            scores = logits.float().sigmoid()
            ids = torch.topk(scores + self.correction_bias, c.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
            if c.routing.endswith("renorm"):
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * SIGMOID_SCALE
            return (weights if c.router_fp32 else weights.to(x.dtype)), ids  # DeepSeek keeps float32
        if c.routing == "topk_softmax":
            values, ids = torch.topk(logits, c.top_k, dim=-1)
            weights = F.softmax(values.float() if c.router_fp32 else values, dim=-1)
            return weights.to(x.dtype), ids
        probs = F.softmax(logits, dim=-1, dtype=torch.float32) if c.router_fp32 else F.softmax(logits, -1)
        weights, ids = torch.topk(probs, c.top_k, dim=-1)
        if c.routing.endswith("renorm"):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class Experts(nn.Module):
    """The experts' weights in one of four storages, and `mlp(e, x)` for a single expert."""

    def __init__(self, case: Case):
        super().__init__()
        e, h, i = case.num_experts, case.hidden, case.intermediate
        self.storage, self.num_experts, self.case = case.storage, e, case
        self.held = case.expert_range  # the experts the loops run (all unless expert parallel)
        self.act_fn = ACTIVATIONS[case.activation]
        self.is_transposed = case.storage == "transposed"
        self.has_bias = False
        if case.storage == "modulelist":
            self.experts = nn.ModuleList(GatedMLP(h, i, ACTIVATIONS[case.activation]) for _ in range(e))
        elif case.storage == "separate":
            self.gate = nn.Parameter(torch.empty(e, i, h))
            self.up = nn.Parameter(torch.empty(e, i, h))
            self.down_proj = nn.Parameter(torch.empty(e, h, i))
        elif self.is_transposed:
            self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
            self.down_proj = nn.Parameter(torch.empty(e, i, h))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
            self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def mlp(self, e: int, x):
        if self.storage == "modulelist":
            return self.experts[e](x)
        if self.storage == "separate":
            h = self.act_fn(F.linear(x, self.gate[e])) * F.linear(x, self.up[e])
            return F.linear(h, self.down_proj[e])
        if self.is_transposed:
            return self.apply_gate(x @ self.gate_up_proj[e]) @ self.down_proj[e]
        return F.linear(self.apply_gate(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])


def dense_mask(experts: Experts, x, ids, weights):
    out = torch.zeros_like(x)
    for e in experts.held:
        out = out + experts.mlp(e, x) * (weights * (ids == e)).sum(dim=-1, keepdim=True)
    return out


def routing_table(experts: Experts, x, ids, weights):
    """The [T, E] table of routing weights, in the case's spelling."""
    e = experts.num_experts
    return {
        "scatter": lambda: torch.zeros(x.shape[0], e, dtype=weights.dtype, device=x.device).scatter_(-1, ids, weights),
        "scatter_add": lambda: torch.zeros(x.shape[0], e, dtype=weights.dtype, device=x.device).scatter_add(
            1, ids, weights),
        "one_hot_sum": lambda: (F.one_hot(ids, e).to(weights.dtype) * weights[..., None]).sum(1),
        "index_put": lambda: torch.zeros(x.shape[0], e, dtype=weights.dtype, device=x.device).index_put_(
            (torch.arange(x.shape[0], device=x.device)[:, None].expand_as(ids), ids), weights, accumulate=True),
    }[experts.case.spelled("table", "scatter")]()


def dense_scatter(experts: Experts, x, ids, weights):
    padded = routing_table(experts, x, ids, weights)
    out = torch.zeros_like(x)
    for e in experts.held:
        out += experts.mlp(e, x) * padded[:, e, None]
    return out


def dense_einsum(experts: Experts, x, ids, weights):
    """Every expert on every token as einsums over the stacks, combined by the [T, E] table (vLLM-Omni's
    dense experts); or, spelled "bmm_sum", bmm of the tokens expanded per expert and a product summed over
    the experts (tt-forge's batched DeepSeek-V3)."""
    combine = experts.case.spelled("combine", "einsum")
    if combine in PICKED_COMBINES:
        return _picked_combine(experts, x, ids, weights, combine)
    table = routing_table(experts, x, ids, weights)
    if combine == "bmm_sum":
        rows = x.unsqueeze(0).expand(experts.num_experts, -1, -1)
        if experts.storage == "separate":
            h = experts.act_fn(torch.bmm(rows, experts.gate.transpose(1, 2))) * torch.bmm(rows, experts.up.transpose(1, 2))
            y = torch.bmm(h, experts.down_proj.transpose(1, 2))
        elif experts.is_transposed:
            y = torch.bmm(experts.apply_gate(torch.bmm(rows, experts.gate_up_proj)), experts.down_proj)
        else:
            h = experts.apply_gate(torch.bmm(rows, experts.gate_up_proj.transpose(1, 2)))
            y = torch.bmm(h, experts.down_proj.transpose(1, 2))
        return (table.unsqueeze(-1).to(y.dtype) * y.permute(1, 0, 2)).sum(dim=1)
    y = _every_expert(experts, x, "et")
    return torch.einsum("etd,te->td", y, table.to(y.dtype))


def _every_expert(experts: Experts, x, order: str):
    """Every expert's output for every token as einsums over the stacks, [E, T, H] (`order` "et") or
    token-major [T, E, H] ("te")."""
    h_axes, y_axes = f"{order}i", f"{order}d"
    if experts.storage == "separate":
        gate = torch.einsum(f"td,eid->{h_axes}", x, experts.gate)
        h = experts.act_fn(gate) * torch.einsum(f"td,eid->{h_axes}", x, experts.up)
        return torch.einsum(f"{h_axes},edi->{y_axes}", h, experts.down_proj)
    if experts.is_transposed:
        h = experts.apply_gate(torch.einsum(f"td,edi->{h_axes}", x, experts.gate_up_proj))
        return torch.einsum(f"{h_axes},eid->{y_axes}", h, experts.down_proj)
    h = experts.apply_gate(torch.einsum(f"td,eid->{h_axes}", x, experts.gate_up_proj))
    return torch.einsum(f"{h_axes},edi->{y_axes}", h, experts.down_proj)


def _picked_combine(experts: Experts, x, ids, weights, spelling: str):
    """Every expert on every token as token-major einsums ([T, E, .]), then each token's chosen outputs
    picked by its ids and weighted (JetStream's Mixtral), the pick spelled three ways."""
    y = _every_expert(experts, x, "te")
    rows = torch.arange(x.shape[0], device=x.device)
    w = weights.to(y.dtype)
    if spelling == "picked_gather":
        picked = y.gather(1, ids.unsqueeze(-1).expand(-1, -1, y.shape[-1]))
        return (picked * w.unsqueeze(-1)).sum(dim=1)
    picked = y[rows[:, None], ids] if spelling == "picked_index" else y.transpose(0, 1)[ids, rows.unsqueeze(1)]
    return torch.einsum("tad,ta->td", picked, w)


def sparse_loop(experts: Experts, x, ids, weights):
    out = torch.zeros_like(x)
    if experts.case.spelled("select", "where_index_add") == "mask_store":
        for e in experts.held:
            chose = ids == e
            rows = chose.any(-1)
            weight = (weights * chose).sum(-1, keepdim=True)
            out[rows] = (experts.mlp(e, x[rows]) * weight[rows]).to(x.dtype)
        return out
    if experts.case.spelled("select", "where_index_add") == "sorted_slots":  # TensorRT-LLM's VanillaMoE
        return _sorted_slots_loop(experts, x, ids, weights)
    mask = F.one_hot(ids, num_classes=experts.num_experts).permute(2, 1, 0)
    for e in experts.held:
        slot, token = torch.where(mask[e])
        y = experts.mlp(e, x[None, token].reshape(-1, x.shape[-1])) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def _sorted_slots_loop(experts: Experts, x, ids, weights):
    """The held experts' slots gathered once and argsorted by expert, each expert's at a boolean mask."""
    mine = (ids >= experts.held.start) & (ids < experts.held.stop)
    order = torch.argsort(ids[mine])
    sorted_ids = ids[mine][order]
    token, slot = torch.where(mine)
    token, slot = token[order], slot[order]
    rows, scales = x[token], weights[token, slot, None]
    out = torch.zeros_like(x)
    for e in experts.held:
        chose = sorted_ids == e
        out[token[chose]] += (experts.mlp(e, rows[chose]) * scales[chose]).to(x.dtype)
    return out


def segment_loop(experts: Experts, x, ids, weights):
    """Slots sorted by expert, offsets from the per-expert counts read as numbers, and for each held expert
    its segment's tokens through its MLP, added back one accumulation at a time (spellings drawn)."""
    case, k, flat = experts.case, ids.size(-1), ids.reshape(-1)
    order = _sorted_slots(flat, case.spelled("perm", "argsort"))
    offsets = torch.cumsum(_counts(ids, experts.num_experts, case.spelled("counts", "histc")).long(), 0).tolist()
    out = torch.zeros_like(x)
    for e in experts.held:
        slots = order[(0 if e == 0 else offsets[e - 1]):offsets[e]]
        tokens = slots // k
        y = (experts.mlp(e, x[tokens]) * weights.reshape(-1)[slots, None]).to(x.dtype)
        how = case.spelled("accumulate", "index_add_")
        if how == "index_add_":
            out.index_add_(0, tokens, y)
        elif how == "index_put_":
            out.index_put_((tokens,), y, accumulate=True)
        elif how == "scatter_add_":
            out.scatter_add_(0, tokens.view(-1, 1).expand(-1, x.shape[-1]), y)
        else:
            out.scatter_reduce_(0, tokens.view(-1, 1).repeat(1, x.shape[-1]), y, reduce="sum")
    return out


def _sorted_slots(flat, spelling: str):
    return {
        "sort": lambda: torch.sort(flat)[1],
        "sort_stable": lambda: torch.sort(flat, stable=True)[1],
        "argsort": lambda: torch.argsort(flat),
        "argsort_stable": lambda: torch.argsort(flat, stable=True),
    }[spelling]()


def _counts(ids, e: int, spelling: str):
    """Per-expert counts of the flat ids, of length e, in one of the spellings of SPELLINGS["counts"]."""
    flat = ids.reshape(-1)
    return {
        "histc": lambda: torch.histc(flat.float(), bins=e, min=0, max=e - 1),
        "histc_to_E": lambda: torch.histc(flat.float(), bins=e, min=0, max=e),
        "bincount": lambda: torch.bincount(flat, minlength=e),
        "scatter_ones": lambda: torch.zeros(ids.shape[0], e, dtype=torch.long).scatter_(1, ids, 1).sum(0),
        "scatter_add_ones": lambda: torch.zeros(e, dtype=torch.int32).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32)),
        "index_add_ones": lambda: torch.zeros(e).index_add_(0, flat, torch.ones(flat.shape[0])).long(),
    }[spelling]()


def grouped_mm(experts: Experts, x, ids, weights):
    """transformers 5.x grouped_mm_experts_forward (form_catalog/hf_grouped_mm.py), either layout; or, with
    a spelling drawn, the same computation written step by step in the drawn spellings."""
    if experts.case.spelling:
        return spelled_grouped_mm(experts, x, ids, weights, experts.case)
    k = ids.size(-1)
    sorted_ids, perm = torch.sort(ids.reshape(-1))
    offsets = torch.cumsum(_tokens_per_expert(sorted_ids, experts.num_experts), dim=0, dtype=torch.int32)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if not experts.is_transposed:
        gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    out = _grouped_mm(x[perm // k], gate_up, offsets)
    out = _grouped_mm(experts.apply_gate(out), down, offsets)
    weighted = out * weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    return weighted[inverse].view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


def spelled_grouped_mm(experts: Experts, x, ids, weights, case: Case):
    k, e, slots = ids.size(-1), experts.num_experts, ids.numel()
    flat = ids.reshape(-1)
    perm = _sorted_slots(flat, case.spelled("perm", "sort"))
    token = perm // k
    rows = {
        "index": lambda: x[token],
        "index_select": lambda: x.index_select(0, token),
        "gather": lambda: torch.gather(x, 0, token.unsqueeze(-1).expand(-1, x.shape[-1])),
    }[case.spelled("gather", "index")]()
    counts = _counts(ids, e, case.spelled("counts", "histc"))
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    y = _grouped_experts(experts, rows, offsets)
    placement = case.spelled("weights", "rows")
    if placement == "rows":
        y = y * weights.reshape(-1)[perm].unsqueeze(-1)
    combine = case.spelled("combine", "inverse_index_put")
    if combine in BY_TOKEN:
        out = torch.zeros(x.shape[0], x.shape[-1], dtype=y.dtype)
        if combine == "index_add_by_token":
            return out.index_add(0, token, y).to(x.dtype)
        if combine == "scatter_add_by_token":
            return out.scatter_add(0, token.unsqueeze(-1).expand(-1, x.shape[-1]), y).to(x.dtype)
        return out.index_put((token,), y, accumulate=True).to(x.dtype)
    if combine.startswith("inverse"):
        if combine == "inverse_argsort":
            inverse = torch.argsort(perm)
        else:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(slots)
        in_slots = y[inverse]
    else:
        buffer = torch.zeros(slots, x.shape[-1], dtype=y.dtype)
        if combine == "index_put_back":
            in_slots = buffer.index_put((perm,), y)
        elif combine == "index_copy_back":
            in_slots = buffer.index_copy(0, perm, y)
        else:
            in_slots = buffer.scatter(0, perm.unsqueeze(-1).expand(-1, x.shape[-1]), y)
    per_token = in_slots.view(x.shape[0], k, x.shape[-1])
    if placement == "combine_mul":
        return (per_token * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1).to(x.dtype)
    if placement == "combine_bmm":
        return torch.bmm(weights.to(y.dtype).view(-1, 1, k), per_token).squeeze(1).to(x.dtype)
    return per_token.sum(dim=1).to(x.dtype)


def _grouped_experts(experts: Experts, rows, offsets):
    """The expert MLPs over rows grouped by `offsets`: fused gate/up stacks or separate ones."""
    if experts.storage == "separate":
        h = experts.act_fn(_grouped_mm(rows, experts.gate.transpose(-2, -1), offsets))
        h = h * _grouped_mm(rows, experts.up.transpose(-2, -1), offsets)
        return _grouped_mm(h, experts.down_proj.transpose(-2, -1), offsets)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if not experts.is_transposed:
        gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    return _grouped_mm(experts.apply_gate(_grouped_mm(rows, gate_up, offsets)), down, offsets)


def batched_mm(experts: Experts, x, ids, weights):
    """transformers 5.x batched_mm_experts_forward (form_catalog/hf_batched_mm.py), either layout; the rows
    repeated k times in the case's spelling."""
    k = ids.size(-1)
    flat = ids.reshape(-1)
    slot_token = torch.arange(flat.numel()) // k
    rows = {
        "repeat_interleave": lambda: x.repeat_interleave(k, dim=0),
        "index_arange": lambda: x[slot_token],
        "index_select_arange": lambda: x.index_select(0, slot_token),
    }[experts.case.spelled("rows", "repeat_interleave")]()
    out = batched_linear(rows, experts.gate_up_proj[flat], None, experts.is_transposed)
    out = batched_linear(experts.apply_gate(out), experts.down_proj[flat], None, experts.is_transposed)
    weighted = out * weights.reshape(-1).unsqueeze(-1)
    return weighted.view(x.shape[0], k, x.shape[-1]).sum(dim=1).to(x.dtype)


def hit_loop(experts: Experts, x, ids, weights):
    return eager_experts_forward(experts, x, ids, weights)


EXPERT_FORWARDS = {
    f.__name__: f for f in (dense_mask, dense_scatter, dense_einsum, sparse_loop, segment_loop, grouped_mm, batched_mm)
}
EXPERT_FORWARDS["hit_loop"] = hit_loop


class FuzzMoE(nn.Module):
    """[1, T, H] -> [1, T, H]: route, run the experts the case's way, add the shared expert."""

    def __init__(self, case: Case):
        super().__init__()
        self.case = case
        self.router = Router(case)
        self.experts = Experts(case)
        self.forward_experts = EXPERT_FORWARDS[case.experts]
        if case.shared != "none":
            self.shared_expert = GatedMLP(case.hidden, case.intermediate, "silu")
            self.shared_gate = nn.Linear(case.hidden, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.router(flat)
        out = self.forward_experts(self.experts, flat, ids, weights)
        if self.case.shared == "plain":
            out = out + self.shared_expert(flat)
        elif self.case.shared == "gated":
            out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared_expert(flat)
        return out.to(x.dtype).reshape(shape)


def build(case: Case) -> FuzzMoE:
    """The case's block with seeded weights scaled by 1/sqrt(fan-in), in the case's dtype, in eval mode."""
    model = FuzzMoE(case)
    generator = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            fan_in = parameter.shape[-2 if name.endswith("proj") and case.storage == "transposed" else -1]
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(fan_in))
    return model.to(case.torch_dtype).eval()


def example(case: Case, tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.seed + tokens + 1)
    return torch.randn(1, tokens, case.hidden, generator=generator).to(case.torch_dtype)


# ---------------------------------------------------------------------------------------------------
# The differential check


@dataclass
class Outcome:
    """What one case did: "fused", "declined", or a failure ("mismatch", "exception", "wrong ...")."""

    case: Case
    kind: str
    detail: str = ""
    max_diff: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.kind not in ("fused", "declined")

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}\n  {self.case.replay()}"


class _CountingInner:
    """Eager inner backend that counts the fused calls in the graphs it is handed."""

    def __init__(self):
        self.fused_calls = 0
        self.ranges: set[tuple[int, int]] = set()  # (experts_min, experts_max) of the fused calls

    def __call__(self, gm, example_inputs, **kwargs):
        for node in gm.graph.nodes:
            if is_fused_moe(node):
                self.fused_calls += 1
                names = [a.name for a in node.target._schema.arguments]
                self.ranges.add(tuple(_argument(node, names, n) for n in ("experts_min", "experts_max")))
        return lookup_backend("eager")(gm, example_inputs)


def _argument(node, names: list[str], name: str):
    index = names.index(name)
    return node.args[index] if index < len(node.args) else node.kwargs[name]


def run_case(case: Case, options: dict | None = None) -> Outcome:
    """Compile the case with hpu_moe, run it at its token count(s), compare with eager, classify."""
    torch._dynamo.reset()
    model = build(case)
    inputs = [example(case, case.tokens)]
    if case.dynamic:
        inputs.append(example(case, case.second_tokens))
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    inner = _CountingInner()
    opts = {"inner": inner, "target": "portable", "strict": case.strict, **(options or {})}
    backend = lambda gm, example_inputs: hpu_moe(gm, example_inputs, options=opts)  # noqa: E731
    # Loops dynamo captures only with these (the expert-loop adapter switches them on for methods; these
    # blocks are plain functions, as a user who set them would write them).
    config = {"capture_dynamic_output_shape_ops": case.experts == "sparse_loop"}
    if case.experts == "segment_loop":
        config.update(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)
    try:
        with collecting() as collector, torch.no_grad(), torch._dynamo.config.patch(**config):
            compiled = torch.compile(model, backend=backend, dynamic=case.dynamic)
            actual = [compiled(x) for x in inputs]
    except Exception as error:  # noqa: BLE001 - an exception is a finding, reported with the case
        return Outcome(case, "exception", f"{type(error).__name__}: {str(error)[:500]}")
    finally:
        torch._dynamo.reset()
    fused = [f for r in collector.records for f in r.fused]
    reasons = [d.reason for r in collector.records for d in r.declined]
    reasons += [r.fallback for r in collector.records if r.fallback]
    atol, rtol = TOLERANCE[case.torch_dtype]
    max_diff = 0.0
    for got, want in zip(actual, expected, strict=True):
        if got.shape != want.shape or got.dtype != want.dtype:
            return Outcome(case, "mismatch", f"{got.shape}/{got.dtype} != {want.shape}/{want.dtype}")
        if got.numel():
            max_diff = max(max_diff, (got.float() - want.float()).abs().max().item())
        if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol, equal_nan=True):
            return Outcome(case, "mismatch", f"max |diff| {max_diff:.3g}", max_diff, reasons)
    if any(r.fallback and "internal error" in r.fallback for r in collector.records):
        return Outcome(case, "exception", "; ".join(reasons), max_diff, reasons)
    expected_fused = expect_fused(case)
    if fused:
        if expected_fused is False:
            return Outcome(case, "wrong fuse", f"fused {[f.form for f in fused]}", max_diff, reasons)
        if inner.fused_calls != len(fused) or len(fused) > len(collector.records):
            # one MoE layer: at most one fused call per compiled graph (a recompile makes another)
            return Outcome(case, "wrong fuse", f"{len(fused)} reported, {inner.fused_calls} in graphs")
        held = case.expert_range
        if inner.ranges != {(held.start, held.stop - 1)}:
            return Outcome(case, "wrong fuse", f"expert range {inner.ranges}, held {held}", max_diff)
        return Outcome(case, "fused", fused[0].form, max_diff, reasons)
    if expected_fused and case.experts == "segment_loop" and _broke_the_graph(collector) and _slices_break():
        return Outcome(case, "declined", "this torch's dynamo breaks the graph at the segment's data-dependent "
                       "slice (a plain function: no adapter cuts it)", max_diff, reasons)
    if expected_fused:
        return Outcome(case, "wrong decline", "; ".join(reasons) or "nothing found", max_diff, reasons)
    if not reasons and not _broke_the_graph(collector):
        return Outcome(case, "unexplained", "neither fused nor declined with a reason", max_diff)
    return Outcome(case, "declined", "; ".join(reasons) or "graph breaks", max_diff, reasons)


def _slices_break() -> bool:
    """Whether this torch's dynamo breaks the graph at a slice with bounds read as numbers (2.9 and 2.10
    guard on their sign)."""
    from tests.helpers import torch_release

    return torch_release() < (2, 11)


def _broke_the_graph(collector) -> bool:
    """A block dynamo split into several graphs never reaches the passes whole (explain names the break)."""
    return len(collector.records) != 1
