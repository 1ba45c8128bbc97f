"""Sparse expert loops: each expert runs on the tokens routed to it and adds its output back.

    mask = one_hot(ids, E).permute(2, 1, 0)                     # [E, k, T]
    for e in range(E):
        slot, tok = torch.where(mask[e])                        # data-dependent sizes (nonzero)
        y = MLP_e(x[tok]) * w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))

This is the transformers 4.x loop (OLMoE, Jamba, PhiMoE; Mixtral and Qwen-MoE with `range(E)`) over an
`nn.ModuleList` of experts. Dynamo captures it in one graph only with
`torch._dynamo.config.capture_dynamic_output_shape_ops = True` (otherwise `nonzero` breaks the graph).
Functionalized, it is a chain of out-of-place `index_add`s from a zero tensor; each link is read as an
expert term whose rows are `tok` (experts_dense_loop.ExpertTerm), and which tokens and weights each
expert serves is checked by evaluating the index/mask sub-graph on probe routing tensors, exactly as
for dense loops.

The links may also be `scatter_add` / `scatter_reduce(..., "sum")` over the rows repeated along the
hidden dim, and the rows a segment of the slots sorted by expert, cut at offsets read from the counts
(DeepSeek-MoE's `moe_infer`: `order[offsets[e-1]:offsets[e]] // k`); the probes check those too.

A chain may also store into an uninitialised buffer of slots (DeepSeek-V2's training loop, ESFT):
`y = empty_like(x.repeat_interleave(k))`, `y[ids.view(-1) == e] = MLP_e(xs[ids.view(-1) == e])`, then
`(y.view(T, k, H) * w[..., None]).sum(1)`. Its terms' rows are slots (token s // k); the probes check
that the experts' stores cover every slot once and that each token gets its routing weight per expert.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx_utils import (
    arguments,
    const_int,
    dtype,
    is_call,
    is_getitem,
    shape,
    strip_casts,
    strip_shape_ops,
    through_trailing_cast,
)
from .expert_terms import ExpertTerm, is_zero_init, match_terms, no_mlp_reason, read_term
from .finder import Candidate, Finder
from .matches import Decline, ExpertsMatch, NoMatch
from .mlp import same_value
from .slots import repeat_interleaved, same_shape, same_size

aten = torch.ops.aten
FORM = "sparse_loop"
CUT_TO_CAPACITY = (
    "an expert's rows are cut to a capacity (`rows[:C]` of the tokens it selected, makeMoE style): tokens "
    "past it are dropped from that expert, and the fused kernel computes every routed token"
)

EXPERTS_CHOOSE_TOKENS = (
    "each expert chooses its tokens (a top-k over the tokens of the expert's scores: expert-choice routing); "
    "the fused kernel routes each token to the top-k of its own scores"
)


def _chosen_by_the_expert(rows: Node, tokens: int | None) -> Node | None:
    """The top-k when `rows` are an expert's row of `topk([E, T] scores).indices`: the tokens an expert
    picked (E != T, so the choice is along the tokens, not along the experts)."""
    node = strip_shape_ops(strip_casts(rows))
    while is_call(node, aten.select.int, aten.slice.Tensor):
        node = strip_shape_ops(node.args[0])
    if not (is_getitem(node, 1) and is_call(node.args[0], aten.topk.default)):
        return None
    scores = shape(node.args[0].args[0])
    dims = [const_int(d) for d in scores] if scores else []
    chosen_along = node.args[0].args[2] if len(node.args[0].args) > 2 else -1
    if len(dims) == 2 and chosen_along in (-1, 1) and tokens is not None and dims[1] == tokens != dims[0]:
        return node.args[0]
    return None


def _cut_to_capacity(rows: Node) -> Node | None:
    """A slice of an expert's selected rows that is not proved to keep them all (`rows[:C]` with C not
    proved at least their count, or a start or step that skips some): probes route few tokens to each
    expert, so they cannot be trusted to see the rows it drops.

    A slice between offsets read from the routing data (`order[start:end]` at running sums of the
    per-expert counts, DeepSeek-MoE's `moe_infer`) is a segment, not a cut: which rows it takes is
    checked on the probes like any other rows, and with no threshold in its bounds (no clamp, min or
    comparison) it cannot agree with the counts on the probes and drop rows elsewhere."""
    node = strip_shape_ops(rows)
    while is_call(node, aten.slice.Tensor, aten.alias.default, *_PER_ROW):
        if is_call(node, *_PER_ROW):  # slot -> token (`slots // k`), order[slots]: a row per slot
            source = node.args[0] if not is_call(node, aten.index.Tensor) else list(node.args[1])
            if isinstance(source, list):
                source = source[0] if len(source) == 1 else None
            if not isinstance(source, Node):
                return None
            node = strip_shape_ops(source)
            continue
        if is_call(node, aten.slice.Tensor):
            args = arguments(node) or {}
            size = shape(args.get("input"))[args.get("dim", 0)] if shape(args.get("input")) else None
            start, end = args.get("start"), args.get("end")
            whole = start in (None, 0) and args.get("step", 1) == 1 and (end is None or _at_least(end, size))
            segment = args.get("step", 1) == 1 and all(
                bound in (None, 0) or _data_offset(bound) for bound in (start, end)) and not (
                start in (None, 0) and end is None)
            if not (whole or segment):
                return node
        node = strip_shape_ops(node.args[0])
    return None


def _at_least(end: object, size: object) -> bool:
    """`end` (an int, or a node of a symbolic int) is proved >= `size`. `min(len, C)`, the length a cut
    to capacity C narrows to, is, where both are: proved one by one, as sympy does not prove a Min."""
    if is_call(end, torch.sym_min):
        return all(_at_least(bound, size) for bound in end.args)
    if is_call(end, operator.add) and len(end.args) == 2 and 0 in end.args:
        return _at_least(end.args[1] if end.args[0] == 0 else end.args[0], size)
    value = end.meta.get("val") if isinstance(end, Node) else end
    return size is not None and isinstance(value, int | torch.SymInt) and statically_known_true(value >= size)


_PER_ROW = (aten.floor_divide.default, aten.div.Tensor_mode, aten.remainder.Scalar, aten.index.Tensor)
_THRESHOLDS = frozenset({
    aten.clamp.default, aten.clamp.Tensor, aten.clamp_max.default, aten.clamp_max.Tensor, aten.minimum.default,
    aten.min.default, aten.min.dim, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther,
    aten.lt.Scalar, aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.gt.Tensor,
    aten.ge.Scalar, aten.ge.Tensor, torch.sym_min,
})


def _data_offset(bound: object) -> bool:
    """`bound` is a number read from tensor data (`.item()` of an offset), computed with no threshold."""
    if not isinstance(bound, Node):
        return False
    seen, stack, reads = set(), [bound], False
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if is_call(node, *_THRESHOLDS):
            return False
        reads |= is_call(node, aten._local_scalar_dense.default)
        stack.extend(n for n in node.all_input_nodes if n.op == "call_function")
    return reads


def _candidates(_graph: torch.fx.Graph, anchors: list[Node]) -> list[Candidate]:
    """The last link of every accumulation chain of two or more links from zeros."""
    found = []
    for node in anchors:
        if _is_chain_end(node):
            links = _chain(node)
            if links is not None and len(links) >= 2:
                found.append(Candidate(node, (node, links)))
    return found


def link_parts(node: Node) -> tuple[Node, object, object, object, str] | None:
    """(accumulator before, dim, token rows, expert output, how it writes) of one accumulation step.

    `out.index_add_(0, tok, y)`; `out.index_put_((tok,), y, accumulate=True)` ("adds"); DeepSeek-V3's
    `out[tok] += y`, functionalized as index_put(out, [tok], out[tok] + y), which overwrites rows and
    equals an index_add only when `tok` has no repeated rows ("rewrites"); or a store at a token mask,
    `out[mask] = y` (Switch-style top-1 loops), which equals an index_add only where no other expert
    writes those rows ("stores"; both checked on the probes).
    """
    if is_call(node, aten.index_add.default):
        return node.args[0], node.args[1], node.args[2], node.args[3], "adds"
    if is_call(node, aten.scatter_add.default) or (
            is_call(node, aten.scatter_reduce.two) and (arguments(node) or {}).get("reduce") == "sum"
            and (arguments(node) or {}).get("include_self", True)):
        rows = _broadcast_rows(node.args[2], node.args[3])
        return (node.args[0], node.args[1], rows, node.args[3], "adds") if rows is not None else None
    if not is_call(node, aten.index_put.default) or len(node.args[1]) != 1:
        return None
    base, (rows,), values = node.args[:3]
    if len(node.args) > 3 and node.args[3]:
        return base, 0, rows, values, "adds"
    if is_call(values, aten.add.Tensor) and len(values.args) == 2:
        for old, new in (values.args, values.args[::-1]):
            if is_call(old, aten.index.Tensor) and old.args[0] is base and list(old.args[1]) == [rows]:
                return base, 0, rows, new, "rewrites"
    if isinstance(rows, Node) and not dtype(rows).is_floating_point and (
            len(shape(rows) or ()) == 1 or _index_column(rows)):
        return base, 0, rows, values, "stores"  # at a token mask, or at token indices (`out[idx, :] = y`)
    return None


def _index_column(rows: Node) -> bool:
    """Token indices as an [n, 1] column (`(ids == e).nonzero()`, BlackMamba): `out[idx, :] = y` stores
    y[i, 0] at row idx[i, 0], as a 1-D index of those rows would."""
    dims = shape(rows) or ()
    return len(dims) == 2 and const_int(dims[1]) == 1 and dtype(rows) in (torch.int64, torch.int32)


def _broadcast_rows(index: object, source: object) -> Node | None:
    """r when a scatter index is the 1-D rows r repeated along the hidden dim (`r.view(-1, 1).repeat(1,
    H)` or `.expand(-1, H)`, the shape of a 2-D source): scattering along dim 0 with it adds source row i
    into row r[i], as `index_add(0, r, source)` does."""
    if not is_call(index, aten.repeat.default, aten.expand.default) or not same_shape(shape(index), shape(source)):
        return None
    column = index.args[0]
    column_shape, index_shape = shape(column), shape(index)
    if column_shape is None or len(column_shape) != 2 or len(index_shape) != 2 or const_int(column_shape[1]) != 1:
        return None
    if is_call(index, aten.repeat.default) and const_int(list(index.args[1])[0]) != 1:
        return None
    rows = strip_shape_ops(column) if is_call(column, aten.view.default, aten.reshape.default,
                                              aten.unsqueeze.default) else None
    rows_shape = shape(rows) if rows is not None else None
    return rows if rows_shape is not None and len(rows_shape) == 1 else None


def _is_chain_end(node: Node) -> bool:
    return link_parts(node) is not None and not any(
        (parts := link_parts(user)) is not None and parts[0] is node for user in node.users
    )


def _chain(end: Node) -> list[Node] | None:
    """The accumulation steps into `end`, first to last, when the accumulator starts at zero, or when
    every step stores: into a buffer uninitialised (`empty_like`, `_fills`) or holding values the stores
    must all replace (`x.clone()`, `_overwrites`)."""
    links = []
    node = end
    while link_parts(node) is not None:
        links.append(node)
        node = link_parts(node)[0]
    return links[::-1] if _zero_buffer(node) or _fills(node, links) or _overwrites(node, links) else None


def _zero_buffer(node: Node) -> bool:
    """Zeros, also viewed as rows (`zeros(B, S, H)` stored through its `[B * S, H]` view)."""
    while is_call(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        node = node.args[0]
    return is_zero_init(node)


_UNINITIALISED = (aten.empty_like.default, aten.empty.memory_format, aten.new_empty.default)


def _fills(base: Node, links: list[Node]) -> bool:
    """Stores at masks into a buffer that holds nothing yet: the experts must write every row (checked
    on the probes, where the rows are the routing's slots)."""
    return is_call(strip_casts(base), *_UNINITIALISED) and all(link_parts(n)[4] == "stores" for n in links)


def _overwrites(base: Node, links: list[Node]) -> bool:
    """Stores at token rows into a buffer that holds values (HF Switch: `next_states = x.clone()`, then
    `next_states[mask_e] = expert_e(x[mask_e])`): exact where every token's row is stored by one expert,
    so that no old value survives (checked on the probes, "overwrites")."""
    return not _zero_buffer(base) and all(link_parts(n)[4] == "stores" for n in links)


def _slot_combine(end: Node, top_k: int) -> tuple[Node, Node] | None:
    """(the sum, the [T, k] weights) when the stored buffer's one use is (buf.view(T, k, H) * w[..., None])
    .sum(1): slot s of the buffer is token s // k's slot s % k, weighted by w and summed per token."""
    node = through_trailing_cast(end)
    if len(node.users) != 1:
        return None
    viewed = next(iter(node.users))
    dims = shape(viewed)
    if not is_call(viewed, aten.view.default, aten.reshape.default, aten._unsafe_view.default) or len(
            dims or ()) != 3 or const_int(dims[1]) != top_k or len(viewed.users) != 1:
        return None
    product = next(iter(viewed.users))
    if not is_call(product, aten.mul.Tensor) or len(product.users) != 1:
        return None
    table = product.args[1] if product.args[0] is viewed else product.args[0]
    if not isinstance(table, Node) or not is_call(table, aten.unsqueeze.default) or table.args[1] not in (-1, 2):
        return None
    weights = table.args[0]
    total = next(iter(product.users))
    args = arguments(total) or {}
    if not is_call(total, aten.sum.dim_IntList) or list(args.get("dim") or ()) not in ([1], [-2]) or args.get(
            "keepdim"):
        return None
    if shape(weights) is None or len(shape(weights)) != 2 or const_int(shape(weights)[1]) != top_k:
        return None
    return total, weights


def _gather_source(rows_value: Node, index: Node) -> Node | None:
    """x when `rows_value` is x[index], `index_select(x, 0, index)` or x[None, index] (the expert's input
    rows), or x[B][M] where `index` is B[M]: TensorRT-LLM gathers every routed row once, then each
    expert's at its mask, and (x[B])[M] is x[B[M]] for any one index M along dim 0, boolean or integer."""
    node = strip_shape_ops(rows_value)
    if is_call(node, aten.index_select.default) and node.args[1] == 0 and same_value(node.args[2], index):
        return node.args[0]  # `torch.index_select(x, 0, index)`: x[index]
    if not is_call(node, aten.index.Tensor):
        return None
    base, indices = node.args[0], list(node.args[1])
    if len(indices) == 1 and same_value(indices[0], index):  # `rows[e]` written twice is two equal nodes
        return base
    if (len(indices) == 1 and is_call(index, aten.index.Tensor) and len(index.args[1]) == 1
            and same_value(indices[0], index.args[1][0])):
        inner = strip_shape_ops(base)
        if is_call(inner, aten.index.Tensor) and list(inner.args[1]) == [index.args[0]]:
            return inner.args[0]
    if indices == [None, index] and is_call(base, aten.unsqueeze.default) and base.args[1] == 0:
        return base.args[0]
    return None


def match_at(chain: tuple[Node, list[Node]]) -> ExpertsMatch | Decline | None:
    """The match for one accumulation chain: (its last link, every link first to last)."""
    end, links = chain

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, end, at)

    if _fills(link_parts(links[0])[0], links):  # `_chain` starts at the link whose input is the buffer
        return _match_slot_stores(end, links)
    links = _before_trailing_non_mlps(links)
    end = links[-1]
    terms: list[ExpertTerm] = []
    for link in links:
        _, dim, index, source, writes = link_parts(link)
        if dim != 0 or not isinstance(index, Node) or not isinstance(source, Node):
            return no("expert outputs are not added back along the token dimension", link)
        cut = _cut_to_capacity(index)
        if cut is not None:
            return no(CUT_TO_CAPACITY, cut)
        term = read_term(source)
        if term is None and strip_shape_ops(strip_casts(source)).op == "placeholder":
            return None  # the experts ran in another graph (a graph break before them): nothing to read here
        if term is None:
            return no(no_mlp_reason(source, "an expert's scattered output is not a gated MLP of the gathered tokens"),
                      source)
        rows_value = term.hidden
        if term.input_scaled_by is not None:  # MLP(x[tok] * w): let match_terms name the problem
            rows_value = next(
                (a for a in strip_casts(rows_value).args if isinstance(a, Node) and _gather_source(a, index)),
                rows_value,
            )
        hidden = _gather_source(rows_value, index)
        if hidden is None:
            return no(
                "an expert's input rows are not the hidden states at the tokens it adds back to", rows_value
            )
        terms.append(
            dataclasses.replace(term, hidden=strip_shape_ops(hidden), rows=index, rows_write=writes)
        )
    accumulator = link_parts(links[0])[0]
    base = strip_casts(accumulator)
    if _overwrites(accumulator, links):
        terms = [dataclasses.replace(t, rows_write="overwrites") for t in terms]
    tokens = _one_row_per_token(shape(terms[0].hidden), accumulator)
    if isinstance(tokens, NoMatch):
        return no(tokens.reason, base)
    chooser = next((c for t in terms if (c := _chosen_by_the_expert(t.rows, tokens)) is not None), None)
    if chooser is not None:
        return no(EXPERTS_CHOOSE_TOKENS, chooser)
    root = through_trailing_cast(end)
    scaled = _scaled_after(root) if all(t.coefficient is None and t.input_scaled_by is None for t in terms) else None
    if scaled is not None:  # out * w[:, None] after the loop: each expert's rows take their tokens' weight
        root, weight = scaled
        terms = [dataclasses.replace(t, coefficient=weight, coefficient_by_token=True) for t in terms]
    return match_terms(root, terms, FORM)


def _one_row_per_token(hidden_shape, accumulator: Node) -> int | None | NoMatch:
    """The token count (None where not a constant) when the accumulator holds one row per token of the
    hidden states, as the links write it (a [B, S, H] buffer flattened to rows is a [T, H] one); else why
    not."""
    base = strip_casts(accumulator)
    out_shape = shape(accumulator) if len(shape(base) or ()) != 2 else shape(base)
    if out_shape is None or len(out_shape) != 2 or hidden_shape is None or len(hidden_shape) < 2:
        return NoMatch("the accumulator is not a [T, H] tensor")
    tokens = 1
    for size in hidden_shape[:-1]:
        tokens = tokens * const_int(size) if tokens is not None and const_int(size) is not None else None
    if (tokens, const_int(hidden_shape[-1])) != (const_int(out_shape[0]), const_int(out_shape[1])):
        return NoMatch("the accumulator does not hold one row per token of the hidden states")
    return tokens


def _before_trailing_non_mlps(links: list[Node]) -> list[Node]:
    """The links up to the last gated MLP when every link after it adds something else (LongCat-Flash's
    zero-computation experts, `x[tok] * w`, after its routed ones), and at least two come before.

    The accumulator after the last MLP link is the sum of those experts' weighted outputs alone, which
    is what the kernel computes over their range of ids (it skips every other id); the later links then
    add to it as written. Otherwise the chain as it is (a non-MLP link in the middle is declined)."""
    mlps = [read_term(parts[3]) is not None if (parts := link_parts(link)) and isinstance(parts[3], Node) else False
            for link in links]
    if all(mlps) or True not in mlps:
        return links
    last = len(mlps) - 1 - mlps[::-1].index(True)
    return links[: last + 1] if last >= 1 and all(mlps[: last + 1]) else links


def _match_slot_stores(end: Node, links: list[Node]) -> ExpertsMatch | Decline:
    """Experts storing into an uninitialised buffer of slots: y = empty_like(x.repeat_interleave(k));
    `y[ids.view(-1) == e] = MLP_e(y_rows)` per expert; out = (y.view(T, k, H) * w[..., None]).sum(1).

    Exact where every slot is stored once, by the expert its id names, from its token's row: the rows each
    term gathers are the repeated hidden states at the slots it stores (read here), and which slots each
    expert stores, that they cover the buffer without overlap, and the weight each token gets are checked
    on the probes (`expert_terms`)."""

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, end, at)

    terms: list[ExpertTerm] = []
    repeated = None
    for link in links:
        _, _, index, source, _ = link_parts(link)
        term = read_term(source) if isinstance(source, Node) else None
        if term is None or term.input_scaled_by is not None or term.coefficient is not None:
            reason = "an expert's stored output is not a gated MLP of the rows it stores at"
            return no(no_mlp_reason(source, reason) if term is None and isinstance(source, Node) else reason, source)
        gathered = strip_shape_ops(term.hidden)
        rows = None
        if is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1 and same_value(
                gathered.args[1][0], index):  # `y[m] = MLP(rows[m])` spells m twice: two equal nodes
            rows = gathered.args[0]
        if rows is None or (repeated is not None and not same_value(rows, repeated)):
            return no("an expert's input rows are not the buffer's rows at the slots it stores", term.hidden)
        repeated = rows
        terms.append(term)
    found = repeat_interleaved(repeated)
    if found is None:
        return no("the stored slots are not the tokens repeated k times (repeat_interleave)", repeated)
    hidden, top_k = found
    combine = _slot_combine(end, top_k)
    if combine is None:
        return no("the stored slots are not summed per token with the routing weights "
                  "((y.view(T, k, H) * w[..., None]).sum(1))", end)
    root, weights = combine
    terms = [dataclasses.replace(t, hidden=strip_shape_ops(hidden), rows=link_parts(link)[2], rows_write="fills",
                                 coefficient=weights, slots_per_token=top_k)
             for t, link in zip(terms, links, strict=True)]
    return match_terms(root, terms, FORM)


