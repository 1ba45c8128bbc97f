"""The report as terminal text: summary, tables, graph breaks, recompiles, each graph before and after."""

from __future__ import annotations

import os
import sysconfig

from ..report import Report

FUSED_MARK = "<- fused"
STOP_MARK = "<- declined: matching stopped here"
SHOWN_FRAMES = 5  # innermost user frames shown per graph break (all of them in JSON and HTML)


class Style:
    """ANSI colours, or nothing (not a terminal, NO_COLOR, --color never)."""

    def __init__(self, color: bool):
        self.color = color

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def title(self, text: str) -> str:
        return self._wrap("1;4", text)

    def good(self, text: str) -> str:
        return self._wrap("32", text)

    def bad(self, text: str) -> str:
        return self._wrap("33", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)


def fused_rows(report: Report) -> list[list[str]]:
    """The fused-layers table: one row per fused layer (shared by the text and HTML renderers)."""
    rows = []
    for f in report.fused:
        error = "" if f.max_error is None else f"{f.max_error:.2g}"
        rows.append(
            [f"[{f.graph}] {f.layer}", f.routing, f.form, str(f.num_experts), str(f.top_k), f.activation]
            + [f.overload, f.target, error]
        )
    return rows


FUSED_HEADER = ["layer", "routing", "expert form", "E", "k", "activation", "overload", "target", "max error"]


def summary_items(report: Report) -> list[tuple[str, str]]:
    return [
        ("graphs", str(report.graph_count)),
        ("graph breaks", str(report.graph_break_count)),
        ("compiles", str(report.compile_count)),
        ("recompiles", str(report.recompile_count)),
        ("fused layers", str(len(report.fused))),
        ("declined candidates", str(len(report.declined))),
    ] + ([("already fused", str(len(report.already_fused)))] if report.already_fused else [])


def pass_times(report: Report) -> str:
    if not report.pass_seconds:
        return "no graph reached the backend"
    return ", ".join(f"{step} {seconds:.3f} s" for step, seconds in report.pass_seconds.items())


def marked_lines(text: str | None, stops: set[str], fused: bool) -> list[tuple[str, str | None]]:
    """[(line, mark)] of a printed graph: fused calls in a rewritten graph, declined stops in a captured one."""
    out = []
    for line in (text or "").splitlines():
        mark = None
        if fused and "mixture_of_experts" in line:
            mark = FUSED_MARK
        elif line.strip() in stops:
            mark = STOP_MARK
        out.append((line, mark))
    return out


def stops_by_graph(report: Report) -> dict[int, set[str]]:
    """{graph index: printed lines where a declined candidate's matching stopped}."""
    out: dict[int, set[str]] = {}
    for d in report.declined:
        if d.stopped_at:
            out.setdefault(d.graph, set()).add(d.stopped_at.split("  [", 1)[0].strip())
    return out


def short_guard(failure: str) -> str:
    """ "0/3: x.layer_name == 'a'  # code  # file.py:12 in f" -> "x.layer_name == 'a'" (dynamo's guard text)."""
    expression = failure.split("  # ", 1)[0]
    head, sep, rest = expression.partition(": ")
    return rest if sep and "/" in head and " " not in head else expression


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    fmt = lambda cells: indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return [
        fmt(header).rstrip(),
        indent + "  ".join("-" * w for w in widths),
        *(fmt(r).rstrip() for r in rows),
    ]


