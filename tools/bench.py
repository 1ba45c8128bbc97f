"""Benchmark: catalog forms compiled with and without the hpu_moe rewrite, side by side in one run.

For each form it times the unrewritten model (eager and compiled with the inner backend) and the
rewritten one (hpu_moe + the same inner backend), interleaving the variants so drift affects them
alike, and prints medians and ratios. `--check` first compares the portable op with the dense
reference on the chosen device for all three overloads.

    python tools/bench.py --device cuda --dtype bfloat16
    python tools/bench.py --device cpu --forms static_dense_loop --tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import form_catalog  # noqa: E402
import moe_passes  # noqa: E402
from moe_passes import op_groups, reference  # noqa: E402

FUSED_FORMS = [name for name, form in form_catalog.catalog().items() if form.EXPECTED.fused]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_ms(fn, args, device: str, iters: int) -> float:
    samples = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn(*args)
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def check_op(device: str) -> None:
    """The portable op against the dense reference on `device` (T = 0, 1, 33; E up to 256)."""
    op = torch.ops.moe_passes.mixture_of_experts
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for tokens, experts, top_k in ((0, 4, 2), (1, 8, 8), (33, 256, 6)):
            g = torch.Generator().manual_seed(tokens + experts)
            x = torch.randn(tokens, 64, generator=g).to(device, dtype)
            rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
            ids = (torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)).to(device)
            w = torch.rand(tokens, top_k, generator=g).to(device, dtype)
            w12 = list((torch.randn(experts, 64, 64, generator=g) / 8).to(device, dtype).unbind(0))
            w3 = list((torch.randn(experts, 64, 32, generator=g) / 8).to(device, dtype).unbind(0))
            b12 = list((torch.randn(experts, 64, generator=g) / 8).to(device, dtype).unbind(0))
            b3 = list((torch.randn(experts, 64, generator=g) / 8).to(device, dtype).unbind(0))
            w1 = [t[:32] for t in w12]
            w2 = [t[32:] for t in w12]
            args = (x, ids, w)
            pairs = [
                (
                    op.default(*args, w1, w2, w3, True, "silu", 0, experts - 1),
                    reference.mixture_of_experts_reference(*args, w1, w2, w3, True, "silu", 0, experts - 1),
                ),
                (
                    op.fused_weights(*args, w12, w3, True, "gelu", 0, experts - 1),
                    reference.mixture_of_experts_fused_weights_reference(
                        *args, w12, w3, True, "gelu", 0, experts - 1
                    ),
                ),
                (
                    op.bias_fused_weights(
                        *args, w12, w3, b12, b3, permuted_weights=True, experts_min=0, experts_max=experts - 1
                    ),
                    reference.mixture_of_experts_bias_fused_weights_reference(
                        *args, w12, w3, b12, b3, permuted_weights=True, experts_min=0, experts_max=experts - 1
                    ),
                ),
            ]
            for actual, expected in pairs:
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
                if actual.numel():
                    worst = max(worst, (actual.float() - expected.float()).abs().max().item())
    print(
        f"op check on {device}: 3 overloads x 3 dtypes x 3 shapes agree with the reference "
        f"(max abs error {worst:.3g})"
    )


def bench_form(name: str, sizes: dict, device: str, dtype: torch.dtype, inner: str, iters: int) -> dict:
    model, inputs = form_catalog.catalog()[name].build(dtype=dtype, **sizes)
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    torch._dynamo.reset()
    with torch.no_grad(), form_catalog.dynamo_config(form_catalog.catalog()[name]):
        variants = {
            "eager": model,
            inner: torch.compile(model, backend=inner),
            f"hpu_moe+{inner}": torch.compile(
                model, backend=moe_passes.hpu_moe, options={"inner": inner, "target": "portable"}
            ),
        }
        reference_out = model(*inputs)
        errors = {}
        for key, fn in variants.items():
            for _ in range(3):
                out = fn(*inputs)
            errors[key] = (out.float() - reference_out.float()).abs().max().item()
        medians = {k: [] for k in variants}
        for _ in range(iters):
            for key, fn in variants.items():
                medians[key].append(_median_ms(fn, inputs, device, 1))
    return {k: statistics.median(v) for k, v in medians.items()}, errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--forms", nargs="*", default=FUSED_FORMS, choices=FUSED_FORMS)
    parser.add_argument("--inner", default="inductor")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="check the portable op on the device first")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for CPU runs")
    parser.add_argument(
        "--cpu-path",
        choices=["loop", "grouped"],
        help="the portable op's CPU path: per-expert loop or two grouped matmuls over the stacked weights",
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_path == "grouped":
        op_groups.GROUPED_DEVICES = op_groups.GROUPED_DEVICES | {"cpu"}
    elif args.cpu_path == "loop":
        op_groups.GROUPED_DEVICES = op_groups.GROUPED_DEVICES - {"cpu"}
    name = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    path = "grouped" if "cpu" in op_groups.GROUPED_DEVICES else "loop"
    print(f"device: {name}, torch {torch.__version__}, dtype {args.dtype}, inner {args.inner}, CPU op path {path}")
    if args.check:
        check_op(args.device)
    sizes = dict(
        tokens=args.tokens,
        hidden=args.hidden,
        intermediate=args.intermediate,
        num_experts=args.num_experts,
        top_k=args.top_k,
        layers=args.layers,
    )
    print("sizes: " + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    print(
        f"{'form':24s} {'eager ms':>9s} {args.inner + ' ms':>12s} {'hpu_moe ms':>11s} "
        f"{'vs eager':>9s} {'vs ' + args.inner:>13s} {'err ' + args.inner[:5]:>9s} {'err fused':>9s}"
    )
    for form in args.forms:
        if form == "hf_grouped_mm" and dtype != torch.bfloat16:
            continue
        r, errors = bench_form(form, sizes, args.device, dtype, args.inner, args.iters)
        fused = r[f"hpu_moe+{args.inner}"]
        print(
            f"{form:24s} {r['eager']:9.3f} {r[args.inner]:12.3f} {fused:11.3f} "
            f"{r['eager'] / fused:8.2f}x {r[args.inner] / fused:12.2f}x {errors[args.inner]:9.2g} {errors[f'hpu_moe+{args.inner}']:9.2g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
