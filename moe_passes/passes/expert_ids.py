"""Which values the routing ids can take, read from the ops that made them.

Under expert parallelism a rank holds a contiguous range of the router's experts, and the ids that reach
its experts are the router's top-k choices remapped: transformers' all-reduce EP hands its experts
`where(ids // E_local != rank, E_local, ids % E_local)`, a local id or the sentinel E_local; other code
subtracts the rank's first expert and masks what falls outside. The kernel needs to know which global
experts the held ones are (`experts_min`/`experts_max`) and that an id it does not hold contributes
nothing, so this module evaluates the id arithmetic for every choice the router can make: the ids are
traced back through pointwise integer ops (`remainder`, `floor_divide`, `where`, `clamp`, `masked_fill`,
comparisons, casts, constants) to one `topk` over W columns (or an `arange`), and those ops are run on
`arange(W)`. The result is exact, whatever the spelling, and small (W is the router's width). A top-1
choice written as `argmax(scores, -1)` or `scores.max(-1)[1]` is a top-k over W columns too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..fx_utils import arguments, const_int, is_call, is_getitem, shape
from .matches import IdsCheck

aten = torch.ops.aten

# Ops that keep each element in place (row-major order): an id keeps its position through them.
_ORDER_KEEPING = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.flatten.using_ints,
    aten.alias.default,
    aten.clone.default,
)
# Pointwise ops torch does not tag as such (or that take device arguments evaluated here on the CPU).
_ALSO_POINTWISE = (
    aten.floor_divide.default,
    aten.floor_divide.Scalar,
    aten.where.ScalarSelf,
    aten.where.ScalarOther,
    aten.where.Scalar,
    aten.masked_fill.Tensor,
    aten._to_copy.default,
)
_CONSTANT_OPS = (aten.scalar_tensor.default, aten.full.default)
# Reached through more ops than this, the ids are not treated as routing arithmetic.
_MAX_OPS = 64


class _Unreadable(Exception):
    """The ids depend on something other than one router choice and constants."""


@dataclass(frozen=True)
class ExpertIds:
    """Every value an id can take; for ids computed from one top-k choice, the id for each choice."""

    values: tuple[int, ...]  # sorted, distinct
    choices: Node | None = None  # the top-k's ids the values are computed from
    router_experts: int | None = None  # W: the ids are a function of a top-k choice among W columns
    by_choice: tuple[int, ...] | None = None  # the id when the router chose expert g, for g in 0..W-1

    @property
    def low(self) -> int:
        return self.values[0]

    @property
    def high(self) -> int:
        return self.values[-1]

    def window(self, first: int, count: int) -> int | None:
        """The global id of the router's expert that becomes id `first`, when the choices that give an
        id in first..first+count-1 are `count` consecutive experts each shifted by one offset; else None."""
        if self.by_choice is None:
            return None
        chosen = [(g, v) for g, v in enumerate(self.by_choice) if first <= v < first + count]
        if len(chosen) != count:
            return None
        offsets = {v - g for g, v in chosen}
        if len(offsets) != 1 or chosen[-1][0] - chosen[0][0] != count - 1:
            return None
        return first - offsets.pop()


def read_expert_ids(ids: Node) -> ExpertIds | None:
    """The values `ids` can take, or None when they do not come from a router choice by arithmetic."""
    reader = _Reader()
    try:
        value = reader.evaluate(ids)
    except _Unreadable:
        return None
    if reader.root is None or not isinstance(value, torch.Tensor) or value.dtype.is_floating_point:
        return None
    values = tuple(sorted({int(v) for v in value.reshape(-1).tolist()}))
    if not values:
        return None
    if reader.root_is_choice and reader.positional.get(ids, False):
        return ExpertIds(values, reader.root, reader.width, tuple(int(v) for v in value.tolist()))
    return ExpertIds(values)


def vanishing_choices(weights: Node, choices: Node) -> frozenset[int]:
    """The router choices g at which `weights` is zero whatever the scores: a product (or a `masked_fill`
    with 0) one of whose factors is computed from `choices` alone, element by element, and is 0 at g
    (`weights * mine`, `mine` saying that this rank holds the chosen expert)."""
    node = weights
    while isinstance(node, Node) and (node.target in _ORDER_KEEPING or node.target is aten._to_copy.default):
        node = node.args[0]
    if not isinstance(node, Node):
        return frozenset()
    if is_call(node, aten.mul.Tensor):
        return frozenset().union(*(
            vanishing_choices(f, choices) | _zeros_of(f, choices, shape(node), lambda v: v == 0) for f in node.args[:2]
        ))
    if is_call(node, aten.masked_fill.Scalar) and node.args[2] == 0:
        return vanishing_choices(node.args[0], choices) | _zeros_of(node.args[1], choices, shape(node), bool)
    return frozenset()


def _zeros_of(factor, choices: Node, full_shape, zero) -> frozenset[int]:
    """The choices g where `zero(factor at g)`, for a factor of `full_shape` (no broadcast) that is a
    function of `choices` element by element; else none."""
    if not isinstance(factor, Node) or shape(factor) != full_shape:
        return frozenset()
    reader = _Reader()
    try:
        value = reader.evaluate(factor)
    except _Unreadable:
        return frozenset()
    if reader.root is not choices or not reader.positional.get(factor, False) or not isinstance(value, torch.Tensor):
        return frozenset()
    return frozenset(g for g, v in enumerate(value.reshape(-1).tolist()) if zero(v))


class _Reader:
    """Evaluates the id arithmetic on the router's choices: each root-derived node becomes a 1-D tensor
    over the choices (positional when each element still belongs to its choice), each constant a
    scalar tensor."""

    def __init__(self) -> None:
        self.root: Node | None = None
        self.width: int | None = None
        self.root_is_choice = False
        self.positional: dict[Node, bool] = {}
        self.memo: dict[Node, object] = {}

    def evaluate(self, node):
        if not isinstance(node, Node):
            return node
        if node not in self.memo:
            if len(self.memo) > _MAX_OPS:
                raise _Unreadable
            self.memo[node] = self._evaluate(node)
        return self.memo[node]

    def _evaluate(self, node: Node):
        root = self._as_root(node)
        if root is not None:
            return root
        if node.op != "call_function":
            raise _Unreadable
        target = node.target
        if target in _CONSTANT_OPS:
            return self._constant(node)
        if target in _ORDER_KEEPING:
            value = self.evaluate(node.args[0])
            self.positional[node] = self.positional.get(node.args[0], False)
            return value
        pointwise = target in _ALSO_POINTWISE or (
            isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
        )
        if not pointwise:
            raise _Unreadable
        return self._pointwise(node)

    def _as_root(self, node: Node):
        """arange(W) for the ids of a top-k over W columns (or for an arange itself)."""
        width, choice = None, False
        if is_call(node, aten.argmax.default) or (is_getitem(node, 1) and is_call(
                node.args[0], aten.topk.default, aten.max.dim)):  # top-k, or top-1: argmax / max(dim)[1]
            width = choice_width(node)
            choice = width is not None
        elif is_call(node, aten.arange.default) and len(node.args) == 1:
            width = const_int(node.args[0])
        if width is None:
            return None
        if self.root is not None and self.root is not node:
            raise _Unreadable  # two sources of ids: not a function of one choice
        self.root, self.width, self.root_is_choice = node, width, choice
        self.positional[node] = True
        return torch.arange(width)

    def _constant(self, node: Node):
        if any(isinstance(a, Node) for a in node.args) or any(isinstance(v, Node) for v in node.kwargs.values()):
            raise _Unreadable
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("device", "layout", "pin_memory")}
        value = node.target(*node.args, **kwargs)
        if value.numel() != 1:
            raise _Unreadable
        return value.reshape(())

    def _pointwise(self, node: Node):
        tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, Node)]
        derived = [a for a in tensors if isinstance(self.evaluate(a), torch.Tensor) and self.evaluate(a).dim() == 1]
        if len({tuple(shape(a) or ()) for a in derived}) > 1:
            raise _Unreadable  # two shapes of the ids meet: broadcasting, not the same choice
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("device", "layout", "pin_memory", "memory_format")}
        args = [self.evaluate(a) for a in node.args]
        kwargs = {k: self.evaluate(v) for k, v in kwargs.items()}
        try:
            value = node.target(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as error:
            raise _Unreadable from error
        self.positional[node] = bool(derived) and all(self.positional.get(a, False) for a in derived)
        return value


# --- Ids no op of the graph bounds -------------------------------------------------------------------
#
# Ids handed to the graph as an input (an experts module compiled on its own, routing computed in an
# earlier graph) can hold any value. The kernel skips an id outside its held range; the region's own ops
# may not: `w[ids]` wraps a negative id and raises past the end, `one_hot` and `scatter` raise, and a sort
# or a histogram of the ids turns an out-of-range id into rows the groups no longer line up with. What the
# region does decides what the fused call must do first (`IdsCheck`).

DROPS, WRAPS, RAISES = "drops", "wraps", "raises"

# Ops an id passes through with its value unchanged (only where it sits, or how often, changes).
_VALUE_KEEPING = (
    *_ORDER_KEEPING,
    aten._to_copy.default,
    aten.expand.default,
    aten.repeat.default,
    aten.repeat_interleave.self_int,
    aten.permute.default,
    aten.t.default,
    aten.transpose.int,
    aten.select.int,
    aten.slice.Tensor,
)
# Ops that read an id as the position of a row along `dim` of `source`, and raise outside 0..rows-1:
# {op: (the index argument, the indexed tensor's argument, its dim (an argument name or a fixed dim))}.
_INDEXING = {
    aten.index_select.default: ("index", "input", "dim"),
    aten.gather.default: ("index", "input", "dim"),
    aten.scatter.src: ("index", "input", "dim"),
    aten.scatter.value: ("index", "input", "dim"),
    aten.scatter_add.default: ("index", "input", "dim"),
    aten.scatter_reduce.two: ("index", "input", "dim"),
    aten.index_add.default: ("index", "input", "dim"),
    aten.index_copy.default: ("index", "input", "dim"),
    aten.embedding.default: ("indices", "weight", 0),
}
_SELECTED_BY = (aten.index.Tensor, aten.index_select.default, aten.gather.default)  # ids[perm]: values kept


@dataclass(frozen=True)
class IdRead:
    """How one op of the region treats an id outside the experts it indexes.

    DROPS: compares ids with expert numbers (`ids == e`): an unknown id matches none, as in the kernel.
    WRAPS: Python indexing of `rows` rows (`w[ids]`): a negative id counts from the end, others raise.
    RAISES: raises outside 0..rows-1 (`one_hot`, `scatter`, `index_select`), or (rows None) gives an
    out-of-range id no meaning the kernel could share (a sort or histogram of the ids, a clamp).
    """

    how: str
    rows: int | None
    op: str


class UnboundedIds(Exception):
    """The ids' range is not proved and the region reads them in a way the fused call cannot keep."""


