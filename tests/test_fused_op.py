"""The portable fused MoE op against the bridge's dense reference loop, and its fit with torch.compile.

Sizes stay tiny (H=16, I=8) so the whole file runs in seconds on a small CPU machine.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from moe_passes import fused_op, reference

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, INTER = 16, 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (4e-2, 4e-2), torch.float16: (5e-3, 5e-3)}
REFERENCES = {
    "default": reference.mixture_of_experts_reference,
    "fused_weights": reference.mixture_of_experts_fused_weights_reference,
    "bias_fused_weights": reference.mixture_of_experts_bias_fused_weights_reference,
}


# ---------------------------------------------------------------------------------------------------
# Building inputs.


def routing(tokens, experts, top_k, dtype, generator, lo=0):
    """[T, k] distinct global ids in [lo, lo + experts) per token, and normalised router weights."""
    rows = [torch.randperm(experts, generator=generator)[:top_k] + lo for _ in range(tokens)]
    table = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    return table, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def expert_weights(count, out_features, in_features, permuted, dtype, generator):
    """`count` per-expert weights in the requested layout, scaled so outputs stay near 1."""
    stacked = torch.randn(count, out_features, in_features, generator=generator) / in_features**0.5
    if not permuted:
        stacked = stacked.transpose(1, 2)
    return list(stacked.to(dtype).contiguous().unbind(0))


def case(
    overload,
    tokens=7,
    experts=4,
    top_k=2,
    dtype=torch.float32,
    permuted=True,
    activation="silu",
    experts_min=0,
    experts_max=None,
    routed_experts=None,
    seed=0,
):
    """(args, kwargs) for one call of `overload`; `routed_experts` ids may fall outside the range."""
    generator = torch.Generator().manual_seed(seed)
    experts_max = experts_min + experts - 1 if experts_max is None else experts_max
    count = experts_max - experts_min + 1
    routed = routed_experts or (experts_min, count)
    table, router_weights = routing(tokens, routed[1], top_k, dtype, generator, lo=routed[0])
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    down = expert_weights(count, HIDDEN, INTER, permuted, dtype, generator)
    head = [x, table, router_weights]
    if overload == "default":
        gate = expert_weights(count, INTER, HIDDEN, permuted, dtype, generator)
        up = expert_weights(count, INTER, HIDDEN, permuted, dtype, generator)
        return head + [gate, up, down, permuted, activation, experts_min, experts_max], {}
    gate_up = expert_weights(count, 2 * INTER, HIDDEN, permuted, dtype, generator)
    if overload == "fused_weights":
        return head + [gate_up, down, permuted, activation, experts_min, experts_max], {}
    w12_bias = list((torch.randn(count, 2 * INTER, generator=generator) * 0.5).to(dtype).unbind(0))
    w3_bias = list((torch.randn(count, HIDDEN, generator=generator) * 0.5).to(dtype).unbind(0))
    kwargs = {"permuted_weights": permuted, "experts_min": experts_min, "experts_max": experts_max}
    return head + [gate_up, down, w12_bias, w3_bias], kwargs


def run_op(overload, args, kwargs):
    return getattr(fused_op.OP, overload)(*args, **kwargs)


def assert_matches_reference(overload, args, kwargs, label=""):
    actual = run_op(overload, args, kwargs)
    expected = REFERENCES[overload](*args, **kwargs)
    x = args[0]
    assert actual.shape == x.shape and actual.dtype == x.dtype, label
    atol, rtol = TOLERANCE[x.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{label}: {m}")
    return actual


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls run fastest on one thread; several threads contend badly on a loaded small machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SMALL_SHAPES = [(t, e, k) for t in (0, 1, 7) for e in (1, 4) for k in sorted({1, 2, e}) if k <= e]


# ---------------------------------------------------------------------------------------------------
# Agreement with the reference.


@pytest.mark.parametrize("activation", fused_op.ACTIVATIONS)
@pytest.mark.parametrize("permuted", [True, False])
@pytest.mark.parametrize("overload", ["default", "fused_weights"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_on_small_shapes(dtype, overload, permuted, activation):
    for tokens, experts, top_k in SMALL_SHAPES:
        args, kwargs = case(overload, tokens, experts, top_k, dtype, permuted, activation)
        assert_matches_reference(overload, args, kwargs, label=f"T={tokens} E={experts} k={top_k}")


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("overload", ["default", "fused_weights", "bias_fused_weights"])
def test_matches_reference_with_256_experts(overload, top_k):
    args, kwargs = case(overload, tokens=7, experts=256, top_k=top_k, dtype=torch.bfloat16)
    assert_matches_reference(overload, args, kwargs)


def test_every_token_routed_to_every_expert():
    args, kwargs = case("fused_weights", tokens=3, experts=16, top_k=16)
    out = assert_matches_reference("fused_weights", args, kwargs)
    assert out.abs().sum() > 0


@pytest.mark.parametrize("permuted", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_variant_matches_reference(dtype, permuted):
    for tokens, experts, top_k in SMALL_SHAPES:
        args, kwargs = case("bias_fused_weights", tokens, experts, top_k, dtype, permuted)
        assert_matches_reference(
            "bias_fused_weights", args, kwargs, label=f"T={tokens} E={experts} k={top_k}"
        )


def test_bias_variant_alpha_and_limit_matter_and_chunking_does_not():
    args, kwargs = case("bias_fused_weights", tokens=9, experts=4, top_k=2)
    base = run_op("bias_fused_weights", args, kwargs)
    tight = {**kwargs, "alpha": 1.0, "limit": 0.25}
    clamped = assert_matches_reference("bias_fused_weights", args, tight)
    assert not torch.allclose(base, clamped)
    tuned = run_op("bias_fused_weights", args, {**kwargs, "chunk_size": 64, "total_experts": 128})
    torch.testing.assert_close(tuned, base, atol=0, rtol=0)


def test_gelu_is_the_tanh_approximation():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, generator=generator).to(torch.float64) * 3
    table, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1, dtype=torch.float64)
    one = [torch.ones(1, 1, dtype=torch.float64)]
    out = fused_op.OP(x, table, weights, one, one, one, True, "gelu", 0, 0)
    expected = torch.nn.functional.gelu(x, approximate="tanh") * x
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, torch.nn.functional.gelu(x) * x, atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------------------------
# Expert ranges (expert parallelism).


def with_range(overload, args, kwargs, lo, hi):
    """The call for the experts [lo, hi] only: their slice of every weight list, and that range."""
    args = [a[lo : hi + 1] if isinstance(a, list) else a for a in args]
    if overload == "bias_fused_weights":
        return args, {**kwargs, "experts_min": lo, "experts_max": hi}
    return args[:-2] + [lo, hi], kwargs


@pytest.mark.parametrize("overload", ["default", "fused_weights", "bias_fused_weights"])
@pytest.mark.parametrize("experts_min, experts_max", [(2, 5), (0, 0), (7, 7)])
def test_partial_range_ignores_ids_outside_it(overload, experts_min, experts_max):
    """Eight experts routed, the lists hold [experts_min, experts_max]; token 0 chose none of them."""
    args, kwargs = case(overload, tokens=9, top_k=3, experts=8, routed_experts=(0, 8))
    outside = [e for e in range(8) if not experts_min <= e <= experts_max]
    args[1][0] = torch.tensor(outside[:3])
    args, kwargs = with_range(overload, args, kwargs, experts_min, experts_max)
    out = assert_matches_reference(overload, args, kwargs)
    assert out[0].abs().max() == 0
    assert out[1:].abs().max() > 0


@pytest.mark.parametrize("overload", ["default", "fused_weights", "bias_fused_weights"])
def test_ranks_partial_outputs_sum_to_the_whole(overload):
    """Eight experts split over two ranks, [0, 3] and [4, 7]: the partial outputs sum to the whole."""
    args, kwargs = case(overload, tokens=6, experts=8, top_k=2)
    whole = run_op(overload, args, kwargs)
    total = sum(run_op(overload, *with_range(overload, args, kwargs, lo, hi)) for lo, hi in ((0, 3), (4, 7)))
    torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)


def test_int32_routing_table_gives_the_int64_result():
    args, kwargs = case("fused_weights", tokens=7, experts=4, top_k=2)
    as_int32 = [args[0], args[1].to(torch.int32), *args[2:]]
    torch.testing.assert_close(
        run_op("fused_weights", as_int32, kwargs), run_op("fused_weights", args, kwargs)
    )


# ---------------------------------------------------------------------------------------------------
# Only routed experts run.


def _poison_unrouted(args, table, lists, value=float("nan")):
    """The unrouted experts' weights replaced by new tensors full of `value` (None: copies of them)."""
    routed = set(table.flatten().tolist())
    for index in lists:
        args[index] = [
            w if e in routed else w.clone() if value is None else torch.full_like(w, value)
            for e, w in enumerate(args[index])
        ]
    return args


