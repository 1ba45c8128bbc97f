"""Draw the CPU benchmark's plot from its logs (`docs/bench/cpu.log`, `docs/bench/cpu_op.log`).

The logs hold the tables `tools/bench.py` and `tools/bench_cpu_op.py` printed; this reads them back so
the plot shows exactly the README's numbers.

    python tools/plot_cpu.py docs/bench/cpu.log docs/bench/cpu_op.log docs/bench/cpu.png
"""

from __future__ import annotations

import re
import sys

FORM_ROW = re.compile(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x")
OP_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x")


def forms_under_eager(path: str) -> list[tuple[str, float, float]]:
    """(form, original ms, hpu_moe ms) of the log's `--inner eager` table."""
    rows, inner = [], None
    for line in open(path):
        if line.startswith("device:"):
            inner = re.search(r"inner (\w+)", line).group(1)
        match = FORM_ROW.match(line)
        if match and inner == "eager":
            rows.append((match.group(1), float(match.group(2)), float(match.group(4))))
    return rows


def op_sizes(path: str) -> list[tuple[str, float, float, float]]:
    """(T/H/I label, dense loop ms, op loop ms, op grouped ms) from `tools/bench_cpu_op.py` output."""
    rows = []
    for line in open(path):
        match = OP_ROW.match(line)
        if match:
            t, h, i, dense, loop, grouped = match.groups()[:6]
            rows.append((f"T {t}\nH {h}, I {i}", float(dense), float(loop), float(grouped)))
    return rows


def main(argv=None) -> int:
    forms_log, op_log, out = (argv or sys.argv[1:])[:3]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    forms = forms_under_eager(forms_log)
    left.barh([f for f, _, _ in forms], [o / r for _, o, r in forms], color="tab:purple")
    left.axvline(1.0, color="black", linewidth=1)
    left.set(xscale="log", xlabel="speedup of hpu_moe over the original (inner eager)",
             title="catalog forms, CPU, float32, 8 experts top-2")
    sizes = op_sizes(op_log)
    xs = range(len(sizes))
    for offset, (index, label) in zip((-0.25, 0, 0.25), enumerate(("dense loop", "op, loop path", "op, grouped path")),
                                      strict=True):
        right.bar([x + offset for x in xs], [row[1 + index] for row in sizes], 0.25, label=label)
    right.set(xticks=list(xs), xticklabels=[row[0] for row in sizes], yscale="log", ylabel="ms per call",
              title="static dense loop vs the op (8 experts, top-2)")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
