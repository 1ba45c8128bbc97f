"""What the backend did to each compiled graph, in a form people and tools can read."""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Fused:
    """One MoE layer rewritten into one fused call."""

    layer: str
    form: str
    num_experts: int
    top_k: int
    activation: str
    overload: str  # the emitted OpOverload, e.g. "moe_passes::mixture_of_experts.fused_weights"
    target: str  # "hpu" or "portable"
    routing: str
    graph: int = 0


@dataclass(frozen=True)
class Declined:
    """A candidate left as it was, and why."""

    candidate: str
    form: str
    reason: str
    graph: int = 0


@dataclass
class GraphRecord:
    """The outcome for one graph the backend compiled."""

    index: int
    fused: list[Fused] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    fallback: str | None = None  # set when the graph went to the inner backend unrewritten


@dataclass
class Report:
    """The result of `moe_passes.explain`: graphs, breaks, compiles, and every MoE decision."""

    graph_count: int = 0
    graph_break_count: int = 0
    break_reasons: list[str] = field(default_factory=list)
    compile_count: int = 0
    fused: list[Fused] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    target: str = ""
    inner: str = ""

    def to_json(self, **dumps_kwargs) -> str:
        return json.dumps(asdict(self), **{"indent": 2, **dumps_kwargs})

    def __str__(self) -> str:
        lines = [
            f"moe_passes report (target={self.target}, inner={self.inner})",
            f"  graphs: {self.graph_count}   graph breaks: {self.graph_break_count}   "
            f"compiles: {self.compile_count}",
        ]
        for reason in self.break_reasons:
            details = [line.strip() for line in reason.splitlines() if line.strip()]
            lines.append(f"  break: {' / '.join(details[:2])}")
        lines.append(f"  fused MoE layers: {len(self.fused)}")
        for f in self.fused:
            lines.append(
                f"    [graph {f.graph}] {f.layer}: {f.form}, {f.num_experts} experts, top-{f.top_k}, "
                f"{f.activation}, routing {f.routing} -> {f.overload} ({f.target})"
            )
        lines.append(f"  declined candidates: {len(self.declined)}")
        for d in self.declined:
            lines.append(f"    [graph {d.graph}] {d.candidate} ({d.form}): {d.reason}")
        for fallback in self.fallbacks:
            lines.append(f"  fallback: {fallback}")
        for advice in self.advice:
            lines.append(f"  advice: {advice}")
        return "\n".join(lines)


class _Collector:
    """Collects GraphRecords from every backend call made while it is active."""

    def __init__(self) -> None:
        self.records: list[GraphRecord] = []


_active = threading.local()


def _stack() -> list[_Collector]:
    if not hasattr(_active, "stack"):
        _active.stack = []
    return _active.stack


@contextlib.contextmanager
def collecting():
    collector = _Collector()
    _stack().append(collector)
    try:
        yield collector
    finally:
        _stack().remove(collector)


def next_graph_index() -> int:
    stack = _stack()
    return len(stack[-1].records) if stack else 0


def publish(record: GraphRecord) -> None:
    for collector in _stack():
        collector.records.append(record)