def id_reads(ids: Node, region: frozenset[Node]) -> list[IdRead]:
    """How the region's ops read the values of `ids`, followed through the ops that keep those values
    (views of the ids count as the region's input, not as part of it); nothing found reads as unknown."""
    reads, stack, seen = [], [ids], {ids}
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            read = _read_by(user, node)
            if read is None:
                stack.append(user)
            elif user in region:
                reads.append(read)
    return reads or [IdRead(RAISES, None, "no op the region reads them with")]


def _read_by(user: Node, value: Node) -> IdRead | None:
    """How `user` reads the ids `value` holds, or None when it passes them on unchanged."""
    if _made_by(user) is torch.nn.functional.one_hot:  # eq(ids[..., None], arange(n)) once traced
        if is_call(user, aten.eq.Tensor):
            return IdRead(RAISES, const_int((shape(user) or (None,))[-1]), "one_hot")
        return None
    if user.target in _VALUE_KEEPING or (is_getitem(user, 0) and is_call(user.args[0], aten.sort.default)):
        return None
    if is_call(user, aten.eq.Scalar, aten.eq.Tensor):
        return IdRead(DROPS, None, "aten.eq")
    if user.target in _SELECTED_BY and user.args[0] is value:
        return None  # ids[perm]: the same values, in another order
    if is_call(user, aten.index.Tensor):
        position = next((d for d, index in enumerate(user.args[1]) if index is value), None)
        rows = const_int(shape(user.args[0])[position]) if position is not None else None
        return IdRead(WRAPS if rows is not None else RAISES, rows, "aten.index")
    if user.target in _INDEXING:
        return IdRead(RAISES, _indexed_rows(user, value), str(user.target.overloadpacket))
    op = str(getattr(user.target, "overloadpacket", getattr(user.target, "__name__", user.target)))
    return IdRead(RAISES, None, op)


