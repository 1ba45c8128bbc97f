"""vLLM-style MoE layers compiled one decoder layer at a time: compiles, breaks, fused layers, speed.

Builds the catalog's `vllm_fused_moe` model (vLLM's FusedMoE calling convention: layer registry,
`layer_name`, an opaque op that finds the layer through the forward context) and compiles each decoder
layer separately, as vLLM's regional compilation does, once with plain inductor and once with
`hpu_moe` (inner inductor). Prints, side by side from one run: dynamo compiles, frames left to eager,
graph breaks, layers that ran the fused call, max difference to eager, and the time of one forward.

    python tools/vllm_layers.py [--layers 32] [--tokens 64] [--hidden 256] [--intermediate 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch._dynamo.backends.registry import lookup_backend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import moe_passes  # noqa: E402
from form_catalog import vllm_fused_moe  # noqa: E402
from moe_passes.printer import is_fused_moe  # noqa: E402


class FusedRunCounter:
    """Inner backend (inductor) that counts the fused MoE calls the compiled graphs execute."""

    __name__ = "inductor"

    def __init__(self):
        self.fused_runs = 0

    def __call__(self, gm, example_inputs):
        fused = sum(1 for node in gm.graph.nodes if is_fused_moe(node))
        compiled = lookup_backend("inductor")(gm, example_inputs)

        def run(*args):
            self.fused_runs += fused
            return compiled(*args)

        return run


def run_layers(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def median_ms(fn, iters: int) -> float:
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def measure(model, x, expected, backend, options, iters):
    torch._dynamo.reset()
    moe_passes.install_discovery_hook()
    counters.clear()
    kwargs = {"options": options} if options else {}
    layers = [torch.compile(layer, backend=backend, **kwargs) for layer in model.layers]
    context = vllm_fused_moe.set_forward_context(model, num_tokens_across_dp=[x.shape[1]])
    with torch.no_grad(), context:
        out = run_layers(layers, x)  # the first run compiles
        row = {
            "compiles": counters["frames"]["ok"],
            "frames to eager": counters["frames"]["total"] - counters["frames"]["ok"],
            "graph breaks": sum(counters["graph_break"].values()),
            "max diff": (out - expected).abs().max().item(),
        }
        row["ms / forward"] = median_ms(lambda: run_layers(layers, x), iters)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    model, (x,) = vllm_fused_moe.build(
        num_layers=args.layers, tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate
    )
    with torch.no_grad(), vllm_fused_moe.set_forward_context(model, num_tokens_across_dp=[x.shape[1]]):
        expected = model(x)
        eager_ms = median_ms(lambda: model(x), args.iters)
    counter = FusedRunCounter()
    rows = {
        "inductor": measure(model, x, expected, "inductor", None, args.iters),
        "hpu_moe (inner inductor)": measure(
            model, x, expected, "hpu_moe", {"inner": counter, "target": "portable"}, args.iters
        ),
    }
    fused_layers = counter.fused_runs // (args.iters + 1)
    print(
        f"vllm_fused_moe: {args.layers} decoder layers compiled one by one, tokens={args.tokens}, "
        f"hidden={args.hidden}, intermediate={args.intermediate}; torch {torch.__version__}, "
        f"recompile_limit {torch._dynamo.config.recompile_limit}; eager {eager_ms:.2f} ms / forward"
    )
    print("| backend | compiles | frames to eager | graph breaks | layers fused | max diff | ms / forward |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        fused = f"{fused_layers}/{args.layers}" if name.startswith("hpu_moe") else f"0/{args.layers}"
        print(
            f"| {name} | {row['compiles']} | {row['frames to eager']} | {row['graph breaks']} | {fused} | "
            f"{row['max diff']:.1e} | {row['ms / forward']:.2f} |"
        )
    speedup = rows["inductor"]["ms / forward"] / rows["hpu_moe (inner inductor)"]["ms / forward"]
    print(f"hpu_moe per-layer compile is {speedup:.2f}x faster than inductor per-layer compile on this machine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
