"""One wrapper for every step of the backend: timed, logged, counted, and its graphs left for tlparse.

    counters["moe_passes"]: "<step>" (runs), "fused", "declined", "internal_errors", "fallbacks"

Artifacts go to TORCH_TRACE (structured logging files them under the compile id of the compile in
progress) only when someone reads them; printing a graph is never paid for otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch
from torch._dynamo.utils import counters

from .printer import format_graph
from .report import GraphRecord, collecting_now

log = logging.getLogger("moe_passes.backend")
COUNTERS = "moe_passes"


def keep_graph_texts() -> bool:
    """Print graphs only for someone who reads them: explain(), TORCH_TRACE, TORCH_LOGS=+moe_passes."""
    trace_log = getattr(getattr(torch._logging, "_internal", None), "trace_log", None)
    return (
        collecting_now()
        or bool(trace_log is not None and trace_log.handlers)
        or log.isEnabledFor(logging.DEBUG)
    )


def trace_artifact(name: str, payload_fn: Callable[[], object], encoding: str = "string") -> None:
    """Leave a step's graph or decisions in TORCH_TRACE output (free when tracing is off)."""
    trace = getattr(torch._logging, "trace_structured", None)
    if trace is not None:
        trace("artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn)


def count(what: str, n: int = 1) -> None:
    if n:
        counters[COUNTERS][what] += n


class Steps:
    """The steps of one graph's trip through the backend, recorded on its `GraphRecord`."""

    def __init__(self, record: GraphRecord):
        self.record = record
        self.detail = keep_graph_texts()

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        log.debug("graph %d: %s", self.record.index, name)
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.record.seconds[name] = self.record.seconds.get(name, 0.0) + seconds
            count(name)

    def graph(self, when: str, gm: torch.fx.GraphModule) -> None:
        """The graph before or after the rewrite, as the stable printer shows it (when read)."""
        if not self.detail:
            return
        text = format_graph(gm)
        if when == "before":
            self.record.captured = text
        else:
            self.record.rewritten = text
        trace_artifact(f"moe_passes_graph_{self.record.index}_{when}", lambda: text)
        log.debug("graph %d %s the MoE rewrite:\n%s", self.record.index, when, text)
