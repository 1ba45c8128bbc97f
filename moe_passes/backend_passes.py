"""The hpu_moe backend's passes, in the order `backend.DEFAULT_PASSES` runs them.

    canonicalize         dynamo graph -> canonical ATen IR (ir.py)
    find                 every registered finder reads the graph; matches checked (passes/pipeline.py)
    rewrite              each accepted layer becomes one fused call (passes/rewrite.py)
    verify               (options verify=True) the rewritten graph against the captured one
    fuse routing         softmax -> top-k -> renormalise chains become softmax_topk (passes/routing_fusion.py)
    stack weights        per-expert weight lists taken as stacked inputs, or moved into one storage
                         once the inner backend compiled (weight_stacks.py)
    save activations     training with recompute=False: stacked calls as grouped matmuls whose
                         activations the backward reads (fused_op.saving_forward)
    inner compile        the inner backend compiles the graph (rewritten, or as captured)

Each pass reads and writes a `GraphState`; `pass_manager.PassManager` runs them.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
from torch._dynamo.backends.registry import list_backends, lookup_backend
from torch._subclasses.fake_tensor import DataDependentOutputException

from . import kernels, lowering
from .adapters.hit_expert_loops import switched_settings_for_this_compile
from .fused_op import STACKED_SCHEMAS, saving_forward
from .fx_utils import source_line, val
from .ir import (
    UntraceableConstruct,
    carry_dynamo_metadata,
    differentiable_copies,
    to_canonical_aten,
    views_to_reshapes,
)
from .op_groups import grouped_mm_applies
from .pass_manager import COMPILE, LOWER, BackendPass, GraphState
from .passes import already_fused, routing_fusion
from .passes.matches import RoutingInfo
from .passes.pipeline import Accepted, Found, Rejected, apply, find_layers, layer_name
from .printer import node_lines
from .report import AlreadyFused, Declined, Fused, GraphRecord
from .steps import Steps, count
from .subclass_inputs import SubclassOutput
from .verify import compare_rewrite
from .weight_stacks import Stacking, stack_weights

LAYER_META = "moe_passes_layer"  # on each fused call: the layer the report names it by
log = logging.getLogger("moe_passes.backend")


# ---------------------------------------------------------------------------------------------------
# Rewrite: canonicalize, find, rewrite, verify


class _Rewriting(BackendPass):
    """A pass of the rewrite: constructs of the user's code that the canonical trace cannot follow are
    reported by name (the graph stays as captured); anything else is an internal error."""

    def fallback_reason(self, error: Exception) -> tuple[str, bool] | None:
        if isinstance(error, DataDependentOutputException):  # a construct, not a bug: reported, no warning
            return (
                "the graph reads tensor values as Python numbers (`.item()` / `.tolist()`, here "
                f"{error.func}) that the canonical trace cannot follow; graph left unrewritten"
            ), False
        if isinstance(error, UntraceableConstruct | SubclassOutput):  # the user's construct, named
            return f"graph left unrewritten: {error}", True
        return None


class Canonicalize(_Rewriting):
    name = "canonicalize"

    def run(self, state: GraphState) -> None:
        state.canonical = to_canonical_aten(state.captured, state.example_inputs)
        Steps(state.record).graph("before", state.canonical)
        state.record.already_fused.extend(
            AlreadyFused(layer_name(c.node), c.overload, c.num_experts, c.experts_min, c.experts_max, state.record.index)
            for c in already_fused.find(state.canonical.graph)
        )


class Find(_Rewriting):
    name = "find"

    def applies(self, state: GraphState) -> bool:
        return state.canonical is not None

    def run(self, state: GraphState) -> None:
        found = find_layers(state.canonical.graph, state.options.forms, strict=state.options.strict)
        if state.training:
            _leave_untrainable(found, state.target)
        state.found = found
        state.record.declined.extend(_declined(found, state.canonical, state.record.index))
        if found.internal_errors:
            count("internal_errors", len(found.internal_errors))
            warnings.warn(
                f"hpu_moe: internal error in a finder, its layer left unrewritten: {found.internal_errors[0]}",
                RuntimeWarning,
                stacklevel=2,
            )


def _leave_untrainable(found: Found, target: str) -> None:
    """In a graph that needs gradients, decline the layers whose target overload has no autograd."""
    kept = []
    for accepted in found.accepted:
        why = lowering.why_not_trainable(target, accepted.match.overload)
        if why is None:
            kept.append(accepted)
        else:
            found.rejected.append(Rejected(accepted.layer, accepted.match.form, why))
    found.accepted[:] = kept


class Rewrite(_Rewriting):
    name = "rewrite"

    def applies(self, state: GraphState) -> bool:
        return state.found is not None and bool(state.found.accepted)

    def run(self, state: GraphState) -> None:
        record, found = state.record, state.found
        for accepted, node in zip(found.accepted, apply(state.canonical, found, state.target), strict=True):
            node.meta[LAYER_META] = accepted.layer
            record.fused.append(_fused(accepted, node, state.target, record.index, state.training))
        views_to_reshapes(state.canonical)
        if state.training:
            differentiable_copies(state.canonical)
        carry_dynamo_metadata(state.captured, state.canonical)
        Steps(record).graph("after", state.canonical)
        state.rewritten = state.canonical


class Verify(_Rewriting):
    name = "verify"

    def applies(self, state: GraphState) -> bool:
        return state.options.verify and state.rewritten is not None

    def run(self, state: GraphState) -> None:
        record = state.record
        worst, ok = compare_rewrite(state.captured, state.rewritten, state.example_inputs)
        if ok:
            record.fused[:] = [dataclasses.replace(f, max_error=worst) for f in record.fused]
            return
        why = f"numerical verification failed: max abs error {worst:.3g} exceeds the tolerance for the output dtype"
        record.declined.extend(Declined(f.layer, f.form, why, record.index) for f in record.fused)
        record.fused.clear()
        record.rewritten = None
        state.rewritten = None


# ---------------------------------------------------------------------------------------------------
# Lower the rewritten graph: fuse routing, stack weights


class FuseRouting(BackendPass):
    """The routing chains that feed portable calls become `softmax_topk` calls: with the option
    `fuse_routing` None only where the op's Triton kernel covers the logits, with True every one found."""

    name = "fuse routing"
    phase = LOWER
    what = "fusing the routing"

    def applies(self, state: GraphState) -> bool:
        # softmax_topk has no gradient: in training the routing stays as written, so the router trains.
        return state.target == "portable" and state.options.fuse_routing is not False and not state.training

    def run(self, state: GraphState) -> None:
        graph, record, fuse = state.rewritten, state.record, state.options.fuse_routing
        try:
            chains = [
                chain for chain in routing_fusion.find(graph.graph)
                if fuse or kernels.routing_kernel_applies(val(chain.logits), chain.k, chain.dtype)
            ]
        except Exception as error:  # noqa: BLE001 - the routing runs as written; the MoE rewrite stands
            count("internal_errors")
            warnings.warn(f"hpu_moe: internal error while looking for routing to fuse, routing kept as written: "
                          f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)
            return
        if not chains:
            return
        layers = set()
        for chain in chains:
            layers.update(user.meta.get(LAYER_META) for node in (chain.ids, chain.weights) for user in node.users)
            routing_fusion.rewrite(graph.graph, chain)
        graph.recompile()
        record.fused[:] = [dataclasses.replace(f, routing_fused=f.layer in layers) for f in record.fused]
        count("fused_routing", len(chains))
        log.info("fused %d routing chains into softmax_topk calls", len(chains))