def render_text(report: Report, target: str, color: bool = False, graphs: bool = True) -> str:
    s = Style(color)
    out = [s.title(f"moe-graph-dump {target}") + f"  (target {report.target}, inner {report.inner})", ""]
    out.append(s.title("Summary"))
    out.append("  " + "   ".join(f"{k}: {v}" for k, v in summary_items(report)))
    out.append(f"  time per pass: {pass_times(report)}")
    out.append("")
    out.append(s.title(f"Fused layers ({len(report.fused)})"))
    if report.fused:
        header = FUSED_HEADER if report.verify else FUSED_HEADER[:-1]
        rows = [r if report.verify else r[:-1] for r in fused_rows(report)]
        out += _table(header, rows)
    else:
        out.append(s.dim("  none"))
    out.append("")
    out.append(s.title(f"Declined candidates ({len(report.declined)})"))
    for d in report.declined:
        out.append(f"  [{d.graph}] {d.candidate} ({d.form}): {s.bad(d.reason)}")
        if d.stopped_at:
            out.append(f"      matching stopped at: {d.stopped_at}")
    if not report.declined:
        out.append(s.dim("  none"))
    out.append("")
    out.append(s.title(f"Graph breaks ({report.graph_break_count})"))
    # the same break met by several compiles (each layer, each resumed frame) is shown once
    groups: dict[tuple[str, str], list] = {}
    for graph_break in report.graph_breaks:
        groups.setdefault((graph_break.location, graph_break.reason), []).append(graph_break)
    for n, ((location, reason), same) in enumerate(groups.items(), 1):
        compiles = ", ".join(str(b.compile_id) for b in same)
        out.append(f"  {n}. at {location} (compile {compiles}): {s.bad(reason)}")
        stack = same[0].user_stack
        if len(stack) > SHOWN_FRAMES:
            out.append(s.dim(f"       ... {len(stack) - SHOWN_FRAMES} outer frame(s)"))
        for frame in stack[-SHOWN_FRAMES:]:
            out.append(f"       {frame}")
    if not report.graph_breaks:
        out += [f"  {r.splitlines()[0]}" for r in report.break_reasons] or [s.dim("  none")]
    out.append("")
    out.append(s.title(f"Recompiles ({report.recompile_count})"))
    for r in report.recompiles:
        out.append(f"  {r.compile_id} {r.function} ({r.location})")
        if r.guard_failures:
            more = len(r.guard_failures) - 1
            earlier = f"  (and the guards of {more} earlier compile(s))" if more else ""
            out.append(f"      guard failed: {s.bad(short_guard(r.guard_failures[0]))}{earlier}")
        if r.user_stack:
            out.append(f"      guard from: {r.user_stack[-1]}")
    for hit in report.recompile_limit_hits:
        out.append(f"  {s.bad(hit)}")
    if not report.recompiles and not report.recompile_limit_hits:
        out.append(s.dim("  none"))
    out.append("")
    out.append(s.title(f"Compiles ({len(report.compiles)})"))
    for c in report.compiles:
        detail = s.bad(f"failed: {c.failure}") if c.failure else f"{c.graph_ops} graph ops"
        out.append(f"  {c.compile_id}  {c.function}  {c.location}  {detail}")
    if not report.compiles:
        out.append(s.dim("  none"))
    for fallback in report.fallbacks:
        out += ["", f"{s.bad('fallback')}: {fallback}"]
    for advice in report.advice:
        out += ["", f"{s.title('Advice')}: {advice}"]
    if graphs:
        stops = stops_by_graph(report)
        for g in report.graphs:
            header = f"Graph {g.index} (compile {g.compile_id}): {g.fused} fused, {g.declined} declined"
            out += ["", s.title(header)]
            if g.fallback:
                out.append(f"  {s.bad('fallback')}: {g.fallback}")
            out.append(s.dim("  captured (canonical ATen, before the MoE rewrite):"))
            out += _graph_text(g.captured, stops.get(g.index, set()), False, s)
            if g.rewritten is not None:
                out.append(s.dim("  rewritten (handed to the inner backend):"))
                out += _graph_text(g.rewritten, set(), True, s)
            else:
                out.append(s.dim("  rewritten: unchanged"))
    return relative_to_cwd("\n".join(out) + "\n")


def relative_to_cwd(text: str) -> str:
    """Paths under the current directory, or of installed packages, shown relative to it (short, and the
    same on every checkout): "form_catalog/x.py", "transformers/models/..."."""
    for prefix in (os.getcwd(), sysconfig.get_paths()["purelib"]):
        text = text.replace(prefix.rstrip("/") + "/", "")
    return text


def _graph_text(text: str | None, stops: set[str], fused: bool, s: Style) -> list[str]:
    if text is None:
        return [s.dim("    (not recorded)")]
    out = []
    for line, mark in marked_lines(text, stops, fused):
        if mark == FUSED_MARK:
            out.append(f"    {s.good(line)}   {s.good(mark)}")
        elif mark:
            out.append(f"    {s.bad(line)}   {s.bad(mark)}")
        else:
            out.append(f"    {line}")
    return out
