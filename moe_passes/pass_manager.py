"""Running the backend's passes over one graph: one interface for a pass, one manager for the rest.

    GraphState  what the passes read and write for one dynamo graph (captured, rewritten, compiled)
    BackendPass one step: `applies(state)`, then `run(state)`; a name the report and counters use
    PassManager runs a declared list of passes; owns timing, counters, TORCH_TRACE artifacts, the
                fallback when a pass raises, and publishing the graph's record for the report

A pass knows nothing of the others: it reads the state it needs and says, through `applies`, when it
has nothing to do. What a failure means is the pass's `phase`: a failure while rewriting leaves the
graph as captured; a failure while lowering the rewritten graph (after the MoE layers were fused)
declines those layers and compiles the captured graph instead. Either way the user's compile goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .printer import format_graph
from .report import Declined, GraphRecord, publish
from .steps import Steps, count, keep_graph_texts, trace_artifact

log = logging.getLogger("moe_passes.backend")

REWRITE, LOWER, COMPILE = "rewrite", "lower", "compile"


@dataclass
class GraphState:
    """One graph's trip through the backend."""

    captured: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    options: Any  # moe_passes.Options (not imported: the options name these passes)
    target: str  # "hpu" or "portable" (lowering.resolve_target)
    record: GraphRecord
    mode: str | None = None  # torch.compile(mode=...), for the inner backend
    training: bool = False  # gradients enabled and an input requires grad: AOTAutograd will differentiate
    canonical: torch.fx.GraphModule | None = None  # the canonical ATen graph being rewritten
    found: Any = None  # what the finders saw (passes.pipeline.Found)
    rewritten: torch.fx.GraphModule | None = None  # set once the rewrite is complete and kept
    inputs: Sequence[Any] | None = None  # what the inner backend is handed (the example inputs unless a pass changed them)
    compiled: Callable | None = None
    # Wrap the compiled function (a pass that changed the inputs gives the user's inputs back their shape).
    wrap_compiled: Callable[[Callable], Callable] | None = None
    # Undo what lowering passes did outside the graph, should a later one fail (weights moved into stacks).
    undo: list[Callable[[], None]] = field(default_factory=list)
    # What lowering passes left to do once the inner backend compiled the rewritten graph.
    after_compile: list[Callable[[], None]] = field(default_factory=list)

    @property
    def graph(self) -> torch.fx.GraphModule:
        """The graph the next compile gets: the rewritten one when there is one, else the captured one."""
        return self.rewritten if self.rewritten is not None else self.captured

    def keep_captured(self, why: str) -> None:
        """Go on with the captured graph; `why` is the report's fallback line."""
        self.record.fallback = why
        self.canonical, self.rewritten = None, None


