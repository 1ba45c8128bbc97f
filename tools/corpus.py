"""Measure the wild corpus (form_catalog/corpus/): what `backend="hpu_moe"` does with each entry, as written.

Each entry is compiled as a user would, `torch.compile(model, backend="hpu_moe")` with default dynamo
settings (inner backend eager, for speed; the rewrite does not depend on it), in a process of its own,
and compared with the eager model. It is also compiled with `backend="eager"`, the bar `hpu_moe` must
never fall below. Outcomes:

    fused           the entry's MoE layer became one fused call, output equal to eager
    declined        a candidate was found and left as written, or a router whose experts (in the same graph)
                    no form reads; the reason names what stopped it
    not captured    dynamo split or skipped the layer before the passes saw it; the first break names the
                    construct and where it is
    no candidate    one graph, nothing recognised as an MoE layer
    RAISES          hpu_moe raised where backend="eager" compiles and runs (a defect)
    WRONG           fused, but the output differs from eager (a defect)

    python tools/corpus.py                                  # markdown table on stdout
    python tools/corpus.py --json runs/corpus.json --entries make_moe nano_moe
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOLERANCE = 1e-4  # float32, relative to the output's scale


def measure(name: str) -> dict:
    """The outcome of one entry (run in this process)."""
    import torch

    from form_catalog.corpus import entries
    from moe_passes.explain import explain_and_run
    from moe_passes.passes.pipeline import UNREAD_FORM

    module = entries()[name]
    row = {"entry": name, "source": str(module.SOURCE)}
    model, inputs = module.build()
    with torch.no_grad():
        torch.manual_seed(0)  # entries that draw noise in inference (makeMoE's router) draw the same
        expected = model(*inputs)
        torch._dynamo.reset()
        try:
            torch.compile(model, backend="eager")(*inputs)
            row["eager_compile"] = "ok"
        except Exception as error:  # noqa: BLE001 - recorded: the bar hpu_moe is held to
            row["eager_compile"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    start = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            report, output = explain_and_run(model, *inputs, options={"inner": "eager"})
    except Exception as error:  # noqa: BLE001 - the outcome under test
        row["outcome"] = "RAISES" if row["eager_compile"] == "ok" else "raises (as eager does)"
        row["detail"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        row["trace"] = traceback.format_exc()[-2000:]
        return row
    row["seconds"] = round(time.monotonic() - start, 1)
    row.update(graphs=report.graph_count, breaks=report.graph_break_count, fused=len(report.fused))
    output, expected = (t[0] if isinstance(t, tuple) else t for t in (output, expected))
    error = (output.float() - expected.float()).abs().max().item() / max(expected.abs().max().item(), 1.0)
    row["error"] = error
    if report.fused:
        row["outcome"] = "fused" if error <= TOLERANCE else "WRONG"
        row["detail"] = "; ".join(f"{f.form} -> {f.overload.split('.')[-1]}" for f in report.fused)
    elif report.declined and not (_broken(report) and all(d.form == UNREAD_FORM for d in report.declined)):
        row["outcome"] = "declined"
        row["detail"] = report.declined[0].reason
    elif _broken(report):
        row["outcome"] = "not captured"
        row["detail"] = _first_break(report)
    else:
        row["outcome"] = "no candidate"
        row["detail"] = "; ".join(report.fallbacks) or "one graph, no MoE layer recognised in it"
    return row


def _broken(report) -> bool:
    """Dynamo split the frame: a router named as unread (passes/unread_routing.py) may then have its
    experts in another graph, and the break, not the router, is what stopped the layer."""
    return bool(report.graph_break_count or report.graph_count != 1)


def _first_break(report) -> str:
    """The first graph break's reason, one line, with the user line it happened at."""
    if report.graph_breaks:
        first = report.graph_breaks[0]
        reason = " ".join(first.reason.split())[:200]
        frame = first.user_stack[-1] if first.user_stack else None
        code = f": `{frame.code}`" if frame is not None and frame.code else ""
        return f"{reason} (at {first.location}{code})"
    if report.break_reasons:
        return " ".join(report.break_reasons[0].split())[:200]
    return f"{report.graph_count} graphs" + (f"; {report.fallbacks[0]}" if report.fallbacks else "")


def run_all(names: list[str], timeout: int) -> list[dict]:
    rows = []
    for name in names:
        command = [sys.executable, __file__, "--one", name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), None)
            row = json.loads(line) if line else {
                "entry": name, "outcome": "RAISES", "detail": f"the process died: {done.stderr[-300:]}"}
        except subprocess.TimeoutExpired:
            row = {"entry": name, "outcome": "RAISES", "detail": f"timed out after {timeout} s"}
        rows.append(row)
        print(f"{name:32s} {row['outcome']:14s} {row.get('detail', '')[:120]}", file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    counts = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    lines = [
        "| entry | source | outcome | why / what | graphs, breaks |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        detail = row.get("detail", "").replace("|", "\\|")
        shape = f"{row['graphs']}, {row['breaks']}" if "graphs" in row else ""
        lines.append(f"| {row['entry']} | {row.get('source', '')} | {row['outcome']} | {detail} | {shape} |")
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    return "\n".join([*lines, "", f"{len(rows)} entries: {summary}"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", nargs="*", help="entry names (default: all)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per entry")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # measure one entry in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    from form_catalog.corpus import entries

    known = entries()
    names = args.entries or list(known)
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown entries {unknown}; known: {sorted(known)}")
    rows = run_all(names, args.timeout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": __import__("torch").__version__, "rows": rows}, f, indent=1)
    print(markdown(rows))
    return 1 if any(r["outcome"] in ("RAISES", "WRONG") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