@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "stacked"])
@pytest.mark.parametrize("overload", ["default", "fused_weights", "bias_fused_weights"])
def test_unrouted_experts_are_never_touched(overload, stacked):
    """NaN weights on every expert no token chose must not reach the output, whichever path runs (the
    loop over routed experts for separate tensors, grouped matmuls over views of one stack)."""
    args, kwargs = case(overload, tokens=2, experts=64, top_k=1)
    lists = [i for i, a in enumerate(args) if isinstance(a, list)]
    # The clean run gets the same allocations as the poisoned one (fresh copies of the unrouted experts),
    # so that both take the same path: the op reads weights that are views of one stack as a stack.
    clean, poisoned = (_poison_unrouted(list(args), args[1], lists, value) for value in (None, float("nan")))
    if stacked:
        clean, poisoned = ([list(torch.stack(a).unbind(0)) if i in lists else a for i, a in enumerate(run)]
                           for run in (clean, poisoned))
    clean = run_op(overload, clean, kwargs)
    poisoned = run_op(overload, poisoned, kwargs)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("permuted", [True, False])
def test_matmuls_scale_with_routed_experts_not_with_all_experts(permuted):
    """E=64, T=2, k=1: at most two expert groups run, three matmuls each (the loop over routed experts,
    which weights in separate allocations take; views of one stack take the grouped path)."""
    args, _ = case("default", tokens=2, experts=64, top_k=1, permuted=permuted)
    args[3:6] = [[w.clone() for w in weights] for weights in args[3:6]]
    with CountMatmuls() as counter:
        fused_op.mixture_of_experts(*args)
    routed = len(set(args[1].flatten().tolist()))
    assert counter.count == 3 * routed <= 6


