"""What the capture layer costs code that does not use `hpu_moe`: other backends' compiles, eager calls.

For catalog forms whose classes the adapters take, in fresh processes:
  - `torch._dynamo.explain` (the eager backend) of each form: graphs, breaks and guards in a process
    that never imported moe_passes, after `import moe_passes`, and after an `hpu_moe` compile of the
    same forms (when the adapted forwards exist);
  - after the hpu_moe compile, an eager forward of the adapted block through the installed forward and
    through the user's own, alternated in one process (median of 2,000 calls each).

    python tools/adapter_scope.py                 # markdown table on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMS = {"hf4_hit_expert_loop": "HitExpertLoopMoE", "deepseek_v2_count_loop": "CountLoopMoE",
         "mistral_where_loop": "WhereLoopMoE"}  # form: its block the adapters take
STATES = {
    "never imported": "",
    "imported": "import moe_passes",
    "after an hpu_moe compile": "import moe_passes\nuse_hpu_moe()",
}

_SCRIPT = """
import json, statistics, sys, time, torch
sys.path.insert(0, {root!r})
from form_catalog import catalog, dynamo_config
FORMS = {forms!r}

def use_hpu_moe():
    for name in FORMS:
        form = catalog()[name]
        model, inputs = form.build()
        torch._dynamo.reset()
        with torch.no_grad(), dynamo_config(form):
            torch.compile(model, backend="hpu_moe", options={{"inner": "eager"}})(*inputs)

{setup}
rows = {{}}
for name, block_class in FORMS.items():
    form = catalog()[name]
    model, inputs = form.build()
    torch._dynamo.reset()
    with torch.no_grad(), dynamo_config(form):
        out = torch._dynamo.explain(model)(*inputs)
    rows[name] = {{"graphs": out.graph_count, "breaks": out.graph_break_count,
                   "guards": len(out.out_guards or []), "block": block_class}}
    block = next(m for m in model.modules() if type(m).__qualname__ == block_class)
    own = getattr(type(block).forward, "__moe_passes_original__", None)
    if own is None:
        continue
    seen = []
    hook = block.register_forward_pre_hook(lambda module, a: seen.append(a))
    with torch.no_grad():
        model(*inputs)
    hook.remove()
    args = seen[0]
    timings = {{"installed": [], "own": []}}
    with torch.no_grad():
        for _ in range(2000):
            for which, call in (("installed", lambda: block(*args)), ("own", lambda: own(block, *args))):
                start = time.perf_counter()
                call()
                timings[which].append(time.perf_counter() - start)
    rows[name].update({{k + "_us": statistics.median(v) * 1e6 for k, v in timings.items()}})
print(json.dumps(rows))
"""


def measure(setup: str) -> dict:
    code = _SCRIPT.format(root=ROOT, forms=FORMS, setup=setup)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args(argv)
    results = {state: measure(setup) for state, setup in STATES.items()}
    print(f"torch {__import__('torch').__version__}; another backend: `torch._dynamo.explain` (eager)\n")
    print("| form (block) | state | graphs | breaks | guards |")
    print("|---|---|---|---|---|")
    for name in FORMS:
        for state, rows in results.items():
            row = rows[name]
            print(f"| {name} ({row['block']}) | {state} | {row['graphs']} | {row['breaks']} | {row['guards']} |")
    print("\nEager forward of the adapted block after an hpu_moe compile, median of 2,000 alternated calls:\n")
    print("| block | installed forward (us) | the user's own (us) | ratio |")
    print("|---|---|---|---|")
    for name in FORMS:
        row = results["after an hpu_moe compile"][name]
        if "own_us" in row:
            print(f"| {row['block']} | {row['installed_us']:.1f} | {row['own_us']:.1f} | "
                  f"{row['installed_us'] / row['own_us']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
