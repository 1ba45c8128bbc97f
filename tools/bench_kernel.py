"""The fused MoE Triton kernel alone: correctness against float32 references, then time against the limit.

For one MoE layer at Mixtral-8x7B and Qwen3-30B-A3B sizes (bfloat16, random routing that changes
every call, so weights come from HBM and not from L2), prints the kernel's time, the portable op's
grouped-matmul path and the physical limit max(routed weight bytes / HBM bandwidth, FLOPs / matmul
throughput), both ceilings measured at the start of the same run. `--sweep` searches the tile
configurations at each size, one GEMM at a time (the data behind `moe_passes/kernels/config.py`);
`--profile` splits one call into its kernels; `--group-m` times the table's tiles with each GROUP_M
(row blocks per column sweep); `--align` times the alignment's two paths. From `--gemm-tokens` on,
each row also gives every kernel's GPU time, each GEMM's throughput against the matmul ceiling and,
where the table picks the persistent TMA down kernel, the call's time with the pointer down kernel
instead.

    python tools/bench_kernel.py                # check + time
    python tools/bench_kernel.py --sweep --tokens 1 16 128
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from moe_passes import fused_op, reference, routing_op, stacks  # noqa: E402
from moe_passes.kernels import MoEConfig, TileConfig, choose_config, triton_kernels  # noqa: E402
from moe_passes.kernels.align import check_alignment  # noqa: E402

MODELS = {
    "mixtral-8x7b": dict(hidden=4096, intermediate=14336, experts=8, top_k=2),
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, experts=128, top_k=8),
}
TOKENS = (1, 16, 128, 1024, 8192)
ROTATE = 8  # routing tables cycled through while timing
GROUP_MS = (4, 8, 16, 32)  # `--group-m`


def time_ms(fn, inputs, reps: int = 30, warmup: int = 3) -> float:
    """Median of CUDA-event times of `fn(*inputs[i % len])`, one event pair per call."""
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(*inputs[i % len(inputs)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def measure_ceilings() -> dict:
    """HBM bandwidth (a 4 GiB device copy, bytes read + written) and bf16 matmul throughput (8192^3)."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = time_ms(dst.copy_, [(src,)], reps=20)
    bandwidth = 2 * src.numel() * 4 / (copy_ms * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = time_ms(lambda: a @ b, [()], reps=20)
    return {"hbm_bytes_per_s": bandwidth, "matmul_flop_per_s": 2 * 8192**3 / (mm_ms * 1e-3)}


def routing(tokens: int, experts: int, top_k: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def limit_ms(ids_list, hidden: int, inter: int, top_k: int, ceilings: dict, itemsize: int = 2) -> float:
    """max(routed weight bytes / bandwidth, FLOPs / throughput), averaged over the rotated routings."""
    limits = []
    for ids in ids_list:
        routed = torch.unique(ids).numel()
        weight_bytes = routed * 3 * hidden * inter * itemsize
        flops = 2 * ids.numel() * 3 * hidden * inter
        limits.append(
            max(weight_bytes / ceilings["hbm_bytes_per_s"], flops / ceilings["matmul_flop_per_s"]) * 1e3
        )
    return statistics.mean(limits)


def make_layer(hidden, intermediate, experts, seed=0, dtype=torch.bfloat16, permuted=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape12, shape3 = ((experts, 2 * intermediate, hidden), (experts, hidden, intermediate))
    if not permuted:
        shape12, shape3 = (experts, hidden, 2 * intermediate), (experts, intermediate, hidden)
    w12 = (torch.randn(shape12, device="cuda", generator=g) * hidden**-0.5).to(dtype)
    w3 = (torch.randn(shape3, device="cuda", generator=g) * intermediate**-0.5).to(dtype)
    return w12, w3


def rel_error(actual, expected) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def check(args) -> None:
    """Kernel == float32 reference on small shapes (every branch) and on the two models' shapes."""
    kernels = triton_kernels()
    op = torch.ops.moe_passes.mixture_of_experts
    worst = 0.0
    cases = []
    for permuted, activation, dtype in itertools.product((True, False), ("silu", "gelu", "relu"), (torch.bfloat16, torch.float16)):
        for tokens, hidden, inter, experts, top_k, emin, held in (
            (1, 64, 32, 8, 2, 0, 8), (37, 96, 80, 16, 3, 0, 16), (300, 128, 64, 16, 4, 4, 8), (5, 64, 48, 4, 4, 0, 4)
        ):
            cases.append((permuted, activation, dtype, tokens, hidden, inter, experts, top_k, emin, held))
    for permuted, activation, dtype, tokens, hidden, inter, experts, top_k, emin, held in cases:
        g = torch.Generator(device="cuda").manual_seed(tokens * 7 + held)
        x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
        ids, w = routing(tokens, experts, top_k, tokens + experts, dtype)
        w12, w3 = make_layer(hidden, inter, held, seed=tokens, dtype=dtype, permuted=permuted)
        l12, l3 = list(w12.unbind(0)), list(w3.unbind(0))
        args_ = (x, ids, w, l12, l3, permuted, activation, emin, emin + held - 1)
        for config_m in (16, 64):
            table_layout = kernels.align(ids.contiguous(), emin, held, config_m)
            check_alignment(ids, emin, held, config_m, *table_layout)
        out = op.fused_weights(*args_)
        expected = reference.mixture_of_experts_fused_weights_reference(*args_)
        err = rel_error(out, expected)
        assert torch.isfinite(out).all() and err < 1e-2, (permuted, activation, dtype, tokens, err)
        worst = max(worst, err)
        inter_ = inter
        w1 = [t[:inter_] if permuted else t[:, :inter_] for t in l12]
        w2 = [t[inter_:] if permuted else t[:, inter_:] for t in l12]
        # .default with separate stacks
        w1s = torch.stack(w1).contiguous().unbind(0)
        w2s = torch.stack(w2).contiguous().unbind(0)
        out = op.default(x, ids, w, list(w1s), list(w2s), l3, permuted, activation, emin, emin + held - 1)
        expected = reference.mixture_of_experts_reference(x, ids, w, w1, w2, l3, permuted, activation, emin, emin + held - 1)
        err = rel_error(out, expected)
        assert err < 1e-2, ("default", permuted, activation, dtype, tokens, err)
        worst = max(worst, err)
    print(f"kernel check: {len(cases)} small cases x 2 overloads agree with the reference (worst rel err {worst:.2e})")
    for name, sizes in MODELS.items():
        w12, w3 = make_layer(sizes["hidden"], sizes["intermediate"], sizes["experts"])
        for tokens in (1, 128):
            x = torch.randn(tokens, sizes["hidden"], device="cuda", dtype=torch.bfloat16)
            ids, w = routing(tokens, sizes["experts"], sizes["top_k"], tokens)
            l12, l3 = list(w12.unbind(0)), list(w3.unbind(0))
            out = op.fused_weights(x, ids, w, l12, l3, True, "silu", 0, sizes["experts"] - 1)
            expected = fused_op._combine(
                x.float(), ids, w.float(), 0, sizes["experts"],
                fused_op._swiglu_expert(lambda i, h: torch.nn.functional.linear(h, w12[i].float()).chunk(2, -1),  # noqa: B023 (called at once)
                                        [t.float() for t in l3], torch.nn.functional.silu, True),
            )
            err = rel_error(out, expected)
            assert err < 1e-2, (name, tokens, err)
            print(f"kernel check {name} T={tokens}: rel err {err:.2e}")


def grouped_path(x, ids, w, w12, w3, sizes):
    return fused_op._grouped_fused(x, ids, w, (w12,), w3, True, torch.nn.functional.silu, 0, sizes["experts"])


def bench(args, ceilings) -> list[dict]:
    kernels = triton_kernels()
    op = torch.ops.moe_passes.mixture_of_experts
    rows = []
    for name in args.models:
        sizes = MODELS[name]
        w12, w3 = make_layer(sizes["hidden"], sizes["intermediate"], sizes["experts"])
        l12, l3 = list(w12.unbind(0)), list(w3.unbind(0))
        inter = sizes["intermediate"]
        for tokens in args.tokens:
            x = torch.randn(tokens, sizes["hidden"], device="cuda", dtype=torch.bfloat16)
            routings = [routing(tokens, sizes["experts"], sizes["top_k"], seed) for seed in range(ROTATE)]
            inputs = [(x, ids, w) for ids, w in routings]
            limit = limit_ms([ids for ids, _ in routings], sizes["hidden"], inter, sizes["top_k"], ceilings)
            row = {"model": name, "tokens": tokens, "limit_ms": limit}
            row["op_ms"] = time_ms(lambda x, i, w: op.fused_weights(x, i, w, l12, l3, True, "silu", 0, sizes["experts"] - 1), inputs)  # noqa: B023 (called at once)
            row["grouped_ms"] = time_ms(lambda x, i, w: grouped_path(x, i, w, w12, w3, sizes), inputs)  # noqa: B023 (called at once)
            gate, up = w12[:, :inter], w12[:, inter:]
            row["kernel_ms"] = time_ms(lambda x, i, w: kernels.fused_moe(x, i, w, gate, up, w3, True, "silu", 0), inputs)  # noqa: B023 (called at once)
            if tokens >= args.gemm_tokens:  # each kernel's GPU time, and each GEMM's share of the matmul ceiling
                per_kernel = kernel_us(lambda x, i, w: kernels.fused_moe(x, i, w, gate, up, w3, True, "silu", 0), inputs)  # noqa: B023
                row["kernel_us"] = per_kernel
                flops = 2 * tokens * sizes["top_k"] * sizes["hidden"] * inter
                for gemm, kernel, gemm_flops in (("gate_up", "_gate_up_kernel", 2 * flops), ("down", "_down_kernel", flops)):
                    us = sum(t for k, t in per_kernel.items() if k.startswith(kernel))
                    row[f"{gemm}_of_matmul_ceiling"] = gemm_flops / (us * 1e-6) / ceilings["matmul_flop_per_s"]
            table_config = choose_config(tokens * sizes["top_k"], sizes["experts"])
            if table_config.down.persistent_tma:  # the same call with the pointer down kernel, side by side
                pointer = dataclasses.replace(table_config, down=dataclasses.replace(table_config.down, persistent_tma=False))
                row["kernel_pointer_down_ms"] = time_ms(
                    lambda x, i, w: kernels.fused_moe(x, i, w, gate, up, w3, True, "silu", 0, pointer), inputs)  # noqa: B023
                if tokens >= args.gemm_tokens:  # the two down kernels' GPU times, free of host noise
                    pointer_us = kernel_us(
                        lambda x, i, w: kernels.fused_moe(x, i, w, gate, up, w3, True, "silu", 0, pointer), inputs)  # noqa: B023
                    row["down_us"] = {k: v for k, v in row["kernel_us"].items() if k.startswith("_down_kernel")}
                    row["down_us"].update({k: v for k, v in pointer_us.items() if k.startswith("_down_kernel")})
            if args.in_out:  # the same weights stored [E, in, out] (transposed stacks)
                gate_t, up_t, down_t = (t.transpose(1, 2).contiguous() for t in (gate, up, w3))
                row["kernel_in_out_ms"] = time_ms(
                    lambda x, i, w: kernels.fused_moe(x, i, w, gate_t, up_t, down_t, False, "silu", 0), inputs)  # noqa: B023
                if choose_config(tokens * sizes["top_k"], sizes["experts"], permuted=False) != table_config:
                    # side by side: the [E, out, in] layout's tiles on these weights
                    row["kernel_in_out_with_out_in_tiles_ms"] = time_ms(
                        lambda x, i, w: kernels.fused_moe(x, i, w, gate_t, up_t, down_t, False, "silu", 0, table_config),  # noqa: B023
                        inputs)
                if args.sweep and tokens in args.sweep_tokens:
                    row["sweep_in_out_best_ms"], row["sweep_in_out_best"] = sweep(
                        kernels, inputs, gate_t, up_t, down_t, tokens * sizes["top_k"], sizes["experts"], permuted=False)
                del gate_t, up_t, down_t
            if args.group_m:
                row["group_m_us"] = group_sweep(kernels, inputs, gate, up, w3, tokens * sizes["top_k"], sizes["experts"])
                if args.in_out:
                    gate_t, up_t, down_t = (t.transpose(1, 2).contiguous() for t in (gate, up, w3))
                    row["group_m_in_out_us"] = group_sweep(
                        kernels, inputs, gate_t, up_t, down_t, tokens * sizes["top_k"], sizes["experts"], permuted=False)
                    del gate_t, up_t, down_t
            if args.sweep and tokens in args.sweep_tokens:
                best = sweep(kernels, inputs, gate, up, w3, tokens * sizes["top_k"], sizes["experts"])
                row["sweep_best_ms"], row["sweep_best"] = best
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def kernel_us(fn, inputs, reps: int = 20) -> dict:
    """GPU microseconds per call of each kernel `fn` launches (torch.profiler; host time excluded)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(*inputs[i % len(inputs)])
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / reps for e in prof.key_averages() if e.self_device_time_total > 0}


def sweep(kernels, inputs, gate, up, down, pairs, experts, permuted=True):
    """Best (ms, config) by coordinate search: per block_m, every gate/up tile with the table's down tile,
    then every down tile with the best gate/up tile. Tiles that do not fit (shared memory) time as inf."""
    default = choose_config(pairs, experts, permuted)
    m = pairs / experts
    block_ms = [16] if m <= 4 else [16, 32] if m <= 16 else [32, 64] if m <= 64 else [64, 128]
    block_ns = (32, 64, 128) if m <= 16 else (64, 128, 256)

    def timed(cfg):
        try:
            return time_ms(lambda x, i, w: kernels.fused_moe(x, i, w, gate, up, down, permuted, "silu", 0, cfg), inputs, reps=10)  # noqa: B023
        except Exception:  # out of shared memory and the like
            return float("inf")

    best = (timed(default), default)
    for bm in block_ms:
        down_tile = dataclasses.replace(default.down, block_m=bm)
        gate_ups = [TileConfig(bm, bn, bk, default.gate_up.group_m, warps, stages)
                    for bn, bk, warps, stages in itertools.product(block_ns[:2], (64, 128), (4, 8), (3, 4))]
        gate_up = min(gate_ups, key=lambda t: timed(MoEConfig(t, down_tile)))
        downs = [TileConfig(bm, bn, bk, default.down.group_m, warps, stages, default.down.persistent_tma)
                 for bn, bk, warps, stages in itertools.product(block_ns, (64, 128), (4, 8), (3, 4))]
        for tile in downs:
            best = min(best, (timed(MoEConfig(gate_up, tile)), MoEConfig(gate_up, tile)), key=lambda r: r[0])
    return best[0], repr(best[1])


def group_sweep(kernels, inputs, gate, up, down, pairs, experts, permuted=True, rounds: int = 3) -> dict:
    """GPU microseconds per call (profiler, host excluded) of the table's tiles with each GROUP_M (row blocks
    sharing one column sweep), both GEMMs alike: the data behind `config._group_m`. Timed in interleaved
    rounds and the median kept: within one run the same call's GPU time drifts by up to 8%."""
    table = choose_config(pairs, experts, permuted)
    configs = {g: MoEConfig(dataclasses.replace(table.gate_up, group_m=g), dataclasses.replace(table.down, group_m=g))
               for g in GROUP_MS}
    times = {g: [] for g in GROUP_MS}
    for r in range(rounds):  # the order reversed every other round, so a drift favours no position
        for g in GROUP_MS if r % 2 == 0 else GROUP_MS[::-1]:
            cfg = configs[g]
            times[g].append(sum(kernel_us(
                lambda x, i, w: kernels.fused_moe(x, i, w, gate, up, down, permuted, "silu", 0, cfg),  # noqa: B023
                inputs, reps=10).values()))
    return {g: statistics.median(t) for g, t in times.items()}


ALIGN_SHAPES = ((8, 2), (64, 6), (128, 8), (256, 8))  # (experts, top_k) for `--align`


def bench_align(args) -> list[dict]:
    """The alignment alone, GPU time per call, both paths side by side (one program only where it can
    run: up to ALIGN_CHUNK pairs), at the block_m the tile table picks: the data behind
    `triton_moe.one_program_alignment`."""
    triton_moe = triton_kernels()
    rows = []
    for experts, top_k in ALIGN_SHAPES:
        for tokens in args.tokens:
            pairs = tokens * top_k
            block_m = choose_config(pairs, experts).block_m
            inputs = [(routing(tokens, experts, top_k, seed)[0],) for seed in range(ROTATE)]
            row = {"experts": experts, "top_k": top_k, "tokens": tokens, "pairs": pairs, "block_m": block_m,
                   "rule": "one program" if triton_moe.one_program_alignment(pairs, experts) else "many"}
            for path, one in (("one program", True), ("many", False)):
                if one and pairs > triton_moe.ALIGN_CHUNK:
                    continue
                check_alignment(inputs[0][0], 0, experts, block_m, *triton_moe.align(inputs[0][0], 0, experts, block_m,
                                                                                     one_program=one))
                row[path + " us"] = sum(kernel_us(
                    lambda t: triton_moe.align(t, 0, experts, block_m, one_program=one), inputs).values())  # noqa: B023
            print(f"E={experts:3d} top-{top_k} T={tokens:5d} pairs={pairs:6d} block_m={block_m:3d}: "
                  + ", ".join(f"{p} {row[p + ' us']:.1f} us" for p in ("one program", "many") if p + " us" in row)
                  + f"; the rule takes {row['rule']}", flush=True)
            rows.append(row)
    return rows


def bench_routing(args) -> list[dict]:
    """The routing alone, GPU time per call, side by side: inductor's softmax → top-k → renormalise (the
    chain as models write it, compiled) against `moe_passes.softmax_topk`'s Triton kernel."""
    from moe_passes.kernels import routing_kernels

    chain = torch.compile(routing_op.reference, dynamic=False)
    rows = []
    for model in args.models:
        experts, top_k = MODELS[model]["experts"], MODELS[model]["top_k"]
        for tokens in args.tokens:
            inputs = [(torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16),) for _ in range(ROTATE)]
            weights, ids = routing_kernels().softmax_topk(inputs[0][0], top_k, True, torch.bfloat16)
            expected_weights, _ = routing_op.reference(inputs[0][0], top_k, True, torch.bfloat16)
            probabilities = torch.softmax(inputs[0][0].float(), dim=-1)  # ties: compare what the ids hold
            assert torch.allclose(probabilities.gather(-1, ids), probabilities.topk(top_k).values, rtol=1e-6, atol=0)
            assert torch.allclose(weights, expected_weights, rtol=8e-3, atol=1e-6)
            inductor = kernel_us(lambda x: chain(x, top_k, True, torch.bfloat16), inputs)  # noqa: B023
            kernel = kernel_us(lambda x: routing_kernels().softmax_topk(x, top_k, True, torch.bfloat16), inputs)  # noqa: B023
            row = {"model": model, "tokens": tokens, "inductor_us": sum(inductor.values()), "inductor_kernels": inductor,
                   "softmax_topk_us": sum(kernel.values())}
            print(f"{model:14s} {tokens:5d} routing: inductor {row['inductor_us']:6.1f} us in {len(inductor)} kernels, "
                  f"softmax_topk {row['softmax_topk_us']:6.1f} us ({row['inductor_us'] / row['softmax_topk_us']:.1f}x)"
                  f"; inductor's: " + ", ".join(f"{k[:40]} {v:.1f}" for k, v in inductor.items()), flush=True)
            rows.append(row)
    return rows


def profile(model: str, tokens: int) -> None:
    """Where the time goes at one size: CPU issue time of each layer of the call, GPU time per kernel."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sizes = MODELS[model]
    kernels = triton_kernels()
    op = torch.ops.moe_passes.mixture_of_experts
    w12, w3 = make_layer(sizes["hidden"], sizes["intermediate"], sizes["experts"])
    l12, l3 = list(w12.unbind(0)), list(w3.unbind(0))
    inter, emax = sizes["intermediate"], sizes["experts"] - 1
    gate, up = w12[:, :inter], w12[:, inter:]
    x = torch.randn(tokens, sizes["hidden"], device="cuda", dtype=torch.bfloat16)
    ids, w = routing(tokens, sizes["experts"], sizes["top_k"], 0)
    steps = {
        "op.fused_weights": lambda: op.fused_weights(x, ids, w, l12, l3, True, "silu", 0, emax),
        "python impl": lambda: fused_op.mixture_of_experts_fused_weights(x, ids, w, l12, l3, True, "silu", 0, emax),
        "kernels.fused_moe": lambda: kernels.fused_moe(x, ids, w, gate, up, w3, True, "silu", 0),
        "align": lambda: kernels.align(ids, 0, sizes["experts"], 16),
        "_stacked_view x2": lambda: (stacks.stacked_view(l12), stacks.stacked_view(l3)),
        "_check_fused": lambda: fused_op._check_fused(x, l12, l3, True, emax + 1),
        "unbind x2": lambda: (w12.unbind(0), w3.unbind(0)),
    }
    for name, fn in steps.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            fn()
        cpu = (time.perf_counter() - start) / 50 * 1e6
        torch.cuda.synchronize()
        print(f"  CPU issue {name:20s} {cpu:8.1f} us")
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            steps["kernels.fused_moe"]()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--in-out", action="store_true", help="also time the kernel on stacks stored [E, in, out]")
    parser.add_argument("--sweep-tokens", nargs="*", type=int, default=[1024, 8192])
    parser.add_argument("--gemm-tokens", type=int, default=1024,
                        help="from this T on, time each kernel on the GPU and each GEMM against the matmul ceiling")
    parser.add_argument("--group-m", action="store_true",
                        help="also time the table's tiles with each GROUP_M (GPU time per call, both GEMMs alike)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--profile", nargs=2, action="append", metavar=("MODEL", "T"), default=[])
    parser.add_argument("--routing", action="store_true", help="time only the routing: inductor's chain against softmax_topk")
    parser.add_argument("--align", action="store_true", help="time only the alignment: one program against the parallel path")
    args = parser.parse_args(argv)
    if args.routing or args.align:
        rows = bench_routing(args) if args.routing else bench_align(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
        return 0
    for model, tokens in args.profile:
        print(f"profile {model} T={tokens}")
        profile(model, int(tokens))
    if args.profile:
        return 0
    import triton

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if not args.no_check:
        check(args)
    ceilings = measure_ceilings()
    print(f"ceilings: HBM {ceilings['hbm_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {ceilings['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s")
    rows = bench(args, ceilings)
    print(f"{'model':14s} {'T':>5s} {'limit':>8s} {'kernel':>8s} {'op':>8s} {'grouped':>8s} {'kern/lim':>8s}")
    for r in rows:
        print(f"{r['model']:14s} {r['tokens']:5d} {r['limit_ms']:8.3f} {r['kernel_ms']:8.3f} {r['op_ms']:8.3f} "
              f"{r['grouped_ms']:8.3f} {r['kernel_ms'] / r['limit_ms']:8.2f}" + (f"  best {r['sweep_best_ms']:.3f} {r['sweep_best']}" if "sweep_best" in r else "")
              + (f"  in-out layout {r['kernel_in_out_ms']:.3f}" if args.in_out else "")
              + (f" (with the out-in layout's tiles {r['kernel_in_out_with_out_in_tiles_ms']:.3f})"
                 if "kernel_in_out_with_out_in_tiles_ms" in r else "")
              + (f"  with the pointer down kernel {r['kernel_pointer_down_ms']:.3f}" if "kernel_pointer_down_ms" in r else ""))
    for r in rows:
        if "kernel_us" in r:
            kernels_line = ", ".join(f"{k} {v:.0f} us" for k, v in sorted(r["kernel_us"].items(), key=lambda kv: -kv[1]))
            print(f"{r['model']:14s} {r['tokens']:5d} gate/up GEMM {r['gate_up_of_matmul_ceiling']:.0%} and down GEMM "
                  f"{r['down_of_matmul_ceiling']:.0%} of the matmul ceiling; per call: {kernels_line}"
                  + ("; down kernels side by side: " + ", ".join(f"{k} {v:.0f} us" for k, v in r["down_us"].items())
                     if "down_us" in r else ""))
    for r in rows:
        for key, layout in (("group_m_us", "[E, out, in]"), ("group_m_in_out_us", "[E, in, out]")):
            if key in r:
                table_g = choose_config(r["tokens"] * MODELS[r["model"]]["top_k"], MODELS[r["model"]]["experts"],
                                        permuted=key == "group_m_us").gate_up.group_m
                print(f"{r['model']:14s} {r['tokens']:5d} GPU us per call by GROUP_M, weights {layout}: "
                      + ", ".join(f"{g} {us:.0f}" + (" (table)" if g == table_g else "") for g, us in r[key].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

