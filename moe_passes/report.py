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
    max_error: float | None = (
        None  # with options verify=True: the graph's output difference after the rewrite
    )
    # Expert parallelism: the region holds experts experts_min .. experts_min + num_experts - 1 of the
    # router's router_experts (None: the router's width is unknown or equal to num_experts).
    experts_min: int = 0
    router_experts: int | None = None
    restacked: int = 0  # per-expert weight tensors moved into stacks for the portable op (weight_stacks.py)
    compiled_as: str | None = None  # the stacked overload the compiled graph calls instead (weight_stacks.py)
    routing_fused: bool = False  # its routing chain runs as one softmax_topk call (passes/routing_fusion.py)
    # Ids no op of the graph bounds: how the call checks them, e.g. "0..7, negative ids wrapped (aten.index)"
    ids_checked: str | None = None
    training: bool = False  # fused in a graph that needs gradients (AOTAutograd differentiates the call)
    training_backward: str | None = None  # "recompute" (the op's backward) or "saved activations"

    def experts_text(self) -> str:
        """"8 experts", or "4 experts: ids 4..7 of the router's 8 (expert-parallel rank 1)" where the region
        holds part of the router's experts. The graph shows which ids it computes, not why the others are
        elsewhere: other ranks' experts, or experts the layer handles outside the region (LongCat's
        identity experts). The rank is named only where contiguous, equal shares give one."""
        if self.router_experts is None or self.router_experts == self.num_experts:
            return f"{self.num_experts} experts"
        last = self.experts_min + self.num_experts - 1
        share = self.router_experts % self.num_experts == 0 and self.experts_min % self.num_experts == 0
        rank = f" (expert-parallel rank {self.experts_min // self.num_experts})" if share else ""
        return f"{self.num_experts} experts: ids {self.experts_min}..{last} of the router's {self.router_experts}{rank}"


@dataclass(frozen=True)
class Declined:
    """A candidate left as it was, and why."""

    candidate: str
    form: str
    reason: str
    graph: int = 0
    stopped_at: str = ""  # the node where matching stopped, as the captured graph prints it, with its source


@dataclass(frozen=True)
class AlreadyFused:
    """A call of the fused MoE kernel the model already made: left exactly as written."""

    layer: str
    overload: str  # e.g. "hpu::mixture_of_experts.default"
    num_experts: int | None = None
    experts_min: int | None = None
    experts_max: int | None = None
    graph: int = 0


@dataclass
class GraphRecord:
    """The outcome for one graph the backend compiled."""

    index: int
    fused: list[Fused] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    already_fused: list[AlreadyFused] = field(default_factory=list)
    fallback: str | None = None  # set when the graph went to the inner backend unrewritten
    compile_id: str | None = None  # dynamo's "frame/compile" id of the compile that produced the graph
    captured: str | None = None  # the graph before the MoE rewrite (stable printer), when collected
    rewritten: str | None = None  # the graph handed to the inner backend when the rewrite changed it
    seconds: dict[str, float] = field(default_factory=dict)  # time per pass of the backend


@dataclass(frozen=True)
class Frame:
    """One frame of user code: where a graph break or a guard came from."""

    file: str
    line: int
    function: str
    code: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}" + (f": {self.code}" if self.code else "")


@dataclass(frozen=True)
class GraphBreak:
    """A place where dynamo split the graph (or gave up on a frame), with the user code that led there."""

    reason: str  # dynamo's reason, first lines
    location: str  # "file:line" of the break
    user_stack: list[Frame] = field(default_factory=list)
    compile_id: str | None = None


@dataclass(frozen=True)
class Compile:
    """One dynamo compile of a frame (a first compile or a recompile)."""

    compile_id: str  # "frame/compile": "0/0" first compile of frame 0, "0/3" its fourth
    function: str
    location: str  # "file:line" of the function
    graph_ops: int | None = None
    failure: str | None = None  # why dynamo gave up on the frame (then it runs eagerly)


@dataclass(frozen=True)
class Recompile:
    """A compile caused by failing guards of earlier compiles of the same code."""

    compile_id: str
    function: str
    location: str
    guard_failures: list[str] = field(default_factory=list)  # one per earlier compile, first line each
    user_stack: list[Frame] = field(default_factory=list)  # where the failing guard was installed


@dataclass(frozen=True)
class GraphView:
    """One graph the backend received, before and after the rewrite (stable printer text)."""

    index: int
    compile_id: str | None
    captured: str | None
    rewritten: str | None  # None: handed on as captured
    fused: int = 0
    declined: int = 0
    fallback: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)


REPORT_KEYS = (
    "graph_count",
    "graph_break_count",
    "compile_count",
    "recompile_count",
    "fused",
    "declined",
    "already_fused",
    "graph_breaks",
    "compiles",
    "recompiles",
    "recompile_limit_hits",
    "graphs",
    "pass_seconds",
    "break_reasons",
    "fallbacks",
    "advice",
    "target",
    "inner",
    "verify",
)


