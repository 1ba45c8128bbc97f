"""Segmented experts: slot rows sorted by expert, one contiguous segment of rows per expert.

    perm = sort(ids.view(-1)).indices;  rows = x[perm // k]                 # slots in expert order
    n_e = count of slots routed to e (`.tolist()` / `.item()`: unbacked SymInts under dynamo)
    y = cat(MLP_0(segment 0 of rows), ..., MLP_{E-1}(segment E-1))          # segments: split(rows, n)
                                                                            # or rows[s_e : s_e + n_e]
    out = zeros(T, H).index_add(0, perm // k, y * w.view(-1)[perm, None])   # GraniteMoE, JetMoE
        | (empty.index_put([perm], y).view(T, k, H) * w[..., None]).sum(1)  # DeepSeek-V2 (4.x)

A gated MLP may also be cut and re-joined around its activation (GraniteMoE's ParallelExperts: split,
per-expert gate/up, cat, act(gate) * up on all rows, split again, per-expert down, cat): the activation
works row by row, so segment e of its output is the activation of segment e of its input.

Why this is the kernel's sum over each token's k experts: `perm` sorts the flat ids ascending, so the
slots routed to expert e form one run of the sorted order, of length n_e; segment e is exactly that run
when it runs from n_0 + ... + n_{e-1} for n_e rows. The segment bounds (split sizes, slice starts and
ends: `.tolist()` or `.item()` reads of counts, running sums, cumsum offsets) are evaluated from the ids
on probe routings and compared with those runs. Each slot's output then goes back to its token with
its weight.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx import Node

from ..fx_utils import (
    METADATA_ONLY_OPS,
    const_int,
    is_call,
    is_cast,
    is_getitem,
    shape,
    strip_casts,
    strip_shape_ops,
)
from . import probe
from .experts_dense_loop import ExpertTerm, is_zero_init, read_term, role_weights
from .finder import Candidate, Finder
from .matches import Decline, ExpertsMatch
from .mlp import activation_of, gated_product, halves, projection

aten = torch.ops.aten
FORM = "segments"


def _candidates(_graph: torch.fx.Graph, anchors: list[Node]) -> list[Candidate]:
    """Joins of two or more pieces whose result is combined back into token order."""
    found = []
    for node in anchors:
        join = _joined(node)
        if join is not None and len(join.pieces) >= 2 and _combined(node) is not None:
            found.append(Candidate(node, join))
    return found


@dataclasses.dataclass(frozen=True)
class Join:
    """Per-expert outputs put together in row order: `cat(pieces)`, or each piece written over its rows
    of a zeros buffer (`out[s_e:t_e] = piece_e`, Aria: slice_scatter in the IR; where each lands is a
    segment, checked on probes like the inputs)."""

    node: Node
    pieces: tuple[Node, ...]
    placed: tuple  # the Segment each piece is written to; empty for cat (consecutive by construction)


def _joined(node: Node) -> Join | None:
    if is_call(node, aten.cat.default) and (len(node.args) < 2 or node.args[1] == 0):
        return Join(node, tuple(node.args[0]), ())
    pieces, placed, buffer = [], [], node
    while is_call(buffer, aten.slice_scatter.default) and len(buffer.args) >= 5 and buffer.args[2] == 0:
        step = buffer.args[5] if len(buffer.args) > 5 else 1
        value = buffer.args[1]
        if step != 1 or (buffer is not node and not _read_only_to_overwrite(buffer)):
            return None
        if is_call(value, aten.copy.default):  # out[s:t] = piece: piece broadcast into the slice
            value = value.args[1]
        pieces.append(strip_shape_ops(strip_casts(value)))
        placed.append(Segment(buffer.args[0], (buffer.args[3],), (buffer.args[4],)))
        buffer = buffer.args[0]
    if not pieces or not is_zero_init(buffer):
        return None
    return Join(node, tuple(reversed(pieces)), tuple(reversed(placed)))


# ---------------------------------------------------------------------------------------------------
# Segments and their bounds


@dataclasses.dataclass(frozen=True)
class Segment:
    """rows[start : end], each bound a sum of ints and scalar nodes (read on probes, never assumed)."""

    rows: Node
    start: tuple
    end: tuple


def _read_only_to_overwrite(buffer: Node) -> bool:
    """An intermediate buffer of the writes: read by the next write, and by slices only copied over."""
    for user in buffer.users:
        if is_call(user, aten.slice_scatter.default) and user.args[0] is buffer:
            continue
        if is_call(user, aten.slice.Tensor) and all(
            (is_call(c, aten.copy.default) and c.args[0] is user) or is_call(c, *METADATA_ONLY_OPS) for c in user.users
        ):
            continue
        return False
    return True


def _segment(node: Node) -> Segment | None:
    """`node` as a cut of some rows: getitem e of split_with_sizes(rows, sizes) along dim 0, or
    rows[start:end] (step 1)."""
    if is_getitem(node) and is_call(node.args[0], aten.split_with_sizes.default):
        split, e = node.args[0], node.args[1]
        dim = split.args[2] if len(split.args) > 2 else 0
        sizes = tuple(split.args[1])
        return Segment(split.args[0], sizes[:e], sizes[: e + 1]) if dim == 0 else None
    if is_call(node, aten.slice.Tensor) and node.args[1] == 0:
        step = node.args[4] if len(node.args) > 4 else 1
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        return Segment(node.args[0], (start,), (end,)) if step == 1 else None
    return None


def _segments_are_runs(segments: list[tuple[int, Segment]], ids: Node, experts: int) -> str | None:
    """None when, on probe routings, segment e is exactly the run of sorted slots routed to expert e.

    The bounds (split sizes, slice starts and ends: `.tolist()` / `.item()` reads of counts, running
    sums, cumsum offsets, however they are spelled) are evaluated from the ids; the runs follow from
    the counts, since the slots are sorted by expert.
    """
    tokens, top_k = (int(probe._concrete(d)) for d in shape(ids))
    scalars = [t for _, s in segments for t in (*s.start, *s.end) if isinstance(t, Node)]
    nodes = probe.slice_between(scalars, {ids}) if scalars else []
    if any(n.op in ("placeholder", "get_attr") for n in nodes):
        return "the segment bounds are not computed from the routing ids the rows are sorted by"
    try:
        for probe_ids, _ in probe.routing_probes(tokens, top_k, experts, torch.float32):
            env = probe.evaluate(nodes, {ids: probe_ids.to(ids.meta["val"].dtype)}, probe.OFFSET_OPS)
            ends = torch.bincount(probe_ids.view(-1), minlength=experts).cumsum(0).tolist()
            for e, segment in segments:
                bounds = (_bound(segment.start, env, tokens * top_k), _bound(segment.end, env, tokens * top_k))
                if bounds != ((ends[e - 1] if e else 0), ends[e]):
                    return f"expert {e}'s segment is not the run of sorted slots routed to it (on a probe routing)"
    except probe.NotProbeable as why:
        return f"the segment bounds are computed with ops the finder cannot check ({why})"
    return None


def _bound(terms: tuple, env: dict, length: int) -> int:
    """The sum of `terms` as a slice bound into `length` rows (None: the end; clamped as slicing does)."""
    if len(terms) == 1 and terms[0] is None:
        return length
    value = sum(int(env[t]) if isinstance(t, Node) else int(t) for t in terms)
    value = value + length if value < 0 else value
    return min(max(value, 0), length)


# ---------------------------------------------------------------------------------------------------
# The sort and the way back to token order


def _sort_permutation(node: Node) -> Node | None:
    """flat ids when `node` is sort(flat ids).indices (ascending) or argsort(flat ids)."""
    if is_getitem(node, 1) and is_call(node.args[0], aten.sort.default, aten.sort.stable):
        sort = node.args[0]
        descending = sort.kwargs.get("descending", sort.args[2] if len(sort.args) > 2 and isinstance(sort.args[2], bool) else False)
        if sort.target is aten.sort.stable:
            descending = sort.kwargs.get("descending", False)
        return None if descending else sort.args[0]
    if is_call(node, aten.argsort.default, aten.argsort.stable) and not node.kwargs.get("descending", False):
        return node.args[0]
    return None


def _slot_ids(flat: Node) -> Node | None:
    """ids [T, k] when `flat` is ids.view(-1) (or flatten)."""
    ids = strip_shape_ops(flat)
    if ids is flat or len(shape(flat)) != 1 or len(shape(ids) or ()) != 2:
        return None
    return ids


def _token_of_slot(node: Node, perm: Node, top_k: int) -> bool:
    """`node` is perm // k (trunc or floor division)."""
    if is_call(node, aten.div.Tensor_mode) and node.kwargs.get("rounding_mode") in ("trunc", "floor"):
        return node.args[0] is perm and node.args[1] == top_k
    if is_call(node, aten.floor_divide.default, aten.floor_divide.Scalar):
        return node.args[0] is perm and node.args[1] == top_k
    return False


