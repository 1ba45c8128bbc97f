"""Forward + backward of one MoE layer on the GPU: the original forms under inductor against hpu_moe.

Mixtral-8x7B sizes (H 4096, I 14336, E 8, top-2) and Qwen3-30B-A3B sizes (H 2048, I 768, E 128, top-8),
bfloat16, 4,096 and 16,384 tokens, one set of weights and one router for every form:
- "grouped_mm": the model's own transformers block with `experts_implementation="grouped_mm"` (PyTorch's
  grouped GEMM, whose autograd gives the backward), compiled with inductor;
- "torchtitan": torchtitan's grouped experts (`form_catalog/torchtitan_grouped_experts.py`: argsort,
  gather, three grouped GEMMs, scatter_add), compiled with inductor;
- "hpu_moe[<form>]": the same module compiled with `hpu_moe` (portable target, inner inductor), where the
  layer becomes one `mixture_of_experts` call with its recompute backward, and "hpu_moe[<form>] saved"
  with the option `recompute=False` (the call written as grouped matmuls whose activations are saved).
A step is `layer(x).backward(dy)` with the parameters and x requiring grad (gradients set to None before
each step). Time: median of CUDA-event times over back-to-back steps, variants interleaved over
`--rounds` rounds, median round kept. Memory: peak allocated during a step above what was allocated
before it. Each rewritten variant's output and gradients are compared with its original's (bfloat16).

    python tools/bench_training.py --json docs/bench/training_gpu.json --markdown docs/bench/training_gpu.md
    python tools/bench_training.py --render docs/bench/training_gpu.json --markdown docs/bench/training_gpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import moe_passes  # noqa: E402
from form_catalog._common import settings  # noqa: E402
from form_catalog.torchtitan_grouped_experts import GroupedExpertsMoE  # noqa: E402
from tools.bench_gpu import MODELS, transformers_block  # noqa: E402
from tools.bench_kernel import time_ms  # noqa: E402

TOKENS = (4096, 16384)
# A small Qwen3-MoE-shaped layer that compiles in seconds: checks the tool itself (--models smoke).
SIZES = {**MODELS, "smoke": dict(hidden=256, intermediate=256, experts=8, top_k=2)}
FORMS = ("grouped_mm", "torchtitan")
DEVICE = "cuda"


def build(name: str, sizes: dict) -> dict[str, torch.nn.Module]:
    """{form: module} sharing one set of bfloat16 weights (the down projection, gate and up alike)."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    e, h, i = sizes["experts"], sizes["hidden"], sizes["intermediate"]
    gate = (torch.randn(e, h, device=DEVICE, generator=generator) * h**-0.5).bfloat16()
    gate_up = (torch.randn(e, 2 * i, h, device=DEVICE, generator=generator) * h**-0.5).bfloat16()
    down = (torch.randn(e, h, i, device=DEVICE, generator=generator) * i**-0.5).bfloat16()
    block = transformers_block(name, sizes, "grouped_mm")
    block.load_state_dict({"gate.weight": gate, "experts.gate_up_proj": gate_up.clone(),
                           "experts.down_proj": down.clone()}, assign=True, strict=False)
    cfg = settings(dict(dtype=torch.bfloat16, num_experts=e, top_k=sizes["top_k"], hidden=h, intermediate=i),
                   exclude=("routing", "router_fp32"))
    with torch.device("meta"):
        titan = GroupedExpertsMoE(cfg)
    titan.load_state_dict({"router.gate.weight": gate.clone(), "w1": gate_up[:, :i].contiguous(),
                           "w3": gate_up[:, i:].contiguous(), "w2": down.clone()}, assign=True)
    modules = {"grouped_mm": block, "torchtitan": titan}
    for module in modules.values():
        module.train().requires_grad_(True)
    return modules


def first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def step_fn(compiled, module):
    params = list(module.parameters())

    def step(x, dy):
        for p in params:
            p.grad = None
        x.grad = None
        first_tensor(compiled(x)).backward(dy)

    return step


def compile_variants(modules: dict) -> dict:
    """{variant: step}: each module compiled with inductor, and with hpu_moe recomputing or saving activations."""
    steps = {}
    for form, module in modules.items():
        steps[form] = step_fn(torch.compile(module, backend="inductor", dynamic=False), module)
        for variant, recompute in ((f"hpu_moe[{form}]", True), (f"hpu_moe[{form}] saved", False)):
            options = {"target": "portable", "inner": "inductor", "recompute": recompute}
            compiled = torch.compile(module, backend="hpu_moe", options=options, dynamic=False)
            steps[variant] = step_fn(compiled, module)
    return steps


def peak_mib(step, inputs) -> float:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(*inputs[0])
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def gradients(step, module, x, dy) -> list[torch.Tensor]:
    step(x, dy)
    return [x.grad.clone(), *(p.grad.clone() for p in module.parameters())]