class StackWeights(BackendPass):
    """The portable calls' per-expert weight lists become stacks (weight_stacks.py): taken as stacked
    graph inputs for inner backends that compile any graph of aten ops (not a user's callable that may
    expect the captured inputs), else moved into one storage each after the inner compile."""

    name = "stack weights"
    phase = LOWER
    what = "taking the weight lists as stacked inputs"

    def applies(self, state: GraphState) -> bool:
        # In training the gradients must reach the user's own parameters, not stacks made from them.
        return state.target == "portable" and not state.training

    def run(self, state: GraphState) -> None:
        stacking = stack_weights(state.rewritten, state.example_inputs, takes_stacks(state.options.inner))
        state.inputs = stacking.inputs
        state.wrap_compiled = stacking.wrap
        state.undo.append(stacking.undo)
        state.after_compile.append(lambda: _after_compile(stacking, state.record))
        if stacking.taken is not None:
            _record_stacking(state.record, stacking)
            count("stacked_inputs", len(stacking.taken.plan.groups))
            log.info("the compiled graph takes %d per-expert weight lists as stacks", len(stacking.taken.plan.groups))


class SaveActivations(BackendPass):
    """Training with the option `recompute=False`: each portable call over stacked weights is written as
    its grouped matmuls (fused_op.saving_forward), whose activations the backward reads instead of
    recomputing them: faster, and as much memory as the layer as written."""

    name = "save activations"
    phase = LOWER
    what = "writing the training calls with saved activations"

    def applies(self, state: GraphState) -> bool:
        return state.training and state.target == "portable" and state.options.recompute is False

    def run(self, state: GraphState) -> None:
        graph, saved = state.rewritten, set()
        for node in list(graph.graph.nodes):
            if _grouped_stacked_call(node):
                node.target = saving_forward(node.target._overloadname)
                saved.add(node.meta.get(LAYER_META))
        if saved:
            graph.recompile()
            state.record.fused[:] = [
                dataclasses.replace(f, training_backward="saved activations") if f.layer in saved else f
                for f in state.record.fused
            ]


