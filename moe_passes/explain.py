"""`moe_passes.explain`: compile and run, then say what dynamo and the backend did.

Two entry points:

    report = moe_passes.explain(model, x)            # compile the whole callable, run it once

    with moe_passes.explaining() as session:         # any compile pattern, e.g. one compile per layer
        layers = [session.compile(layer) for layer in model.layers]
        for layer in layers:
            x = layer(x)
    report = session.report

Besides the backend's own decisions (fused layers, declined candidates, graphs before and after),
the report carries what dynamo did while the session was open: every compile, every recompile with
the guards that failed, every graph break with the user code that led to it. Those come from torch's
structured trace (the records `TORCH_TRACE` writes and tlparse reads: `compilation_metrics`,
`recompile_reasons`, `dynamo_graph_break_reason`), listened to for the session's duration, so they
need no log configuration and leave the user's logging as it was.
"""

from __future__ import annotations

import contextlib
import functools
import json
import linecache
import logging
import os
import re
import sysconfig

import torch
from torch._dynamo.utils import counters

from .adapters import adapt, prepare
from .backend import hpu_moe, inner_name
from .lowering import resolve_target
from .options import Options
from .report import Compile, Frame, GraphBreak, GraphView, Recompile, Report, collecting

log = logging.getLogger(__name__)


def explain(model_or_fn, *args, options: dict | None = None, **kwargs) -> Report:
    """Compile `model_or_fn` with the hpu_moe backend, run it once on `args`/`kwargs` under no_grad,
    and return a Report: graphs, graph breaks (with the user stack), compiles, recompiles (with the
    failing guards), fused layers, declined candidates.

    Resets dynamo's caches first so that the counts describe this call alone.
    """
    return explain_and_run(model_or_fn, *args, options=options, **kwargs)[0]


def explain_and_run(model_or_fn, *args, options: dict | None = None, **kwargs):
    """`explain`, also returning the compiled call's output (for checks against the eager model)."""
    if not callable(model_or_fn):
        raise TypeError(f"explain needs a module or a function, got {type(model_or_fn).__name__}")
    with explaining(options) as session, torch.no_grad():
        output = session.compile(model_or_fn)(*args, **kwargs)
    return session.report, output


class ExplainSession:
    """What `explaining()` yields: the backend to compile with, and the report once the block ends."""

    def __init__(self, options: Options):
        self.options = options
        backend = functools.partial(hpu_moe, options=options)
        functools.update_wrapper(backend, hpu_moe)
        self.backend = backend
        self.report: Report | None = None

    def compile(self, model_or_fn, **compile_kwargs):
        """`torch.compile(model_or_fn, backend=<hpu_moe with the session's options>, **compile_kwargs)`.

        Modules get the adapters first (unless options turn them off), as `backend="hpu_moe"` would.
        """
        if self.options.adapters and isinstance(model_or_fn, torch.nn.Module):
            adapt(model_or_fn)
        return torch.compile(model_or_fn, backend=self.backend, **compile_kwargs)


@contextlib.contextmanager
def explaining(options: dict | Options | None = None):
    """Record what every torch.compile call made inside the block does; `session.report` after it.

    Compile with `session.compile(...)` (hpu_moe with `options`) or with any other backend: compiles,
    recompiles and graph breaks are reported for all of them, MoE decisions for hpu_moe graphs.
    Resets dynamo first so that the counts describe the block alone.
    """
    opts = Options.parse(options)
    torch._dynamo.reset()
    counters.clear()
    prepare()  # dynamo's reset() dropped the discovery callback
    session = ExplainSession(opts)
    with collecting() as collector, _DynamoEvents.listening() as events:
        yield session
    session.report = _build_report(opts, collector.records, events)
    _emit_report(session.report)