def max_relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12)).item()
               for g, w in zip(got, want, strict=True))


def run_model(name: str, sizes: dict, tokens: list[int], rounds: int, reps: int) -> list[dict]:
    modules = build(name, sizes)
    with moe_passes.explaining() as session:
        rows = _run_sizes(name, modules, compile_variants(modules), sizes, tokens, rounds, reps)
    fused = [line.strip() for line in str(session.report).splitlines() if "fused (training)" in line]
    for row in rows:
        row["fused_training_layers"] = len(fused)  # over every variant and size of this model
        row["fused"] = fused
    del modules
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def _run_sizes(name, modules, steps, sizes, tokens, rounds, reps) -> list[dict]:
    rows = []
    for t in tokens:
        generator = torch.Generator(device=DEVICE).manual_seed(t)
        inputs = [(torch.randn(1, t, sizes["hidden"], device=DEVICE, generator=generator).bfloat16().requires_grad_(),
                   torch.randn(1, t, sizes["hidden"], device=DEVICE, generator=generator).bfloat16())
                  for _ in range(2)]
        compile_s = {}
        for variant, step in steps.items():  # compile (and warm up) every variant at this size
            started = time.time()
            step(*inputs[0])
            step(*inputs[1])
            torch.cuda.synchronize()
            compile_s[variant] = round(time.time() - started, 1)
        errors = {}
        for form, module in modules.items():
            want = gradients(steps[form], module, *inputs[0])
            for variant in (f"hpu_moe[{form}]", f"hpu_moe[{form}] saved"):
                errors[variant] = max_relative_error(gradients(steps[variant], module, *inputs[0]), want)
        per_round = {variant: [] for variant in steps}
        for _ in range(rounds):
            for variant, step in steps.items():
                per_round[variant].append(time_ms(step, inputs, reps=reps, warmup=0))
        memory = {variant: peak_mib(step, inputs) for variant, step in steps.items()}
        for variant in steps:
            rows.append({"model": name, "tokens": t, "variant": variant,
                         "ms": statistics.median(per_round[variant]), "rounds_ms": per_round[variant],
                         "peak_mib": round(memory[variant], 1), "compile_and_warmup_s": compile_s[variant],
                         "grad_rel_error": errors.get(variant)})
    return rows


def markdown(result: dict) -> str:
    lines = [f"Forward + backward of one MoE layer, bfloat16, {result['device']} (torch {result['torch']}, "
             f"transformers {result['transformers']}), {result['date']}. Commands: `{result['command']}`.", "",
             "hpu_moe recomputes the projections in the backward (the default) or, with `recompute=False`, "
             "saves them (\"saved\").", "",
             "| model | tokens | form | inductor ms | hpu_moe ms | speed-up | saved ms | speed-up "
             "| inductor peak MiB | hpu_moe peak MiB | saved peak MiB | grad rel. error (saved) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = {(r["model"], r["tokens"], r["variant"]): r for r in result["rows"]}
    for (model, tokens, variant), row in rows.items():
        if variant not in FORMS:
            continue
        ours = rows.get((model, tokens, f"hpu_moe[{variant}]"))
        saved = rows.get((model, tokens, f"hpu_moe[{variant}] saved"))
        if ours is None or saved is None:
            continue
        lines.append(f"| {model} | {tokens} | {variant} | {row['ms']:.2f} | {ours['ms']:.2f} | "
                     f"{row['ms'] / ours['ms']:.2f}x | {saved['ms']:.2f} | {row['ms'] / saved['ms']:.2f}x | "
                     f"{row['peak_mib']:.0f} | {ours['peak_mib']:.0f} | {saved['peak_mib']:.0f} | "
                     f"{ours['grad_rel_error']:.2e} ({saved['grad_rel_error']:.2e}) |")
    fused = {row["model"]: row.get("fused_training_layers") for row in result["rows"]}
    lines += ["", "Layers the hpu_moe report lists as fused (training), over all forms and sizes of a model: "
              + ", ".join(f"{model} {count}" for model, count in fused.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(SIZES))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--render", nargs="*", default=[], help="saved JSON runs to render (no GPU)")
    args = parser.parse_args(argv)
    if args.render:
        runs = [json.load(open(path)) for path in args.render]
        result = {**runs[0], "rows": [row for run in runs for row in run["rows"]],
                  "command": "`; `".join(run["command"] for run in runs)}
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU", file=sys.stderr)
            return 2
        import transformers

        rows = []
        for name in args.models:
            rows += run_model(name, SIZES[name], args.tokens, args.rounds, args.reps)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "date": datetime.date.today().isoformat(),
                  "command": "python tools/bench_training.py " + " ".join(argv or sys.argv[1:]), "rows": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    text = markdown(result)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