def _made_by(node: Node):
    """The torch function of the user's code that a traced node came from (dynamo's source_fn_stack)."""
    stack = node.meta.get("source_fn_stack") or ()
    return stack[-1][1] if stack else None


def _indexed_rows(user: Node, value: Node) -> int | None:
    index_name, source_name, dim = _INDEXING[user.target]
    values = arguments(user) or {}
    if values.get(index_name) is not value:
        return None
    source = shape(values.get(source_name))
    dim = values.get(dim) if isinstance(dim, str) else dim
    if source is None or not isinstance(dim, int):
        return None
    return const_int(source[dim])


def check_unbounded_ids(ids: Node, region: frozenset[Node], first: int, count: int, partial: bool) -> IdsCheck | None:
    """What the fused call must check of ids whose range is not proved, holding experts first..first+count-1.

    None where every read drops an unknown id, as the kernel does (loops comparing ids with expert
    numbers); a wrap and a range check where every read is Python indexing of the E experts; else a
    range check to the bound the reads raise at (an out-of-range id there either raises in the region or
    gives its result no meaning). `partial`: the region may hold part of the router's experts, so ids
    outside the held ones are valid; then a read with no bound is declined (UnboundedIds).
    """
    reads = id_reads(ids, region)
    if all(r.how == DROPS for r in reads):
        return None
    read_by = ", ".join(sorted({r.op for r in reads if r.how != DROPS}))
    if all(r.how == WRAPS and r.rows == count for r in reads) and first == 0:
        return IdsCheck(0, count - 1, count, read_by)
    bounds = [r.rows for r in reads if r.how != DROPS]
    if any(b is None for b in bounds):
        if partial:
            raise UnboundedIds(
                f"the routing ids come from outside the graph and {read_by} reads them with no bound, so ids of "
                f"experts other ranks hold cannot be told from invalid ones"
            )
        return IdsCheck(first, first + count - 1, None, read_by)
    high = min(bounds) - 1
    return IdsCheck(0, high if partial else min(high, first + count - 1), None, read_by)


_CHOICES = (aten.topk.default, aten.sort.default, aten.max.dim, aten.min.dim)  # (values, indices)


def choice_width(node: Node) -> int | None:
    """W when `node` is the index output of a choice over the last dim of a [..., W] tensor made in the
    graph (top-k, sort, max / min over a dim, argmax / argmin), so every value lies in 0..W-1; else None."""
    if is_getitem(node, 1) and is_call(node.args[0], *_CHOICES):
        choice = node.args[0]
    elif is_call(node, aten.argmax.default, aten.argmin.default):
        choice = node
    else:
        return None
    args = arguments(choice) or {}
    scores = shape(args.get("self", args.get("input")))
    dim = args.get("dim")
    if not scores or not isinstance(dim, int) or dim not in (-1, len(scores) - 1):
        return None
    return const_int(scores[-1])