def _build_report(opts: Options, records, events: _DynamoEvents) -> Report:
    breaks = dict(counters["graph_break"])
    # A graph break inside a loop makes dynamo skip the whole frame and run it eagerly; it is counted
    # as "unimplemented", not as a graph break, but it splits the model's graph all the same.
    breaks.update({reason: n for reason, n in counters["unimplemented"].items() if _skipped_a_frame(reason)})
    compiles = events.compiles()
    succeeded = [c for c in compiles if c.failure is None]
    graph_breaks = events.graph_breaks()
    report = Report(
        graph_count=len(records) or int(counters["stats"]["unique_graphs"]),
        # dynamo counts a frame it gave up on ("skipping the function") apart from its graph breaks
        graph_break_count=max(sum(breaks.values()), len(graph_breaks)),
        break_reasons=list(breaks),
        compile_count=len(succeeded) if compiles else (int(counters["frames"]["ok"]) or len(records)),
        target=resolve_target(opts.target),
        inner=inner_name(opts.inner),
        verify=opts.verify,
        graph_breaks=graph_breaks,
        compiles=compiles,
        recompiles=events.recompiles(),
        recompile_limit_hits=list(events.limit_hits),
    )
    report.recompile_count = len(report.recompiles)
    for record in records:
        report.fused.extend(record.fused)
        report.declined.extend(record.declined)
        report.already_fused.extend(record.already_fused)
        if record.fallback:
            report.fallbacks.append(f"graph {record.index}: {record.fallback}")
        report.graphs.append(
            GraphView(
                index=record.index,
                compile_id=record.compile_id,
                captured=record.captured,
                rewritten=record.rewritten,
                fused=len(record.fused),
                declined=len(record.declined),
                fallback=record.fallback,
                seconds={step: round(s, 6) for step, s in record.seconds.items()},
            )
        )
        for step, seconds in record.seconds.items():
            report.pass_seconds[step] = round(report.pass_seconds.get(step, 0.0) + seconds, 6)
    break_locations = list(dict.fromkeys(where for b in report.graph_breaks for where in _user_locations(b) if where))
    report.advice = advice_for_breaks(report.break_reasons, break_locations, report.graph_breaks) + advice_for_recompiles(
        report
    )
    return report


def _emit_report(report: Report) -> None:
    """The report as a structured-trace artifact, next to dynamo's records in TORCH_TRACE output."""
    trace = getattr(torch._logging, "trace_structured", None)
    if trace is None:
        return
    metadata = lambda: {"name": "moe_passes_report", "encoding": "json"}  # noqa: E731
    try:
        trace("artifact", metadata_fn=metadata, payload_fn=report.to_dict, expect_trace_id=False)
    except TypeError:  # torch without expect_trace_id
        trace("artifact", metadata_fn=metadata, payload_fn=report.to_dict)


def _skipped_a_frame(reason: str) -> bool:
    return "frame skipped" in reason or "Skipping the frame" in reason


class _DynamoEvents(logging.Handler):
    """Collects dynamo's structured-trace records (and its recompile-limit warning) while active."""

    TRACE_NAMES = ("compilation_metrics",)
    ARTIFACTS = ("recompile_reasons", "dynamo_graph_break_reason")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.metrics: list[dict] = []
        self.artifacts: list[tuple[str, str | None, str]] = []  # (name, compile id, payload)
        self.limit_hits: list[str] = []

    @classmethod
    @contextlib.contextmanager
    def listening(cls):
        events = cls()
        trace_log = getattr(getattr(torch._logging, "_internal", None), "trace_log", None)
        limit_log = logging.getLogger("torch._dynamo.convert_frame")
        if trace_log is None:
            log.debug("this torch has no structured trace: compiles and recompiles are counted only")
            yield events
            return
        level, propagate = trace_log.level, trace_log.propagate
        trace_log.setLevel(logging.DEBUG)
        trace_log.propagate = False  # structured records are for trace handlers, not the user's logs
        trace_log.addHandler(events)
        limit_log.addHandler(events)
        try:
            yield events
        finally:
            trace_log.removeHandler(events)
            limit_log.removeHandler(events)
            trace_log.setLevel(level)
            trace_log.propagate = propagate

    def emit(self, record: logging.LogRecord) -> None:
        try:
            metadata = getattr(record, "metadata", None)
            if metadata is None:
                message = record.getMessage()
                if record.levelno >= logging.WARNING and (
                    "recompile_limit" in message or "cache_size_limit" in message
                ):
                    self.limit_hits.append(_first_lines(message, 3))
                return
            if "compilation_metrics" in metadata:
                self.metrics.append(dict(metadata["compilation_metrics"]))
            artifact = metadata.get("artifact")
            if isinstance(artifact, dict) and artifact.get("name") in self.ARTIFACTS:
                compile_id = None
                if metadata.get("frame_id") is not None:
                    compile_id = f"{metadata['frame_id']}/{metadata.get('frame_compile_id', 0)}"
                self.artifacts.append((artifact["name"], compile_id, getattr(record, "payload", "") or ""))
        except Exception:  # noqa: BLE001 - a report detail must never break the user's compile
            log.debug("could not read a structured trace record", exc_info=True)

    def compiles(self) -> list[Compile]:
        out = []
        code_of_frame: dict[str, tuple[str, str]] = {}  # frame id -> (function, location)
        for m in self.metrics:
            if m.get("compile_id") is None:
                continue
            compile_id = str(m["compile_id"])
            frame = compile_id.split("/", 1)[0]
            if m.get("co_name"):
                code_of_frame[frame] = (
                    str(m["co_name"]),
                    f"{m.get('co_filename')}:{m.get('co_firstlineno')}",
                )
            # a compile refused by the recompile limit names no code: it is the frame's code again
            function, location = code_of_frame.get(frame, ("?", "?"))
            failure = m.get("fail_reason") or m.get("fail_type")
            out.append(
                Compile(
                    compile_id=compile_id,
                    function=function,
                    location=location,
                    graph_ops=m.get("graph_op_count"),
                    failure=_first_lines(failure, 2) if failure else None,
                )
            )
        return out

    def recompiles(self) -> list[Recompile]:
        functions = {c.compile_id: c for c in self.compiles()}
        out = []
        for name, compile_id, payload in self.artifacts:
            if name != "recompile_reasons":
                continue
            try:
                reasons = json.loads(payload)
            except ValueError:
                reasons = payload
            reasons = [reasons] if isinstance(reasons, str) else list(reasons)
            compiled = functions.get(compile_id)
            out.append(
                Recompile(
                    compile_id=compile_id or "?",
                    function=compiled.function if compiled else "?",
                    location=compiled.location if compiled else "?",
                    guard_failures=[_guard_summary(str(r)) for r in reasons],
                    user_stack=_recompile_stack(_guard_summary(str(reasons[0])), compiled) if reasons else [],
                )
            )
        return out

    def graph_breaks(self) -> list[GraphBreak]:
        out = []
        for name, compile_id, payload in self.artifacts:
            if name != "dynamo_graph_break_reason":
                continue
            at = re.search(r"Graph break in user code at (.+?):(\d+)\n", payload)
            reason = payload.split("Graph Break Reason:", 1)[-1]
            for end in ("\nStack variable source attribution:", "\nUser code traceback:"):
                reason = reason.split(end, 1)[0]
            reason = _break_reason(reason)
            stack = payload.split("User code traceback:", 1)[-1].split(
                "Traceback (most recent call last)", 1
            )[0]
            out.append(
                GraphBreak(
                    reason=reason,
                    location=f"{at.group(1)}:{at.group(2)}" if at else "?",
                    user_stack=_frames(stack),
                    compile_id=compile_id,
                )
            )
        return out


