"""`moe-graph-dump TARGET [options]`: compile a model with hpu_moe and show what happened to it.

    moe-graph-dump catalog:hf_grouped_mm                       # text report on the terminal
    moe-graph-dump hf:qwen3_moe --layers 1 --json               # the same content as JSON
    moe-graph-dump catalog:near_miss_exact_gelu --html gelu.html
    moe-graph-dump catalog:vllm_fused_moe --regional --no-adapters --out dump/   # every format

TARGET is catalog:<name> (a catalog form), hf:<model_type> (a tiny random transformers model) or
package.module:callable (returning (model, example_inputs)). Exit status: 0 when the dump was made,
1 when the target could not be built or run, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

from ..explain import explaining
from ..lowering import TARGETS
from .html import render_html
from .targets import Target, TargetError, layer_list, load
from .text import render_text

PROG = "moe-graph-dump"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Compile a model with the hpu_moe backend and dump its graphs and MoE decisions.",
        epilog=__doc__.split("\n\n", 1)[1].split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "target", metavar="TARGET", help="catalog:<name>, hf:<model_type> or package.module:callable"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    p.add_argument("--html", metavar="FILE", help="also write the report as one self-contained HTML page")
    p.add_argument("--out", metavar="DIR", help="write report.txt, report.json and report.html into DIR")
    p.add_argument(
        "--inner", default="eager", help="inner backend (default: eager; the graphs do not depend on it)"
    )
    p.add_argument("--target-op", dest="op_target", default="auto", choices=TARGETS, help="fused op to emit")
    p.add_argument(
        "--verify", action="store_true", help="check each rewrite numerically; report the max error"
    )
    p.add_argument("--no-adapters", action="store_true", help="trace framework MoE layers as written")
    p.add_argument(
        "--regional", action="store_true", help="compile each layer of the model's layer list alone"
    )
    p.add_argument("--layers", type=int, help="number of layers (catalog: and hf: targets)")
    p.add_argument("--experts-implementation", help="hf: targets: grouped_mm (default), batched_mm or eager")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    return p


def run(target: Target, options: dict, regional: bool):
    """The report of compiling and running `target` once (whole, or one compile per layer)."""
    with target.running(), explaining(options) as session, torch.no_grad():
        if not regional:
            session.compile(target.model)(*target.args, **target.kwargs)
        else:
            path, layers = layer_list(target.model)
            originals = list(layers)
            try:
                for i, layer in enumerate(originals):
                    layers[i] = session.compile(layer)
                target.model(*target.args, **target.kwargs)
            finally:
                for i, layer in enumerate(originals):
                    layers[i] = layer
    return session.report


def _use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.layers is not None and args.layers < 1:
        return _fail("--layers must be a positive number", status=2)
    options = {
        "inner": args.inner,
        "target": args.op_target,
        "verify": args.verify,
        "adapters": not args.no_adapters,
    }
    try:
        target = load(args.target, layers=args.layers, experts_implementation=args.experts_implementation)
    except TargetError as error:
        return _fail(str(error))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            report = run(target, options, args.regional)
    except TargetError as error:
        return _fail(str(error))
    except Exception as error:  # noqa: BLE001 - one line, no traceback
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return _fail(f"running {target.name} failed: {type(error).__name__}: {lines[0] if lines else ''}")
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        sys.stdout.write(render_text(report, target.name, color=_use_color(args.color)))
    written = []
    try:
        if args.html:
            written.append(_write(Path(args.html), render_html(report, target.name)))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            written.append(_write(out / "report.txt", render_text(report, target.name, color=False)))
            written.append(_write(out / "report.json", report.to_json() + "\n"))
            written.append(_write(out / "report.html", render_html(report, target.name)))
    except OSError as error:
        return _fail(f"cannot write the output: {error}")
    for path in written:
        print(f"{PROG}: wrote {path}", file=sys.stderr)
    return 0


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _fail(message: str, status: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
