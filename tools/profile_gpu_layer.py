"""Where one form's compiled MoE layer spends its time per call on the GPU: host time, then a profiler table.

Builds the layers of `tools/bench_gpu.py` (same sizes and weights), compiles one form with `hpu_moe`
(portable target, inner inductor) in the given mode, runs it at each T and prints the host time per call
(without a sync) and the time with a final sync; then profiles ten calls at the last T.

    python tools/profile_gpu_layer.py --model Qwen3-30B-A3B --form "ModuleList loop" --mode reduce-overhead --tokens 1 16 128
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import moe_passes  # noqa: E402
from tools.bench_gpu import COMPILED, MODELS, build  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen3-30B-A3B", choices=list(MODELS))
    parser.add_argument("--form", default="ModuleList loop", choices=list(COMPILED))
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    parser.add_argument("--tokens", nargs="*", type=int, default=[1, 16, 128])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the ModuleList loop's torch.where
    sizes = MODELS[args.model]
    layer = build(args.model, sizes)[args.form]
    options = {} if args.mode != "default" else {"options": {"inner": "inductor", "target": "portable"}}
    compiled = torch.compile(layer, backend=moe_passes.hpu_moe, mode=None if args.mode == "default" else args.mode,
                             **options)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: hpu_moe[{args.form}] at {args.model} sizes, "
          f"mode {args.mode!r}")
    with torch.no_grad():
        for tokens in args.tokens:
            xs = [torch.randn(1, tokens, sizes["hidden"], device="cuda", dtype=torch.bfloat16) for _ in range(4)]
            for i in range(6):
                compiled(xs[i % 4])
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(args.calls):
                compiled(xs[i % 4])
            host = (time.perf_counter() - start) / args.calls * 1e3
            torch.cuda.synchronize()
            synced = (time.perf_counter() - start) / args.calls * 1e3
            print(f"T={tokens}: host {host:.3f} ms per call, {synced:.3f} ms per call with the final sync", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(10):
                compiled(xs[i % 4])
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
