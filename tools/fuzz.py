"""Differential fuzzing of the hpu_moe backend against eager, in bulk.

    python tools/fuzz.py --cases 5000            # or MOE_FUZZ_CASES=5000 python tools/fuzz.py

Draws random MoE blocks (tests/fuzz_models.py: routing, k, E, H, I, activation, weight storage,
expert computation, dtype, shared expert, token count, static/dynamic shapes), compiles each with
hpu_moe (portable target, eager inner) and compares it with eager. Unlike the bounded test
(tests/test_fuzz.py) it does not stop at the first failure: it prints every failing case with the
line that replays it, then the totals (cases, fused, declined, mismatches, exceptions, ...).
Exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

from tests.fuzz_models import cases, run_case  # noqa: E402

FAILURE_KINDS = ("mismatch", "exception", "wrong fuse", "wrong decline", "unexplained")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=int(os.environ.get("MOE_FUZZ_CASES", "5000")))
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (the draws are reproducible)")
    parser.add_argument("--progress", type=int, default=100, help="print running totals every N cases")
    parser.add_argument("--json", type=Path, help="write the totals and the failing cases here")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # dynamo's and the backend's warnings are counted, not printed

    kinds: collections.Counter[str] = collections.Counter()
    forms: collections.Counter[tuple[str, str]] = collections.Counter()
    failures = []
    start = time.monotonic()

    @hypothesis_seed(args.seed)
    @settings(
        max_examples=args.cases,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def one(case):
        outcome = run_case(case)
        kinds[outcome.kind] += 1
        forms[(case.experts, outcome.kind)] += 1
        if outcome.failed:
            failures.append(outcome)
            print(outcome, flush=True)
        done = sum(kinds.values())
        if args.progress and done % args.progress == 0:
            print(f"[{time.monotonic() - start:7.0f}s] {done} cases: {dict(kinds)}", flush=True)

    one()
    elapsed = time.monotonic() - start
    totals = {
        "cases": sum(kinds.values()),
        "fused": kinds["fused"],
        "declined": kinds["declined"],
        "mismatches": kinds["mismatch"],
        "exceptions": kinds["exception"],
        "wrong_fuses": kinds["wrong fuse"],
        "wrong_declines": kinds["wrong decline"],
        "unexplained": kinds["unexplained"],
        "seconds": round(elapsed),
        "seed": args.seed,
    }
    print("\nper expert form (fused / declined / failed):")
    for form in sorted({f for f, _ in forms}):
        failed = sum(forms[(form, k)] for k in FAILURE_KINDS)
        print(f"  {form:14s} {forms[(form, 'fused')]:5d} {forms[(form, 'declined')]:5d} {failed:5d}")
    print("totals: " + ", ".join(f"{key} {value}" for key, value in totals.items()))
    if args.json:
        args.json.write_text(json.dumps({**totals, "failures": [str(f) for f in failures]}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
