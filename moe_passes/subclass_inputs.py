"""Tensor-subclass inputs of a captured graph (DTensor parameters under tensor or expert parallelism).

The canonical trace reads a subclass input as its inner tensors, as AOTAutograd does: each DTensor
becomes its local shard, and ops on DTensors become the local ops and collectives they dispatch to. The
canonical graph keeps dynamo's placeholders, one per input, and reads the inner tensors from each with
`getattr`, so the inner backend receives the inputs dynamo passes and desugars them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class SubclassOutput(Exception):
    """The graph returns a tensor subclass: the canonical graph, on inner tensors, cannot return it."""


@dataclass(frozen=True)
class _Layout:
    """One subclass input: its type, how `__tensor_flatten__` split it, and its outer size and stride."""

    kind: type
    attrs: tuple[str, ...]
    context: object
    size: tuple
    stride: tuple
    inner: tuple  # per attr: a nested _Layout or None (a plain tensor)

    def leaves(self) -> int:
        return sum(1 if sub is None else sub.leaves() for sub in self.inner)


def _layout_of(value) -> _Layout | None:
    if not is_traceable_wrapper_subclass(value):
        return None
    attrs, context = value.__tensor_flatten__()
    inner = tuple(_layout_of(getattr(value, a)) for a in attrs)
    return _Layout(type(value), tuple(attrs), context, tuple(value.size()), tuple(value.stride()), inner)


def _flatten(value, layout: _Layout | None) -> list:
    if layout is None:
        return [value]
    return [leaf for a, sub in zip(layout.attrs, layout.inner, strict=True) for leaf in _flatten(getattr(value, a), sub)]


def _rebuild(leaves: list, layout: _Layout | None):
    """Inverse of _flatten; consumes from the front of `leaves`."""
    if layout is None:
        return leaves.pop(0)
    inner = {a: _rebuild(leaves, sub) for a, sub in zip(layout.attrs, layout.inner, strict=True)}
    return layout.kind.__tensor_unflatten__(inner, layout.context, layout.size, layout.stride)


@dataclass(frozen=True)
class SubclassInputs:
    """Which inputs are tensor subclasses and how each flattens into plain tensors."""

    layouts: tuple[_Layout | None, ...]

    @classmethod
    def of(cls, inputs) -> SubclassInputs:
        return cls(tuple(_layout_of(v) for v in inputs))

    @property
    def any(self) -> bool:
        return any(layout is not None for layout in self.layouts)

    def flatten(self, inputs) -> list:
        return [leaf for v, layout in zip(inputs, self.layouts, strict=True) for leaf in _flatten(v, layout)]

    def rebuild(self, flat) -> list:
        leaves = list(flat)
        return [_rebuild(leaves, layout) for layout in self.layouts]

    def check_outputs(self, outputs) -> None:
        if not self.any:
            return
        for value in torch.utils._pytree.tree_leaves(outputs):
            if is_traceable_wrapper_subclass(value):
                raise SubclassOutput(
                    f"the graph returns a {type(value).__name__}, which the canonical graph on local tensors "
                    "cannot return"
                )

    def restore_placeholders(self, graph: torch.fx.Graph, inputs) -> None:
        """Give `graph` (traced on the flattened inputs) one placeholder per original input again, each
        subclass input read into its inner tensors by `getattr` nodes that take the old placeholders' place."""
        if not self.any:
            return
        placeholders = list(graph.find_nodes(op="placeholder"))
        body = next(n for n in graph.nodes if n.op != "placeholder")
        position = 0
        for value, layout in zip(inputs, self.layouts, strict=True):
            count = 1 if layout is None else layout.leaves()
            own, position = placeholders[position : position + count], position + count
            if layout is None:
                continue
            with graph.inserting_before(own[0]):
                outer = graph.placeholder(own[0].name.rsplit("_", 1)[0])
            outer.meta["val"] = value
            with graph.inserting_before(body):
                _read_inner(graph, outer, layout, iter(own))


def _read_inner(graph: torch.fx.Graph, outer: torch.fx.Node, layout: _Layout, leaves) -> None:
    """getattr nodes for `outer`'s inner tensors, replacing the placeholders the trace gave them."""
    for attr, sub in zip(layout.attrs, layout.inner, strict=True):
        read = graph.call_function(getattr, (outer, attr))
        if sub is not None:
            read.meta["val"] = getattr(outer.meta["val"], attr)
            _read_inner(graph, read, sub, leaves)
            continue
        leaf = next(leaves)
        read.meta.update(leaf.meta)
        leaf.replace_all_uses_with(read)
        graph.erase_node(leaf)
