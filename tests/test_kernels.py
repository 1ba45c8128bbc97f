"""The CUDA fused-MoE kernel package: layout and tile logic on CPU, the kernel itself on CUDA only."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from moe_passes import kernels
from moe_passes.kernels.align import align_reference, block_count, check_alignment
from moe_passes.kernels.config import choose_config, padded_capacity
from moe_passes.reference import mixture_of_experts_fused_weights_reference, mixture_of_experts_reference

CUDA_TRITON = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def routing_table(tokens: int, experts: int, top_k: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
    return (torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)).to(device)


@pytest.mark.parametrize(
    "tokens, experts, top_k, experts_min, held, block_m",
    [(0, 4, 2, 0, 4, 16), (1, 128, 8, 0, 128, 16), (33, 8, 2, 0, 8, 16), (100, 16, 3, 4, 8, 32), (5, 8, 2, 0, 8, 64)],
)
def test_reference_alignment_is_a_valid_layout(tokens, experts, top_k, experts_min, held, block_m):
    table = routing_table(tokens, experts, top_k, tokens + held)
    check_alignment(table, experts_min, held, block_m, *align_reference(table, experts_min, held, block_m))


def test_alignment_check_catches_a_broken_layout():
    table = routing_table(10, 8, 2, 0)
    sorted_pairs, block_expert, used = align_reference(table, 0, 8, 16)
    broken = sorted_pairs.clone()
    broken[0], broken[16] = broken[16].clone(), broken[0].clone()  # a pair moves into another expert's block
    with pytest.raises(AssertionError):
        check_alignment(table, 0, 8, 16, broken, block_expert, used)


def test_capacity_bounds_the_padded_rows_without_looking_at_the_routing():
    for tokens, experts, top_k, block_m in ((1, 128, 8, 16), (7, 8, 2, 64), (1000, 16, 4, 128)):
        for seed in range(3):
            table = routing_table(tokens, experts, top_k, seed)
            _, _, used = align_reference(table, 0, experts, block_m)
            assert int(used) <= padded_capacity(tokens * top_k, experts, block_m)
            assert block_count(tokens * top_k, experts, block_m) * block_m >= int(used)


def test_tiles_grow_with_rows_per_expert_and_fit_hopper_shared_memory():
    previous = 0
    for pairs in (1, 16, 256, 4096, 65536):
        config = choose_config(pairs, 8)
        assert config.gate_up.block_m == config.down.block_m >= previous
        previous = config.block_m
        for tile, operands in ((config.gate_up, 2), (config.down, 1)):
            stage_bytes = 2 * (tile.block_m * tile.block_k + operands * tile.block_k * tile.block_n)
            assert stage_bytes * tile.num_stages <= 227 * 1024


def test_package_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import moe_passes, torch\n"
        "from moe_passes import kernels\n"
        "assert kernels.triton_kernels() is None\n"
        "x = torch.zeros(2, 8)\n"
        "assert not kernels.kernel_applies(x, 'silu', x, x)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_tensors_never_take_the_kernel():
    x = torch.randn(3, 16)
    assert kernels.fused_moe_cuda(x, None, None, x, x, x, True, "silu", 0) is None


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("permuted", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
@pytest.mark.parametrize(
    "tokens, experts, top_k, experts_min, held", [(1, 8, 2, 0, 8), (300, 16, 4, 4, 8), (1100, 16, 4, 0, 16)]
)
def test_kernel_matches_the_reference(permuted, activation, tokens, experts, top_k, experts_min, held):
    triton_moe = kernels.triton_kernels()
    table = routing_table(tokens, experts, top_k, tokens, "cuda")
    for block_m in (16, 64):
        check_alignment(table, experts_min, held, block_m, *triton_moe.align(table, experts_min, held, block_m))
    x = torch.randn(tokens, 96, device="cuda").bfloat16()
    w = torch.rand(tokens, top_k, device="cuda").bfloat16()
    shape12, shape3 = ((held, 160, 96), (held, 96, 80)) if permuted else ((held, 96, 160), (held, 80, 96))
    w12 = (torch.randn(shape12, device="cuda") / 10).bfloat16()
    w3 = (torch.randn(shape3, device="cuda") / 10).bfloat16()
    args = (x, table, w, list(w12.unbind(0)), list(w3.unbind(0)), permuted, activation, experts_min)
    args = (*args, experts_min + held - 1)
    actual = torch.ops.moe_passes.mixture_of_experts.fused_weights(*args)
    expected = mixture_of_experts_fused_weights_reference(*args)
    assert torch.isfinite(actual).all()
    assert ((actual.float() - expected).norm() / expected.norm()).item() < 1e-2
    w1 = torch.stack([t[:80] if permuted else t[:, :80] for t in w12]).contiguous()
    w2 = torch.stack([t[80:] if permuted else t[:, 80:] for t in w12]).contiguous()
    default = (x, table, w, list(w1.unbind(0)), list(w2.unbind(0)), list(w3.unbind(0)), permuted, activation)
    default = (*default, experts_min, experts_min + held - 1)
    actual = torch.ops.moe_passes.mixture_of_experts.default(*default)
    expected = mixture_of_experts_reference(*default)
    assert ((actual.float() - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("tokens", [3, 4096])
def test_kernel_never_reads_an_expert_no_token_is_routed_to(tokens):
    """NaN weights in experts 8..15, ids only 0..7: the output is finite and as if those experts were
    zero (decode tiles at 3 tokens, prefill tiles and the persistent down kernel at 4096)."""
    table = routing_table(tokens, 8, 2, tokens, "cuda")
    x = torch.randn(tokens, 128, device="cuda").bfloat16()
    w = torch.rand(tokens, 2, device="cuda").bfloat16()
    w12 = (torch.randn(16, 192, 128, device="cuda") / 10).bfloat16()
    w3 = (torch.randn(16, 128, 96, device="cuda") / 10).bfloat16()
    clean = torch.ops.moe_passes.mixture_of_experts.stacked_fused_weights(x, table, w, w12, w3, True, "silu", 0, 15)
    w12[8:], w3[8:] = float("nan"), float("nan")
    poisoned = torch.ops.moe_passes.mixture_of_experts.stacked_fused_weights(x, table, w, w12, w3, True, "silu", 0, 15)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize(
    "tokens, experts, top_k, experts_min, held", [(1100, 8, 4, 0, 8), (2000, 64, 4, 8, 40), (64, 128, 8, 0, 128)]
)
def test_parallel_alignment_is_a_valid_layout(tokens, experts, top_k, experts_min, held):
    """Past one chunk of pairs, or with many experts, the layout is built by a parallel histogram,
    offsets and scatter; where one program may take it, both paths build a valid layout."""
    triton_moe = kernels.triton_kernels()
    table = routing_table(tokens, experts, top_k, tokens, "cuda")
    assert not triton_moe.one_program_alignment(table.numel(), held)
    for block_m in (16, 64, 128):
        check_alignment(table, experts_min, held, block_m, *triton_moe.align(table, experts_min, held, block_m))
    small = table[: triton_moe.ALIGN_CHUNK // top_k]
    for one_program in (True, False):
        layout = triton_moe.align(small, experts_min, held, 16, one_program=one_program)
        check_alignment(small, experts_min, held, 16, *layout)
    too_many = routing_table(triton_moe.ALIGN_CHUNK // top_k + 1, experts, top_k, 0, "cuda")
    with pytest.raises(ValueError, match="at most"):
        triton_moe.align(too_many, experts_min, held, 16, one_program=True)


def tma_device() -> bool:
    return CUDA_TRITON and kernels.triton_kernels()._tma_device(torch.device("cuda"))


@pytest.mark.skipif(not tma_device(), reason="needs a Hopper GPU and Triton tensor descriptors")
@pytest.mark.parametrize("permuted", [True, False])
def test_persistent_tma_down_kernel_matches_the_pointer_kernel(permuted):
    """Both down kernels on one layout (K tail: I = 80; N tail: H = 96 under 256-wide tiles); a down stack
    whose rows are not 16-byte aligned takes the pointer kernel."""
    import dataclasses

    triton_moe = kernels.triton_kernels()
    experts, top_k, tokens, hidden, inter = 8, 2, 700, 96, 80
    table = routing_table(tokens, experts, top_k, 1, "cuda")
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    w = torch.rand(tokens, top_k, device="cuda").bfloat16()
    shape12, shape3 = ((experts, 2 * inter, hidden), (experts, hidden, inter))
    if not permuted:
        shape12, shape3 = (experts, hidden, 2 * inter), (experts, inter, hidden)
    w12 = (torch.randn(shape12, device="cuda") / 10).bfloat16()
    down = (torch.randn(shape3, device="cuda") / 10).bfloat16()
    gate, up = (w12[:, :inter], w12[:, inter:]) if permuted else (w12[..., :inter], w12[..., inter:])
    tma = choose_config(tokens * top_k, experts)
    assert tma.down.persistent_tma
    pointer = dataclasses.replace(tma, down=dataclasses.replace(tma.down, persistent_tma=False))
    args = (x, table, w, gate, up, down, permuted, "silu", 0)
    expected = mixture_of_experts_fused_weights_reference(
        x, table, w, list(w12.unbind(0)), list(down.unbind(0)), permuted, "silu", 0, experts - 1
    )
    results = [triton_moe.fused_moe(*args, config=config) for config in (tma, pointer)]
    for result in results:
        assert ((result.float() - expected).norm() / expected.norm()).item() < 1e-2
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    intermediate = torch.empty(64, inter, device="cuda", dtype=torch.bfloat16)
    assert triton_moe.tma_ready(down, intermediate, traced=False)
    shifted = torch.empty(down.numel() + 1, device="cuda", dtype=down.dtype)[1:].view(down.shape)
    assert not triton_moe.tma_ready(shifted, intermediate, traced=False)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is not available")
def test_cpu_takes_the_grouped_path_only_for_few_rows_per_expert():
    from moe_passes import fused_op, op_groups

    experts, top_k = 4, 2
    w12 = list((torch.randn(experts, 64, 32) / 8).unbind(0))
    w3 = list((torch.randn(experts, 32, 32) / 8).unbind(0))
    for tokens, grouped in ((8, True), (op_groups.CPU_GROUPED_MAX_ROWS * experts, False)):
        table = routing_table(tokens, experts, top_k, tokens)
        x, w = torch.randn(tokens, 32), torch.rand(tokens, top_k)
        stacks = (torch.stack(w12),), torch.stack(w3)
        result = fused_op._grouped_fused(x, table, w, *stacks, True, torch.nn.functional.silu, 0, experts)
        assert (result is not None) == grouped
        args = (x, table, w, w12, w3, True, "silu", 0, experts - 1)
        expected = mixture_of_experts_fused_weights_reference(*args)
        torch.testing.assert_close(torch.ops.moe_passes.mixture_of_experts.fused_weights(*args), expected)


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and Triton")
@pytest.mark.skipif(not kernels.wrap_triton_available(), reason="needs torch.library.wrap_triton")
def test_inductor_launches_the_kernel_from_its_generated_code():
    """hpu_moe + inductor on CUDA: the stacked call becomes the Triton launches in inductor's own code
    (no opaque op call per step), and stays right as the token count changes (symbolic sizes)."""
    from torch._inductor.utils import run_and_get_code

    import moe_passes
    from form_catalog import hf_grouped_mm

    torch._dynamo.reset()
    model, _ = hf_grouped_mm.build(hidden=64, intermediate=48, num_experts=8, top_k=2, layers=1)
    model = model.cuda()
    compiled = torch.compile(model, backend=moe_passes.hpu_moe, options={"inner": "inductor", "target": "portable"})
    with torch.no_grad():
        for tokens in (5, 37, 300, 2100):  # 2100 x 2 pairs: the parallel alignment, the persistent down GEMM
            x = torch.randn(1, tokens, 64, device="cuda", dtype=torch.bfloat16)
            actual, codes = run_and_get_code(compiled, x)
            expected = model(x)
            assert ((actual.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-2, tokens
            code = "\n".join(codes)
            if codes:  # a (re)compile happened for this size
                assert "_gate_up_kernel" in code and "_down_kernel" in code, code[-3000:]
                assert "torch.ops.moe_passes" not in code, "the op is still called from the generated code"


@pytest.mark.skipif(not tma_device(), reason="needs a Hopper GPU and Triton tensor descriptors")
@pytest.mark.skipif(not kernels.wrap_triton_available(), reason="needs torch.library.wrap_triton")
def test_compiled_tma_kernel_runs_in_a_thread_that_never_set_an_allocator():
    """Triton's allocator (the descriptors' scratch) is per context: a compiled layer called from a fresh
    thread (a server's worker, say) must still find one."""
    import threading

    import moe_passes
    from form_catalog import hf_grouped_mm

    torch._dynamo.reset()
    model, _ = hf_grouped_mm.build(hidden=64, intermediate=48, num_experts=8, top_k=2, layers=1)
    model = model.cuda()
    compiled = torch.compile(model, backend=moe_passes.hpu_moe, options={"inner": "inductor", "target": "portable"})
    x = torch.randn(1, 2100, 64, device="cuda", dtype=torch.bfloat16)
    results = {}

    def call(name):
        try:
            with torch.no_grad():
                results[name] = compiled(x)
        except Exception as error:  # noqa: BLE001 - reported below
            results[name] = error

    for name in ("compiling", "fresh"):
        thread = threading.Thread(target=call, args=(name,))
        thread.start()
        thread.join()
    for name, result in results.items():
        assert isinstance(result, torch.Tensor), f"{name}: {result!r}"
    torch.testing.assert_close(results["fresh"], results["compiling"], rtol=0, atol=0)
