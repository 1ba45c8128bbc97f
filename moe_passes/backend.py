"""The `hpu_moe` torch.compile backend: a declared list of passes, run by `pass_manager.PassManager`.

    dynamo graph -> canonicalize -> find -> rewrite -> (verify) -> fuse routing -> stack weights
                 -> inner compile                                          (backend_passes.py, in order)

The rewrite is for inference: a graph that may need gradients goes to the inner backend as captured.
Anything that fails inside the passes also sends the captured graph on unchanged, with a warning, so
the user's compile never breaks because of this package. `options={"skip_passes": [...]}` leaves
passes out by name; `options={"custom_passes": [...]}` runs the user's own `BackendPass` objects on
the rewritten graph before it is lowered.
"""

from __future__ import annotations

import torch

from . import lowering
from .adapters import prepare
from .adapters.base import BACKEND_MARK
from .backend_passes import DEFAULT_PASSES, LOWER_PASSES, REWRITE_PASSES, default_inner, inner_name
from .options import Options
from .pass_manager import BackendPass, GraphState, PassManager
from .report import GraphRecord, next_graph_index

__all__ = ["DEFAULT_PASSES", "default_inner", "hpu_moe", "inner_name", "passes_for", "rewrite_graph"]


def passes_for(options: Options) -> list[BackendPass]:
    """The passes a compile with `options` runs: the default ones with the user's `custom_passes` after
    the rewrite (they see the rewritten graph, before routing fusion); the manager leaves out
    `skip_passes`."""
    return [*REWRITE_PASSES, *options.custom_passes, *LOWER_PASSES]


def hpu_moe(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None):
    """torch.compile backend: fuse MoE layers into one `mixture_of_experts` call each, then compile."""
    opts = Options.parse(options)
    prepare()  # again after a dynamo reset(), and for classes defined since: for the next frames
    state = GraphState(
        captured=gm,
        example_inputs=example_inputs,
        options=opts,
        target=lowering.resolve_target(opts.target),
        record=GraphRecord(index=next_graph_index(), compile_id=_compile_id()),
        mode=mode,
    )
    state.record.fallback = _why_not_rewritten(opts, example_inputs)
    return PassManager(passes_for(opts), skip=opts.skip_passes).run(state)


setattr(hpu_moe, BACKEND_MARK, hpu_moe)


def rewrite_graph(gm: torch.fx.GraphModule, example_inputs, options: Options, target: str, record: GraphRecord):
    """The rewrite passes alone (no inner compile): the rewritten graph, or None where nothing was fused."""
    state = GraphState(captured=gm, example_inputs=example_inputs, options=options, target=target, record=record)
    PassManager(REWRITE_PASSES, skip=options.skip_passes).run_passes(state)
    return state.rewritten


def _why_not_rewritten(options: Options, example_inputs) -> str | None:
    if not options.enabled:
        return "disabled by options"
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs):
        return (
            "gradients are enabled and inputs require grad; the rewrite is inference-only "
            "(run under torch.no_grad() or torch.inference_mode())"
        )
    return None


def _compile_id() -> str | None:
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - another torch's internals: the id is only for the report
        return None
    return None if compile_id is None else str(compile_id)
