"""The main job: compile a catalog MoE model with backend="hpu_moe" and show what happened.

Prints the fused layers, the numerical check against the unrewritten model, and the speed of the
rewritten model against the unrewritten one (eager and inductor), measured side by side in one run on
this machine.

    python tools/demo.py [--form static_dense_loop] [--iters 20] [--inner inductor]
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

# Large enough that expert work dominates, small enough for a 2-core machine.
DEMO_SIZES = dict(tokens=64, hidden=256, intermediate=512, num_experts=16, top_k=2, layers=2)


def _time(fn, args, iters: int) -> list[float]:
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(*args)
        samples.append(time.perf_counter() - start)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--form", default="static_dense_loop", choices=sorted(form_catalog.catalog()))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--inner", default="inductor", help="inner backend for both compiled variants")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    form = form_catalog.catalog()[args.form]
    model, inputs = form.build(**DEMO_SIZES)
    sizes = ", ".join(f"{k}={v}" for k, v in DEMO_SIZES.items())
    print(f"form: {args.form}  ({sizes}, {torch.get_num_threads()} CPU threads)")

    report = moe_passes.explain(model, *inputs, options={"inner": args.inner})
    print(report)

    with torch.no_grad():
        reference = model(*inputs)
        torch._dynamo.reset()
        rewritten = torch.compile(model, backend="hpu_moe", options={"inner": args.inner})
        plain = torch.compile(model, backend=args.inner)
        output = rewritten(*inputs)
        plain(*inputs)
        error = (output.float() - reference.float()).abs().max().item()
        print(f"\nnumerical check: max |rewritten - unrewritten eager| = {error:.3g}")

        variants = {
            "eager (unrewritten)": model,
            f"{args.inner} (unrewritten)": plain,
            f"hpu_moe+{args.inner}": rewritten,
        }
        for fn in variants.values():  # warm up caches and threads
            _time(fn, inputs, 3)
        samples = {name: [] for name in variants}
        for _ in range(args.iters):  # interleave so drift hits every variant alike
            for name, fn in variants.items():
                samples[name] += _time(fn, inputs, 1)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians["eager (unrewritten)"]
    print(f"\nspeed on this machine (median of {args.iters}, interleaved):")
    for name, median in medians.items():
        print(f"  {name:28s} {median * 1e3:8.2f} ms   speed-up vs eager {base / median:5.2f}x")
    fused_key = f"hpu_moe+{args.inner}"
    print(
        f"  ratio hpu_moe+{args.inner} / {args.inner} (unrewritten): "
        f"{medians[f'{args.inner} (unrewritten)'] / medians[fused_key]:.2f}x faster"
    )
    return 0 if report.fused else 1


if __name__ == "__main__":
    sys.exit(main())
