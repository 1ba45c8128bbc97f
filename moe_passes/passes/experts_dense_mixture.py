"""Dense and soft mixtures: experts weighted by a softmax over all of them, never selected.

    torch.stack([expert(x) for expert in experts], 1) weighted by softmax(gate(x))     MMoE
    experts(slots(softmax(logits))) mixed back by softmax(logits)                       Soft MoE
    out = out + softmax(gate(x))[:, e:e+1] * expert_e(x)                                a loop of any MLP

No MoE kernel can run these exactly (mixtures.py says why); this finder only declines, so that the
report names the construct instead of finding nothing. It never matches. Sums of gated-MLP terms are
the dense-loop finder's, which gives the same reason; this one reads the sums of other experts.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from ..fx_utils import is_call, strip_casts
from .expert_terms import is_zero_init, read_term
from .finder import Candidate, Finder
from .matches import Decline
from .mixtures import dense_gate, dense_reason, expert_bank, over_experts, read_dense_mixture

aten = torch.ops.aten
FORM = "dense_mixture"


def _weighted_leaves(root: Node) -> list[tuple[Node, Node, Node]] | None:
    """(expert output, gate weight, product) for each product the add tree at `root` sums; None when a
    leaf is not a zero start or a product of an output and a dense gate's weight (either order)."""
    products, stack = [], [root]
    while stack:
        node = strip_casts(stack.pop())
        if is_call(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1 and len(node.args) == 2:
            stack.extend(node.args)
        elif is_call(node, aten.mul.Tensor) and all(isinstance(a, Node) for a in node.args):
            products.append(node)
        elif not (isinstance(node, Node) and is_zero_init(node)):
            return None
    found = []
    for product in products:
        a, b = product.args
        orders = [(out, w) for out, w in ((a, b), (b, a)) if dense_gate(w, product) and not dense_gate(out, product)]
        if len(orders) != 1:
            return None
        found.append((*orders[0], product))
    return found


def _candidates(graph: torch.fx.Graph, anchors: list[Node]) -> list[Candidate]:
    found = []
    for node in anchors:
        if is_call(node, aten.stack.default, aten.cat.default):
            if isinstance(node.args[0], list | tuple) and len(node.args[0]) >= 2:
                found.append(Candidate(node, ("merged", node)))
        elif not any(is_call(user, aten.add.Tensor) for user in node.users):  # the root of an add tree
            found.append(Candidate(node, ("summed", node)))
    return found


def _read(payload: tuple[str, Node]) -> Decline | None:
    kind, node = payload
    if kind == "merged":
        found = read_dense_mixture([a for a in node.args[0] if isinstance(a, Node)], node)
        return None if found is None else Decline(FORM, found[0], found[1], node)
    leaves = _weighted_leaves(node)
    if not leaves or len(leaves) < 2 or all(read_term(product) is not None for _, _, product in leaves):
        return None  # not a sum of products, or the dense-loop finder's to read
    if expert_bank([output for output, _, _ in leaves]) is None:
        return None
    if not all(over_experts(dense_gate(weight, product), len(leaves)) for _, weight, product in leaves):
        return None
    return Decline(FORM, dense_reason(len(leaves), soft=False), node)


FINDER = Finder(
    FORM, (aten.stack.default, aten.cat.default, aten.add.Tensor), _candidates, _read, priority=100
)