@dataclass
class Report:
    """The result of `moe_passes.explain`: graphs, breaks, compiles, and every MoE decision."""

    graph_count: int = 0
    graph_break_count: int = 0
    break_reasons: list[str] = field(default_factory=list)
    compile_count: int = 0
    fused: list[Fused] = field(default_factory=list)
    declined: list[Declined] = field(default_factory=list)
    already_fused: list[AlreadyFused] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    target: str = ""
    inner: str = ""
    verify: bool = False
    recompile_count: int = 0
    graph_breaks: list[GraphBreak] = field(default_factory=list)
    compiles: list[Compile] = field(default_factory=list)
    recompiles: list[Recompile] = field(default_factory=list)
    recompile_limit_hits: list[str] = field(default_factory=list)  # dynamo's "hit recompile_limit" warnings
    graphs: list[GraphView] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)  # summed over graphs, per backend pass

    def to_dict(self) -> dict:
        data = asdict(self)
        return {key: data[key] for key in REPORT_KEYS}

    def to_json(self, **dumps_kwargs) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **dumps_kwargs})

    @classmethod
    def from_dict(cls, data: dict) -> Report:
        """The report a `to_dict()`/`to_json()` payload describes; unknown or missing keys are errors."""
        if set(data) != set(REPORT_KEYS):
            missing, unknown = set(REPORT_KEYS) - set(data), set(data) - set(REPORT_KEYS)
            raise ValueError(f"not a moe_passes report: missing {sorted(missing)}, unknown {sorted(unknown)}")

        def frames(items):
            return [Frame(**f) for f in items]

        return cls(
            **{
                **data,
                "fused": [Fused(**f) for f in data["fused"]],
                "declined": [Declined(**d) for d in data["declined"]],
                "already_fused": [AlreadyFused(**a) for a in data["already_fused"]],
                "graph_breaks": [
                    GraphBreak(**{**b, "user_stack": frames(b["user_stack"])}) for b in data["graph_breaks"]
                ],
                "compiles": [Compile(**c) for c in data["compiles"]],
                "recompiles": [
                    Recompile(**{**r, "user_stack": frames(r["user_stack"])}) for r in data["recompiles"]
                ],
                "graphs": [GraphView(**g) for g in data["graphs"]],
            }
        )

    def __str__(self) -> str:
        lines = [
            f"moe_passes report (target={self.target}, inner={self.inner})",
            f"  graphs: {self.graph_count}   graph breaks: {self.graph_break_count}   "
            f"compiles: {self.compile_count}   recompiles: {self.recompile_count}",
        ]
        for reason in self.break_reasons:
            details = [line.strip() for line in reason.splitlines() if line.strip()]
            lines.append(f"  break: {' / '.join(details[:2])}")
        for graph_break in self.graph_breaks:
            frame = graph_break.user_stack[-1] if graph_break.user_stack else None
            where = f" ({frame.function})" + (f": {frame.code}" if frame.code else "") if frame else ""
            lines.append(f"  break at {graph_break.location}{where}")
        for recompile in self.recompiles:
            reason = recompile.guard_failures[0] if recompile.guard_failures else "unknown"
            lines.append(
                f"  recompile {recompile.compile_id} of {recompile.function}: guard failed: {reason}"
            )
        for hit in self.recompile_limit_hits:
            lines.append(f"  {hit}")
        lines.append(f"  fused MoE layers: {len(self.fused)}")
        for f in self.fused:
            error = f", verified max error {f.max_error:.2g}" if f.max_error is not None else ""
            if f.restacked:
                error += f", {f.restacked} per-expert weights moved into stacks"
            if f.compiled_as:
                error += f", compiled as {f.compiled_as} on stacked inputs"
            if f.routing_fused:
                error += ", routing as one softmax_topk call"
            if f.ids_checked:
                error += f", routing ids from outside the graph checked at run time: {f.ids_checked}"
            trains = f"fused (training, {f.training_backward}), " if f.training else ""
            lines.append(
                f"    [graph {f.graph}] {f.layer}: {trains}{f.form}, {f.experts_text()}, top-{f.top_k}, "
                f"{f.activation}, routing {f.routing} -> {f.overload} ({f.target}){error}"
            )
        if self.already_fused:
            lines.append(f"  already fused (the model calls the kernel itself; left as written): {len(self.already_fused)}")
            for a in self.already_fused:
                experts = f", {a.num_experts} experts" if a.num_experts is not None else ""
                window = (
                    f" (ids {a.experts_min}..{a.experts_max})" if a.experts_min is not None and a.experts_max is not None else ""
                )
                lines.append(f"    [graph {a.graph}] {a.layer}: {a.overload}{experts}{window}")
        lines.append(f"  declined candidates: {len(self.declined)}")
        for d in self.declined:
            lines.append(f"    [graph {d.graph}] {d.candidate} ({d.form}): {d.reason}")
            if d.stopped_at:
                lines.append(f"      matching stopped at {d.stopped_at}")
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


def collecting_now() -> bool:
    """Whether a collector is active (then the backend keeps graph texts and timings for it)."""
    return bool(_stack())


def publish(record: GraphRecord) -> None:
    for collector in _stack():
        collector.records.append(record)
