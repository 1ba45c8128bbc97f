"""Every expert module on every token, their outputs stacked, then weighted by a routing table or picked.

    y   = torch.stack([expert(x) for expert in self.experts], dim=1)              [T, E, H]
    out = (y * table[..., None]).sum(1)                                           table[t, e]: e's weight
    out = (y.gather(1, ids[..., None].expand(-1, -1, H)) * w[..., None]).sum(1)   or y[arange(T)[:, None], ids]

(Hand-written MoE blocks and tutorials.) Each stacked output is read as one expert's MLP (expert_terms),
and the combine says with which per-token weight it counts: column e of the table, or, for a pick,
sum_j w[:, j] * (ids[:, j] == e), which is the kernel's sum as written. That weight is written into the
graph as a few index ops while the layer is read, so that the probes check it from the ids and weights as
they check a dense loop's `(w * (ids == e)).sum(-1)`, and taken out again before the match is returned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch._guards import detect_fake_mode
from torch.fx import Node

from ..fx_utils import Emitter, is_call, is_cast, shape, val
from .combines import picked_outputs, table_labels
from .expert_terms import match_terms, reads_as_mlp, weighted_output
from .finder import Candidate, Finder
from .matches import Decline, ExpertsMatch
from .slots import same_shape

aten = torch.ops.aten

FORM = "stacked_outputs"


@dataclass(frozen=True)
class StackedCombine:
    """A combine of stacked expert outputs: `outputs` (one per expert, in stack order) and how they are
    weighted: a [T, E] `table`, or `ids` and `weights` ([T, k]) for a pick."""

    root: Node
    outputs: tuple[Node, ...]
    table: Node | None = None
    ids: Node | None = None
    weights: Node | None = None


def _below_casts(node: Node) -> Node:
    """The tensor `node` casts (dtype conversions only: a view would move the dims the combine reads)."""
    while is_cast(node):
        node = node.args[0]
    return node


def _stacked(node: Node, expert_dim: int) -> tuple[Node, ...] | None:
    """The stacked tensors when `node` is `torch.stack(outputs, expert_dim)` of [T, H] outputs."""
    node = _below_casts(node)
    if not is_call(node, aten.stack.default):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    outputs = tuple(node.args[0])
    if dim % 3 != expert_dim or len(outputs) < 2 or any(len(shape(o) or ()) != 2 for o in outputs):
        return None
    return outputs


def _unsqueezed_last(node: Node) -> Node | None:
    """x for `x[..., None]` / `x.unsqueeze(-1)` (through casts) of a 2-D x."""
    node = _below_casts(node)
    if is_call(node, aten.unsqueeze.default) and node.args[1] % 3 == 2:
        return node.args[0]
    return None


def _read_combine(root: Node) -> StackedCombine | None:
    """`sum(stacked * table[..., None], 1)` or `sum(pick(stacked, ids) * w[..., None], 1)`, else None."""
    if not is_call(root, aten.sum.dim_IntList) or len(root.args) < 2 or list(root.args[1]) not in ([1], [-2]):
        return None
    if (root.args[2] if len(root.args) > 2 else root.kwargs.get("keepdim", False)) or len(shape(root) or ()) != 2:
        return None
    product = _below_casts(root.args[0])
    if not is_call(product, aten.mul.Tensor) or not all(isinstance(a, Node) for a in product.args[:2]):
        return None
    for a, b in (product.args[:2], product.args[1::-1]):
        picked = picked_outputs(_below_casts(a))
        if picked is not None and picked[2] == ("t", "e", "o"):
            outputs = _stacked(picked[0], 1)
            weights = _unsqueezed_last(b)
            ids = picked[1]
            if outputs is not None and weights is not None and same_shape(shape(weights), shape(ids)):
                return StackedCombine(root, outputs, ids=ids, weights=weights)
        outputs = _stacked(a, 1)
        labelled = table_labels(b)
        if outputs is not None and labelled is not None and labelled[1] == ("t", "e", None):
            return StackedCombine(root, outputs, table=labelled[0])
    return None


def _candidates(_graph: torch.fx.Graph, anchors: list[Node]) -> list[Candidate]:
    return [Candidate(node, combine) for node in anchors if (combine := _read_combine(node)) is not None]


def match_combine(combine: StackedCombine) -> ExpertsMatch | Decline | None:
    """The match for the stacked experts, read with their per-token weights written into the graph for
    the probes, and those nodes taken out again."""
    if not all(reads_as_mlp(output) for output in combine.outputs):
        return None  # not a stack of MLP outputs: some other stack
    graph = combine.root.graph
    emit = Emitter(graph, detect_fake_mode([val(combine.root)]))
    added: list[Node] = []

    def call(target, *args) -> Node:
        added.append(emit.call(target, args))
        return added[-1]

    try:
        with graph.inserting_before(combine.root):
            coefficients = []
            for e in range(len(combine.outputs)):
                if combine.table is not None:
                    coefficients.append(call(aten.unsqueeze.default, call(aten.select.int, combine.table, 1, e), -1))
                else:
                    chose = call(aten.eq.Scalar, combine.ids, e)
                    coefficients.append(
                        call(aten.sum.dim_IntList, call(aten.mul.Tensor, combine.weights, chose), [-1], True))
        terms = [weighted_output(output, c) for output, c in zip(combine.outputs, coefficients, strict=True)]
        result = match_terms(combine.root, terms, FORM)
    finally:
        for node in reversed(added):
            graph.erase_node(node)
    if isinstance(result, Decline) and result.stopped_at in added:
        return Decline(FORM, result.reason, combine.root, None)
    if isinstance(result, ExpertsMatch) and combine.ids is not None:
        return replace(result, picks_routed=True)  # only the routed experts' outputs are read
    return result


FINDER = Finder(FORM, (aten.sum.dim_IntList,), _candidates, match_combine, priority=31, partial_ranges=False,
                reads_every_expert=True)
