"""The MoE fusion pass: run every finder, check each match, rewrite, clean up.

Finders are independent (one module per expert form). Checks that hold for every form (nothing
inside the region is used outside it, the router's width agrees with the experts held, token counts
line up) live here once. Every candidate ends as a `Fused` or a `Declined` entry.
"""

from __future__ import annotations

import logging
import re

import torch
from torch.fx import GraphModule, Node

from ..fx_utils import backward_slice, const_int, dtype, escaping_users, shape, source_line, strip_casts
from ..printer import node_lines
from ..report import Declined, Fused
from . import (
    experts_batched_mm,
    experts_dense_bmm,
    experts_dense_loop,
    experts_grouped_mm,
    experts_segments,
    experts_sparse_loop,
    routing,
)
from .matches import Decline, ExpertsMatch
from .rewrite import rewrite_experts

log = logging.getLogger(__name__)

FINDERS = (
    experts_grouped_mm.find,
    experts_batched_mm.find,
    experts_dense_loop.find,
    experts_sparse_loop.find,
    experts_dense_bmm.find,
    experts_segments.find,
)

# Forms whose finders verify which expert of the router each term is (probes), so that a region may
# hold a contiguous range of the router's experts (expert parallelism).
PARTIAL_RANGE_FORMS = (experts_dense_loop.FORM, experts_sparse_loop.FORM)

# Runtime checks dynamo records on data-dependent sizes (e.g. the row counts `nonzero` yields in a
# sparse expert loop). They have no users, so they keep the values they check alive after a rewrite.
ASSERTION_OPS = (
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
)


def layer_name(node: Node | None) -> str:
    """The module path a node came from (dynamo's nn_module_stack), e.g. "model.layers.0.mlp.experts"."""
    if node is None:
        return "<graph>"
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path, module_type = list(stack.values())[-1][:2]
    return _module_path(path) or getattr(module_type, "__name__", str(module_type))


def _module_path(source: str) -> str:
    """"model.layers.0.mlp" from dynamo's source names of any torch version:
    `L['self'].model.layers[0].mlp`, `L['self']._modules['model']._modules['layers']._modules['0']`, ..."""
    path = re.sub(r"^L\['(?:self|fn|mod)'\]", "", source)
    path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return ".".join(part for part in path.split(".") if part)


def _layer_of(match: ExpertsMatch) -> str:
    """Name the MoE block: the common module path of the region's output and the routing ids."""
    out, ids = layer_name(match.output).split("."), layer_name(match.ids).split(".")
    common = []
    for a, b in zip(out, ids, strict=False):
        if a != b:
            break
        common.append(a)
    return ".".join(common) if len(common) > 1 else layer_name(match.output)


def _is_size_value(node: Node) -> bool:
    """A symbolic size (or other scalar) or a runtime check on one: not a tensor at all."""
    return isinstance(
        node.meta.get("val"), int | float | bool | torch.SymInt | torch.SymFloat | torch.SymBool
    ) or (node.op == "call_function" and node.target in ASSERTION_OPS)


def read_only_for_sizes(graph: torch.fx.Graph) -> set[Node]:
    """Size values, and tensors whose every use is one (a slice cut at data-dependent offsets whose row
    count dynamo asserts on; an offset read only to check its range). One pass from the graph's end."""
    found: set[Node] = set()
    for node in reversed(graph.nodes):
        if _is_size_value(node) or (node.op == "call_function" and node.users and node.users.keys() <= found):
            found.add(node)
    return found


def region_of(match: ExpertsMatch) -> set[Node]:
    """The nodes the fused call replaces: everything between the region's inputs and its output."""
    boundary = {match.hidden, match.ids, match.weights, *match.weight_nodes()}
    # Views and casts of the region's inputs are aliases of those inputs, and symbolic size
    # arithmetic is not a tensor at all: both are free to be shared with the rest of the graph.
    return {
        n for n in backward_slice(match.output, boundary) if strip_casts(n) not in boundary and not _is_size_value(n)
    }


