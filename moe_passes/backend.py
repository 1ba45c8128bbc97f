"""The `hpu_moe` torch.compile backend.

    dynamo graph -> canonical ATen IR -> MoE fusion pass -> (verify) -> inner backend

The rewrite is for inference: a graph that may need gradients goes to the inner backend as captured.
Anything that fails inside the passes also sends the captured graph on unchanged, with a warning, so
the user's compile never breaks because of this package.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
from torch._dynamo.backends.registry import list_backends, lookup_backend
from torch._subclasses.fake_tensor import DataDependentOutputException

from . import kernels, lowering
from .adapters import prepare
from .adapters.base import BACKEND_MARK
from .adapters.hit_expert_loops import switched_settings_for_this_compile
from .fx_utils import source_line, val
from .ir import UntraceableConstruct, carry_dynamo_metadata, to_canonical_aten, views_to_reshapes
from .options import Options
from .passes import already_fused, routing_fusion
from .passes.matches import RoutingInfo
from .passes.pipeline import Accepted, Found, apply, find_layers, layer_name
from .printer import format_graph, node_lines
from .report import AlreadyFused, Declined, Fused, GraphRecord, next_graph_index, publish
from .restack import restack_weight_lists
from .stacked_inputs import Taken, find_list_calls, take_stacks, with_stacked_inputs
from .stacks import unstack
from .steps import Steps, count, keep_graph_texts, trace_artifact
from .subclass_inputs import SubclassOutput
from .verify import compare_rewrite

LAYER_META = "moe_passes_layer"  # on each fused call: the layer the report names it by
log = logging.getLogger(__name__)


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


def _needs_grad(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def rewrite_graph(
    gm: torch.fx.GraphModule, example_inputs, options: Options, target: str, record: GraphRecord
):
    """The canonical graph with every fusable MoE layer rewritten, or None to keep `gm` as captured."""
    steps = Steps(record)
    with steps.step("canonicalize"):
        canonical = to_canonical_aten(gm, example_inputs)
    steps.graph("before", canonical)
    record.already_fused.extend(
        AlreadyFused(layer_name(c.node), c.overload, c.num_experts, c.experts_min, c.experts_max, record.index)
        for c in already_fused.find(canonical.graph)
    )
    with steps.step("find"):
        found = find_layers(canonical.graph, options.forms, strict=options.strict)
    record.declined.extend(_declined(found, canonical, record.index))
    if found.internal_errors:
        count("internal_errors", len(found.internal_errors))
        warnings.warn(
            f"hpu_moe: internal error in a finder, its layer left unrewritten: {found.internal_errors[0]}",
            RuntimeWarning,
            stacklevel=3,
        )
    if not found.accepted:
        return None
    with steps.step("rewrite"):
        nodes = apply(canonical, found, target)
    fused = [_fused(a, node, target, record.index) for a, node in zip(found.accepted, nodes, strict=True)]
    for accepted, node in zip(found.accepted, nodes, strict=True):
        node.meta[LAYER_META] = accepted.layer
    if options.verify:
        with steps.step("verify"):
            worst, ok = compare_rewrite(gm, canonical, example_inputs)
        if not ok:
            record.declined.extend(
                Declined(
                    f.layer,
                    f.form,
                    f"numerical verification failed: max abs error {worst:.3g} exceeds the tolerance "
                    "for the output dtype",
                    record.index,
                )
                for f in fused
            )
            return None
        fused = [dataclasses.replace(f, max_error=worst) for f in fused]
    record.fused.extend(fused)
    views_to_reshapes(canonical)
    carry_dynamo_metadata(gm, canonical)
    steps.graph("after", canonical)
    return canonical


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


def _fused(accepted: Accepted, node: torch.fx.Node, target: str, graph_index: int) -> Fused:
    match = accepted.match
    return Fused(
        layer=accepted.layer,
        form=match.form,
        num_experts=match.num_experts,
        top_k=match.top_k,
        activation=match.activation,
        overload=_overload_name(node.target),
        target=target,
        routing=routing_text(accepted.routing),
        graph=graph_index,
        experts_min=match.experts_min,
        router_experts=match.router_experts or accepted.routing.num_experts,
        ids_checked=_ids_checked_text(match.ids_check),
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


def _compile_id() -> str | None:
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - another torch's internals: the id is only for the report
        return None
    return None if compile_id is None else str(compile_id)


def hpu_moe(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None):
    """torch.compile backend: fuse MoE layers into one `mixture_of_experts` call each, then compile."""
    opts = Options.parse(options)
    prepare()  # again after a dynamo reset(), and for classes defined since: for the next frames
    target = lowering.resolve_target(opts.target)
    compiler = _inner_compiler(opts.inner)
    record = GraphRecord(index=next_graph_index(), compile_id=_compile_id())
    graph = gm
    if not opts.enabled:
        record.fallback = "disabled by options"
    elif _needs_grad(example_inputs):
        record.fallback = (
            "gradients are enabled and inputs require grad; the rewrite is inference-only "
            "(run under torch.no_grad() or torch.inference_mode())"
        )
    else:
        try:
            rewritten = rewrite_graph(gm, example_inputs, opts, target, record)
            if rewritten is not None:
                graph = rewritten
        except DataDependentOutputException as error:  # a construct, not a bug: reported, no warning
            record.fallback = (
                "the graph reads tensor values as Python numbers (`.item()` / `.tolist()`, here "
                f"{error.func}) that the canonical trace cannot follow; graph left unrewritten"
            )
        except (UntraceableConstruct, SubclassOutput) as error:  # the user's construct, named
            record.fallback = f"graph left unrewritten: {error}"
            warnings.warn(f"hpu_moe: {record.fallback}", RuntimeWarning, stacklevel=2)
        except Exception as error:  # noqa: BLE001 - never break the user's compile
            record.fallback = f"internal error, graph left unrewritten: {type(error).__name__}: {error}"
            warnings.warn(f"hpu_moe: {record.fallback}", RuntimeWarning, stacklevel=2)
            log.warning("hpu_moe fell back to the captured graph", exc_info=True)
    if record.captured is None and keep_graph_texts():
        record.captured = format_graph(gm)  # not rewritten: the graph as dynamo captured it
    publish(record)
    count("fused", len(record.fused))
    count("declined", len(record.declined))
    count("fallbacks", record.fallback is not None)
    trace_artifact(
        f"moe_passes_graph_{record.index}_decisions", lambda: dataclasses.asdict(record), encoding="json"
    )
    for f in record.fused:
        log.info(
            "fused %s (%s, %d experts, top-%d) -> %s", f.layer, f.form, f.num_experts, f.top_k, f.overload
        )
    for d in record.declined:
        log.info("declined %s (%s): %s", d.candidate, d.form, d.reason)
    if graph is gm:
        with Steps(record).step("inner compile"):
            return _compile_captured(compiler, opts.inner, gm, example_inputs, mode, record)
    taken, stage = None, "taking the weight lists as stacked inputs"
    try:
        inputs = example_inputs
        if target == "portable":
            stage = "fusing the routing"
            _fuse_routing(graph, opts.fuse_routing, record)
            stage = "taking the weight lists as stacked inputs"
        if target == "portable" and _takes_stacks(opts.inner):
            taken = _take_stacks(graph, example_inputs, record)
            if taken is not None:
                inputs = taken.inputs
        stage = "the inner backend"
        with Steps(record).step("inner compile"):
            compiled = _compile_inner(compiler, opts.inner, graph, inputs, mode)
        if target == "portable":
            _restack(graph, inputs, record)
        return compiled if taken is None else with_stacked_inputs(compiled, taken.plan)
    except Exception as error:  # noqa: BLE001 - the captured graph still compiles: never break the user
        if taken is not None:  # what this compile moved is laid out as dynamo recorded it again
            unstack([t for tensors in taken.moved.values() for t in tensors])
        why = f"{stage} failed on the rewritten graph"
        record.fallback = (
            f"{why}, compiled the captured one instead: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        )
        record.declined.extend(Declined(f.layer, f.form, why, record.index) for f in record.fused)
        record.fused.clear()
        record.rewritten = None
        warnings.warn(f"hpu_moe: {record.fallback}", RuntimeWarning, stacklevel=2)
        return _compile_inner(compiler, opts.inner, gm, example_inputs, mode)


setattr(hpu_moe, BACKEND_MARK, hpu_moe)


def _restack(graph: torch.fx.GraphModule, example_inputs, record: GraphRecord) -> None:
    """Move the portable calls' per-expert weights in separate allocations into stacks (restack.py).

    After the inner compile: the compilers have read the inputs' layouts (storage offsets included)
    as dynamo recorded them, and the move changes only where the data lives, not shapes or values.
    """
    _record_restacked(record, restack_weight_lists(graph.graph, example_inputs))


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


def _fuse_routing(graph: torch.fx.GraphModule, fuse: bool | None, record: GraphRecord) -> None:
    """The routing chains that feed portable calls become `softmax_topk` calls (passes/routing_fusion.py):
    with `fuse` None only where the op's Triton kernel covers the logits, with True every one found."""
    if fuse is False:
        return
    try:
        chains = [
            chain for chain in routing_fusion.find(graph.graph)
            if fuse or kernels.routing_kernel_applies(val(chain.logits), chain.k, chain.dtype)
        ]
    except Exception as error:  # noqa: BLE001 - the routing runs as written; the MoE rewrite stands
        count("internal_errors")
        warnings.warn(f"hpu_moe: internal error while looking for routing to fuse, routing kept as written: "
                      f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)
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


