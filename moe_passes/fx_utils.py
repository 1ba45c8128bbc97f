"""Small FX helpers the finders share: look through shape-only ops, read fake values, walk regions."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch.fx import Node
from torch.fx.node import map_arg
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten

# Ops that only re-index memory: walking through them never changes which values a tensor holds.
SHAPE_ONLY_OPS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.alias.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.expand.default,
        aten.view_copy.default,
        aten.unsqueeze_copy.default,
        aten.squeeze_copy.dim,
        aten.alias_copy.default,
    }
)

TRANSPOSE_OPS = frozenset({aten.t.default, aten.transpose.int, aten.permute.default, aten.t_copy.default})


def is_call(node: object, *targets) -> bool:
    """True when `node` is a call_function node of one of `targets` (OpOverload or OpOverloadPacket)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    for target in targets:
        if node.target is target:
            return True
        packet = getattr(node.target, "overloadpacket", None)
        if packet is not None and packet is target:
            return True
    return False


def arguments(node: Node) -> dict | None:
    """A call's arguments by schema name, defaults filled in (torch's schema normalisation), so that
    `sort(x, 0)` and `sort(x, dim=0)` read alike; None when the target has no schema."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    try:
        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    except Exception:  # noqa: BLE001 - an op torch cannot normalise is read positionally by its finder
        normalized = None
    return dict(normalized.kwargs) if normalized is not None else None


def val(node: object):
    """The fake value recorded on a node (tensor, SymInt, or tuple), or None."""
    if isinstance(node, Node):
        return node.meta.get("val")
    return None


def shape(node: Node) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Node) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def device(node: Node) -> torch.device | None:
    v = val(node)
    return v.device if isinstance(v, torch.Tensor) else None


def strip_shape_ops(node: Node) -> Node:
    """Walk up through view/reshape/unsqueeze/... to the node that produced the values."""
    while is_call(node, *SHAPE_ONLY_OPS):
        node = node.args[0]
    return node


def slot_table(node: Node, top_k: int | None, through_casts: bool = False) -> Node | None:
    """The [T, k] routing tensor (ids or weights) that `node`, a flat or reshaped view of it, reads.

    Usually that is where the shape-only ops start (top-k's output); a router that works on [B, S, k]
    and reshapes to (-1, k) last (ZAYA) has its [T, k] form part-way up the chain.
    """
    chain = [node]
    while is_call(chain[-1], *SHAPE_ONLY_OPS) or (through_casts and is_cast(chain[-1])):
        chain.append(chain[-1].args[0])
    for candidate in (chain[-1], *chain):
        size = shape(candidate)
        if size is not None and len(size) == 2 and top_k is not None and const_int(size[1]) == top_k:
            return candidate
    return None


def strip_casts(node: Node) -> Node:
    """Walk up through dtype conversions and shape-only ops."""
    while True:
        if is_call(node, *SHAPE_ONLY_OPS):
            node = node.args[0]
        elif is_cast(node):
            node = node.args[0]
        else:
            return node


def is_cast(node: object) -> bool:
    """A `_to_copy` / `convert_element_type` that changes only the dtype."""
    if is_call(node, torch.ops.prims.convert_element_type.default):
        return True
    if is_call(node, aten._to_copy.default):
        return set(node.kwargs) <= {"dtype", "layout", "device", "pin_memory", "memory_format"}
    return False


def through_trailing_cast(out: Node) -> Node:
    """`out`, or its single user when that is a cast (`.to(hidden dtype)` after the combine): the region's
    output then includes the cast, which the fused call makes unnecessary (it returns that dtype)."""
    users = list(out.users)
    return users[0] if len(users) == 1 and is_cast(users[0]) else out


def is_getitem(node: object, index: int | None = None) -> bool:
    if not isinstance(node, Node) or node.target is not operator.getitem:
        return False
    return index is None or node.args[1] == index


def const_int(value: object) -> int | None:
    """A plain int argument (SymInts with a hint are read through their hint)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.hint if hasattr(value.node, "hint") else None
        return int(hint) if hint is not None else None
    return None


# Ops that read only the shape, dtype and device of their tensor argument, never its values.
METADATA_ONLY_OPS = (
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_empty.default,
    aten.new_full.default,
)


def backward_slice(output: Node, boundary: Iterable[Node]) -> set[Node]:
    """All nodes whose values `output` depends on, stopping at (and excluding) the boundary nodes and
    placeholders; `zeros_like(t)` and its kin depend on t's metadata only, so t is not followed."""
    stop = set(boundary)
    seen: set[Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node in seen or node in stop or node.op in ("placeholder", "get_attr"):
            continue
        seen.add(node)
        if not is_call(node, *METADATA_ONLY_OPS):
            stack.extend(n for n in node.all_input_nodes)
    return seen


def escaping_users(region: set[Node], output: Node) -> list[tuple[Node, Node]]:
    """(inside, outside) pairs where a region node other than `output` feeds a node outside the region."""
    escapes = []
    for node in region:
        if node is output:
            continue
        for user in node.users:
            if user not in region:
                escapes.append((node, user))
    return escapes


def ancestors(node: Node, depth: int | None = None, limit: int | None = None) -> list[Node]:
    """`node` and the nodes it depends on, nearest first (breadth-first): at most `depth` steps up, and
    no more than about `limit` nodes (the level that reaches it is kept whole)."""
    seen, order, frontier = {node}, [node], [node]
    steps = 0
    while frontier and (depth is None or steps < depth) and (limit is None or len(order) < limit):
        nxt = []
        for n in frontier:
            for parent in n.all_input_nodes:
                if parent not in seen:
                    seen.add(parent)
                    nxt.append(parent)
        order.extend(nxt)
        frontier, steps = nxt, steps + 1
    return order


def within(node: Node, depth: int, predicate) -> bool:
    """True when some ancestor of `node` at most `depth` steps up satisfies `predicate` (breadth-first)."""
    return any(predicate(n) for n in ancestors(node, depth=depth))


def source_line(node: Node) -> str:
    """ "file.py:LINE in function" of the user code that produced `node` (dynamo's stack trace), or ""."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    if not frames:
        return ""
    # 'File "/path/to/file.py", line 12, in forward'
    parts = frames[-1].split('"')
    if len(parts) < 3:
        return ""
    path, rest = parts[1], parts[2]
    line = rest.split("line", 1)[-1].split(",")[0].strip()
    function = rest.split(" in ", 1)[-1].strip() if " in " in rest else ""
    return f"{path.rsplit('/', 1)[-1]}:{line}" + (f" in {function}" if function else "")


class Emitter:
    """Creates nodes with fake values, so later passes and backends see shapes and dtypes."""

    def __init__(self, graph: torch.fx.Graph, fake_mode):
        self.graph = graph
        self.fake_mode = fake_mode

    def call(self, target, args=(), kwargs=None) -> Node:
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)
        with self.fake_mode:
            node.meta["val"] = target(*map_arg(args, val), **map_arg(kwargs, val))
        return node

    def getitems(self, node: Node, count: int) -> list[Node]:
        items = []
        for i in range(count):
            item = self.graph.call_function(operator.getitem, (node, i))
            item.meta["val"] = node.meta["val"][i]
            items.append(item)
        return items
