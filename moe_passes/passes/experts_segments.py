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

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx_utils import (
    METADATA_ONLY_OPS,
    SHAPE_ONLY_OPS,
    arguments,
    const_int,
    is_call,
    is_cast,
    is_getitem,
    shape,
    strip_casts,
    strip_shape_ops,
    through_trailing_cast,
)
from . import probe
from .expert_terms import ExpertTerm, first_no_match, is_zero_init, no_mlp_reason, read_term, role_weights
from .finder import Candidate, Finder
from .matches import IDS_WEIGHTS_SHAPES, MIXED_GATE_UP, Decline, ExpertsMatch, NoMatch, unprobeable
from .mlp import GATE_SECOND, activation_of, gate_second, gated_product, halves, projection
from .slots import (
    INPUT_SCALED,
    Combine,
    IndexMap,
    Rows,
    SlotAlgebra,
    SlotCombines,
    gather_parts,
    same_shape,
    sorted_ids,
)

aten = torch.ops.aten
FORM = "segments"


def _candidates(_graph: torch.fx.Graph, anchors: list[Node]) -> list[Candidate]:
    """Joins of two or more pieces whose result flows on to a scatter or a sum back to the tokens."""
    found = []
    for node in anchors:
        join = _joined(node)
        path = _combine_path(node) if join is not None and len(join.pieces) >= 2 else None
        if path:
            found.append(Candidate(node, (join, path)))
    return found


def _combine_path(join: Node, depth: int = 8) -> list[Node] | None:
    """The single users from `join` on (weights multiplied in, views, an unpermuting scatter) down to a
    scatter-add by token or a sum over the slots; None when the joined rows go elsewhere."""
    path, node, unpermuted = [], join, False
    for _ in range(depth):
        users = [u for u in node.users if not is_call(u, *METADATA_ONLY_OPS)]  # empty_like(y): no values
        if len(users) != 1:
            break
        node = users[0]
        path.append(node)
        if is_call(node, *_ADDS_BY_ROW) or is_call(node, aten.sum.dim_IntList, aten.bmm.default):
            return path
        unpermuted |= is_call(node, aten.index_put.default, aten.index_copy.default, aten.scatter.src)
        if not (unpermuted or is_call(node, aten.mul.Tensor) or is_cast(node) or is_call(node, *SHAPE_ONLY_OPS)):
            return None
    return path if unpermuted else None


_ADDS_BY_ROW = (aten.index_add.default, aten.scatter_add.default)


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


def _segments_are_runs(
    segments: list[tuple[int, Segment]], ids: Node, experts: int, width: int | None = None
) -> NoMatch | None:
    """None when, on probe routings (ids drawn from `width` experts, default `experts`), segment e is
    exactly the run of sorted slots routed to expert e; else why not (where: the caller's join).

    The bounds (split sizes, slice starts and ends: `.tolist()` / `.item()` reads of counts, running
    sums, cumsum offsets, however they are spelled) are evaluated from the ids; the runs follow from
    the counts, since the slots are sorted by expert.
    """
    tokens, top_k = (int(probe.concrete(d)) for d in shape(ids))
    ops = probe.OFFSET_OPS if width is None else probe.ROUTED_OFFSET_OPS
    scalars = [t for _, s in segments for t in (*s.start, *s.end) if isinstance(t, Node)]
    nodes = probe.slice_between(scalars, {ids}) if scalars else []
    if any(n.op in ("placeholder", "get_attr") for n in nodes):
        return NoMatch("the segment bounds are not computed from the routing ids the rows are sorted by")
    try:
        for probe_ids, _ in probe.routing_probes(tokens, top_k, width or experts, torch.float32):
            env = probe.evaluate(nodes, {ids: probe_ids.to(ids.meta["val"].dtype)}, ops)
            ends = torch.bincount(probe_ids.view(-1), minlength=experts).cumsum(0).tolist()
            for e, segment in segments:
                bounds = (_bound(segment.start, env, tokens * top_k), _bound(segment.end, env, tokens * top_k))
                if bounds != ((ends[e - 1] if e else 0), ends[e]):
                    return NoMatch(f"expert {e}'s segment is not the run of sorted slots routed to it (on a probe routing)")
    except probe.NotProbeable as why:
        return NoMatch(unprobeable("the segment bounds", why))
    return None


def _bound(terms: tuple, env: dict, length: int) -> int:
    """The sum of `terms` as a slice bound into `length` rows (None: the end; clamped as slicing does)."""
    if len(terms) == 1 and terms[0] is None:
        return length
    value = sum(int(env[t]) if isinstance(t, Node) else int(t) for t in terms)
    value = value + length if value < 0 else value
    return min(max(value, 0), length)