def _takes_stacks(inner) -> bool:
    """Whether the inner backend may be handed the graph with weight lists taken as stacks
    (stacked_inputs.py): those that compile any graph of aten ops, not a user's callable that may
    expect the captured inputs."""
    return inner_name(inner) in ("inductor", "eager", "aot_eager")


def _take_stacks(graph: torch.fx.GraphModule, example_inputs, record: GraphRecord) -> Taken | None:
    """Let the graph take the portable calls' per-expert weight lists as stacks (stacked_inputs.py)."""
    taken = take_stacks(graph, example_inputs, find_list_calls(graph, example_inputs))
    if taken is None:
        return None
    _record_restacked(record, {call: len(tensors) for call, tensors in taken.moved.items()})
    compiled_as = {old.meta.get(LAYER_META): _overload_name(new.target) for old, new in taken.replaced.items()}
    record.fused[:] = [dataclasses.replace(f, compiled_as=compiled_as.get(f.layer)) for f in record.fused]
    count("stacked_inputs", len(taken.plan.groups))
    log.info("the compiled graph takes %d per-expert weight lists as stacks", len(taken.plan.groups))
    return taken


def _overload_name(op: torch._ops.OpOverload) -> str:
    return f"{op._schema.name}.{op._overloadname}"


def _compile_captured(compiler, inner, gm, example_inputs, mode, record: GraphRecord):
    """The inner backend on the graph as captured. Where an expert-loop adapter had dynamo keep
    data-dependent values symbolic for this compile (a graph plain dynamo would have split) and the
    inner backend cannot compile that graph, it runs uncompiled rather than failing the user's compile."""
    try:
        return _compile_inner(compiler, inner, gm, example_inputs, mode)
    except Exception as error:  # noqa: BLE001 - re-raised unless this package's setting caused the graph
        switched = switched_settings_for_this_compile()
        if not switched:
            raise
        record.fallback = (
            f"the inner backend could not compile the graph captured with {', '.join(switched)} (switched on by "
            f"the expert-loop adapter); it runs uncompiled: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}"
        )
        warnings.warn(f"hpu_moe: {record.fallback}", RuntimeWarning, stacklevel=2)
        return gm.forward


def _compile_inner(compiler, inner, graph, example_inputs, mode):
    """Hand the graph on; `torch.compile(mode=...)` reaches inductor as its config, as it would directly."""
    if mode and mode != "default" and inner_name(inner) == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph, example_inputs, config_patches=list_mode_options(mode))
    return compiler(graph, example_inputs)