# Older torch (2.9) gives no stack with a failed guard, only its source line as a comment:
# "<guard>  # <code>  # <file suffix>:<line> in <function>"
_GUARD_SOURCE = re.compile(r"#\s*(.*?)\s+#\s*(\S+):(\d+) in (\S+)\s*$", re.M)


def _recompile_stack(reason: str, compiled) -> list[Frame]:
    frames = _frames(reason.split("User stack trace:", 1)[-1])
    if frames or "User stack trace:" in reason:
        return frames
    found = _GUARD_SOURCE.search(reason.splitlines()[0] if reason else "")
    if found is None:
        return []
    code, path, line, function = found.groups()
    known = compiled.location.rsplit(":", 1)[0] if compiled else ""
    if known.endswith(path):  # the comment shortens the path; the compiled function's file has it whole
        path = known
    return [Frame(path, int(line), function, code.strip())]


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)\n(?:\s{4,}(?!File )(.*)\n)?', re.M)
# torch, the standard library and this package (the adapters' wrappers) are not the user's code
_NOT_USER_CODE = tuple(
    {
        prefix
        for path in (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"], os.path.dirname(__file__))
        for prefix in (os.path.abspath(path) + "/", os.path.realpath(path) + "/")
    }
)
# How dynamo introduces a break reason; the reason itself follows
_BREAK_PREAMBLES = (
    "Encountered graph break when attempting",
    "Failed to handle graph break",
    "Graph break encountered",
)


def _break_reason(text: str) -> str:
    """Dynamo's break reason without its preamble: the break type and its explanation."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    skipped = any("Skipping the function" in line or "Skipping frame" in line for line in lines)
    kept = [
        line for line in lines if not line.startswith(_BREAK_PREAMBLES) and not line.startswith("Skipping")
    ]
    reason = " / ".join(kept[:2]) or " / ".join(lines[:2])
    return reason + (" (dynamo gave up on the whole function: it runs eagerly)" if skipped else "")


def _frames(text: str) -> list[Frame]:
    """User frames of a formatted stack (torch's own frames left out)."""
    frames = []
    for path, line, function, code in _FRAME.findall(text if text.endswith("\n") else text + "\n"):
        if path.startswith(_NOT_USER_CODE) or os.path.realpath(path).startswith(_NOT_USER_CODE):
            continue
        frames.append(Frame(path, int(line), function, (code or "").strip()))
    return frames


def _guard_summary(failure: str) -> str:
    """A failed guard on one line, with the source comment dynamo puts after it: an object's guard
    spans the lines of its repr (`___check_obj_id(self, N), type=FusedMoE(` ... `)  # code  # file:line`)."""
    lines = [line.strip() for line in failure.split("User stack trace:", 1)[0].splitlines() if line.strip()]
    commented = [line for line in lines[1:] if "  # " in line]
    if commented and "  # " not in lines[0]:
        return f"{lines[0]} ... {commented[-1]}"
    return lines[0] if lines else ""


def _first_lines(text: str, count: int) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " / ".join(lines[:count])


# Graph breaks an MoE layer typically causes, and the setting that removes them.
DATA_DEPENDENT_MARKERS = (
    "nonzero",
    "Dynamic shape operator",
    "data-dependent",
    "_local_scalar_dense",
    "Tensor.item()",  # a number read from a tensor (also `in` on a tensor, `if x.sum() == 0`)
    "tolist",
    "graph break in loop",
)
DATA_DEPENDENT_ADVICE = (
    "a data-dependent shape or number in the MoE layer (nonzero / torch.where / .item() / .tolist() / "
    "masked_select) breaks the graph, so no MoE layer in that code can be fused. Under hpu_moe (adapters on), "
    "a loop over range(num_experts) with torch.where, a loop over the experts that were hit (transformers "
    "4.x) and methods that read per-expert counts as numbers are captured in one graph by the expert-loop "
    "adapter; loops it left as written are listed with the construct that stopped it. Elsewhere, "
    "torch._dynamo.config.capture_scalar_outputs = True and capture_dynamic_output_shape_ops = True let "
    "dynamo keep such values symbolic in one graph. Transformers models: load with "
    "experts_implementation='grouped_mm' (or call model.set_experts_implementation('grouped_mm')), which "
    "compiles in one graph and is fused"
)
TOKEN_EXCHANGE_ADVICE = (
    "expert parallelism that exchanges tokens between ranks (all-to-all) reads the exchange's split sizes "
    "back as numbers in every MoE layer (at {where}), which breaks the graph there by design; each rank's "
    "experts then run on a data-dependent number of received rows and are not fused. At inference, where "
    "every rank of the expert group holds the same batch, an all-reduce expert parallelism keeps each layer "
    "in one graph, and hpu_moe fuses each rank's experts with the rank's expert range "
    "(experts_min/experts_max): transformers: DistributedConfig(ep_size=tp_size, ep_implementation='all_reduce')"
)
NAME_GUARD_ADVICE = (
    "each layer recompiles because a guard checks the layer's name string (vLLM-style layers that find "
    "themselves again by name through a forward context): compile with backend='hpu_moe' and adapters on "
    "(the default), which hold the layer by reference so that one compile serves every layer"
)
LIMIT_ADVICE = (
    "dynamo hit its recompile limit: the calls after it run eagerly, uncompiled and unfused "
    "(torch._dynamo.config.recompile_limit); remove the cause of the recompiles rather than raising the limit"
)


def advice_for_breaks(
    break_reasons: list[str], break_locations: list[str] = (), graph_breaks: list[GraphBreak] = ()
) -> list[str]:
    """What the user can change to remove the graph breaks that stop MoE fusion.

    Code its authors excluded from compilation is named first: hpu_moe honours the exclusion. Expert
    loops the adapter left as written are named when a break lies in their forward.
    """
    advice = excluded_code_advice(break_reasons, graph_breaks)
    causes = [_first_cause(reason) if _DISABLED_CALL.search(_first_cause(reason)) else reason for reason in break_reasons]
    if any(marker in reason for reason in causes for marker in DATA_DEPENDENT_MARKERS):
        from .adapters.hit_expert_loops import declined_at

        left = declined_at(break_locations)
        exchanges = [where for where in break_locations if _exchanges_tokens(where)]
        advice += [TOKEN_EXCHANGE_ADVICE.format(where=exchanges[0])] if exchanges else []
        return advice + [DATA_DEPENDENT_ADVICE] + [f"expert loop left as written: {why}" for why in left]
    return advice


# dynamo's reason for not tracing into a function wrapped in torch.compiler.disable / torch._dynamo.disable
# ("Skip inlining function <function f at 0x..> since ..."; a call of such a function quotes it in backticks)
_DISABLED_CALL = re.compile(
    r"<function (?P<name>\S+) at 0x[0-9a-f]+>`? since it was wrapped with `torch\.(?:compiler|_dynamo)\.disable"
)
# dynamo appends the breaks a first break caused (a loop around it skipped) after this line
_CHAINED_BREAK = "*** While handling this graph break, another graph break occurred"


def _first_cause(reason: str) -> str:
    return reason.split(_CHAINED_BREAK, 1)[0]


def excluded_code_advice(break_reasons: list[str], graph_breaks: list[GraphBreak] = ()) -> list[str]:
    """Functions the graph broke at because their authors wrapped them in `torch.compiler.disable`.

    hpu_moe never traces into such code (the user's explicit word, honoured by every backend), so an MoE
    computation inside it stays eager and unfused; the chained "graph break in loop" that a loop around
    the call adds is a consequence, not a data-dependent construct.
    """
    names, sites = [], []
    for reason, where in [(b.reason, b.location) for b in graph_breaks] + [(r, "") for r in break_reasons]:
        match = _DISABLED_CALL.search(_first_cause(reason))
        if match is None:
            continue
        if match["name"] not in names:
            names.append(match["name"])
        if where and where not in sites:
            sites.append(where)
    if not names:
        return []
    called = f", called at {', '.join(sites)}" if sites else ""
    return [
        f"{', '.join(f'`{name}`' for name in names)} {'is' if len(names) == 1 else 'are'} excluded from "
        f"compilation by its authors (torch.compiler.disable){called}: hpu_moe honours that and does not trace "
        "into it, so an MoE computation inside it runs eagerly and is not fused. Where the exclusion is not "
        "needed (a decorator kept for a kernel the model no longer calls), removing it lets hpu_moe see the layer"
    ]


_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep


def _user_locations(graph_break: GraphBreak) -> tuple[str, ...]:
    """Where a break happened, and, where that is torch's own code (a tensor's `in` breaks inside
    `Tensor.__contains__` on some versions), the deepest frame outside torch: the line that called it."""
    outside = [f for f in graph_break.user_stack if not os.path.realpath(f.file).startswith(_TORCH_DIR)]
    return (graph_break.location, *([f"{outside[-1].file}:{outside[-1].line}"] if outside else []))


def _exchanges_tokens(location: str, around: int = 12) -> bool:
    """Whether the code around a break location ("path:line") exchanges tokens with an all-to-all
    collective (`all_to_all`, `all_to_all_single`): the split sizes it needs are read as numbers."""
    path, _, line = location.rpartition(":")
    if not line.isdigit():
        return False
    number = int(line)
    nearby = [linecache.getline(path, n) for n in range(max(1, number - around), number + around + 1)]
    return any("all_to_all" in text for text in nearby)


# `___check_obj_id(self, 1398...), type=FusedMoE(...)  # layer_id = id(layer)  # path.py:398 in forward_torch`
_IDENTITY_GUARD = re.compile(r"___check_obj_id\(.*#\s*(?P<code>[^#\n]*\bid\([^#\n]*?)\s*#\s*(?P<where>\S+:\d+)", re.S)


def identity_guard_advice(where: str, code: str) -> str:
    """Advice for a layer whose identity, read by `id(...)` in traced code, keys an opaque op."""
    return (
        f"each layer recompiles because traced code reads the layer's identity (`{code}` at {where}): dynamo "
        "puts the number into the graph and guards on the object, so every layer compiles its own graph. "
        "hpu_moe leaves this as written (the op finds the layer again by that number, and its body is not "
        "traced); pass the layer, or a name that the adapters can hold by reference, instead of its id(). "
        "vLLM 0.17 to 0.23 do this in their CPU MoE fallback (`forward_torch`, taken where vLLM's CPU "
        "grouped GEMM is not available); GPUs, Gaudi and vLLM 0.24+ do not take that path"
    )


def advice_for_recompiles(report: Report) -> list[str]:
    """What the user can change to remove per-layer recompiles."""
    advice = []
    failures = [failure for r in report.recompiles for failure in r.guard_failures]
    if any(re.search(r"\.layer_name ==|\bprefix ==", failure) for failure in failures):
        advice.append(NAME_GUARD_ADVICE)
    identity = next((m for m in map(_IDENTITY_GUARD.search, failures) if m), None)
    if identity is not None:
        advice.append(identity_guard_advice(identity["where"], identity["code"].strip()))
    if report.recompile_limit_hits:
        advice.append(LIMIT_ADVICE)
    return advice
