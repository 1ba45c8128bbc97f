"""What index tensors mean, whatever op produced them: maps between tokens, slots, sorted positions.

An MoE layer moves rows between four index spaces: tokens T (rows of x), slots S (t * k + j, the
flattened [T, k] routing table), the positions P of a permutation of the slots (rows grouped by
expert), and experts E. Every index tensor of the layer is a map between them, written as steps
applied from its domain outward:

    ids.view(-1)                    S -> E      (expert,)
    argsort(ids.view(-1)), sort(..)[1]  P -> S  (perm p,)          p: the node that sorted
    perm // k                       P -> T      (perm p, token)
    argsort(perm), index_put(empty, [perm], arange)   S -> P   (inv p,)
    a[b] (index, index_select, gather, take)          b's steps, then a's

so `y[inverse]` is y's rows read through (inv p, perm p) = (): back in slot order, proved by the steps
cancelling, not by the spelling of the gather. Rows of x gathered by a map ending in `token` hold, at
each position, the token of the slot the rest of the map names; the combine back to tokens (a view-sum
over the k slots, an index_add / scatter_add by token, or a scatter by the permutation first) is read
the same way. Rules are per op: a new spelling of a known step needs a rule here, not a new finder.

Megatron-style layers sort cells of the one-hot table of the ids instead of the ids: the [T, E] table
transposed to expert-major [E, T] and flattened, a stable descending sort putting its true cells first
(by expert, then token), cut to the number of true cells. Those positions are the space C; each holds a
cell index e * T + t (step "cell", C -> grid G), and `% T` is the token of that cell. With ids distinct
in each token (`topk`'s), true cells and slots are in one-to-one correspondence, and
`masked_select(table.T, mask.T)` lists a dense [T, E] weight table's values in the same C order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx_utils import (
    SHAPE_ONLY_OPS,
    TRANSPOSE_OPS,
    arguments,
    const_int,
    dtype,
    is_call,
    is_cast,
    is_getitem,
    shape,
)

aten = torch.ops.aten

TOKENS, SLOTS, EXPERTS = "T", "S", "E"
CELLS, GRID = "C", "G"  # true cells of the expert-major one-hot table of the ids; cell indices e * T + t
Space = str | Node  # "T", "S", "E", "C", "G", or the node whose permutation orders the positions


# Routing weights applied to the rows before the experts (torchtitan's score_before_experts, Llama 4).
INPUT_SCALED = (
    "routing weights scale each expert's input, not its output; the fused kernel weights outputs, and "
    "with a non-linear MLP the two are not equal"
)

@dataclass(frozen=True)
class Step:
    """One primitive map: "perm" (P(p) -> S), "inv" (S -> P(p)), "token" (S -> T, or G -> T by `% T`),
    "expert" (S -> E), "cell" (C -> G: the cell each true-cell position holds)."""

    kind: str
    perm: Node | None = None

    def source(self) -> Space:
        return {"perm": self.perm, "cell": CELLS}.get(self.kind, SLOTS)

    def target(self) -> Space:
        return {"perm": SLOTS, "inv": self.perm, "token": TOKENS, "expert": EXPERTS, "cell": GRID}[self.kind]


def compose(*parts: tuple[Step, ...]) -> tuple[Step, ...]:
    """The steps one after another, with a permutation and its inverse cancelling."""
    out: list[Step] = []
    for step in (s for part in parts for s in part):
        if out and out[-1].perm is step.perm and {out[-1].kind, step.kind} == {"perm", "inv"}:
            out.pop()
        else:
            out.append(step)
    return tuple(out)


@dataclass(frozen=True)
class IndexMap:
    """An integer tensor whose entry at each position of `domain` is a position of its codomain."""

    domain: Space
    steps: tuple[Step, ...]

    @property
    def codomain(self) -> Space:
        return self.steps[-1].target() if self.steps else self.domain


@dataclass(frozen=True)
class Rows:
    """Per-row data over `domain` whose row d belongs to slot `slot(d)` (steps from domain to S).

    `hidden` is set for rows of x itself (x[token of slot]), None for values computed from them."""

    domain: Space
    slot: tuple[Step, ...]
    hidden: Node | None = None


@dataclass(frozen=True)
class Identity:
    """arange(n): the identity of whichever space of size n it is used in (n may be symbolic)."""

    size: object


@dataclass(frozen=True)
class CellOrder:
    """Every cell index of the expert-major one-hot table, its true cells first in row-major order (a
    stable descending sort of the flattened table); cut to the true cells, it is the map C -> G."""


def same_size(a: object, b: object) -> bool:
    """Sizes proved equal: equal integers, or symbolic sizes the shape environment shows equal."""
    if a is None or b is None:
        return False
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - sizes the shape environment cannot compare are not proved equal
        return False


class SlotAlgebra:
    """Index meanings relative to one routing table `ids` [T, k] (memoised per node)."""

    def __init__(self, ids: Node, top_k: int):
        self.ids, self.top_k = ids, top_k
        self._memo: dict[Node, IndexMap | Identity | None] = {}
        # Set where the ascending sort order of the ids is cut to the slots of ids below R (`_routed_prefix`).
        self.routed_below: int | None = None
        self._routed_cuts: set[Node] = set()

    # -- index tensors ---------------------------------------------------------------------------
    def index(self, node: object) -> IndexMap | Identity | None:
        if not isinstance(node, Node):
            return None
        if node not in self._memo:
            self._memo[node] = None  # cycles cannot occur in a DAG; this guards re-entry on failure
            self._memo[node] = self._index(node)
        return self._memo[node]

    def _index(self, node: Node) -> IndexMap | Identity | None:
        if (is_cast(node) and _keeps_index_values(node)) or _flattening(node) or _splitting_tokens(node) or is_call(
            node, aten.clone.default, aten.alias.default
        ):
            return self.index(node.args[0])
        if is_cast(node):
            return None  # bool or a narrow dtype: not the same indices (a sort of `ids.bool()` is no sort of the ids)
        if node is self.ids:
            return IndexMap(SLOTS, (Step("expert"),))
        args = arguments(node) or {}
        if is_call(node, aten.arange.default, aten.arange.start, aten.arange.start_step):
            return self._arange(args)
        if is_getitem(node, 1) and is_call(node.args[0], aten.sort.default, aten.sort.stable):
            sort = node.args[0]  # argsort decomposes to sort(...)[1]: of the ids, of a permutation, of cells
            sort_args = arguments(sort) or {}
            return self._sorted(sort, sort) or self._inverse(self.index(sort.args[0]), sort_args) or self._cells(sort_args)
        if is_getitem(node, 0) and is_call(node.args[0], aten.sort.default, aten.sort.stable):
            perm = self._sorted(node.args[0], node.args[0])
            return IndexMap(perm.domain, compose(perm.steps, (Step("expert"),))) if perm else None
        if is_call(node, aten.argsort.default, aten.argsort.stable):
            return self._sorted(node, node) or self._inverse(self.index(args.get("input")), args) or self._cells(args)
        if is_call(node, aten.floor_divide.default, aten.div.Tensor_mode):
            return self._token_of(node, args)
        if is_call(node, aten.slice.Tensor):
            return self._true_cells(args) or self._routed_prefix(node, args)
        if is_call(node, aten.remainder.Scalar):
            return self._token_of_cell(args)
        if is_call(node, aten.masked_select.default):
            return self._selected_tokens(args)
        if is_call(node, aten.index_put.default, aten.scatter.src, aten.scatter.value, aten.index_copy.default):
            return self._inverse_by_scatter(node, args)
        if is_call(node, aten.expand.default, aten.repeat_interleave.self_int):
            return self._token_of_each_slot(node)
        gathered = gather_parts(node)
        if gathered is not None:
            source, by = self.index(gathered[0]), self.index(gathered[1])
            if isinstance(source, IndexMap) and isinstance(by, IndexMap) and by.codomain == source.domain:
                return IndexMap(by.domain, compose(by.steps, source.steps))
        return None

    def _arange(self, args: dict) -> Identity | None:
        start, end, step = args.get("start", 0), args.get("end"), args.get("step", 1)
        size = end.meta.get("val") if isinstance(end, Node) else end
        return Identity(size) if start == 0 and step == 1 and size is not None else None

    def _sorted(self, sort: Node, perm: Node) -> IndexMap | None:
        """P(perm) -> S when `sort` orders the flat ids ascending (stable or not: an expert's rows stay
        together either way, and every later step goes through the same permutation)."""
        args = arguments(sort) or {}
        if args.get("descending") or args.get("dim", -1) not in (0, -1) or len(shape(args.get("input")) or ()) != 1:
            return None  # a sort of [T, k] ids along a dim orders each token's ids, not the flat ids
        source = self.index(args.get("input"))
        if not (isinstance(source, IndexMap) and source.domain == SLOTS and source.steps == (Step("expert"),)):
            return None
        return IndexMap(perm, (Step("perm", perm),))

    def _inverse(self, source: object, args: dict) -> IndexMap | None:
        """argsort of a permutation of the slots is its inverse (not of one cut to the routed slots:
        that orders fewer positions than there are slots)."""
        cut = args.get("input")
        while isinstance(cut, Node) and (is_cast(cut) or _flattening(cut) or is_call(cut, aten.clone.default, aten.alias.default)):
            cut = cut.args[0]
        if cut in self._routed_cuts:
            return None
        if isinstance(source, IndexMap) and len(source.steps) == 1 and source.steps[0].kind == "perm":
            if not args.get("descending") and args.get("dim", -1) in (0, -1):
                return IndexMap(SLOTS, (Step("inv", source.steps[0].perm),))
        return None

    def _inverse_by_scatter(self, node: Node, args: dict) -> IndexMap | None:
        """index_put(empty(n), [perm], arange(n)) (or scatter / index_copy of arange): the inverse."""
        if is_call(node, aten.index_put.default):
            indices, values = args.get("indices") or [None], args.get("values")
            index = indices[0] if len(indices) == 1 else None
        else:
            index, values = args.get("index"), args.get("src", args.get("source"))
        by = self.index(index)
        while is_call(values, aten.view.default, aten.reshape.default, aten.squeeze.default, aten.squeeze.dim):
            values = values.args[0]  # one slot: arange(1) is viewed as a scalar
        identity = self.index(values)
        if not isinstance(identity, Identity) or not _fresh(args.get("input")):
            return None
        if not same_size(identity.size, self.slot_count()):
            return None  # a shorter arange would broadcast: not the inverse
        return self._inverse(by, {"input": index})

    def _token_of_each_slot(self, node: Node) -> IndexMap | None:
        """arange(T)[:, None].expand(T, k) or arange(T).repeat_interleave(k): at slot t * k + j, token t."""
        tokens = shape(self.ids)[0]
        if is_call(node, aten.repeat_interleave.self_int):
            column, repeats = node.args[0], const_int(node.args[1])
            if repeats != self.top_k or len(node.args) > 2 and node.args[2] not in (None, 0):
                return None
        else:
            dims, column = shape(node), node.args[0]
            if not dims or len(dims) != 2 or const_int(dims[1]) != self.top_k or const_int((shape(column) or (0, 0))[-1]) != 1:
                return None
            while is_call(column, aten.unsqueeze.default, aten.view.default, aten.reshape.default):
                column = column.args[0]
        source = self.index(column)
        if isinstance(source, Identity) and len(shape(column) or ()) == 1 and same_size(source.size, tokens):
            return IndexMap(SLOTS, (Step("token"),))
        return None

    def _token_of(self, node: Node, args: dict) -> IndexMap | None:
        """m // k, for m a map into the slots: the token of each slot."""
        if is_call(node, aten.div.Tensor_mode) and args.get("rounding_mode") not in ("floor", "trunc"):
            return None
        source = self.index(args.get("input"))
        if const_int(args.get("other")) != self.top_k:
            return None
        if isinstance(source, Identity) and same_size(source.size, self.slot_count()):
            return IndexMap(SLOTS, (Step("token"),))
        if isinstance(source, IndexMap) and source.codomain == SLOTS:
            return IndexMap(source.domain, compose(source.steps, (Step("token"),)))
        return None

    # -- Megatron's expert-major cells (the module docstring's C and G) --------------------------------
    def _cells(self, args: dict) -> CellOrder | None:
        """A stable descending sort of the flattened expert-major one-hot table: its true cells first."""
        stable = args.get("stable") is True
        if not (stable and args.get("descending") and args.get("dim", -1) in (0, -1) and self.distinct_ids()):
            return None
        flat = args.get("input")
        if not _flattening(flat) or not self._expert_major_mask(flat.args[0]):
            return None
        return CellOrder()

    def _true_cells(self, args: dict) -> IndexMap | None:
        """CellOrder cut to its first n positions, n proved to be the number of true cells."""
        if not isinstance(self.index(args.get("input")), CellOrder) or args.get("dim") != 0:
            return None
        if args.get("start", 0) != 0 or args.get("step", 1) != 1 or not self._true_cell_count(args.get("end")):
            return None
        return IndexMap(CELLS, (Step("cell"),))

    def _true_cell_count(self, end: object) -> bool:
        """T * k (each token has k distinct true cells), or the item of a full sum of the one-hot table."""
        if same_size(end.meta.get("val") if isinstance(end, Node) else end, self.slot_count()):
            return True
        if is_call(end, aten._local_scalar_dense.default):
            total = uncast(end.args[0])
            while is_call(total, aten.sum.default, aten.sum.dim_IntList):
                total = uncast(total.args[0])
            return one_hot_ids(total) is self.ids
        return False

    # -- the sort order cut to the routed experts (LongCat-Flash's zero experts) -----------------------
    def _routed_prefix(self, node: Node, args: dict) -> IndexMap | None:
        """The ids' ascending sort order cut to its first n positions, n proved to be the number of ids
        below some R (`order[:(ids < R).sum().item()]`): an ascending sort puts the slots of experts
        0..R-1 first, so the cut holds exactly their positions. Each kept position maps to the slot it
        did, so the map is the order's own, over fewer positions; `routed_below` records R: the slots of
        ids >= R reach no row, which the readers of the rows must allow for (a scatter back to slot
        order must start from zeros, the experts must be 0..R-1)."""
        source = self.index(args.get("input"))
        if not (isinstance(source, IndexMap) and len(source.steps) == 1 and source.steps[0].kind == "perm"):
            return None
        if args.get("dim") != 0 or args.get("start", 0) not in (None, 0) or args.get("step", 1) != 1:
            return None
        below = self._count_below(args.get("end"))
        if below is None or self.routed_below not in (None, below):
            return None
        self.routed_below = below
        self._routed_cuts.add(node)
        return source

    def _count_below(self, end: object) -> int | None:
        """R when `end` is the number of ids below R, read as a number: `(ids < R).sum().item()`, as the
        slice bound `min(n, T * k)` (which a count of slots never exceeds) or `0 + n`."""
        while isinstance(end, Node) and end.op == "call_function" and len(end.args) == 2:
            first, second = end.args
            if end.target is operator.add and isinstance(first, int) and first == 0:
                end = second
            elif end.target is operator.add and isinstance(second, int) and second == 0:
                end = first
            elif end.target is torch.sym_min and same_size(second, self.slot_count()):
                end = first
            elif end.target is torch.sym_min and same_size(first, self.slot_count()):
                end = second
            else:
                break
        if not is_call(end, aten._local_scalar_dense.default):
            return None
        total = uncast(end.args[0])
        if not is_call(total, aten.sum.default):
            return None
        below = uncast(total.args[0])
        if not is_call(below, aten.lt.Scalar) or type(below.args[1]) is not int or below.args[1] < 1:
            return None
        flat = self.index(below.args[0])
        if not (isinstance(flat, IndexMap) and flat.domain == SLOTS and flat.steps == (Step("expert"),)):
            return None
        return below.args[1]

    def _token_of_cell(self, args: dict) -> IndexMap | None:
        """cell % T: the token of an expert-major cell e * T + t."""
        source = self.index(args.get("input"))
        if isinstance(source, IndexMap) and source.codomain == GRID:
            if same_size(args.get("other"), shape(self.ids)[0]):
                return IndexMap(source.domain, compose(source.steps, (Step("token"),)))
        return None

    def _selected_tokens(self, args: dict) -> IndexMap | None:
        """arange(T)[None] (expanded over the experts) masked by the expert-major one-hot table: the token
        of each true cell, in C order (Megatron's `token_indices.masked_select(routing_map)`)."""
        source = args.get("input")
        if is_call(source, aten.expand.default):
            source = source.args[0]
        if not (is_call(source, aten.unsqueeze.default) and source.args[1] == 0):
            return None
        tokens = self.index(source.args[0])
        if not (isinstance(tokens, Identity) and same_size(tokens.size, shape(self.ids)[0]) and self.distinct_ids()):
            return None
        if not self._expert_major_mask(args.get("mask")):
            return None
        return IndexMap(CELLS, (Step("cell"), Step("token")))

    def _expert_major_mask(self, node: object) -> bool:
        """`node` is the one-hot table of the ids transposed to expert-major [E, T]."""
        table = _transposed_table(node)
        return table is not None and one_hot_ids(table) is self.ids

    def dense_weights(self, table: Node) -> Node | None:
        """w [T, k] when `table` is zeros(T, E).scatter(1, ids, w): each token's weights at its experts."""
        args = arguments(table) or {}
        if is_call(table, aten.scatter.src) and args.get("dim") in (1, -1) and _zeros(args.get("input")):
            source = uncast(args.get("src"))
            if uncast(args.get("index")) is self.ids and self._is_table(source) and self.distinct_ids():
                return source
        return None

    def distinct_ids(self) -> bool:
        """Each token's k ids differ (they come from a top-k): a one-hot table then has k true cells per
        token, one per slot, and a scatter of the weights at the ids loses none."""
        source = uncast(self.ids)
        return is_getitem(source, 1) and is_call(source.args[0], aten.topk.default)

    def expert_ordered(self, rows: Rows) -> bool:
        """Rows whose positions run through the experts in ascending order: sorted by one ascending sort
        of the ids (`_sorted`), or the expert-major true cells."""
        return len(rows.slot) == 1 and rows.slot[0].kind in ("perm", "cell")

    def slot_count(self) -> object:
        """T * k, symbolic when the token count is."""
        return shape(self.ids)[0] * self.top_k if shape(self.ids) else None

    # -- rows of x and per-slot values -------------------------------------------------------------
    def hidden_rows(self, node: Node) -> Rows | None:
        """x's rows, one per position, each the token of a slot: x[perm // k], index_select, gather with
        an expanded index, or x repeated k times (every slot in order)."""
        node = uncast(node)
        repeated = repeated_rows(node, self.top_k)
        if repeated is not None:
            return Rows(SLOTS, (), repeated)
        gathered = gather_parts(node)
        if gathered is None:
            return None
        by = self.index(gathered[1])
        if isinstance(by, IndexMap) and by.steps and by.steps[-1].kind == "token":
            return Rows(by.domain, by.steps[:-1], gathered[0])
        return None

    def slot_values(self, node: Node) -> tuple[Node, Rows] | None:
        """(table, rows) when `node` reads a [T, k] float table (the routing weights) per position: its
        flat view, or that view gathered by a map into the slots."""
        chain = [node]
        while is_cast(chain[-1]) or is_call(chain[-1], aten.unsqueeze.default, aten.view.default, aten.reshape.default):
            chain.append(chain[-1].args[0])
        if is_call(chain[-1], aten.masked_select.default):
            return self._selected_cells(chain[-1])
        gathered = gather_parts(chain[-1])
        if gathered is not None and _flattening(gathered[0]):  # table.T.reshape(-1)[cells]
            table = _transposed_table(gathered[0].args[0])
            weights = self.dense_weights(table) if table is not None else None
            by = self.index(gathered[1])
            if weights is not None and isinstance(by, IndexMap) and by.codomain == GRID:
                return weights, Rows(by.domain, by.steps)
        if gathered is None:  # the table itself; a cast of it nearest the use is what the model multiplies
            return next(((n, Rows(SLOTS, ())) for n in chain if self._is_table(n)), None)
        source = self.slot_values(gathered[0]) if gathered is not None else None
        if source is not None and source[1] == Rows(SLOTS, ()):
            by = self.index(gathered[1])
            if isinstance(by, IndexMap) and by.codomain == SLOTS:
                return source[0], Rows(by.domain, by.steps)
        return None

    def _selected_cells(self, node: Node) -> tuple[Node, Rows] | None:
        """masked_select(table.T, mask.T): the dense weight table's values at the true cells, in C order."""
        args = arguments(node) or {}
        table = _transposed_table(args.get("input"))
        weights = self.dense_weights(table) if table is not None else None
        if weights is None or not self._expert_major_mask(args.get("mask")):
            return None
        return weights, Rows(CELLS, (Step("cell"),))

    def input_scaling(self, node: Node, depth: int = 12) -> Node | None:
        """A product of x's routed rows and their routing weights above `node`: weights applied to the
        experts' input (torchtitan's score_before_experts, Llama4), which the kernel cannot express."""
        seen, frontier = set(), [node]
        for _ in range(depth):
            frontier = [s for n in frontier for s in n.all_input_nodes if s not in seen and not seen.add(s)]
            for candidate in frontier:
                if is_call(uncast(candidate), aten.mul.Tensor):
                    a, b = uncast(candidate).args
                    for rows, weights in ((a, b), (b, a)):
                        if isinstance(rows, Node) and isinstance(weights, Node) and self.hidden_rows(rows):
                            if self.slot_values(weights) is not None:
                                return candidate
        return None

    def _is_table(self, node: Node) -> bool:
        """A floating [T, k] tensor of this routing's shape (not the ids)."""
        value = node.meta.get("val")
        return (
            node is not self.ids
            and isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dim() == 2
            and tuple(value.shape) == tuple(self.ids.meta["val"].shape)
        )

    def expert_counts(self, node: Node) -> int | None:
        """E when `node` holds, for e in 0..E-1, how many slots chose expert e: histc / bincount of the
        ids (in any order), or a [*, E] one-hot table of them summed over the slots."""
        node = uncast(node)
        args = arguments(node) or {}
        if is_call(node, aten.histc.default, aten.bincount.default):
            source = self.index(args.get("input"))
            if not (isinstance(source, IndexMap) and source.codomain == EXPERTS):
                return None
            if is_call(node, aten.bincount.default):
                return None if args.get("weights") is not None else const_int(args.get("minlength"))
            return _identity_bins(args.get("bins"), args.get("min"), args.get("max"))
        if is_call(node, aten.sum.dim_IntList) and list(args.get("dim") or ()) in ([0], [-2]):
            return self._one_hot_width(uncast(args.get("input")))
        if is_call(node, aten.scatter_add.default, aten.index_add.default):
            return self._counted_by_adding_ones(node, args)
        return None

    def _counted_by_adding_ones(self, node: Node, args: dict) -> int | None:
        """E for zeros(E).scatter_add(0, ids, ones) / zeros(E).index_add(0, ids, ones): a 1 added at each
        slot's expert, which is the histogram of the ids whatever their order."""
        base, index = args.get("input", args.get("self")), args.get("index")
        ones = args.get("src", args.get("source"))
        width = shape(node)
        if args.get("dim") not in (0, -1) or len(width or ()) != 1 or not _zeros(base) or not _ones(ones):
            return None
        if args.get("alpha", 1) != 1 or not same_shape(shape(uncast(ones)), shape(uncast(index))):
            return None
        source = self.index(index)
        return const_int(width[0]) if isinstance(source, IndexMap) and source.codomain == EXPERTS else None

    def _one_hot_width(self, table: Node) -> int | None:
        """E for a [T, E] table with one 1 per chosen expert: scatter of ones at the ids into zeros."""
        width = shape(table)
        return const_int(width[-1]) if width and one_hot_ids(table) is self.ids else None