def _combined(cat: Node) -> tuple[str, Node, Node, Node, Node] | None:
    """(how, output, perm, slot weights, token index) of the way `cat`'s rows go back to the tokens."""
    users = [u for u in cat.users if not is_call(u, *METADATA_ONLY_OPS)]  # empty_like(y), sizes: no values
    if len(users) != 1:
        return None
    user = users[0]
    if is_call(user, aten.mul.Tensor):  # index_add(zeros, 0, perm // k, y * w_flat[perm][:, None])
        scale = user.args[1] if user.args[0] is cat else user.args[0]
        adds = [u for u in user.users if is_call(u, aten.index_add.default)]
        if len(user.users) != 1 or not adds or adds[0].args[1] != 0 or adds[0].args[3] is not user:
            return None
        if not is_zero_init(adds[0].args[0]):  # into another tensor: the output is not the MoE alone
            return None
        gathered = strip_shape_ops(scale)
        if not (is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1):
            return None
        return "index_add", adds[0], gathered.args[1][0], gathered.args[0], adds[0].args[2]
    values = cat
    if is_call(user, *_VIEWS) and len(user.users) == 1 and shape(user) is not None and shape(cat) is not None:
        # one slot (T * k == 1): out[perm] = y puts y's [H] view, broadcast to the one row
        if math.prod(shape(user)) == math.prod(shape(cat)) and len(shape(user)) == 1:
            values, user = user, next(iter(user.users))
    accumulates = len(user.args) > 3 and user.args[3]
    if is_call(user, aten.index_put.default) and user.args[2] is values and len(user.args[1]) == 1 and not accumulates:
        # out[perm] = y with perm a permutation of every row: all rows overwritten (DeepSeek-V2's combine)
        return "unpermute", user, user.args[1][0], None, None
    if is_call(user, aten.index_copy.default) and user.args[1] == 0 and user.args[3] is cat:
        return "unpermute", user, user.args[2], None, None  # Aria's index_copy_(0, perm, y)
    return None


