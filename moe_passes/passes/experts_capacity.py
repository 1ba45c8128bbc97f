"""Capacity-limited dispatch (GShard, DeepSpeed, Tutel): read only to be declined with its reason.

    dispatched = einsum("sec,sm->ecm", dispatch, x)      y = experts(dispatched)      [E, C, M]
    out = einsum("sec,ecm->sm", combine, y)               combine[s, e, c]: token s in slot c of expert e

Each expert takes at most C tokens; the gating drops the ones past that (their weight is zeroed), which
the fused kernel never does. Both einsums are read with `axes.contraction` (whatever views, bmm or mm over
the merged E * C dim they became: fairseq writes them as `mm`); a region of this form is reported as
declined, never rewritten.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import shape
from .axes import contraction, frontier
from .finder import Finder, each_anchor
from .matches import Decline

aten = torch.ops.aten
FORM = "capacity_dispatch"
DROPS = (
    "capacity-limited dispatch ([tokens, experts, capacity] dispatch and combine tensors, GShard / DeepSpeed "
    "style): tokens past an expert's capacity are dropped from it, and the fused kernel computes every routed "
    "token"
)
NO_DROP_YET = (
    "capacity-limited dispatch ([tokens, experts, capacity] tensors) whose capacity is at least the token "
    "count, so no token is dropped; rewriting a dispatch by slot position is not supported yet"
)


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default)


def _top(node: Node) -> Node:
    """The last of the views a single-use chain puts on the einsum's bmm."""
    while len(node.users) == 1 and next(iter(node.users)).target in _VIEWS:
        node = next(iter(node.users))
    return node


def _combine(node: Node) -> tuple[Node, Node] | None:
    """(combine [S, E, C], expert outputs [E, C, M]) when `node` is einsum("sec,ecm->sm"); the outputs may
    carry leading dims of size 1 (fairseq's [all2all size, E, C, M], combined with `mm` over E * C)."""
    leaves = frontier(_top(node))
    if leaves is None or len(leaves) != 2 or not all(len(shape(leaf) or ()) >= 3 for leaf in leaves):
        return None
    for table, outputs in (leaves, leaves[::-1]):
        extra = len(shape(outputs)) - 3
        if len(shape(table)) != 3 or any(size != 1 for size in shape(outputs)[:extra]):
            continue
        read = contraction(_top(node), {table: ("s", "e", "c"), outputs: (None,) * extra + ("e", "c", "m")})
        kept = tuple(axis for axis in read.axes if axis) if read is not None else ()
        if kept == (("s",), ("m",)) and read.summed == frozenset({"e", "c"}):
            return table, outputs
    return None


def _dispatched_by(outputs: Node, table: Node, depth: int = 40) -> bool:
    """The expert outputs come from rows dispatched by a [S, E, C] tensor (in any order of its dims):
    einsum("sec,sm->ecm"). Only ever read to decline, so a loose test costs a decline, never a rewrite."""
    seen, frontier_nodes = set(), [outputs]
    for _ in range(depth):
        frontier_nodes = [s for n in frontier_nodes for s in n.all_input_nodes if s not in seen and not seen.add(s)]
        for node in frontier_nodes:
            if node.target in (aten.bmm.default, aten.mm.default):
                leaves = frontier(_top(node)) or []
                # [S, E, C] as the combine reads it, or permuted ([E, C, S]: nanoMoE's dispatch @ x)
                if any(sorted(map(str, shape(leaf))) == sorted(map(str, shape(table))) for leaf in leaves):
                    return True
    return False


def match_at(anchor: Node) -> Decline | None:
    found = _combine(anchor)
    if found is None or not _dispatched_by(found[1], found[0]):
        return None
    tokens, _, capacity = shape(found[0])
    never_drops = isinstance(tokens, int) and isinstance(capacity, int) and capacity >= tokens
    return Decline(FORM, NO_DROP_YET if never_drops else DROPS, _top(anchor))


FINDER = Finder(
    FORM, (aten.bmm.default, aten.mm.default), each_anchor(lambda node: _combine(node) is not None), match_at,
    priority=90,
)