def _scaled_after(out: Node) -> tuple[Node, Node] | None:
    """(the product, w) when the accumulated output's one use is `out * w` with w one value per token;
    also where a [T, H] buffer of rows is viewed back to [B, S, H] first and w is [B, S, 1] (HF Switch
    Transformers 4.x: `router_probs * next_states`)."""
    if len(out.users) != 1:
        return None
    product = next(iter(out.users))
    if is_call(product, aten.view.default, aten.reshape.default, aten._unsafe_view.default) and len(product.users) == 1:
        viewed, out_shape = product, shape(out)
        product = next(iter(viewed.users))
        viewed_shape = shape(viewed)
        if not (len(out_shape or ()) == 2 and len(viewed_shape or ()) >= 3
                and same_size(viewed_shape[-1], out_shape[-1]) and is_call(product, aten.mul.Tensor)):
            return None
        weight = product.args[1] if product.args[0] is viewed else product.args[0]
        weight_shape = shape(weight) if isinstance(weight, Node) else None
        if (weight is viewed or weight_shape is None or len(weight_shape) != len(viewed_shape)
                or const_int(weight_shape[-1]) != 1
                or not same_shape(weight_shape[:-1], viewed_shape[:-1])):
            return None
        return product, weight
    if not is_call(product, aten.mul.Tensor) or not all(isinstance(a, Node) for a in product.args[:2]):
        return None
    weight = product.args[1] if product.args[0] is out else product.args[0]
    out_shape, weight_shape = shape(out), shape(weight)
    if weight is out or len(weight_shape or ()) != 2 or len(out_shape or ()) != 2:
        return None
    per_token = statically_known_true(weight_shape[0] == out_shape[0]) and const_int(weight_shape[1]) == 1
    return (product, weight) if per_token else None


# Each link is an index_add (or an accumulating index_put) into the output.
FINDER = Finder(
    FORM, (aten.index_add.default, aten.index_put.default, aten.scatter_add.default, aten.scatter_reduce.two),
    _candidates, match_at, priority=40, partial_ranges=True
)
