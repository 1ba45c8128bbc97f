"""Which values the routing ids can take, read from the ops that made them.

Under expert parallelism a rank holds a contiguous range of the router's experts, and the ids that reach
its experts are the router's top-k choices remapped: transformers' all-reduce EP hands its experts
`where(ids // E_local != rank, E_local, ids % E_local)`, a local id or the sentinel E_local; other code
subtracts the rank's first expert and masks what falls outside. The kernel needs to know which global
experts the held ones are (`experts_min`/`experts_max`) and that an id it does not hold contributes
nothing, so this module evaluates the id arithmetic for every choice the router can make: the ids are
traced back through pointwise integer ops (`remainder`, `floor_divide`, `where`, `clamp`, `masked_fill`,
comparisons, casts, constants) to one `topk` over W columns (or an `arange`), and those ops are run on
`arange(W)`. The result is exact, whatever the spelling, and small (W is the router's width).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..fx_utils import const_int, is_call, is_getitem, shape

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
        if is_getitem(node, 1) and is_call(node.args[0], aten.topk.default):
            topk = node.args[0]
            scores = shape(topk.args[0])
            dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
            if scores and dim in (-1, len(scores) - 1):
                width, choice = const_int(scores[-1]), True
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