# ---------------------------------------------------------------------------------------------------
# The experts, segment by segment


def _segment_term(piece: Node, e: int, experts: int, segments: list[tuple[int, Segment]]) -> ExpertTerm | NoMatch:
    """Expert e's MLP on one segment: the whole MLP on the segment, or cut and re-joined around the act
    ((e, segment) is appended to `segments` for each cut, the input's first; which rows each cut takes
    is checked on probes); else why not (stopped at `piece`)."""
    term = read_term(piece)
    if term is not None and term.input_scaled_by is None:
        segment = _segment(strip_shape_ops(term.hidden))
        if segment is None:
            if _picked_by_graph_input(term.hidden):
                return NoMatch(
                    f"expert {e}'s input rows are picked by indices this graph receives as an input: they were "
                    "computed before a graph break (see the breaks), so which tokens they are cannot be checked",
                    piece,
                )
            return NoMatch(f"expert {e}'s input is not a segment of the sorted rows", piece)
        segments.append((e, segment))
        return term
    down = projection(piece)
    joined = _segment(down.input) if down is not None else None
    if joined is None:
        return NoMatch(no_mlp_reason(piece, f"expert {e}'s output is not a gated MLP of a segment of the sorted rows"),
                       piece)
    product = gated_product(joined.rows)
    split = halves(product.gate, product.up) if product is not None else None
    swapped = split is None and product is not None and gate_second(product)
    if swapped:  # up * act(gate) with up first (dolomite-engine's GLU): the halves of W are swapped
        split = halves(product.up, product.gate)
    inner = _joined(split[0]) if split is not None else None
    if inner is None and swapped:
        return NoMatch(GATE_SECOND, piece)
    if inner is None or len(inner.pieces) != experts:
        found = getattr(joined.rows.target, "__name__", str(joined.rows.target))
        return NoMatch(
            f"between the cut projections sits {found}, not act(gate) * up of joined segments (the experts "
            "are not gated MLPs: e.g. JetMoE's mixture of attention heads)",
            piece,
        )
    gate_up = projection(inner.pieces[e])
    segment = _segment(gate_up.input) if gate_up is not None else None
    if segment is None:
        return NoMatch(f"expert {e}'s gate/up input is not a segment of the sorted rows", piece)
    segments.extend([(e, segment), (e, joined)] + ([(e, inner.placed[e])] if inner.placed else []))
    activation, desc = activation_of(product.activation_node)
    if swapped:  # gate = W[I:2I], up = W[:I] of the joined weight, passed as two roles (views of it)
        size = split[1]
        gate = dataclasses.replace(gate_up, out_rows=(size, 2 * size))
        up = dataclasses.replace(gate_up, out_rows=(0, size))
        return ExpertTerm(piece, piece, None, segment.rows, activation, desc, None, gate, up, down)
    return ExpertTerm(piece, piece, None, segment.rows, activation, desc, gate_up, None, None, down)


ROWS_FROM_A_GRAPH_INPUT = (
    "the rows are gathered at indices this graph receives as an input: they were computed before a graph break "
    "(see the breaks), so whether they are the tokens sorted by expert cannot be checked"
)


def _picked_by_graph_input(rows: Node) -> bool:
    """`rows` is `x[idx]` (index / index_select) with `idx` a graph input: per-expert indices built in code
    dynamo did not trace (torchao's Mixtral groups them in a `torch._dynamo.disable`d function)."""
    rows = strip_casts(strip_shape_ops(rows))
    if is_call(rows, torch.ops.aten.index.Tensor):
        indices = [i for i in rows.args[1] if i is not None]
    elif is_call(rows, torch.ops.aten.index_select.default):
        indices = [rows.args[2]]
    else:
        return False
    return any(isinstance(i, Node) and strip_casts(strip_shape_ops(i)).op == "placeholder" for i in indices)


def _scales_gathered_rows(rows: Node) -> bool:
    """`rows` is a gather of the hidden states times another tensor (the routing weights applied to
    each expert's input: torchtune's Llama 4 MoE, torchtitan's score_before_experts)."""
    if not is_call(strip_casts(rows), aten.mul.Tensor):
        return False
    return any(isinstance(a, Node) and gather_parts(strip_shape_ops(strip_casts(a))) is not None
               for a in strip_casts(rows).args)


