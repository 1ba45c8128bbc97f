"""One MoE layer on the GPU: the original forms against `hpu_moe` on each of them, and the limit.

Mixtral-8x7B sizes (H 4096, I 14336, E 8, top-2) and Qwen3-30B-A3B sizes (H 2048, I 768, E 128, top-8),
bfloat16, tokens T in {1, 16, 128, 1024, 8192}, one set of weights and one router for every form:
- the transformers block with its `experts_implementation` "eager" (loop over hit experts, not
  compiled), "grouped_mm" and "batched_mm";
- the static dense loop over stacked weights (`form_catalog/static_dense_loop.py`);
- the grouped_mm form on stacks stored transposed ([E, H, 2I], [E, I, H]);
- a ModuleList of per-expert Linears run on their routed tokens (`form_catalog/mixtral4_sparse_loop.py`).
Each compiled form runs under inductor ("<form>+inductor") and under `hpu_moe` with the portable target
and inner inductor ("hpu_moe[<form>]"), where the layer becomes one `torch.ops.moe_passes.mixture_of_experts`
call. The limit is max(routed expert weight bytes / HBM bandwidth, FLOPs / bf16 matmul throughput),
both ceilings measured in this run. Each time is the median over calls timed with CUDA events, inputs
rotated so routing (and so the weights read) change every call, calls issued back to back (so a
host-bound call shows its host time); the variants are timed in `--rounds` interleaved rounds and the
median round is kept, because at small T the host time of one variant moves by up to 2x within a run.
A third table gives each call's GPU time alone (torch.profiler), which host jitter does not touch.

    python tools/bench_gpu.py --json docs/bench/gpu.json --plot docs/bench/gpu.png --markdown docs/bench/gpu.md
    python tools/bench_gpu.py --render run1.json run2.json --markdown gpu.md   # saved runs, no GPU
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import moe_passes  # noqa: E402
from form_catalog import hf_grouped_mm, mixtral4_sparse_loop, static_dense_loop  # noqa: E402
from form_catalog._common import settings  # noqa: E402
from form_catalog._sparse_loop import SparseLoopMoE  # noqa: E402
from form_catalog._stacked_experts import SparseMoeBlock  # noqa: E402
from tools.bench_kernel import kernel_us, limit_ms, measure_ceilings, time_ms  # noqa: E402

MODELS = {
    "Mixtral-8x7B": dict(hidden=4096, intermediate=14336, experts=8, top_k=2),
    "Qwen3-30B-A3B": dict(hidden=2048, intermediate=768, experts=128, top_k=8),
}
TOKENS = (1, 16, 128, 1024, 8192)
COMPILED = ("grouped_mm", "batched_mm", "static loop", "transposed", "ModuleList loop")
ORIGINAL = ("eager loop", *(f"{form}+inductor" for form in COMPILED))
REWRITTEN = tuple(f"hpu_moe[{form}]" for form in COMPILED)
ROUTING_AS_WRITTEN = "hpu_moe[static loop] routing as written"  # not in REWRITTEN: a side-by-side control
ROTATE = 4
DEVICE = "cuda"
GATHER_LIMIT_BYTES = 16 << 30  # batched_mm copies each routed expert's weights per (token, slot)


def transformers_block(name: str, sizes: dict, implementation: str):
    """The model's own transformers MoE block with `implementation` as its experts implementation."""
    if name.startswith("Mixtral"):
        from transformers import MixtralConfig as Config
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = Config(hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
                        num_local_experts=sizes["experts"], num_experts_per_tok=sizes["top_k"])
    else:
        from transformers import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = Config(hidden_size=sizes["hidden"], moe_intermediate_size=sizes["intermediate"],
                        num_experts=sizes["experts"], num_experts_per_tok=sizes["top_k"], norm_topk_prob=True)
    config = copy.deepcopy(config)
    config.experts_implementation = implementation
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = implementation
    with torch.device("meta"):
        block = Block(config)
    assert block.experts.config._experts_implementation == implementation, block.experts.config
    return block