def check(match: ExpertsMatch) -> str | None:
    """A reason to decline a structurally matched region, or None when it is safe to rewrite."""
    region = region_of(match)
    sizes = read_only_for_sizes(match.output.graph)
    # A size read off a region tensor (and the runtime checks on it) is not a use of its values.
    escapes = [(a, b) for a, b in escaping_users(region, match.output) if b not in sizes]
    if escapes:
        inside, outside = escapes[0]
        return f"an intermediate value of the expert region escapes it ({inside.name} is also used by {outside.name})"
    info = routing.describe(match.ids, match.weights)
    if info.num_experts is not None and info.num_experts != match.num_experts:
        # Loops were checked expert by expert against the router's width (probes): they may hold a
        # contiguous part of its experts. The GEMM forms index their stacks with the ids themselves.
        partial = match.form in PARTIAL_RANGE_FORMS and match.experts_max < info.num_experts
        if not partial:
            return (
                f"the router scores {info.num_experts} experts but the region holds experts "
                f"{match.experts_min}..{match.experts_max}"
            )
    if match.assumes_ids_in_range and info.num_experts != match.num_experts:
        return (
            "the experts clamp or mask ids outside 0..E-1 (expert-parallel sentinels), and the routing does "
            "not show that every id is one of the experts held (top-k over exactly E router columns)"
        )
    # Sizes are read through their hints (const_int): int() on a SymInt would add a guard and make
    # dynamo recompile for every new token count.
    hidden, ids = shape(match.hidden), shape(match.ids)
    tokens = 1
    for size in hidden[:-1]:
        tokens = tokens * const_int(size) if tokens is not None and const_int(size) is not None else None
    if tokens is not None and len(ids) == 2 and const_int(ids[0]) not in (None, tokens):
        return "the hidden states and the routing table hold different numbers of tokens"
    if match.top_k > (info.num_experts or match.num_experts):
        return "top-k exceeds the number of experts"
    return None


def _routing_text(match: ExpertsMatch) -> str:
    info = routing.describe(match.ids, match.weights)
    if info.kind == "opaque":
        return "opaque (ids and weights used as produced)"
    parts = [info.kind]
    if info.bias_corrected:
        parts.append("bias-corrected")
    if info.grouped:
        parts.append("grouped")
    if info.kind in ("softmax_topk", "sigmoid_topk"):
        parts.append("renormalised" if info.renormalized else "not renormalised")
    if info.softmax_fp32:
        parts.append("fp32 softmax")
    if info.scale is not None:
        parts.append(f"scaled x{info.scale:g}")
    return ", ".join(parts)


def rounding_needed(match: ExpertsMatch) -> str | None:
    """What the rewrite rounds that the model keeps wider, or None when the call is exact in dtypes.

    The kernel takes router weights in the hidden dtype and returns the hidden dtype: float32 router
    weights (or a float32 combine) under bfloat16 experts are rounded. The default mode tolerates
    this (the outputs agree within the dtype's tolerance); strict mode declines it.
    """
    hidden = dtype(match.hidden)
    if hidden is None:
        return None
    region = region_of(match)
    wide = [d for d in _dtypes_used_at(match.weights, region) if torch.promote_types(d, hidden) != hidden]
    what = "router weights"
    if not wide and dtype(match.output) is not None and torch.promote_types(dtype(match.output), hidden) != hidden:
        wide, what = [dtype(match.output)], "combined expert output"
    if not wide:
        return None
    return (
        f"strict: the {what} are used in {str(wide[0]).removeprefix('torch.')} and the fused kernel "
        f"takes them in {str(hidden).removeprefix('torch.')} (a rounding the default mode tolerates)"
    )


