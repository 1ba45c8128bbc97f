"""The report as one self-contained HTML page: summary, tables, and each graph before and after.

Graphs are drawn with graphviz `dot` (inline SVG) when it is installed, and shown as the stable
printer's text otherwise (and always, folded, under each picture). Fused calls are green, the node
where a declined candidate's matching stopped is orange.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess

from ..report import Report
from .text import (
    FUSED_HEADER,
    STOP_MARK,
    fused_rows,
    marked_lines,
    pass_times,
    relative_to_cwd,
    short_guard,
    stops_by_graph,
    summary_items,
)

MAX_DRAWN_NODES = 1500  # larger graphs are shown as text: dot takes minutes on them

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1d1d1f; }
h1 { font-size: 1.5em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: .5em 0; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
.summary td:first-child { font-weight: bold; }
.bad { color: #b35900; } .good { color: #1a7f37; }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; font-size: 12px; }
pre .fused { background: #d8f5dd; } pre .stop { background: #ffe2c2; }
.graphs { display: flex; gap: 1.5em; flex-wrap: wrap; align-items: flex-start; }
figure { margin: 0; flex: 1 1 30em; min-width: 20em; }
figure svg { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption { font-weight: bold; margin-bottom: .3em; }
.none { color: #777; } .stack { font-family: monospace; font-size: 12px; white-space: pre; }
"""


