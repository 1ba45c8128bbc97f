"""`moe_passes.explain`: compile and run once, then say what the backend did."""

from __future__ import annotations

import functools

import torch
from torch._dynamo.utils import counters

from .adapters import adapt, install_discovery_hook
from .backend import hpu_moe, inner_name
from .lowering import resolve_target
from .options import Options
from .report import Report, collecting


def explain(model_or_fn, *args, options: dict | None = None, **kwargs) -> Report:
    """Compile `model_or_fn` with the hpu_moe backend, run it once on `args`/`kwargs` under no_grad,
    and return a Report: graphs, graph breaks (with reasons), compiles, fused layers, declined candidates.

    Resets dynamo's caches first so that the counts describe this call alone.
    """
    return explain_and_run(model_or_fn, *args, options=options, **kwargs)[0]


def explain_and_run(model_or_fn, *args, options: dict | None = None, **kwargs):
    """`explain`, also returning the compiled call's output (for checks against the eager model)."""
    if not callable(model_or_fn):
        raise TypeError(f"explain needs a module or a function, got {type(model_or_fn).__name__}")
    opts = Options.parse(options)
    torch._dynamo.reset()
    counters.clear()
    install_discovery_hook()  # dynamo's reset() dropped it
    if opts.adapters and isinstance(model_or_fn, torch.nn.Module):
        adapt(model_or_fn)
    backend = functools.partial(hpu_moe, options=opts)
    functools.update_wrapper(backend, hpu_moe)
    compiled = torch.compile(model_or_fn, backend=backend)
    with collecting() as collector, torch.no_grad():
        output = compiled(*args, **kwargs)
    breaks = dict(counters["graph_break"])
    # A graph break inside a loop makes dynamo skip the whole frame and run it eagerly; it is counted
    # as "unimplemented", not as a graph break, but it splits the model's graph all the same.
    breaks.update({reason: n for reason, n in counters["unimplemented"].items() if _skipped_a_frame(reason)})
    report = Report(
        graph_count=len(collector.records),
        graph_break_count=sum(breaks.values()),
        break_reasons=list(breaks),
        compile_count=int(counters["frames"]["ok"]) or len(collector.records),
        target=resolve_target(opts.target),
        inner=inner_name(opts.inner),
    )
    for record in collector.records:
        report.fused.extend(record.fused)
        report.declined.extend(record.declined)
        if record.fallback:
            report.fallbacks.append(f"graph {record.index}: {record.fallback}")
    report.advice = advice_for_breaks(report.break_reasons)
    return report, output


def _skipped_a_frame(reason: str) -> bool:
    return "frame skipped" in reason or "Skipping the frame" in reason


# Graph breaks an MoE layer typically causes, and the setting that removes them.
DATA_DEPENDENT_MARKERS = (
    "nonzero",
    "Dynamic shape operator",
    "data-dependent",
    "_local_scalar_dense",
    "tolist",
    "graph break in loop",
)
DATA_DEPENDENT_ADVICE = (
    "an expert loop over data-dependent shapes (nonzero / torch.where / .tolist(), e.g. transformers "
    "experts_implementation='eager' or 4.x loops) breaks the graph, so no MoE layer can be fused: load the "
    "model with experts_implementation='grouped_mm' (or call model.set_experts_implementation('grouped_mm')), "
    "which compiles in one graph and is fused. A loop over range(num_experts) with torch.where (transformers "
    "4.x) is kept in one graph, and fused, with torch._dynamo.config.capture_dynamic_output_shape_ops = True; "
    "a loop over the experts that were hit (`for e in expert_hit`) cannot be captured even then"
)


def advice_for_breaks(break_reasons: list[str]) -> list[str]:
    """What the user can change to remove the graph breaks that stop MoE fusion."""
    if any(marker in reason for reason in break_reasons for marker in DATA_DEPENDENT_MARKERS):
        return [DATA_DEPENDENT_ADVICE]
    return []