def match_at(found: tuple[Join, list[Node]]) -> ExpertsMatch | Decline:
    join, path = found

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(FORM, reason, path[-1], at)

    segments: list[tuple[int, Segment]] = []
    terms = []
    inputs: list[Node] = []  # the rows each expert's input segment is cut from
    for e, piece in enumerate(join.pieces):
        first = len(segments)
        term = _segment_term(piece, e, len(join.pieces), segments)
        if isinstance(term, NoMatch):
            return term.decline(FORM, path[-1])
        terms.append(term)
        inputs.append(segments[first][1].rows)
        if join.placed:
            segments.append((e, join.placed[e]))
    sorted_rows = strip_shape_ops(inputs[0])
    if any(strip_shape_ops(r) is not sorted_rows for r in inputs) or gather_parts(sorted_rows) is None:
        if _scales_gathered_rows(sorted_rows):
            return no(INPUT_SCALED, sorted_rows)
        return no("the experts do not read segments of one gather of the hidden states", inputs[0])
    read = _sorted_rows(sorted_rows, path)
    if isinstance(read, NoMatch):
        return read.decline(FORM, path[-1])
    algebra, rows, combine = read
    routed = algebra.routed_below
    if routed is not None and routed != len(terms):
        return no(f"the sorted slots are cut to those of ids below {routed}, and {len(terms)} experts read them", join.node)
    weights = _routing_weights(join, combine, terms, algebra, segments)
    if isinstance(weights, NoMatch):
        return weights.decline(FORM, path[-1])
    not_runs = _segments_are_runs(segments, algebra.ids, len(terms), _probed_width(algebra))
    if not_runs is not None:
        return not_runs.decline(FORM, path[-1], join.node)
    output = through_trailing_cast(combine.output)
    matched = _match(output, terms, rows.hidden, algebra.ids, weights, algebra.top_k)
    if isinstance(matched, NoMatch):
        return matched.decline(FORM, path[-1])
    # Cut to the routed slots, the layer adds nothing for an id >= E, as the kernel skips it.
    return matched if routed is None else dataclasses.replace(matched, sentinels="dropped")


def _probed_width(algebra: SlotAlgebra) -> int | None:
    """How many experts the probe routings draw ids from where the sort order is cut to the routed
    slots: the router's width (a top-k over [T, W] scores), or k more than the experts, so that the
    probes hold ids the cut leaves out."""
    if algebra.routed_below is None:
        return None
    source = strip_casts(algebra.ids)
    if is_getitem(source, 1) and is_call(source.args[0], aten.topk.default):
        width = const_int((shape(source.args[0].args[0]) or (None,))[-1])
        if width is not None and width > algebra.routed_below:
            return width
    return algebra.routed_below + algebra.top_k


def _sorted_rows(sorted_rows: Node, path: list[Node]) -> tuple[SlotAlgebra, Rows, Combine] | NoMatch:
    """The slot algebra of the ids the rows are sorted by, the rows it reads and the combine on `path`
    that brings them back to the same tokens; else why not."""
    ids = sorted_ids(sorted_rows)
    if ids is None and _picked_by_graph_input(sorted_rows):
        return NoMatch(ROWS_FROM_A_GRAPH_INPUT, sorted_rows)
    if ids is None or len(shape(ids) or ()) != 2 or const_int(shape(ids)[1]) is None:
        return NoMatch("the rows are not ordered by sorting the flat expert ids", sorted_rows)
    algebra = SlotAlgebra(ids, const_int(shape(ids)[1]))
    by = algebra.index(gather_parts(sorted_rows)[1])
    rows = algebra.hidden_rows(sorted_rows)
    if not isinstance(by, IndexMap) or not (rows is None or algebra.expert_ordered(rows)):
        cut = _cut_of_the_sort(gather_parts(sorted_rows)[1], algebra)
        if cut is not None:
            return NoMatch(SORT_CUT, cut)
        return NoMatch("the rows are not ordered by sorting the flat expert ids (nor by the expert-major cells of their one-hot table)", sorted_rows)
    if rows is None:
        return NoMatch("the sorted rows are not the tokens of the sorted slots (x[perm // k])", sorted_rows)
    combines = SlotCombines(algebra)
    combine = next((c for c in map(combines.read, path) if c is not None), None)
    if combine is None:
        return NoMatch("the expert outputs are not added back to their tokens, nor weighted and summed over the k slots", path[-1])
    if (combine.domain, combine.slot) != (rows.domain, rows.slot):
        return NoMatch("the expert outputs are not brought back to the tokens their rows were read from", combine.output)
    return algebra, rows, combine


SORT_CUT = (
    "the sorted slots are cut before the rows are gathered (`order[:n]`, as LongCat-Flash keeps the slots of "
    "ids below its routed count): slots past the cut are not computed, and the fused kernel computes every slot"
)