# ---------------------------------------------------------------------------------------------------
# Property test over shapes and ranges.


@st.composite
def shapes(draw):
    experts = draw(st.integers(1, 12))
    lo = draw(st.integers(0, experts - 1))
    hi = draw(st.integers(lo, experts - 1))
    return {
        "tokens": draw(st.integers(0, 9)),
        "experts": experts,
        "top_k": draw(st.integers(1, min(experts, 4))),
        "range": (lo, hi),
        "overload": draw(st.sampled_from(["default", "fused_weights", "bias_fused_weights"])),
        "permuted": draw(st.booleans()),
        "activation": draw(st.sampled_from(fused_op.ACTIVATIONS)),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=25, deadline=None)
@given(shapes())
def test_property_matches_reference(shape):
    lo, hi = shape["range"]
    args, kwargs = case(
        shape["overload"],
        shape["tokens"],
        top_k=shape["top_k"],
        permuted=shape["permuted"],
        activation=shape["activation"],
        experts_min=lo,
        experts_max=hi,
        routed_experts=(0, shape["experts"]),
        seed=shape["seed"],
    )
    assert_matches_reference(shape["overload"], args, kwargs, label=str(shape))


# ---------------------------------------------------------------------------------------------------
# Input validation.


def _replace(args, index, value):
    return [value if i == index else a for i, a in enumerate(args)]