def _grouped_stacked_call(node: torch.fx.Node) -> bool:
    """A portable call over stacked weights whose inputs the grouped matmuls take (device, dtype, size)."""
    if node.op != "call_function" or getattr(node.target, "_overloadname", None) not in STACKED_SCHEMAS:
        return False
    if node.target._schema.name != "moe_passes::mixture_of_experts":
        return False
    hidden, table = val(node.args[0]), val(node.args[1])
    experts_min, experts_max = node.args[-2], node.args[-1]
    return (isinstance(hidden, torch.Tensor) and isinstance(table, torch.Tensor)
            and grouped_mm_applies(hidden, table, experts_max - experts_min + 1))


def _after_compile(stacking: Stacking, record: GraphRecord) -> None:
    stacking.after_compile()
    _record_restacked(record, stacking.moved_after_compile)


def _record_stacking(record: GraphRecord, stacking: Stacking) -> None:
    _record_restacked(record, {call: len(tensors) for call, tensors in stacking.taken.moved.items()})
    compiled_as = {old.meta.get(LAYER_META): overload_name(new.target) for old, new in stacking.replaced().items()}
    record.fused[:] = [dataclasses.replace(f, compiled_as=compiled_as.get(f.layer)) for f in record.fused]


def takes_stacks(inner) -> bool:
    return inner_name(inner) in ("inductor", "eager", "aot_eager")


# ---------------------------------------------------------------------------------------------------
# Compile (then what lowering left for after the compile)


class InnerCompile(BackendPass):
    name = "inner compile"
    phase = COMPILE
    what = "the inner backend"

    def run(self, state: GraphState) -> None:
        options = state.options
        compiler = _inner_compiler(options.inner)
        if state.rewritten is not None:
            inputs = state.inputs if state.inputs is not None else state.example_inputs
            state.compiled = compile_inner(compiler, options.inner, state.rewritten, inputs, state.mode)
            for step in state.after_compile:
                step()
        else:
            state.compiled = _compile_captured(compiler, state)


REWRITE_PASSES: tuple[BackendPass, ...] = (Canonicalize(), Find(), Rewrite(), Verify())
LOWER_PASSES: tuple[BackendPass, ...] = (FuseRouting(), StackWeights(), SaveActivations(), InnerCompile())
DEFAULT_PASSES: tuple[BackendPass, ...] = REWRITE_PASSES + LOWER_PASSES


# ---------------------------------------------------------------------------------------------------
# Helpers: the inner backend, and the report's entries


def default_inner() -> str:
    """hpu_backend when the Gaudi bridge registered it, else inductor."""
    try:
        return "hpu_backend" if "hpu_backend" in list_backends(exclude_tags=()) else "inductor"
    except TypeError:
        return "hpu_backend" if "hpu_backend" in list_backends() else "inductor"