def _dtypes_used_at(node: Node, region: set[Node]) -> set[torch.dtype]:
    """The dtypes in which the region computes with `node`'s values (after the casts the model made)."""
    used, stack, seen = set(), [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if strip_casts(user) is not user:  # a cast or a view (an alias of the input): follow it
                stack.append(user)
            elif user in region and dtype(current) is not None:
                used.add(dtype(current))
    return used


def fuse_moe(
    gm: GraphModule, target: str, graph_index: int = 0, strict: bool = False
) -> tuple[list[Fused], list[Declined]]:
    """Rewrite every MoE region of `gm` in place; returns what was fused and what was declined.

    strict: also decline matches whose rewrite needs a rounding (`rounding_needed`).
    """
    fused: list[Fused] = []
    declined: list[Declined] = []
    seen_outputs: set[Node] = set()
    replaced: set[Node] = set()
    candidates = [c for find in FINDERS for c in find(gm.graph)]
    matches = [c for c in candidates if isinstance(c, ExpertsMatch)]
    matched_anchors = {m.output for m in matches} | {a for m in matches for a in m.output.all_input_nodes}
    # Declines point at a node as the captured graph prints it: name the nodes before any rewrite.
    printed = node_lines(gm) if candidates else {}
    for candidate in candidates:
        if isinstance(candidate, Decline):
            if candidate.anchor in matched_anchors:
                continue  # another finder matched this region
            stopped = candidate.stopped_at or candidate.anchor
            declined.append(
                Declined(
                    layer_name(candidate.anchor),
                    candidate.form,
                    candidate.reason,
                    graph_index,
                    stopped_at=_where(stopped, printed),
                )
            )
            continue
        if candidate.output in seen_outputs:
            continue
        seen_outputs.add(candidate.output)
        reason = check(candidate)
        if reason is None and strict:
            reason = rounding_needed(candidate)
        name = _layer_of(candidate)
        if reason is not None:
            declined.append(
                Declined(
                    name, candidate.form, reason, graph_index, stopped_at=_where(candidate.output, printed)
                )
            )
            continue
        replaced |= region_of(candidate)
        node = rewrite_experts(gm.graph, candidate, target)
        fused.append(
            Fused(
                layer=name,
                form=candidate.form,
                num_experts=candidate.num_experts,
                top_k=candidate.top_k,
                activation=candidate.activation,
                overload=f"{node.target._schema.name}.{node.target._overloadname}",
                target=target,
                routing=_routing_text(candidate),
                graph=graph_index,
                experts_min=candidate.experts_min,
                router_experts=routing.describe(candidate.ids, candidate.weights).num_experts,
            )
        )
        log.debug("fused %s (%s) into %s", name, candidate.form, node.target)
    if fused:
        gm.graph.eliminate_dead_code()
        if _drop_size_assertions_on(gm.graph, replaced):
            gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return fused, declined


def _where(node: Node | None, printed: dict[Node, str]) -> str:
    """A node as the captured graph prints it, with the user source line that produced it."""
    if node is None:
        return ""
    line = printed.get(node, node.name)
    source = source_line(node)
    return f"{line}  [{source}]" if source else line


def _drop_size_assertions_on(graph: torch.fx.Graph, replaced: set[Node]) -> int:
    """Erase runtime size checks that only concern tensors of rewritten regions; returns how many.

    After dead-code elimination such a tensor (a sparse loop's `nonzero`) is still alive only because
    an assertion on its size reads it; the fused call no longer needs that size, so neither the check
    nor the tensor (and its host sync) should stay.
    """
    dropped = 0
    sizes = read_only_for_sizes(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in ASSERTION_OPS:
            continue
        sources, stack, seen = set(), list(node.all_input_nodes), set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if _is_size_value(current) or (current in sizes and current not in replaced):
                stack.extend(current.all_input_nodes)  # through sizes, and tensors only checked
            else:
                sources.add(current)
        if (
            sources
            and sources <= replaced
            and all(all(user in sizes for user in source.users) for source in sources)
        ):
            graph.erase_node(node)
            dropped += 1
    return dropped