def one_hot_ids(table: object) -> Node | None:
    """ids when `table` is zeros(T, E).scatter(1, ids, 1): a 1 at each chosen expert (casts allowed)."""
    table = uncast(table)
    args = (arguments(table) or {}) if isinstance(table, Node) else {}
    if is_call(table, aten.scatter.value, aten.scatter_.value) and args.get("dim") in (1, -1):
        if args.get("value") == 1 and _zeros(args.get("input")) and len(shape(table) or ()) == 2:
            return uncast(args.get("index"))
    return None


def sorted_ids(out: Node, depth: int = 40) -> Node | None:
    """The [T, k] ids whose order a sort above `out` puts the rows in: the ids' flat view sorted, or
    their one-hot table sorted or masked out (Megatron's expert-major cells)."""
    seen, frontier = set(), [out]
    for _ in range(depth):
        next_frontier = []
        for node in frontier:
            for source in node.all_input_nodes:
                if source in seen:
                    continue
                seen.add(source)
                if is_call(source, aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable):
                    table = _one_hot_viewed(source.args[0]) or _table_viewed(source.args[0])
                    if table is not None:
                        return table
                if is_call(source, aten.masked_select.default) and _one_hot_viewed(source.args[1]) is not None:
                    return _one_hot_viewed(source.args[1])
                next_frontier.append(source)
        frontier = next_frontier
    return None