def build(name: str, sizes: dict):
    """{form: module} sharing one set of bfloat16 weights on the GPU."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    e, h, i = sizes["experts"], sizes["hidden"], sizes["intermediate"]
    state = {
        "gate.weight": torch.randn(e, h, device=DEVICE, generator=generator) * h**-0.5,
        "experts.gate_up_proj": torch.randn(e, 2 * i, h, device=DEVICE, generator=generator) * h**-0.5,
        "experts.down_proj": torch.randn(e, h, i, device=DEVICE, generator=generator) * i**-0.5,
    }
    state = {k: v.bfloat16() for k, v in state.items()}
    blocks = {}
    for form, implementation in (("eager loop", "eager"), ("grouped_mm", "grouped_mm"), ("batched_mm", "batched_mm")):
        block = transformers_block(name, sizes, implementation)
        block.load_state_dict(state, assign=True, strict=False)
        blocks[form] = block.eval()
    cfg = settings(dict(dtype=torch.bfloat16, num_experts=e, top_k=sizes["top_k"], hidden=h, intermediate=i),
                   exclude=("activation",))
    with torch.device("meta"):
        static = static_dense_loop.StaticMoE(cfg)
    static.load_state_dict({"router.gate.weight": state["gate.weight"], "w13_weight": state["experts.gate_up_proj"],
                            "w2_weight": state["experts.down_proj"]}, assign=True)
    blocks["static loop"] = static.eval()
    with torch.device("meta"):
        transposed = SparseMoeBlock({**cfg, "activation": "silu"}, transposed_grouped_forward, is_transposed=True)
    transposed.load_state_dict({"gate.gate.weight": state["gate.weight"],
                                "experts.gate_up_proj": state["experts.gate_up_proj"].transpose(1, 2).contiguous(),
                                "experts.down_proj": state["experts.down_proj"].transpose(1, 2).contiguous()},
                               assign=True)
    blocks["transposed"] = transposed.eval()
    make_expert = lambda c: mixtral4_sparse_loop.MixtralExpert(c["hidden"], c["intermediate"])  # noqa: E731
    with torch.device("meta"):
        listed = SparseLoopMoE(cfg, make_expert)
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    listed_state = {"router.gate.weight": state["gate.weight"]}
    for e in range(sizes["experts"]):  # separate allocations per expert, as a ModuleList of Linears holds them
        listed_state[f"experts.{e}.w1.weight"] = gate_up[e, :i].clone()
        listed_state[f"experts.{e}.w3.weight"] = gate_up[e, i:].clone()
        listed_state[f"experts.{e}.w2.weight"] = down[e].clone()
    listed.load_state_dict(listed_state, assign=True)
    blocks["ModuleList loop"] = listed.eval()
    return blocks


def transposed_grouped_forward(self, hidden_states, top_k_index, top_k_weights):
    """The grouped_mm experts forward on stacks stored [E, H, 2I] and [E, I, H] (no transpose to apply)."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    offsets = torch.cumsum(hf_grouped_mm._tokens_per_expert(expert_ids, self.num_experts), 0, dtype=torch.int32)
    out = hf_grouped_mm._grouped_mm(hidden_states[perm // num_top_k], self.gate_up_proj, offsets)
    out = hf_grouped_mm._grouped_mm(self.apply_gate(out), self.down_proj, offsets)
    weighted = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    per_slot = torch.empty_like(weighted).index_copy_(0, perm, weighted)
    return per_slot.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def variants(blocks: dict, fused_forms, mode: str) -> dict:
    """Every timed variant. `mode` "reduce-overhead" replays CUDA graphs (inductor's cudagraph trees)."""
    inductor = lambda m: torch.compile(m, backend="inductor", mode=mode)  # noqa: E731
    if mode == "reduce-overhead":  # torch.compile takes mode or options: hpu_moe's defaults are inductor+portable
        rewrite = lambda m: torch.compile(m, backend=moe_passes.hpu_moe, mode=mode)  # noqa: E731
    else:
        rewrite = lambda m: torch.compile(m, backend=moe_passes.hpu_moe,  # noqa: E731
                                          options={"inner": "inductor", "target": "portable"})
    fns = {"eager loop": blocks["eager loop"]}
    fns.update({f"{form}+inductor": inductor(blocks[form]) for form in COMPILED})
    fns.update({f"hpu_moe[{form}]": rewrite(blocks[form]) for form in fused_forms})
    # Side by side with hpu_moe[static loop]: the same rewrite with its routing left to inductor.
    unfused = functools.partial(moe_passes.hpu_moe, mode=None if mode == "default" else mode,
                                options={"inner": "inductor", "target": "portable", "fuse_routing": False})
    fns[ROUTING_AS_WRITTEN] = torch.compile(blocks["static loop"], backend=unfused)
    return fns


def bench_model(name: str, sizes: dict, tokens_list, ceilings: dict, deadline: float, mode: str,
                forms=(), rounds: int = 3) -> list[dict]:
    blocks = build(name, sizes)
    fused_forms = []
    with torch.no_grad():  # the forms hpu_moe fuses with the installed transformers (all, expectedly)
        x = torch.randn(1, 16, sizes["hidden"], device=DEVICE, dtype=torch.bfloat16)
        for form in COMPILED:
            torch._dynamo.reset()
            report = moe_passes.explain(blocks[form], x, options={"inner": "eager", "target": "portable"})
            print(f"{name} {form}: hpu_moe fused {len(report.fused)} layer(s) "
                  + "; ".join(f"{f.form} -> {f.overload}" for f in report.fused)
                  + "; ".join(f"declined {d.form}: {d.reason}" for d in report.declined), flush=True)
            if len(report.fused) == 1:
                fused_forms.append(form)
    assert fused_forms, "hpu_moe fused none of the forms"
    torch._dynamo.reset()
    fns = {form: fn for form, fn in variants(blocks, fused_forms, mode).items() if not forms or form in forms}
    rows = []
    for tokens in tokens_list:
        g = torch.Generator(device=DEVICE).manual_seed(tokens)
        inputs = [(torch.randn(1, tokens, sizes["hidden"], device=DEVICE, dtype=torch.bfloat16, generator=g),)
                  for _ in range(ROTATE)]
        gate = blocks["grouped_mm"].gate.weight.float()
        with torch.no_grad():  # the routing each input gets (softmax keeps the order of the logits)
            ids = [torch.topk(x.reshape(tokens, -1).float() @ gate.T, sizes["top_k"], -1).indices for (x,) in inputs]
        row = {"model": name, "tokens": tokens, "hpu_moe forms": fused_forms,
               "limit_ms": limit_ms(ids, sizes["hidden"], sizes["intermediate"], sizes["top_k"], ceilings)}
        reps = {}
        with torch.no_grad():
            expected = blocks["eager loop"](*inputs[0]).float()
            for form, fn in fns.items():
                gathered = tokens * sizes["top_k"] * 3 * sizes["hidden"] * sizes["intermediate"] * 2
                if "batched_mm" in form and "hpu_moe" not in form and gathered > GATHER_LIMIT_BYTES:
                    row[form] = None
                    row[form + " note"] = f"not run: gathers {gathered / 2**30:.0f} GiB of weights"
                    continue
                if time.time() > deadline:
                    row[form] = None
                    row[form + " note"] = "not run: time budget spent"
                    continue
                skips, graphs = counters["inductor"]["cudagraph_skips"], counters["stats"]["unique_graphs"]
                start = time.perf_counter()
                out = fn(*inputs[0]).float()
                first = time.perf_counter() - start
                row[form + " first call s"] = round(first, 2)  # compiles included
                row[form + " graphs compiled"] = counters["stats"]["unique_graphs"] - graphs
                if mode == "reduce-overhead":  # a skipped graph runs without CUDA graphs: say so
                    row[form + " cudagraph skips"] = counters["inductor"]["cudagraph_skips"] - skips
                row[form + " error"] = ((out - expected).norm() / expected.norm()).item()
                start = time.perf_counter()
                fn(*inputs[1 % len(inputs)])
                torch.cuda.synchronize()
                reps[form] = 40 if time.perf_counter() - start < 0.02 else 5  # many reps where they are cheap
            for _ in range(rounds):  # interleaved: host jitter and drift spread over every variant alike
                for form, n in reps.items():
                    row.setdefault(form + " rounds", []).append(
                        time_ms(fns[form], inputs, reps=n, warmup=5 if n > 5 else 1))
            for form, n in reps.items():
                row[form] = statistics.median(row[form + " rounds"])
                row[form + " gpu ms"] = sum(kernel_us(fns[form], inputs, reps=min(n, 20)).values()) / 1000
        originals = [(row[f], f) for f in ORIGINAL if row.get(f)]
        if originals:
            row["best original"], row["best original form"] = min(originals)
        rewritten = [(row[f], f) for f in REWRITTEN if row.get(f)]
        if rewritten:
            (row["best hpu_moe"], row["best hpu_moe form"]), (row["worst hpu_moe"], row["worst hpu_moe form"]) = (
                min(rewritten), max(rewritten))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _ms(value) -> str:
    return f"{value:.3f}" if value else "n/a"


def markdown(result: dict) -> str:
    """Three tables: the original forms against hpu_moe's slowest form, hpu_moe on every form, and the
    GPU time alone of the best original against hpu_moe's slowest form (runs without it show none)."""
    head = (f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}, bfloat16, "
            f"torch.compile mode {result.get('mode', 'default')!r}, "
            f"{result['date']}; HBM {result['ceilings']['hbm_bytes_per_s'] / 1e12:.2f} TB/s and bf16 matmul "
            f"{result['ceilings']['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s measured in the same run.")
    if len(result.get("commands", [])) > 1:
        head += (f" Rows from {len(result['commands'])} runs (one per model); the ceilings above are the first run's,"
                 " each row's limit uses its own run's.")
    lines = [head, "",
             "| model | T | limit ms | " + " | ".join(f"{f} ms" for f in ORIGINAL)
             + " | hpu_moe ms (slowest form) | best original / hpu_moe | hpu_moe / limit |",
             "|---|---|---|" + "---|" * len(ORIGINAL) + "---|---|---|"]
    for r in result["rows"]:
        worst = r.get("worst hpu_moe")
        ratio = f"{r['best original'] / worst:.2f}x" if worst and r.get("best original") else "n/a"
        gap = f"{worst / r['limit_ms']:.2f}x" if worst else "n/a"
        lines.append(f"| {r['model']} | {r['tokens']} | {r['limit_ms']:.3f} | "
                     + " | ".join(_ms(r.get(f)) for f in ORIGINAL) + f" | {_ms(worst)} | {ratio} | {gap} |")
    shown = (*REWRITTEN, *([ROUTING_AS_WRITTEN] if any(r.get(ROUTING_AS_WRITTEN) for r in result["rows"]) else []))
    lines += ["", "| model | T | " + " | ".join(f"{f} ms" for f in shown) + " | slowest / fastest form |",
              "|---|---|" + "---|" * len(shown) + "---|"]
    for r in result["rows"]:
        spread = f"{r['worst hpu_moe'] / r['best hpu_moe']:.2f}x" if r.get("worst hpu_moe") else "n/a"
        lines.append(f"| {r['model']} | {r['tokens']} | " + " | ".join(_ms(r.get(f)) for f in shown)
                     + f" | {spread} |")
    if not any(k.endswith(" gpu ms") for r in result["rows"] for k in r):
        return "\n".join(lines) + "\n"
    lines += ["", "GPU time per call alone (torch.profiler: the kernels' time, the host's excluded):", "",
              "| model | T | best original GPU ms | form | slowest hpu_moe GPU ms | form | best original / hpu_moe |",
              "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        originals = [(r[f + " gpu ms"], f) for f in ORIGINAL if r.get(f + " gpu ms")]
        rewritten = [(r[f + " gpu ms"], f) for f in REWRITTEN if r.get(f + " gpu ms")]
        if originals and rewritten:
            (best, best_form), (worst, worst_form) = min(originals), max(rewritten)
            lines.append(f"| {r['model']} | {r['tokens']} | {best:.3f} | {best_form} | {worst:.3f} | {worst_form} | "
                         f"{best / worst:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in result["rows"] if r["model"] == model]
        for form in (*ORIGINAL, "worst hpu_moe"):
            points = [(r["tokens"], r[form] / r["limit_ms"]) for r in rows if r.get(form)]
            if points:
                label = "hpu_moe (slowest form)" if form == "worst hpu_moe" else form
                ax.plot(*zip(*points, strict=True), marker="o", label=label,
                        linewidth=2.5 if form == "worst hpu_moe" else 1)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="physical limit")
        ax.axhline(1.3, color="grey", linestyle=":", linewidth=1, label="1.3x limit")
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="time / physical limit", title=model)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"One MoE layer, bf16, compile mode {result.get('mode', 'default')!r}, {result['device']} "
                 f"({result['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--budget-s", type=float, default=480, help="skip variants once this many seconds passed")
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"],
                        help="torch.compile mode of every compiled variant")
    parser.add_argument("--forms", nargs="*", default=[], help="time only these variants (names as in the tables)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per size (median taken)")
    parser.add_argument("--merge", nargs="*", default=[], help="JSON results of earlier runs (other models) to add")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--markdown")
    parser.add_argument("--render", nargs="*", default=[],
                        help="no run: tables and plot from these saved runs' JSON (rows in order, header of the first)")
    args = parser.parse_args(argv)
    if args.render:
        return render(args)
    import transformers

    deadline = time.time() + args.budget_s
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # the ModuleList loop's torch.where
    ceilings = measure_ceilings()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "date": datetime.date.today().isoformat(),
              "command": "python tools/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "mode": args.mode, "ceilings": ceilings, "rows": []}
    print(f"{result['device']}: HBM {ceilings['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceilings['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    for name in args.models:
        result["rows"] += bench_model(name, MODELS[name], args.tokens, ceilings, deadline, args.mode, args.forms,
                                      args.rounds)
        if args.json:  # after each model: a run the device's time limit stops keeps what it measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    for path in args.merge:  # one model per run keeps each run under the device's time limit
        with open(path) as f:
            result["rows"] += json.load(f)["rows"]
    write(result, args)
    return 0


def write(result: dict, args) -> None:
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.plot:
        plot(result, args.plot)


def render(args) -> int:
    """The tables and plot of saved runs (one model each, say), without a GPU."""
    runs = []
    for path in args.render:
        with open(path) as f:
            runs.append(json.load(f))
    result = {**runs[0], "rows": [row for run in runs for row in run["rows"]],
              "commands": [run.get("command") for run in runs]}
    write(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