def _cut_of_the_sort(index: object, algebra: SlotAlgebra, depth: int = 8) -> Node | None:
    """The slice or narrow of the ids' ascending sort order that `index` reads (through casts, views and
    the `// k` that makes slots tokens), else None. (A cut of a sort of one-hot cells is read by the
    algebra itself: Megatron keeps the true cells.)"""
    node, cut = index, None
    for _ in range(depth):
        if not isinstance(node, Node):
            return None
        if is_call(node, aten.slice.Tensor, aten.narrow.default) and not _keeps_every_row(node):
            cut = node
        order = algebra.index(node) if is_getitem(node, 1) or is_call(
            node, aten.argsort.default, aten.argsort.stable) else None
        if isinstance(order, IndexMap) and order.steps and order.steps[0].kind == "perm":
            return cut  # the ids sorted ascending (the algebra reads nothing else as a "perm")
        node = node.args[0] if node.args else None
    return None


def _keeps_every_row(cut: Node) -> bool:
    """A slice or narrow along dim 0 from 0 whose end is proved to be at least the length."""
    args = arguments(cut) or {}
    size = (shape(args.get("input")) or (None,))[0]
    if args.get("dim", 0) != 0 or args.get("start", 0) not in (None, 0) or args.get("step", 1) != 1:
        return False
    end = args.get("length") if is_call(cut, aten.narrow.default) else args.get("end")
    value = end.meta.get("val") if isinstance(end, Node) else end
    if value is None and not is_call(cut, aten.narrow.default):
        return True
    return size is not None and isinstance(value, int | torch.SymInt) and statically_known_true(value >= size)


UNPERMUTED_WEIGHTS = "routing weights are not permuted like the rows"


def _routing_weights(join: Join, combine: Combine, terms: list, algebra: SlotAlgebra, segments: list) -> Node | NoMatch:
    """The [T, k] routing weights, read where the layer applies them: in the combine (a view-sum with
    w[..., None]), to the joined rows (y * w.view(-1)[perm, None]), or in each expert before its down
    projection (Megatron: segments of one per-row weight list, appended to `segments` for the probes)."""
    values = strip_casts(combine.values)
    scaled = [t.coefficient for t in terms if t.coefficient is not None]
    if any(t.more_factors for t in terms):
        return NoMatch("an expert's output is scaled by several factors, not by its slot's weight", terms[0].term)
    if values is join.node and combine.weights is not None and not scaled:
        return combine.weights
    if values is join.node and combine.weights is None and len(scaled) == len(terms):
        cuts = [_segment(strip_casts(c)) for c in scaled]
        if any(c is None for c in cuts) or len({c.rows for c in cuts}) != 1:
            return NoMatch("the experts' routing weights are not segments of one list of per-row weights", scaled[0])
        read = algebra.slot_values(cuts[0].rows)
        if read is None or read[1] != Rows(combine.domain, combine.slot):
            return NoMatch(UNPERMUTED_WEIGHTS, cuts[0].rows)
        segments.extend(enumerate(cuts))
        return read[0]
    if is_call(values, aten.mul.Tensor) and combine.weights is None and not scaled:
        sides = [(a, b) for a, b in (values.args, values.args[::-1]) if isinstance(a, Node) and strip_casts(a) is join.node]
        read = algebra.slot_values(sides[0][1]) if sides and isinstance(sides[0][1], Node) else None
        if read is not None and read[1] == Rows(combine.domain, combine.slot):
            return read[0]
        return NoMatch(UNPERMUTED_WEIGHTS, values)
    return NoMatch("the expert outputs are not added back to their tokens with their slot's weight", combine.output)


def _match(output, terms, hidden, ids, weights, top_k) -> ExpertsMatch | NoMatch:
    if len({t.activation_desc for t in terms}) != 1 or terms[0].activation is None:
        return NoMatch(f"experts use an activation the kernel lacks or several ({terms[0].activation_desc})")
    if len({t.gate_up is not None for t in terms}) != 1:
        return NoMatch(MIXED_GATE_UP)
    roles = {name: role_weights(terms, name) for name in ("gate_up", "gate", "up", "down")}
    unread = first_no_match(*roles.values())
    if unread is not None:
        return unread
    if not same_shape(shape(ids), shape(weights)):
        return NoMatch(IDS_WEIGHTS_SHAPES, weights)
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
FINDER = Finder(FORM, (aten.cat.default, aten.slice_scatter.default), _candidates, match_at, priority=70)