def _table_viewed(flat: Node) -> Node | None:
    """The 2-D tensor a flat view reads (casts allowed): where its view chain starts, else the first 2-D
    step on the way (a router that reshapes [B, S, k] to [T, k] last)."""
    chain = [flat]
    while is_call(chain[-1], *SHAPE_ONLY_OPS) or is_cast(chain[-1]):
        chain.append(chain[-1].args[0])
    return next((n for n in (chain[-1], *chain) if len(shape(n) or ()) == 2), None)


def _one_hot_viewed(flat: Node) -> Node | None:
    """The ids whose one-hot table a flat view reads (through casts, copies and a transpose)."""
    node = flat
    while is_call(node, *SHAPE_ONLY_OPS, *TRANSPOSE_OPS, aten.clone.default) or is_cast(node):
        node = node.args[0]
    return one_hot_ids(node)


def _transposed_table(node: object) -> Node | None:
    """The [T, E] table under `node` when `node` is it transposed to [E, T] (contiguous or not)."""
    node = uncast(node)
    while is_call(node, aten.clone.default, aten.contiguous.default):
        node = uncast(node.args[0])
    return uncast(node.args[0]) if isinstance(node, Node) and transposes_2d(node) else None


def transposes_2d(node: Node) -> bool:
    """A swap of the two dims of a 2-D tensor: t, transpose(0, 1), permute([1, 0])."""
    if len(shape(node) or ()) != 2:
        return False
    if is_call(node, aten.t.default):
        return True
    if is_call(node, aten.transpose.int):
        return {node.args[1] % 2, node.args[2] % 2} == {0, 1}
    return is_call(node, aten.permute.default) and [d % 2 for d in node.args[1]] == [1, 0]


