"""Reading views, permutes and batched matmuls as one einsum: which axes a result has, which are summed.

`torch.einsum` reaches the ATen graph as unsqueezes, permutes, views and a `bmm`, arranged differently
for every subscript string; a hand-written batched matmul is another arrangement of the same ops. Rather
than match arrangements, the caller names the leaves it expects and labels each of their dims, and
`contraction` follows the ops from the result down to those leaves, carrying the labels:

    out[t, a, o] = sum_i x[t, i] * W[ids][t, a, o, i]         (axes ((t,), (a,), (o,)), summed {i})

An axis is a tuple of labels (a view may merge or split them, row-major); a dim of size 1 carries no
label. Anything else on the way (an add, an activation, a leaf the caller did not name) ends the
reading with None: the result is then not that einsum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..fx_utils import arguments, is_call, val
from .slots import same_size

aten = torch.ops.aten

Axes = tuple[tuple[str, ...], ...]

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
          aten.contiguous.default, aten.alias.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default)
_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)
VIEW_OPS = _VIEWS + _PERMUTES  # what `frontier` and `contraction` read through


@dataclass(frozen=True)
class Contraction:
    """result[axes] = sum over `summed` of the product of `leaves` (each indexed by its labels)."""

    axes: Axes
    summed: frozenset[str]
    leaves: frozenset[Node]


def contraction(node: Node, leaves: dict[Node, tuple], depth: int = 24) -> Contraction | None:
    """The einsum `node` computes from `leaves` ({leaf: per dim, a label, or a tuple of labels for a dim
    that merges several (row-major), or None for a dim of size 1}); None when it is not one."""
    sizes: dict[str, object] = {}
    axes_of: dict[Node, Axes] = {}
    for leaf, labels in leaves.items():
        if len(labels) != len(val(leaf).shape):
            return None
        axes = []
        for label, size in zip(labels, val(leaf).shape, strict=True):
            axis = () if label is None or (isinstance(size, int) and size == 1) else (
                (label,) if isinstance(label, str) else tuple(label)
            )
            if len(axis) == 1:
                sizes[axis[0]] = size
            axes.append(axis)
        axes_of[leaf] = tuple(axes)
    if any(label not in sizes for axes in axes_of.values() for axis in axes for label in axis):
        return None  # a merged dim's labels take their sizes from other leaves
    return _read(node, axes_of, sizes, depth)


def frontier(node: Node, stop=lambda n: False, products: bool = False, depth: int = 24) -> list[Node] | None:
    """The nodes an einsum-shaped chain of views, permutes and matmuls from `node` reads (its leaves);
    a node `stop` accepts is a leaf even when it is a view; `products`: through elementwise products too
    (an einsum whose summed axis has size 1 is a mul)."""
    if depth < 0:
        return None
    if is_call(node, *_VIEWS, *_PERMUTES):
        inputs = node.args[:1]
    elif products and is_call(node, aten.sum.dim_IntList):
        inputs = node.args[:1]
    elif is_call(node, aten.bmm.default, aten.mm.default) or (products and is_call(node, aten.mul.Tensor)):
        inputs = node.args[:2]
        if not all(isinstance(arg, Node) for arg in inputs):
            return [node]
    else:
        return [node]
    parts = [[arg] if stop(arg) else frontier(arg, stop, products, depth - 1) for arg in inputs]
    return None if None in parts else [leaf for part in parts for leaf in part]


def _read(node: object, leaves: dict, sizes: dict, depth: int) -> Contraction | None:
    if not isinstance(node, Node) or depth < 0:
        return None
    if node in leaves:
        return Contraction(leaves[node], frozenset(), frozenset([node]))
    if is_call(node, *_VIEWS):
        inner = _read(node.args[0], leaves, sizes, depth - 1)
        axes = _regroup(inner.axes, list(val(node).shape), sizes) if inner is not None else None
        return Contraction(axes, inner.summed, inner.leaves) if axes is not None else None
    if is_call(node, *_PERMUTES):
        inner = _read(node.args[0], leaves, sizes, depth - 1)
        return Contraction(_permuted(node, inner.axes), inner.summed, inner.leaves) if inner else None
    if is_call(node, aten.bmm.default, aten.mm.default):
        left, right = (_read(arg, leaves, sizes, depth - 1) for arg in node.args[:2])
        return _product(left, right, batched=is_call(node, aten.bmm.default))
    if is_call(node, aten.mul.Tensor):
        left, right = (_read(arg, leaves, sizes, depth - 1) for arg in node.args[:2])
        return _elementwise(left, right)
    if is_call(node, aten.sum.dim_IntList):
        return _summed(node, _read(node.args[0], leaves, sizes, depth - 1))
    return None


def _summed(node: Node, inner: Contraction | None) -> Contraction | None:
    """sum(a, dims, keepdim): the labels of the summed dims join `summed` (a kept dim has none left)."""
    args = arguments(node) or {}
    if inner is None or args.get("dtype") is not None or not args.get("dim"):
        return None
    dims = {d % len(inner.axes) for d in args["dim"]}
    kept = tuple(() if i in dims else axis for i, axis in enumerate(inner.axes) if args.get("keepdim") or i not in dims)
    summed = frozenset(label for i in dims for label in inner.axes[i])
    return Contraction(kept, inner.summed | summed, inner.leaves)


def top_of_views(node: Node) -> Node:
    """The last of the views a single-use chain puts on `node` (where a result is read)."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if not is_call(user, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                       aten.squeeze.dim, aten.permute.default, aten.clone.default):
            break
        node = user
    return node