def test_rejects_unknown_activation():
    args, _ = case("fused_weights")
    with pytest.raises(ValueError, match=r"activation must be one of .*'swish'"):
        run_op("fused_weights", _replace(args, 6, "swish"), {})


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: _replace(a, 3, a[3][:-1]), r"w12 holds 3 tensors but the expert range holds 4"),
        (lambda a: _replace(a, 4, a[4] + a[4][:1]), r"w3 holds 5 tensors"),
        (lambda a: _replace(a, 8, 2), r"w12 holds 4 tensors but the expert range holds 3"),
        (lambda a: _replace(a, 7, 5), r"range \[5, 3\].*empty"),
        (
            lambda a: _replace(a, 4, [w.t().contiguous() for w in a[4]]),
            r"w3\[0\] has shape \(8, 16\), expected \(16, 8\)",
        ),
        (lambda a: _replace(a, 3, [w[:-1] for w in a[3]]), r"w12\[0\].*even"),
        (lambda a: _replace(a, 3, a[3][:-1] + [a[3][0][:, :8]]), r"w12\[3\] has shape"),
        (lambda a: _replace(a, 3, [w.half() for w in a[3]]), r"w12\[0\] is torch.float16"),
        (lambda a: _replace(a, 2, a[2][:, :1]), r"router_weights has shape \(7, 1\)"),
        (lambda a: _replace(a, 1, a[1].float()), r"int64"),
        (lambda a: _replace(a, 1, a[1][:3]), r"expert_routing_table must be \[T, k\] with T=7"),
        (lambda a: _replace(a, 0, a[0][None]), r"hidden_states must be \[T, H\]"),
    ],
)
def test_rejects_inconsistent_inputs(mutate, message):
    args, _ = case("fused_weights", tokens=7, experts=4, top_k=2)
    with pytest.raises(ValueError, match=message):
        run_op("fused_weights", mutate(args), {})


def test_rejects_mismatched_separate_weights_and_biases():
    args, _ = case("default")
    with pytest.raises(ValueError, match=r"w2\[0\] has shape \(4, 16\)"):
        run_op("default", _replace(args, 4, [w[:4] for w in args[4]]), {})
    args, kwargs = case("bias_fused_weights")
    with pytest.raises(ValueError, match=r"w12_bias\[0\] has shape \(8,\), expected \(16,\)"):
        run_op("bias_fused_weights", _replace(args, 5, [b[:8] for b in args[5]]), kwargs)
    with pytest.raises(ValueError, match=r"w3_bias holds 3 tensors"):
        run_op("bias_fused_weights", _replace(args, 6, args[6][:3]), kwargs)


def test_reference_rejects_unknown_activation():
    args, _ = case("default")
    with pytest.raises(ValueError, match="unknown activation"):
        reference.mixture_of_experts_reference(*_replace(args, 7, "tanh"))


# ---------------------------------------------------------------------------------------------------
# Fake kernels and torch.compile.


def routed_moe(x, router_logits, w12_stacked, w3_stacked):
    """A model-shaped caller: routing outside the op, weight lists from stacked parameters."""
    weights, ids = torch.topk(router_logits.softmax(-1), 2, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    experts = w12_stacked.shape[0]
    return torch.ops.moe_passes.mixture_of_experts.fused_weights(
        x, ids, weights, list(w12_stacked.unbind(0)), list(w3_stacked.unbind(0)), True, "silu", 0, experts - 1
    )


def compile_inputs(tokens=5, experts=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, HIDDEN, generator=generator),
        torch.randn(tokens, experts, generator=generator),
        torch.randn(experts, 2 * INTER, HIDDEN, generator=generator) / 4,
        torch.randn(experts, HIDDEN, INTER, generator=generator) / 3,
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiles_fullgraph_and_matches_eager(backend):
    inputs = compile_inputs()
    expected = routed_moe(*inputs)
    compiled = torch.compile(routed_moe, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), expected, atol=1e-5, rtol=1e-5)