def _identity_bins(bins: object, low: object, high: object) -> int | None:
    """E when histc(ids, bins, low, high) puts integer id j in bin j for every j in 0..E-1."""
    bins = const_int(bins)
    if bins is None or (low == 0 and high == 0 and bins != 1):  # 0, 0: the data's own range
        return None
    if bins == 1:
        return 1
    probe = torch.histc(torch.arange(bins, dtype=torch.float64), bins=bins, min=float(low), max=float(high))
    return bins if bool((probe == 1).all()) else None


def gather_parts(node: Node) -> tuple[Node, Node] | None:
    """(source, index) of a row gather along dim 0: a[i], index_select(a, 0, i), take(a, i) (1-D a),
    or gather(a, 0, i.unsqueeze(-1).expand(-1, H)) whose index repeats i across each row."""
    args = arguments(node) if isinstance(node, Node) and node.op == "call_function" else None
    if not args:
        return None
    if is_call(node, aten.index.Tensor) and len(args["indices"]) == 1 and args["indices"][0] is not None:
        return args["input"], args["indices"][0]
    if is_call(node, aten.index_select.default) and args["dim"] == 0:
        return args["input"], args["index"]
    if is_call(node, aten.take.default) and len(shape(args["input"]) or ()) == 1:
        return args["input"], args["index"]
    if is_call(node, aten.gather.default) and args["dim"] == 0:
        row_index = row_broadcast(args["index"], (shape(args["input"]) or (None, None))[-1])
        if row_index is not None:
            return args["input"], row_index
    return None