def _elementwise(left: Contraction | None, right: Contraction | None) -> Contraction | None:
    """a * b of equal rank, each axis equal or broadcast (no labels): nothing summed."""
    if left is None or right is None or left.leaves & right.leaves or len(left.axes) != len(right.axes):
        return None
    if _summed_apart(left, right):
        return None
    axes = []
    for a, b in zip(left.axes, right.axes, strict=True):
        if a and b and a != b:
            return None
        axes.append(a or b)
    return Contraction(tuple(axes), left.summed | right.summed, left.leaves | right.leaves)


def _summed_apart(left: Contraction, right: Contraction) -> bool:
    """A label one operand already summed is one the other also carries: (sum_a y) * (sum_a w) is not
    sum_a y * w, so the product is no single einsum."""
    def labels(c: Contraction) -> set:
        return {label for axis in c.axes for label in (axis or ())} | set(c.summed)

    return bool(left.summed & labels(right) or right.summed & labels(left))


def _permuted(node: Node, axes: Axes) -> Axes:
    if is_call(node, aten.t.default):
        return axes[::-1]
    if is_call(node, aten.transpose.int):
        order = list(range(len(axes)))
        a, b = (d % len(axes) for d in node.args[1:3])
        order[a], order[b] = order[b], order[a]
    else:
        order = [d % len(axes) for d in node.args[1]]
    return tuple(axes[d] for d in order)


def _product(left: Contraction | None, right: Contraction | None, batched: bool) -> Contraction | None:
    """bmm([b, m, n], [b, n, p]) or mm([m, n], [n, p]): n summed, b shared, m and p kept."""
    if left is None or right is None or left.leaves & right.leaves or _summed_apart(left, right):
        return None
    lead = 1 if batched else 0
    if batched and left.axes[0] != right.axes[0]:
        return None
    if left.axes[lead + 1] != right.axes[lead]:
        return None
    kept = left.axes[: lead + 1] + right.axes[lead + 1 :]
    summed = left.summed | right.summed | frozenset(left.axes[lead + 1])
    return Contraction(kept, summed, left.leaves | right.leaves)


def _regroup(axes: Axes, target: list, sizes: dict) -> Axes | None:
    """The labels of `axes`, in row-major order, grouped into the target's dims (None when a label
    would have to be split, or a size cannot be proved to match)."""
    labels = [label for axis in axes for label in axis]
    grouped, position = [], 0
    for size in target:
        if isinstance(size, int) and size == 1:
            grouped.append(())
            continue
        group, product = [], 1
        while position < len(labels) and not (group and same_size(product, size)):
            group.append(labels[position])
            product = product * sizes[labels[position]]
            position += 1
        if not group or not same_size(product, size):
            return None
        grouped.append(tuple(group))
    return tuple(grouped) if position == len(labels) else None