def test_fake_kernel_follows_symbolic_token_counts():
    compiled = torch.compile(routed_moe, backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in (3, 11, 1):
        inputs = compile_inputs(tokens=tokens, seed=tokens)
        torch.testing.assert_close(compiled(*inputs), routed_moe(*inputs), atol=1e-5, rtol=1e-5)


def test_bias_variant_compiles_with_keyword_arguments():
    args, kwargs = case("bias_fused_weights", tokens=5)
    kwargs = {**kwargs, "alpha": 1.5, "limit": 3.0}

    def call(*flat):
        return run_op("bias_fused_weights", flat, kwargs)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), call(*args))


def test_fake_kernel_returns_hidden_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, _ = case("fused_weights", tokens=3, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake_args = [[mode.from_tensor(w) for w in a] if isinstance(a, list) else a for a in fake_args]
        out = run_op("fused_weights", fake_args, {})
    assert out.shape == (3, HIDDEN) and out.dtype == torch.bfloat16


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck is missing")
@pytest.mark.parametrize("overload", ["default", "fused_weights", "bias_fused_weights"])
def test_opcheck(overload):
    args, kwargs = case(overload, tokens=3, experts=3, top_k=2)
    torch.library.opcheck(getattr(fused_op.OP, overload), tuple(args), kwargs)


def test_reimport_keeps_one_registration():
    import importlib

    module = importlib.reload(fused_op)
    assert module.OP is torch.ops.moe_passes.mixture_of_experts
    args, _ = case("default", tokens=2)
    assert_matches_reference("default", args, {})


# ---------------------------------------------------------------------------------------------------
# The test double of the Gaudi op (in a separate process, so this one keeps seeing no bridge).

# The bridge's schemas, as HPU_OP.md quotes them.
BRIDGE_SCHEMAS = {
    "default": """hpu::mixture_of_experts(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights,
        Tensor[] w1, Tensor[] w2, Tensor[] w3, bool permuted_weights, str activation,
        int experts_min, int experts_max) -> Tensor""",
    "fused_weights": """hpu::mixture_of_experts.fused_weights(Tensor hidden_states, Tensor expert_routing_table,
        Tensor router_weights, Tensor[] w12, Tensor[] w3, bool permuted_weights, str activation,
        int experts_min, int experts_max) -> Tensor""",
    "bias_fused_weights": """hpu::mixture_of_experts.bias_fused_weights(Tensor hidden_states, Tensor expert_routing_table,
        Tensor router_weights, Tensor[] w12, Tensor[] w3, Tensor[] w12_bias, Tensor[] w3_bias, *,
        bool permuted_weights, int experts_min, int experts_max, int chunk_size=0, int total_experts=0,
        float alpha=1.702, float limit=7.0) -> Tensor""",
}

BRIDGE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from tests import hpu_contract
    library = hpu_contract.register_fake_gaudi_bridge()
    assert library is not None and hpu_contract.register_fake_gaudi_bridge() is library
    from tests.test_fused_op import case
    packet = torch.ops.hpu.mixture_of_experts
    args, _ = case("fused_weights", tokens=3, experts=4, dtype=torch.bfloat16)
    packet.fused_weights(*args)
    args, kwargs = case("bias_fused_weights", tokens=3, experts=4, experts_min=4)
    packet.bias_fused_weights(*args, **kwargs, limit=5.0)
    print(json.dumps({{
        "schemas": {{name: str(getattr(packet, name)._schema) for name in {overloads!r}}},
        "calls": hpu_contract.CALLS,
    }}))
    """
)


def normalise(schema: str) -> str:
    """One space between tokens, and floats written alike (torch prints 7.0 as "7.")."""
    schema = re.sub(r"\s+", " ", schema).replace("( ", "(").strip()
    return re.sub(r"(\d+\.\d*?)0*(?=[,)])", r"\g<1>", schema)


@pytest.fixture(scope="module")
def bridge_double():
    code = BRIDGE_SCRIPT.format(root=str(ROOT), overloads=list(BRIDGE_SCHEMAS))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bridge_double_has_the_bridge_schemas(bridge_double):
    for overload, expected in BRIDGE_SCHEMAS.items():
        assert normalise(bridge_double["schemas"][overload]) == normalise(expected)


def test_portable_op_has_the_bridge_schemas():
    for overload, expected in BRIDGE_SCHEMAS.items():
        actual = str(getattr(fused_op.OP, overload)._schema).replace("moe_passes::", "hpu::")
        assert normalise(actual) == normalise(expected)


def test_bridge_double_records_each_call(bridge_double):
    fused, bias = bridge_double["calls"]
    assert fused == {
        "overload": "fused_weights",
        "hidden_dtype": "torch.bfloat16",
        "hidden_shape": [3, HIDDEN],
        "routing_dtype": "torch.int64",
        "router_weights_dtype": "torch.bfloat16",
        "num_weights": 4,
        "weight_shapes": [[2 * INTER, HIDDEN], [HIDDEN, INTER]],
        "permuted_weights": True,
        "activation": "silu",
        "experts_min": 0,
        "experts_max": 3,
    }
    assert bias["overload"] == "bias_fused_weights" and bias["activation"] is None
    assert (bias["experts_min"], bias["experts_max"], bias["num_weights"]) == (4, 7, 4)
    assert bias["options"]["limit"] == 5.0


# --- the grouped path (two grouped matmuls over a stacked view; CUDA by default) -------------------


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is not available")
@pytest.mark.parametrize(
    "tokens, experts, top_k, experts_min, held",
    [(0, 4, 2, 0, 4), (1, 8, 8, 0, 8), (33, 16, 3, 0, 16), (20, 16, 2, 4, 8)],
)
def test_grouped_path_matches_the_reference(monkeypatch, tokens, experts, top_k, experts_min, held):
    from moe_passes import fused_op, op_groups
    from moe_passes.reference import mixture_of_experts_fused_weights_reference

    monkeypatch.setattr(op_groups, "GROUPED_DEVICES", {"cpu"})
    calls = []
    original = fused_op._grouped_fused
    monkeypatch.setattr(fused_op, "_grouped_fused", lambda *a: calls.append(1) or original(*a))
    g = torch.Generator().manual_seed(tokens + held)
    x = torch.randn(tokens, 64, generator=g).bfloat16()
    rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
    w = torch.rand(tokens, top_k, generator=g).bfloat16()
    w12 = list((torch.randn(held, 64, 64, generator=g) / 8).bfloat16().unbind(0))
    w3 = list((torch.randn(held, 64, 32, generator=g) / 8).bfloat16().unbind(0))
    args = (x, ids, w, w12, w3, True, "silu", experts_min, experts_min + held - 1)
    assert (
        fused_op._grouped_fused(
            x, ids, w, (torch.stack(w12),), torch.stack(w3), True, torch.nn.functional.silu, experts_min, held
        )
        is not None
    )
    actual = torch.ops.moe_passes.mixture_of_experts.fused_weights(*args)
    torch.testing.assert_close(
        actual.float(), mixture_of_experts_fused_weights_reference(*args).float(), atol=3e-2, rtol=3e-2
    )
    assert calls, "the grouped path was not taken"


def test_stacked_view_is_recovered_only_from_consecutive_slices():
    from moe_passes.stacks import stacked_view as _stacked_view

    stacked = torch.randn(4, 6, 8)
    assert torch.equal(_stacked_view(list(stacked.unbind(0))), stacked)
    assert torch.equal(_stacked_view(list(stacked.transpose(-2, -1).unbind(0))), stacked.transpose(-2, -1))
    assert _stacked_view([stacked[0], stacked[2], stacked[1], stacked[3]]) is None
    assert _stacked_view([torch.randn(6, 8) for _ in range(4)]) is None
    # Two separate tensors are always "evenly spaced": only the storage's bounds tell them from a stack,
    # and finding that out must not grow (and so move) the first one's storage.
    pair = sorted((torch.randn(6, 8), torch.randn(6, 8)), key=torch.Tensor.data_ptr)
    address = pair[0].data_ptr()
    assert _stacked_view(pair) is None
    assert pair[0].untyped_storage().nbytes() == 6 * 8 * 4 and pair[0].data_ptr() == address