def row_broadcast(index: Node, width: object = None) -> Node | None:
    """i when `index` is i[:, None] expanded across the row ([N, H]) and H is `width`, the rows' width:
    each row gathers or scatters one whole row (a narrower index moves only its first columns)."""
    dims = shape(index)
    if dims is None or len(dims) != 2 or not same_size(dims[1], width):
        return None
    node = index
    if is_call(node, aten.expand.default):
        node = node.args[0]
    if is_call(node, aten.unsqueeze.default) and node.args[1] in (1, -1):
        return node.args[0]
    if is_call(node, aten.view.default, aten.reshape.default) and list(node.args[1])[1:] == [1]:
        return node.args[0]
    return None


# Casts of index tensors that keep every id (expert and slot numbers are far below 2**24).
_INDEX_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


def _keeps_index_values(cast: Node) -> bool:
    return dtype(cast) in _INDEX_DTYPES


def uncast(node: object) -> object:
    """Walk up through dtype conversions only (views change which positions a tensor has)."""
    while is_cast(node):
        node = node.args[0]
    return node


def _flattening(node: Node) -> bool:
    """A view that keeps row-major order and ends 1-D: [T, k] -> [T * k]."""
    return is_call(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints) and (
        len(shape(node) or ()) == 1
    )


def _splitting_tokens(node: Node) -> bool:
    """A view of a [T, k] table as [B, S, k] (the tokens split over leading dims, each token's k slots
    kept last): the same slots in the same row-major order."""
    if not is_call(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return False
    before, after = shape(node.args[0]), shape(node)
    return (before is not None and after is not None and len(before) == 2 and len(after) > 2
            and same_size(before[-1], after[-1]))


def _fresh(node: object) -> bool:
    """A buffer made only to be written: empty/zeros of any shape (its old values are never read)."""
    node = uncast(node) if isinstance(node, Node) else node
    return is_call(
        node, aten.empty_like.default, aten.zeros_like.default, aten.empty.memory_format, aten.zeros.default,
        aten.new_empty.default, aten.new_zeros.default, aten.full.default, aten.full_like.default,
    )


def repeated_rows(node: Node, top_k: int) -> Node | None:
    """x when node is x.repeat_interleave(k, dim=0) with k = top_k (`repeat_interleaved`)."""
    found = repeat_interleaved(node)
    return found[0] if found is not None and found[1] == top_k else None


def repeat_interleaved(node: Node) -> tuple[Node, int] | None:
    """(x, k) when node is x.repeat_interleave(k, dim=0), which ATen spells expand(x[:, None], [T, k, H])."""
    while is_call(node, aten.view.default, aten._unsafe_view.default, aten.clone.default, aten.reshape.default):
        node = node.args[0]
    if is_call(node, aten.expand.default):
        source, sizes = node.args[0], list(node.args[1])
        if is_call(source, aten.unsqueeze.default) and source.args[1] == 1 and len(sizes) == 3:
            k = const_int(sizes[1])
            return (source.args[0], k) if k is not None else None
    if is_call(node, aten.repeat_interleave.self_int):
        k = const_int(node.args[1])
        return (node.args[0], k) if k is not None else None
    return None


@dataclass(frozen=True)
class Combine:
    """How per-row values come back to tokens: `values` (rows over `domain`, row d of slot `slot(d)`)
    summed over each token's k slots into `output`; `weights` is the [T, k] table the combine itself
    multiplies by (einsum "tai,ta->ti", bmm, a view times w[..., None]), None when the rows carry it."""

    output: Node
    values: Node
    domain: Space
    slot: tuple[Step, ...]
    weights: Node | None = None


def inverse_steps(steps: tuple[Step, ...]) -> tuple[Step, ...] | None:
    """The inverse of a bijection between S and a P space, or None for maps that are not one."""
    flipped = {"perm": "inv", "inv": "perm"}
    if all(s.kind in flipped for s in steps):
        return tuple(Step(flipped[s.kind], s.perm) for s in reversed(steps))
    return None


def _zeros(node: object) -> bool:
    node = uncast(node) if isinstance(node, Node) else node
    if is_call(node, aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default):
        return True
    if is_call(node, aten.full.default, aten.full_like.default, aten.new_full.default):
        return (arguments(node) or {}).get("fill_value") == 0
    return False


def _ones(node: object) -> bool:
    """A tensor of ones (ones, ones_like, new_ones, or a full of 1), through casts and expands."""
    node = uncast(node) if isinstance(node, Node) else node
    while is_call(node, aten.expand.default):
        node = uncast(node.args[0])
    if is_call(node, aten.ones.default, aten.ones_like.default, aten.new_ones.default):
        return True
    if is_call(node, aten.full.default, aten.full_like.default, aten.new_full.default):
        return (arguments(node) or {}).get("fill_value") == 1
    return False


_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def same_shape(a: object, b: object) -> bool:
    """Shapes proved equal dim by dim (never guarding on a data-dependent size)."""
    return a is not None and b is not None and len(a) == len(b) and all(map(same_size, a, b))


def _row_for_row(values: object, index: object, base: object) -> bool:
    """`values` holds one whole row of `base` per entry of `index`: [N, *row], or one row where N is 1
    (index_put broadcasts it; with more entries it would copy that row to each)."""
    rows, row, count = shape(values), (shape(base) or ())[1:], (shape(index) or (None,))[0]
    if rows is None or not row:
        return False
    return same_shape(rows[1:], row) or (same_size(count, 1) and same_shape(rows, row))


def _flat_view_source(node: Node, top_k: int) -> Node | None:
    """v when node is v viewed as [T, k, H] (a row-major view of [T * k, H] rows)."""
    dims = shape(node)
    if not dims or len(dims) != 3 or const_int(dims[1]) != top_k:
        return None
    while is_call(node, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default):
        node = node.args[0]
    return node if len(shape(node) or ()) == 2 else None


class SlotCombines:
    """Reading the combine back to tokens with a `SlotAlgebra` (kept apart: rows in, tokens out)."""

    def __init__(self, algebra: SlotAlgebra):
        self.algebra = algebra

    def read(self, node: Node) -> Combine | None:
        """The combine that `node` ends, in any of its spellings, else None."""
        if is_call(node, aten.sum.dim_IntList):
            args = arguments(node) or {}
            if list(args.get("dim") or ()) in ([1], [-2]) and len(shape(node) or ()) == 2:
                return self._slot_sum(node, args["input"])
            return None
        if is_call(node, aten.bmm.default):
            return self._weighted_bmm(node)
        return self._add_by_token(node)

    def _slot_sum(self, out: Node, viewed: Node) -> Combine | None:
        """v.view(T, k, H).sum(1), or (v.view(T, k, H) * w[..., None]).sum(1), v in slot order."""
        weights = None
        chain = [viewed]  # an in-place mul_ on the [T, k, H] view comes back re-viewed: reshapes that
        while is_call(chain[-1], *_RESHAPES):  # return to the same shape keep every position in place
            chain.append(chain[-1].args[0])
        viewed = next(n for n in reversed(chain) if same_shape(shape(n), shape(viewed)))
        if is_call(viewed, aten.mul.Tensor):
            for rows, table in (viewed.args, viewed.args[::-1]):
                source = self._weight_table(table)
                if isinstance(rows, Node) and source is not None and len(shape(rows) or ()) == 3:
                    viewed, weights = rows, source
                    break
        flat = _flat_view_source(uncast(viewed), self.algebra.top_k)
        if flat is None:
            return None
        return self._in_slot_order(out, uncast(flat), weights)

    def _weighted_bmm(self, out: Node) -> Combine | None:
        """bmm(w.view(T, 1, k), v.view(T, k, H)): the k slots of each token weighted and summed."""
        left, right = out.args
        table = self._weight_table(left)
        flat = _flat_view_source(uncast(right), self.algebra.top_k)
        if table is None or flat is None or const_int(shape(left)[1]) != 1:
            return None
        return self._in_slot_order(out, uncast(flat), table)

    def _weight_table(self, node: object) -> Node | None:
        """The [T, k] table a [T, k, 1] or [T, 1, k] view reads (cast allowed), else None."""
        if not isinstance(node, Node):
            return None
        source = uncast(node)
        while is_call(source, aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.expand.default):
            source = uncast(source.args[0])
        dims = shape(source)
        if dims is None or len(dims) != 2 or const_int(dims[1]) != self.algebra.top_k or source is self.algebra.ids:
            return None
        return source if source.meta.get("val") is not None and source.meta["val"].is_floating_point() else None

    def _in_slot_order(self, out: Node, rows: Node, weights: Node | None) -> Combine | None:
        """Rows in slot order: as they are, read back through a permutation (y[inverse]), or scattered
        into slot order by it (out[perm] = y, index_copy, scatter)."""
        gathered = gather_parts(rows)
        if gathered is not None:
            by = self.algebra.index(gathered[1])
            back = inverse_steps(by.steps) if isinstance(by, IndexMap) and by.domain == SLOTS else None
            if back is not None:
                return Combine(out, gathered[0], by.codomain, back, weights)
        placed = self._scattered(rows, accumulate=False)
        if placed is not None and placed[1].codomain == SLOTS:
            return Combine(out, placed[0], placed[1].domain, placed[1].steps, weights)
        return Combine(out, rows, SLOTS, (), weights)

    def _scattered(self, node: Node, accumulate: bool) -> tuple[Node, IndexMap] | None:
        """(values, map of their rows) of a row scatter into a fresh buffer (zeros when accumulating)."""
        args = arguments(node) or {}
        base = args.get("input")
        if is_call(node, aten.index_put.default) and len(args.get("indices") or ()) == 1:
            if bool(args.get("accumulate")) != accumulate:
                return None
            values, index = args["values"], args["indices"][0]
        elif is_call(node, aten.index_copy.default) and not accumulate and args["dim"] == 0:
            values, index = args["source"], args["index"]
        elif is_call(node, aten.index_add.default) and accumulate and args["dim"] == 0 and args.get("alpha", 1) == 1:
            values, index = args["source"], args["index"]
        elif is_call(node, aten.scatter.src, aten.scatter_add.default) and (
                accumulate == is_call(node, aten.scatter_add.default)) and args["dim"] == 0:
            width = (shape(base) or (None, None))[-1]  # whole rows of the buffer, from whole rows of src
            full = same_shape(shape(args["index"]), shape(args["src"]))
            values, index = args["src"], row_broadcast(args["index"], width) if full else None
        else:
            return None
        if not _row_for_row(values, index, base):
            return None  # values broadcast across the rows, or only part of them: no row-for-row move
        by = self.algebra.index(index)
        # Where the sort order is cut to the routed slots, the others keep the buffer's values: zeros.
        if not (_zeros(base) if accumulate or self.algebra.routed_below is not None else _fresh(base)):
            return None
        return (values, by) if isinstance(by, IndexMap) else None

    def _add_by_token(self, out: Node) -> Combine | None:
        """index_add / scatter_add / index_put(accumulate) into zeros [T, H] by the token of each row."""
        placed = self._scattered(out, accumulate=True)
        if placed is None:
            return None
        values, by = placed
        if by.codomain != TOKENS or not by.steps:
            return None
        return Combine(out, values, by.domain, by.steps[:-1])