# ---------------------------------------------------------------------------------------------------
# The experts, segment by segment


def _segment_term(piece: Node, e: int, experts: int, segments: list[tuple[int, Segment]]) -> ExpertTerm | str:
    """Expert e's MLP on one segment: the whole MLP on the segment, or cut and re-joined around the act
    ((e, segment) is appended to `segments` for each cut, the input's first; which rows each cut takes
    is checked on probes)."""
    term = read_term(piece)
    if term is not None and term.coefficient is None and term.input_scaled_by is None:
        segment = _segment(strip_shape_ops(term.hidden))
        if segment is None:
            return f"expert {e}'s input is not a segment of the sorted rows"
        segments.append((e, segment))
        return term
    down = projection(piece)
    joined = _segment(down.input) if down is not None else None
    if joined is None:
        return f"expert {e}'s output is not a gated MLP of a segment of the sorted rows"
    product = gated_product(joined.rows)
    split = halves(product.gate, product.up) if product is not None else None
    inner = _joined(split[0]) if split is not None else None
    if inner is None or len(inner.pieces) != experts:
        found = getattr(joined.rows.target, "__name__", str(joined.rows.target))
        return (
            f"between the cut projections sits {found}, not act(gate) * up of joined segments (the experts "
            "are not gated MLPs: e.g. JetMoE's mixture of attention heads)"
        )
    gate_up = projection(inner.pieces[e])
    segment = _segment(gate_up.input) if gate_up is not None else None
    if segment is None:
        return f"expert {e}'s gate/up input is not a segment of the sorted rows"
    segments.extend([(e, segment), (e, joined)] + ([(e, inner.placed[e])] if inner.placed else []))
    activation, desc = activation_of(product.activation_node)
    return ExpertTerm(piece, piece, None, segment.rows, activation, desc, gate_up, None, None, down)


