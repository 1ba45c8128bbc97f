"""The `hpu_moe` torch.compile backend: a declared list of passes, run by `pass_manager.PassManager`.

    dynamo graph -> canonicalize -> find -> rewrite -> (verify) -> fuse routing -> stack weights
                 -> inner compile                                          (backend_passes.py, in order)

A graph that needs gradients (training) is rewritten too, each layer where its target overload is
differentiable (the portable op always; the Gaudi op where the bridge gives it autograd); its routing
and weights stay as written, so that every gradient reaches the user's own parameters.
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
        training=_needs_gradients(example_inputs),
    )
    state.record.fallback = _why_not_rewritten(opts)
    return PassManager(passes_for(opts), skip=opts.skip_passes).run(state)


setattr(hpu_moe, BACKEND_MARK, hpu_moe)


def rewrite_graph(gm: torch.fx.GraphModule, example_inputs, options: Options, target: str, record: GraphRecord):
    """The rewrite passes alone (no inner compile): the rewritten graph, or None where nothing was fused."""
    state = GraphState(captured=gm, example_inputs=example_inputs, options=options, target=target, record=record)
    PassManager(REWRITE_PASSES, skip=options.skip_passes).run_passes(state)
    return state.rewritten


def _needs_gradients(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _why_not_rewritten(options: Options) -> str | None:
    if not options.enabled:
        return "disabled by options"
    return None


def _compile_id() -> str | None:
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # noqa: BLE001 - another torch's internals: the id is only for the report
        return None
    return None if compile_id is None else str(compile_id)