class BackendPass:
    """One step of the backend (in the spirit of inductor's CustomGraphPass and vLLM's InductorPass).

    Subclasses set `name` and `phase` and implement `run`; `applies` says when there is nothing to do.
    """

    name: ClassVar[str] = ""
    phase: ClassVar[str] = REWRITE  # REWRITE, LOWER (runs on the rewritten graph) or COMPILE
    what: ClassVar[str] = ""  # what it does, for "<what> failed on the rewritten graph" (default: name)

    def applies(self, state: GraphState) -> bool:
        return True

    def run(self, state: GraphState) -> None:
        raise NotImplementedError

    def fallback_reason(self, error: Exception) -> tuple[str, bool] | None:
        """(the report's fallback line, whether to warn) for an error this pass expects from user code;
        None for anything else (an internal error: reported with a warning)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def check_skip(passes: Sequence[BackendPass], skip: Sequence[str]) -> None:
    """Refuse skipping a pass that is not in `passes`, or one dynamo cannot do without (the compile)."""
    if not all(isinstance(name, str) for name in skip):
        raise TypeError("hpu_moe option skip_passes must be a list of pass names, e.g. ['fuse routing']")
    names = [p.name for p in passes]
    unknown = sorted(set(skip) - set(names))
    if unknown:
        raise ValueError(f"hpu_moe option skip_passes: unknown pass(es) {unknown}; the passes are {names}")
    essential = sorted({p.name for p in passes if p.phase == COMPILE} & set(skip))
    if essential:
        raise ValueError(f"hpu_moe option skip_passes: {essential} cannot be skipped (dynamo needs a compiled graph)")


class PassManager:
    """Runs `passes` in order on one graph and returns what the inner backend compiled."""

    def __init__(self, passes: Sequence[BackendPass], skip: Sequence[str] = ()):
        check_skip(passes, skip)
        self.passes = [p for p in passes if p.name not in set(skip)]

    def run(self, state: GraphState) -> Callable | None:
        """Every pass, then (if lowering failed after the compile) the captured graph's compile; the
        record is published whatever happens."""
        try:
            self.run_passes(state)
            if state.compiled is None:  # again: after the fallback only the captured graph's compile applies
                self.run_passes(state)
        finally:
            self._finish(state)
        if state.compiled is None or state.wrap_compiled is None:
            return state.compiled
        return state.wrap_compiled(state.compiled)

    def run_passes(self, state: GraphState) -> None:
        """Each pass that applies, in order, timed and counted; a pass that raises falls back (`_fall_back`)."""
        steps = Steps(state.record)
        for backend_pass in self.passes:
            if not self._should_run(backend_pass, state):
                continue
            try:
                with steps.step(backend_pass.name):
                    backend_pass.run(state)
            except Exception as error:  # noqa: BLE001 - never break the user's compile
                if backend_pass.phase == COMPILE and state.rewritten is None:
                    raise  # the captured graph itself does not compile: as it would without hpu_moe
                self._fall_back(backend_pass, state, error)

    @staticmethod
    def _should_run(backend_pass: BackendPass, state: GraphState) -> bool:
        if backend_pass.phase == COMPILE:
            return state.compiled is None and backend_pass.applies(state)
        if backend_pass.phase == LOWER and state.rewritten is None:
            return False
        if backend_pass.phase == REWRITE and state.record.fallback is not None:
            return False
        return backend_pass.applies(state)

    def _fall_back(self, backend_pass: BackendPass, state: GraphState, error: Exception) -> None:
        record = state.record
        first = str(error).splitlines()[0] if str(error) else ""
        if backend_pass.phase == REWRITE:
            expected = backend_pass.fallback_reason(error)
            why, warn = expected or (f"internal error, graph left unrewritten: {type(error).__name__}: {error}", True)
            if expected is None:
                count("internal_errors")
                log.warning("hpu_moe fell back to the captured graph", exc_info=True)
            record.fused.clear()
        else:  # the rewritten graph could not be lowered or compiled: the captured one is
            for undo in reversed(state.undo):
                undo()
            stage = f"{backend_pass.what or backend_pass.name} failed on the rewritten graph"
            why, warn = f"{stage}, compiled the captured one instead: {type(error).__name__}: {first}", True
            record.declined.extend(Declined(f.layer, f.form, stage, record.index) for f in record.fused)
            record.fused.clear()
            record.rewritten = None
            state.inputs, state.wrap_compiled, state.compiled, state.undo, state.after_compile = None, None, None, [], []
        state.keep_captured(why)
        if warn:
            warnings.warn(f"hpu_moe: {why}", RuntimeWarning, stacklevel=4)

    @staticmethod
    def _finish(state: GraphState) -> None:
        """The record published for the report, counters, TORCH_TRACE and log lines."""
        record = state.record
        if record.captured is None and keep_graph_texts():
            record.captured = format_graph(state.captured)  # not rewritten: the graph as dynamo captured it
        publish(record)
        count("fused", len(record.fused))
        count("declined", len(record.declined))
        count("fallbacks", record.fallback is not None)
        trace_artifact(
            f"moe_passes_graph_{record.index}_decisions", lambda: dataclasses.asdict(record), encoding="json"
        )
        for f in record.fused:
            log.info("fused %s (%s, %d experts, top-%d) -> %s", f.layer, f.form, f.num_experts, f.top_k, f.overload)
        for d in record.declined:
            log.info("declined %s (%s): %s", d.candidate, d.form, d.reason)