def match_at(join: Join) -> ExpertsMatch | Decline:
    cat = join.node
    how, output, perm, slot_weights, token_index = _combined(cat)

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, output, at)

    segments: list[tuple[int, Segment]] = []
    terms = []
    inputs: list[Node] = []  # the rows each expert's input segment is cut from
    for e, piece in enumerate(join.pieces):
        first = len(segments)
        term = _segment_term(piece, e, len(join.pieces), segments)
        if isinstance(term, str):
            return no(term, piece)
        terms.append(term)
        inputs.append(segments[first][1].rows)
        if join.placed:
            segments.append((e, join.placed[e]))
    flat = _sort_permutation(perm)
    ids = _slot_ids(flat) if flat is not None else None
    if ids is None:
        return no("the rows are not ordered by sorting the flat expert ids", perm)
    top_k, experts = const_int(shape(ids)[1]), len(terms)
    sorted_rows = strip_shape_ops(inputs[0])
    gathered = _gathered_rows(sorted_rows)
    if any(strip_shape_ops(r) is not sorted_rows for r in inputs) or gathered is None:
        return no("the experts do not read segments of one gather of the hidden states", inputs[0])
    hidden, row_tokens = gathered
    if not _token_of_slot(row_tokens, perm, top_k):
        return no("the sorted rows are not the tokens of the sorted slots (x[perm // k])", sorted_rows)
    reason = _segments_are_runs(segments, ids, experts)
    if reason is not None:
        return no(reason, cat)
    if how == "index_add":
        weights = _slot_weights(slot_weights, top_k)
        if weights is None or not _token_of_slot(token_index, perm, top_k):
            return no("the expert outputs are not added back to their tokens with their slot's weight", output)
    else:
        output, weights = _unpermuted_sum(output, top_k)
        if output is None:
            return no("the unpermuted outputs are not weighted and summed over the k slots", cat)
    return _match(output, terms, hidden, ids, weights, top_k, no)


def _gathered_rows(node: Node) -> tuple[Node, Node] | None:
    """(x, index) for x[index] or x.index_select(0, index)."""
    if is_call(node, aten.index.Tensor) and len(node.args[1]) == 1:
        return node.args[0], node.args[1][0]
    if is_call(node, aten.index_select.default) and node.args[1] == 0:
        return node.args[0], node.args[2]
    return None


def _slot_weights(gathered_from: Node, top_k: int) -> Node | None:
    """w [T, k] when `gathered_from` is w.view(-1)."""
    weights = strip_shape_ops(strip_casts(gathered_from))
    shaped = shape(weights)
    return weights if shaped is not None and len(shaped) == 2 and const_int(shaped[1]) == top_k else None


def _unpermuted_sum(put: Node, top_k: int) -> tuple[Node | None, Node | None]:
    """(output, w) for (put.view(T, k, H) * w[..., None]).sum(1), casts and re-views allowed."""
    node = _through_views(put)
    users = list(node.users)
    if len(users) != 1 or not is_call(users[0], aten.mul.Tensor) or len(shape(node) or ()) != 3:
        return None, None
    product = users[0]
    scale = product.args[1] if product.args[0] is node else product.args[0]
    weights = strip_shape_ops(strip_casts(scale))
    summed = _through_views(product)  # an in-place mul_ on a view comes back viewed to [T, k, H]
    if const_int(shape(node)[1]) != top_k or shape(summed) != shape(product) or len(summed.users) != 1:
        return None, None
    total = next(iter(summed.users))
    if not is_call(total, aten.sum.dim_IntList) or list(total.args[1]) not in ([1], [-2]):
        return None, None
    if shape(weights) is None or len(shape(weights)) != 2:
        return None, None
    if len(total.users) == 1 and is_cast(next(iter(total.users))):
        total = next(iter(total.users))
    return total, weights


def _through_views(node: Node) -> Node:
    """Follow `node`'s single users while they only view or cast it."""
    while len(node.users) == 1 and (is_call(next(iter(node.users)), *_VIEWS) or is_cast(next(iter(node.users)))):
        node = next(iter(node.users))
    return node


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _match(output, terms, hidden, ids, weights, top_k, no) -> ExpertsMatch | Decline:
    if len({t.activation_desc for t in terms}) != 1 or terms[0].activation is None:
        return no(f"experts use an activation the kernel lacks or several ({terms[0].activation_desc})")
    if len({t.gate_up is not None for t in terms}) != 1:
        return no("experts mix fused gate/up and separate gate and up projections")
    roles = {name: role_weights(terms, name) for name in ("gate_up", "gate", "up", "down")}
    if any(isinstance(r, str) for r in roles.values()):
        return no(next(r for r in roles.values() if isinstance(r, str)))
    if shape(ids) != shape(weights):
        return no("routing ids and weights are not [T, k] tensors of the same shape", weights)
    return ExpertsMatch(
        form=FORM,
        output=output,
        hidden=hidden,
        ids=ids,
        weights=weights,
        num_experts=len(terms),
        top_k=top_k,
        activation=terms[0].activation,
        **roles,
    )


# Per-expert outputs are joined by a cat, or written over a zeros buffer by slice_scatters.
FINDER = Finder(FORM, (aten.cat.default, aten.slice_scatter.default), _candidates, match_at)
