"""How the stacked outputs of every expert reach a layer's result: weighted by a [T, E] routing table, or
picked at each token's ids. Read by the finders whose experts run on every token (`dense_einsum`,
`stacked_outputs`)."""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import arguments, is_call, is_cast, shape, val
from . import probe
from .slots import same_size, transposes_2d

aten = torch.ops.aten


def routing_table(node: Node) -> bool:
    """A floating 2-D tensor built from integer ids and one other tensor (the weights) alone: read as one
    leaf, not through its own products."""
    value = val(node)
    if not (isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point()):
        return False
    return probe.builds_table(node) and len(probe.table_sources(node)[0]) == 2


def table_labels(node: Node) -> tuple[Node, tuple] | None:
    """(the 2-D routing table, labels of `node`'s dims) when `node` is the table, or a cast of it with
    size-1 dims inserted (`table.unsqueeze(-1).to(y.dtype)`), transposed or not (`table.t()[..., None]`):
    ("t", "e"), or ("e", "t"), with None at the inserted dims."""
    inserted, transposed = [], False
    while is_cast(node) or is_call(node, aten.unsqueeze.default):
        if is_call(node, aten.unsqueeze.default):
            inserted.append(node.args[1] % len(shape(node)))
        node = node.args[0]
    while transposes_2d(node):  # `table.t()`, and `.t().t()` back again
        node, transposed = node.args[0], not transposed
        while is_cast(node):
            node = node.args[0]
    if not routing_table(node):
        return None
    labels: list = ["e", "t"] if transposed else ["t", "e"]
    for dim in reversed(inserted):  # innermost unsqueeze first
        labels.insert(dim, None)
    return node, tuple(labels)


def _token_column(node: object, tokens: object) -> bool:
    """`node` is arange(T) as a column ([T, 1], or expanded to [T, k]): row t holds t."""
    dims = shape(node) if isinstance(node, Node) else None
    if not dims or len(dims) != 2 or not same_size(dims[0], tokens):
        return False
    while is_call(node, aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.expand.default) or (
            _keeps_everything(node)):
        node = node.args[0]
    args = arguments(node) if is_call(node, aten.arange.default, aten.arange.start, aten.arange.start_step) else None
    if args is None or args.get("start", 0) != 0 or args.get("step", 1) != 1:
        return False
    end = args.get("end")
    return same_size(end.meta.get("val") if isinstance(end, Node) else end, tokens)


def _keeps_everything(node: Node) -> bool:
    """A slice with step 1 whose result is as large as its input (`t[:, None]` under dynamic shapes)."""
    args = arguments(node) if is_call(node, aten.slice.Tensor) else None
    return args is not None and args.get("step", 1) == 1 and len(shape(node)) == len(shape(args["input"])) and all(
        same_size(a, b) for a, b in zip(shape(node), shape(args["input"]), strict=True))


def _chosen_ids(node: object) -> bool:
    value = val(node)
    return isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point() and value.dtype != torch.bool


def picked_outputs(node: Node) -> tuple[Node, Node, tuple] | None:
    """(y, ids, y's labels) when node[t, a, o] = y[t, ids[t, a], o]: `y[arange(T)[:, None], ids]` (the
    indices on y's [T, E] or [E, T] dims) or `y.gather(1, ids[..., None].expand(T, k, O))`."""
    if is_call(node, aten.index.Tensor) and len(shape(node.args[0]) or ()) == 3 and len(node.args[1]) == 2:
        y, (first, second) = node.args
        for rows, ids, labels in ((first, second, ("t", "e", "o")), (second, first, ("e", "t", "o"))):
            if _chosen_ids(ids) and _token_column(rows, shape(ids)[0]):
                return y, ids, labels
    args = arguments(node) if is_call(node, aten.gather.default) else None
    if args is not None and len(shape(args["input"]) or ()) == 3 and args["dim"] % 3 == 1:
        index = args["index"]
        if is_call(index, aten.expand.default):
            index = index.args[0]
        if is_call(index, aten.unsqueeze.default) and index.args[1] % 3 == 2 and _chosen_ids(index.args[0]):
            ids = index.args[0]
            if same_size(shape(ids)[0], shape(node)[0]) and same_size(shape(ids)[1], shape(node)[1]):
                return args["input"], ids, ("t", "e", "o")
    return None