def inner_name(inner) -> str:
    if inner is None:
        return default_inner()
    return inner if isinstance(inner, str) else getattr(inner, "__name__", type(inner).__name__)


def _inner_compiler(inner):
    if inner is None:
        inner = default_inner()
    return lookup_backend(inner) if isinstance(inner, str) else inner


def compile_inner(compiler, inner, graph, example_inputs, mode):
    """Hand the graph on; `torch.compile(mode=...)` reaches inductor as its config, as it would directly."""
    if mode and mode != "default" and inner_name(inner) == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph, example_inputs, config_patches=list_mode_options(mode))
    return compiler(graph, example_inputs)


def _compile_captured(compiler, state: GraphState):
    """The inner backend on the graph as captured. Where an expert-loop adapter had dynamo keep
    data-dependent values symbolic for this compile (a graph plain dynamo would have split) and the
    inner backend cannot compile that graph, it runs uncompiled rather than failing the user's compile."""
    try:
        return compile_inner(compiler, state.options.inner, state.captured, state.example_inputs, state.mode)
    except Exception as error:  # noqa: BLE001 - re-raised unless this package's setting caused the graph
        switched = switched_settings_for_this_compile()
        if not switched:
            raise
        state.record.fallback = (
            f"the inner backend could not compile the graph captured with {', '.join(switched)} (switched on by "
            f"the expert-loop adapter); it runs uncompiled: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        )
        warnings.warn(f"hpu_moe: {state.record.fallback}", RuntimeWarning, stacklevel=2)
        return state.captured.forward


def _record_restacked(record: GraphRecord, moved: dict) -> None:
    """Report `moved` ({fused call: tensors moved into stacks}) on the layers' entries and counters."""
    if not moved:
        return
    by_layer = {node.meta.get(LAYER_META): tensors for node, tensors in moved.items()}
    record.fused[:] = [
        dataclasses.replace(f, restacked=f.restacked + by_layer.get(f.layer, 0)) for f in record.fused
    ]
    count("restacked_weights", sum(moved.values()))
    log.info("moved %d per-expert weights into stacks for the portable op", sum(moved.values()))


def _declined(found: Found, canonical: torch.fx.GraphModule, graph_index: int) -> list[Declined]:
    """The report's entries for what the pass left as it was, naming nodes as the graph prints them."""
    printed = node_lines(canonical) if found.rejected else {}
    return [
        Declined(r.layer, r.form, r.reason, graph_index, stopped_at=_where(r.stopped_at, printed))
        for r in found.rejected
    ]


def _where(node: torch.fx.Node | None, printed: dict) -> str:
    """A node as the captured graph prints it, with the user source line that produced it."""
    if node is None:
        return ""
    line = printed.get(node, node.name)
    source = source_line(node)
    return f"{line}  [{source}]" if source else line


def _fused(accepted: Accepted, node: torch.fx.Node, target: str, graph_index: int, training: bool) -> Fused:
    match = accepted.match
    return Fused(
        layer=accepted.layer,
        form=match.form,
        num_experts=match.num_experts,
        top_k=match.top_k,
        activation=match.activation,
        overload=overload_name(node.target),
        target=target,
        routing=routing_text(accepted.routing),
        graph=graph_index,
        experts_min=match.experts_min,
        router_experts=match.router_experts or accepted.routing.num_experts,
        ids_checked=_ids_checked_text(match.ids_check),
        training=training,
        training_backward="recompute" if training else None,
    )


def _ids_checked_text(check) -> str | None:
    """"0..7, negative ids wrapped (aten.index)": how a call checks ids no op of the graph bounds."""
    if check is None:
        return None
    wrapped = ", negative ids wrapped" if check.wrap is not None else ""
    return f"{check.low}..{check.high}{wrapped} ({check.read_by})"


def routing_text(info: RoutingInfo) -> str:
    """"softmax_topk, renormalised, fp32 softmax", as the report prints the routing of a fused layer."""
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
    if info.masked:
        parts.append("weights zeroed by a mask")
    return ", ".join(parts)


def overload_name(op: torch._ops.OpOverload) -> str:
    return f"{op._schema.name}.{op._overloadname}"
