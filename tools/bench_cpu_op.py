"""The portable op's CPU paths against the static dense loop they replace, op level, side by side.

Times, interleaved, the vllm-hpu-extension static dense loop in eager (every expert on every token,
weighted by a scattered [T, E] table) and `torch.ops.moe_passes.mixture_of_experts.fused_weights` on
its two CPU paths (per-expert matmul loop; two grouped matmuls over the stacked weights), float32,
8 experts, top-2, and prints the medians in ms.

    python tools/bench_cpu_op.py --threads 2 --sizes 64,256,512 256,512,1024 2048,256,512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_passes import op_groups  # noqa: E402


def bench(tokens: int, hidden: int, inter: int, experts: int, top_k: int, iters: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g)
    w12 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w3 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    l12, l3 = list(w12.unbind(0)), list(w3.unbind(0))
    op = torch.ops.moe_passes.mixture_of_experts.fused_weights

    def dense():
        out = torch.zeros(tokens, hidden)
        padded = torch.zeros(tokens, experts).scatter_(1, ids, weights)
        for e in range(experts):
            h = x @ w12[e].T
            out += (F.silu(h[:, :inter]) * h[:, inter:]) @ w3[e].T * padded[:, e : e + 1]
        return out

    def on_path(path: str):
        def run():
            saved = op_groups.GROUPED_DEVICES, op_groups.CPU_GROUPED_MAX_ROWS
            op_groups.GROUPED_DEVICES = {"cuda", "cpu"} if path == "grouped" else {"cuda"}
            op_groups.CPU_GROUPED_MAX_ROWS = tokens * top_k  # the path asked for, whatever the size
            try:
                return op(x, ids, weights, l12, l3, True, "silu", 0, experts - 1)
            finally:
                op_groups.GROUPED_DEVICES, op_groups.CPU_GROUPED_MAX_ROWS = saved

        return run

    fns = {"dense loop": dense, "op loop": on_path("loop"), "op grouped": on_path("grouped")}
    reference = dense()
    for name, fn in fns.items():
        torch.testing.assert_close(fn(), reference, atol=1e-4, rtol=1e-4, msg=name)
    samples = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", nargs="*", default=["64,256,512", "256,512,1024", "2048,256,512"],
                        help="tokens,hidden,intermediate")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, float32, {args.experts} experts, top-{args.top_k}")
    print(f"{'T':>6s} {'H':>5s} {'I':>5s} {'dense loop':>11s} {'op loop':>9s} {'op grouped':>11s} {'best speedup':>13s}")
    for size in args.sizes:
        tokens, hidden, inter = (int(v) for v in size.split(","))
        r = bench(tokens, hidden, inter, args.experts, args.top_k, args.iters)
        best = r["dense loop"] / min(r["op loop"], r["op grouped"])
        print(f"{tokens:6d} {hidden:5d} {inter:5d} {r['dense loop']:11.2f} {r['op loop']:9.2f} {r['op grouped']:11.2f} "
              f"{best:12.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
