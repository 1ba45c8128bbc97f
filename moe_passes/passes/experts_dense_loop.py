"""Dense expert loops: every expert runs on every token and is scaled by its routing weight.

    for e in range(E):  out += MLP_e(x) * c_e          c_e[t] = w[t, j] if ids[t, j] == e else 0

This is the Gaudi static-shape MoE of vllm-hpu-extension (stacked `w13`/`w2` weights, c_e a column of
`zeros(T, E).scatter_(ids, w)`) and the hand-written `nn.ModuleList` loop with dense masks
(`(w * (ids == e)).sum(-1)`). Unrolled by dynamo, it is a tree of `add`s whose leaves are
`mul(MLP_e(x), c_e)`: expert terms (expert_terms.py), read and matched to their experts there; this
module finds the sums of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..fx_utils import backward_slice, is_call, strip_casts
from .expert_terms import ExpertTerm, is_zero_init, match_terms, read_term
from .finder import Candidate, Finder
from .matches import Decline, ExpertsMatch
from .mixtures import dense_gate, dense_reason, masked_reason, masked_selection, over_experts

aten = torch.ops.aten

FORM = "dense_loop"


def _accumulations(graph: torch.fx.Graph, terms: dict[Node, ExpertTerm]) -> list[tuple[Node, list[Node]]]:
    """(root add, its term leaves) for every maximal add-tree whose leaves are terms or zeros."""
    leaves: dict[Node, frozenset | None] = {}
    for node in graph.nodes:
        if node in terms:
            leaves[node] = frozenset([node])
        elif is_call(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1:
            parts = []
            for arg in node.args[:2]:
                if not isinstance(arg, Node):
                    parts = None
                    break
                arg_s = strip_casts(arg)
                if arg_s in leaves and leaves[arg_s] is not None:
                    parts.append(leaves[arg_s])
                elif arg in leaves and leaves[arg] is not None:
                    parts.append(leaves[arg])
                elif is_zero_init(arg):
                    parts.append(frozenset())
                else:
                    parts = None
                    break
            if parts is not None and len(parts) == 2 and parts[0] & parts[1]:
                parts = None  # `out + out`, `y + y`: a term counted twice is no sum of distinct experts
            leaves[node] = frozenset().union(*parts) if parts is not None else None
    order = {n: i for i, n in enumerate(graph.nodes)}
    roots = []
    for node, covered in leaves.items():
        if node in terms or not covered or len(covered) < 2:
            continue
        if any(leaves.get(user) for user in node.users) or any(
            leaves.get(u2) for user in node.users if _passes_through(user) for u2 in user.users
        ):
            continue
        roots.append((node, sorted(covered, key=order.__getitem__)))
    return roots


def _passes_through(node: Node) -> bool:
    return strip_casts(node) is not node


# Nodes that may end one expert's weighted term: `MLP_e(x) * c_e`, or a projection by a weighted input.
TERM_ENDS = (aten.mul.Tensor, aten.mm.default, aten._unsafe_view.default, aten.view.default)


def _candidates(graph: torch.fx.Graph, anchors: list[Node]) -> list[Candidate]:
    """Every maximal sum of expert terms (the roots of add trees) with a routing-weighted member."""
    terms = {node: term for node in anchors if (term := read_term(node)) is not None}
    found = []
    for root, leaves in _accumulations(graph, terms):
        members = [terms[n] for n in leaves]
        if all(t.coefficient is None and t.input_scaled_by is None for t in members):
            continue  # a sum of plain MLPs (e.g. parallel dense MLPs) is not an MoE candidate
        found.append(Candidate(root, Accumulation(root, members, terms)))
    return found


@dataclass(frozen=True)
class Accumulation:
    """A sum of expert terms: its root `add`, its terms in graph order, and every term of the graph."""

    root: Node
    members: list[ExpertTerm]
    terms: dict


def match_accumulation(accumulation: Accumulation) -> ExpertsMatch | Decline:
    """The match for the whole sum, else for the sum without its last addend (a shared expert added
    after the loop, `out + shared(x)` or Qwen2-MoE's `sigmoid(g(x)) * shared(x)`), which then stays
    beside the fused call; else the first decline. An addend weighted by the routing itself (an odd
    routed expert) is never peeled off: that region is declined as a whole.
    """
    root, members, terms = accumulation.root, accumulation.members, accumulation.terms
    result = match_terms(root, members, FORM)
    if isinstance(result, Decline) and _densely_gated(members):
        masked = masked_selection(dense_gate(members[0].coefficient, members[0].term))
        reason = masked_reason(len(members)) if masked is not None else dense_reason(len(members), soft=False)
        return Decline(FORM, reason, root, masked if masked is not None else result.stopped_at)
    if isinstance(result, ExpertsMatch) or not is_call(root, aten.add.Tensor):
        return result
    inner, last = root.args[0], root.args[1]
    if not (isinstance(inner, Node) and isinstance(last, Node)):
        return result
    last = next((t.term for t in members if t.term in (last, strip_casts(last))), None)  # as the add tree read it
    if last is None:
        return result
    rest = [t for t in members if t.term is not last]
    if len(rest) != len(members) - 1 or len(rest) < 2:
        return result
    peeled = match_terms(inner, rest, FORM)
    if not isinstance(peeled, ExpertsMatch):
        return result
    for coefficient in (terms[last].coefficient, *terms[last].more_factors):
        if coefficient is not None and peeled.ids in backward_slice(coefficient, ()):
            return result
    return peeled


def _densely_gated(members: list[ExpertTerm]) -> bool:
    """Every term is weighted by a softmax over the experts that nothing selects from (mixtures.py)."""
    return all(
        t.coefficient is not None and not t.more_factors and t.rows is None
        and over_experts(dense_gate(t.coefficient, t.term), len(members))
        for t in members
    )


FINDER = Finder(
    FORM, TERM_ENDS, _candidates, match_accumulation, priority=30, partial_ranges=True, reads_every_expert=True
)
