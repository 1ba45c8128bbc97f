"""Compile cost of the rewrite: `hpu_moe` + inner backend vs the inner backend alone, and the passes' time.

Builds the catalog's transformers grouped-GEMM decoder (`form_catalog/hf_grouped_mm.py`, tiny sizes) with
8 and 32 layers, compiles it with the inner backend alone and with `hpu_moe` over the same inner
backend (fresh dynamo state each time, alternating, `--repeat` times) and prints the medians of the
first call (compile + one run) and the added share. It then times `rewrite_graph` alone (canonical IR,
finders, rewrite) across layer counts to show how the passes scale with graph size.

    python tools/bench_compile.py --inner inductor --layers 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import form_catalog  # noqa: E402
import moe_passes  # noqa: E402
from moe_passes import backend  # noqa: E402
from moe_passes.options import Options  # noqa: E402

FORM = "hf_grouped_mm"
SIZES = dict(tokens=8, hidden=64, intermediate=32, num_experts=8, top_k=2)


def first_call_s(layers: int, use_hpu_moe: bool, inner: str) -> float:
    """Seconds for torch.compile + the first call (what compiling costs the user), fresh dynamo state."""
    model, inputs = form_catalog.catalog()[FORM].build(layers=layers, **SIZES)
    torch._dynamo.reset()
    backend_ = moe_passes.hpu_moe if use_hpu_moe else inner
    options = {"inner": inner, "target": "portable"} if use_hpu_moe else None
    start = time.perf_counter()
    with torch.no_grad():
        torch.compile(model, backend=backend_, options=options)(*inputs)
    return time.perf_counter() - start


def passes_time(layers: int, repeat: int) -> dict:
    """Median seconds of `rewrite_graph` on the captured graph of a `layers`-layer model, and its size."""
    model, inputs = form_catalog.catalog()[FORM].build(layers=layers, **SIZES)
    captured = []

    def keep(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=keep)(*inputs)
        (gm, example_inputs), = captured
        options = Options.parse({"target": "portable"})
        samples = []
        for index in range(repeat):
            record = backend.GraphRecord(index=index)
            start = time.perf_counter()
            rewritten = backend.rewrite_graph(gm, example_inputs, options, "portable", record)
            samples.append(time.perf_counter() - start)
            assert rewritten is not None and len(record.fused) == layers, record
    return {"layers": layers, "graph_nodes": len(gm.graph.nodes), "passes_s": statistics.median(samples)}


def plot(result: dict, path: str) -> None:
    """Left: first-call seconds per layer count, inner alone vs hpu_moe; right: passes' time vs graph nodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    layers = [str(r["layers"]) for r in result["compile"]]
    width = 0.35
    xs = range(len(layers))
    left.bar([x - width / 2 for x in xs], [r["inner_s"] for r in result["compile"]], width, label=result["inner"])
    left.bar([x + width / 2 for x in xs], [r["hpu_moe_s"] for r in result["compile"]], width,
             label=f"hpu_moe+{result['inner']}")
    left.set(xticks=list(xs), xticklabels=layers, xlabel="decoder layers", ylabel="compile + first call, s")
    left.legend()
    nodes = [r["graph_nodes"] for r in result["scaling"]]
    right.plot(nodes, [r["passes_s"] for r in result["scaling"]], marker="o")
    right.set(xlabel="graph nodes", ylabel="passes' time, s", title="rewrite_graph vs graph size")
    right.grid(True, alpha=0.3)
    fig.suptitle(f"Compile cost, torch {result['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor")
    parser.add_argument("--layers", nargs="*", type=int, default=[8, 32])
    parser.add_argument("--scaling-layers", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    parser.add_argument("--replot", help="only draw --plot from this earlier --json")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.plot)
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, inner {args.inner}, form {FORM}, {SIZES}")
    first_call_s(1, False, args.inner)  # one-time costs (imports, caches) land on neither variant
    first_call_s(1, True, args.inner)
    compile_rows = []
    for layers in args.layers:
        samples = {"inner": [], "hpu_moe": []}
        for _ in range(args.repeat):
            samples["inner"].append(first_call_s(layers, False, args.inner))
            samples["hpu_moe"].append(first_call_s(layers, True, args.inner))
        inner_s, fused_s = (statistics.median(samples[k]) for k in ("inner", "hpu_moe"))
        row = {"layers": layers, "inner_s": inner_s, "hpu_moe_s": fused_s, "added": fused_s / inner_s - 1,
               "samples": samples}
        compile_rows.append(row)
        print(f"layers {layers:3d}: {args.inner} {inner_s:7.2f} s, hpu_moe+{args.inner} {fused_s:7.2f} s, "
              f"added {100 * row['added']:+.1f}%", flush=True)
    scaling = []
    for layers in args.scaling_layers:
        row = passes_time(layers, args.repeat)
        scaling.append(row)
        print(f"passes: {layers:3d} layers, {row['graph_nodes']:5d} graph nodes, {1e3 * row['passes_s']:8.1f} ms, "
              f"{1e6 * row['passes_s'] / row['graph_nodes']:6.1f} us/node", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "inner": args.inner, "compile": compile_rows,
                       "scaling": scaling}, f, indent=1)
    if args.plot:
        plot({"torch": torch.__version__, "inner": args.inner, "compile": compile_rows, "scaling": scaling},
             args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