def dot_available() -> bool:
    return shutil.which("dot") is not None


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _table(table_id: str, header: list[str], rows: list[list[str]], raw: bool = False) -> str:
    if not rows:
        return f'<p id="{table_id}" class="none">none</p>'
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if raw else _esc(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_VALUE = re.compile(r"(%\d+|in\d+)(?:\[\d+\])?")


def graph_to_dot(text: str, stops: set[str]) -> str:
    """A graphviz digraph of a printed graph: inputs, ops and the output, wired by the values they use."""
    lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
    out = [
        "digraph G {",
        'rankdir=TB; node [shape=box, style="rounded,filled", fillcolor="#ffffff", fontname="monospace", '
        'fontsize=10]; edge [color="#888888"];',
    ]
    declared: set[str] = set()

    def ensure_input(name: str) -> None:
        if name not in declared:
            declared.add(name)
            out.append(f'"{name}" [shape=ellipse, fillcolor="#eef3ff", label="{name}"];')

    for line in lines:
        if line.startswith("return "):
            out.append('"return" [shape=ellipse, fillcolor="#eeeeee", label="return"];')
            for used in dict.fromkeys(m.group(1) for m in _VALUE.finditer(line[7:])):
                if used.startswith("in"):
                    ensure_input(used)
                out.append(f'"{used}" -> "return";')
            continue
        name, _, expression = line.partition(" = ")
        op = expression.split("(", 1)[0]
        fill = "#ffffff"
        if "mixture_of_experts" in op:
            fill = "#b7ebc0"
        elif line in stops:
            fill = "#ffd199"
        label = f"{name} {op}".replace('"', "'")
        out.append(f'"{name}" [label="{label}", fillcolor="{fill}"];')
        declared.add(name)
        arguments = expression[len(op) :]
        for used in dict.fromkeys(m.group(1) for m in _VALUE.finditer(arguments)):
            if used.startswith("in"):
                ensure_input(used)
            out.append(f'"{used}" -> "{name}";')
    out.append("}")
    return "\n".join(out)


def render_svg(text: str, stops: set[str]) -> str | None:
    """Inline SVG of a printed graph, or None without graphviz (or for a graph too large to draw)."""
    if not dot_available() or text.count("\n") > MAX_DRAWN_NODES:
        return None
    try:
        result = subprocess.run(
            ["dot", "-Tsvg"], input=graph_to_dot(text, stops), capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    svg = result.stdout
    return svg[svg.index("<svg") :] if "<svg" in svg else None


def _graph_pre(text: str | None, stops: set[str], fused: bool) -> str:
    if text is None:
        return "<pre>(not recorded)</pre>"
    rows = []
    for line, mark in marked_lines(text, stops, fused):
        if mark is None:
            rows.append(_esc(line))
        else:
            css = "stop" if mark == STOP_MARK else "fused"
            rows.append(f'<span class="{css}">{_esc(line)}   {_esc(mark)}</span>')
    return "<pre>" + "\n".join(rows) + "</pre>"


def _figure(caption: str, text: str | None, stops: set[str], fused: bool, kind: str) -> str:
    svg = render_svg(text, stops) if text else None
    body = _graph_pre(text, stops, fused)
    if svg is not None:
        body = f"{svg}<details><summary>as text</summary>{body}</details>"
    return f'<figure class="{kind}"><figcaption>{_esc(caption)}</figcaption>{body}</figure>'


def _guard_failures(failures: list[str]) -> str:
    """The latest compile's failing guard; those of earlier compiles folded under it."""
    if not failures:
        return ""
    latest = f'<code class="bad">{_esc(short_guard(failures[0]))}</code>'
    if len(failures) == 1:
        return latest
    earlier = "<br>".join(_esc(f) for f in failures[1:])
    return (
        f"{latest}<details><summary>and {len(failures) - 1} earlier compile(s)</summary>{earlier}</details>"
    )


def render_html(report: Report, target: str) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>moe-graph-dump {_esc(target)}</title><style>{CSS}</style></head><body>",
        f"<h1>moe-graph-dump {_esc(target)}</h1>",
        f"<p>target {_esc(report.target)}, inner backend {_esc(report.inner)}</p>",
        '<h2 id="summary-title">Summary</h2>',
        '<table id="summary" class="summary"><tbody>'
        + "".join(
            f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>"
            for k, v in [*summary_items(report), ("time per pass", pass_times(report))]
        )
        + "</tbody></table>",
        f"<h2>Fused layers ({len(report.fused)})</h2>",
    ]
    header = FUSED_HEADER if report.verify else FUSED_HEADER[:-1]
    rows = [r if report.verify else r[:-1] for r in fused_rows(report)]
    parts.append(_table("fused", header, rows))
    parts.append(f"<h2>Declined candidates ({len(report.declined)})</h2>")
    parts.append(
        _table(
            "declined",
            ["graph", "candidate", "form", "reason", "matching stopped at"],
            [[str(d.graph), d.candidate, d.form, d.reason, d.stopped_at] for d in report.declined],
        )
    )
    parts.append(f"<h2>Graph breaks ({report.graph_break_count})</h2>")
    parts.append(
        _table(
            "graph-breaks",
            ["compile", "at", "reason", "user stack"],
            [
                [
                    _esc(b.compile_id),
                    _esc(b.location),
                    _esc(b.reason),
                    '<div class="stack">' + "\n".join(_esc(f) for f in b.user_stack) + "</div>",
                ]
                for b in report.graph_breaks
            ],
            raw=True,
        )
    )
    parts.append(f"<h2>Recompiles ({report.recompile_count})</h2>")
    parts.append(
        _table(
            "recompiles",
            ["compile", "function", "guard that failed", "guard from"],
            [
                [
                    _esc(r.compile_id),
                    _esc(f"{r.function} ({r.location})"),
                    _guard_failures(r.guard_failures),
                    _esc(r.user_stack[-1]) if r.user_stack else "",
                ]
                for r in report.recompiles
            ],
            raw=True,
        )
    )
    parts += [f'<p class="bad">{_esc(hit)}</p>' for hit in report.recompile_limit_hits]
    if report.fallbacks or report.advice:
        parts.append("<h2>Fallbacks and advice</h2><ul>")
        parts += [f'<li class="bad">{_esc(f)}</li>' for f in report.fallbacks]
        parts += [f"<li>{_esc(a)}</li>" for a in report.advice]
        parts.append("</ul>")
    stops = stops_by_graph(report)
    for g in report.graphs:
        parts.append(f'<section class="graph" id="graph-{g.index}">')
        parts.append(
            f"<h2>Graph {g.index} (compile {_esc(g.compile_id)}): {g.fused} fused, {g.declined} declined</h2>"
        )
        if g.fallback:
            parts.append(f'<p class="bad">fallback: {_esc(g.fallback)}</p>')
        parts.append('<div class="graphs">')
        parts.append(
            _figure("before the MoE rewrite", g.captured, stops.get(g.index, set()), False, "before")
        )
        if g.rewritten is not None:
            parts.append(_figure("after the MoE rewrite", g.rewritten, set(), True, "after"))
        else:
            parts.append('<figure class="after"><figcaption>after: unchanged</figcaption></figure>')
        parts.append("</div></section>")
    parts.append(f"<h2>Compiles ({len(report.compiles)})</h2>")
    parts.append(
        _table(
            "compiles",
            ["compile", "function", "location", "graph ops", "failure"],
            [
                [c.compile_id, c.function, c.location, str(c.graph_ops), c.failure or ""]
                for c in report.compiles
            ],
        )
    )
    parts.append("</body></html>")
    return relative_to_cwd("\n".join(parts) + "\n")
