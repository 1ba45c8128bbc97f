"""The softmax → top-k → renormalise chain feeding the portable op as one `moe_passes.softmax_topk` call."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_for_dtype, eager_output, run_hpu_moe
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

import moe_passes
from form_catalog import static_dense_loop
from moe_passes import kernels, routing_op
from moe_passes.passes import routing_fusion
from moe_passes.steps import COUNTERS

aten = torch.ops.aten


def _chain(logits, k, renormalize, dtype):
    """The routing as the models write it."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_computes_the_chain_it_replaces(renormalize, dtype):
    logits = torch.randn(37, 12, dtype=dtype)
    weights, ids = torch.ops.moe_passes.softmax_topk(logits, 3, renormalize, dtype)
    expected_weights, expected_ids = _chain(logits, 3, renormalize, dtype)
    assert torch.equal(ids, expected_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(weights, expected_weights, atol=0, rtol=0)


def test_the_op_names_bad_arguments():
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        torch.ops.moe_passes.softmax_topk(torch.randn(2, 4), 5, True, torch.float32)
    with pytest.raises(ValueError, match="floating tensor"):
        torch.ops.moe_passes.softmax_topk(torch.ones(2, 4, dtype=torch.int64), 2, True, torch.float32)


@pytest.mark.parametrize(
    "routing, router_fp32, dtype, fused",
    [
        ("softmax_topk_renorm", True, torch.bfloat16, 2),
        ("softmax_topk", True, torch.bfloat16, 2),
        ("softmax_topk_renorm", True, torch.float32, 2),  # no cast after the renormalisation
        ("topk_softmax", True, torch.bfloat16, 0),  # top-k on the logits first: another computation
        ("softmax_topk_renorm", False, torch.bfloat16, 0),  # softmax in bfloat16: the op's is float32
    ],
)
def test_only_the_chains_the_op_computes_exactly_are_fused(routing, router_fp32, dtype, fused):
    model, inputs = static_dense_loop.build(routing=routing, router_fp32=router_fp32, dtype=dtype)
    counters.clear()
    report, output, recorder = run_hpu_moe(model, inputs, fuse_routing=True)
    assert len(report.fused) == 2 and counters[COUNTERS]["fused_routing"] == fused
    assert_close_for_dtype(output, eager_output(model, inputs))
    targets = [n.target for gm in recorder.graphs for n in gm.graph.nodes]
    assert targets.count(routing_op.OP) == fused
    assert (aten.topk.default in targets) == (fused == 0)
    assert ("routing as one softmax_topk call" in str(report)) == bool(fused)


@pytest.mark.parametrize("fuse_routing", [None, False])
def test_off_cuda_the_chain_stays_unless_asked_for(fuse_routing):
    model, inputs = static_dense_loop.build(dtype=torch.bfloat16)
    counters.clear()
    report, _, recorder = run_hpu_moe(model, inputs, fuse_routing=fuse_routing)
    assert len(report.fused) == 2 and counters[COUNTERS]["fused_routing"] == 0
    assert not any(n.target is routing_op.OP for gm in recorder.graphs for n in gm.graph.nodes)


def _routed_layer(x, gate, w13, w2, returns_ids: bool):
    weights, ids = _chain(x @ gate, 2, True, x.dtype)
    out = torch.ops.moe_passes.mixture_of_experts.stacked_fused_weights(x, ids, weights, w13, w2, True, "silu", 0, 3)
    return (out, ids) if returns_ids else out


@pytest.mark.parametrize("returns_ids", [False, True])
def test_a_chain_read_by_anything_but_fused_calls_is_kept(returns_ids):
    args = (torch.randn(6, 16), torch.randn(16, 4), torch.randn(4, 16, 16), torch.randn(4, 16, 8))
    gm = make_fx(lambda *a: _routed_layer(*a, returns_ids))(*args)
    expected = gm(*args)
    chains = routing_fusion.find(gm.graph)
    assert len(chains) == (0 if returns_ids else 1)
    for chain in chains:
        assert (chain.k, chain.renormalize, chain.dtype) == (2, True, torch.float32)
        routing_fusion.rewrite(gm.graph, chain)
    gm.recompile()
    assert [n.target for n in gm.graph.nodes].count(aten.topk.default) == (1 if returns_ids else 0)
    torch.testing.assert_close(gm(*args), expected)


def test_the_option_is_checked():
    with pytest.raises(TypeError, match="fuse_routing"):
        moe_passes.Options.parse({"fuse_routing": "yes"})


needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.routing_kernels() is not None), reason="needs CUDA and Triton"
)


def assert_same_choice(logits, ids, k):
    """ids pick k distinct experts holding the k largest probabilities. Equal probabilities (bfloat16 logits
    repeat often among 128) may be picked in either order, or either one at the k-th place: torch.topk
    leaves that open, so the ids are compared by the probability they hold."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(probabilities.gather(-1, ids), torch.topk(probabilities, k).values, atol=0, rtol=1e-6)
    assert bool((ids.sort(dim=-1).values.diff(dim=-1) > 0).all()), "an expert chosen twice"


@needs_kernel
@pytest.mark.parametrize("tokens, experts, k", [(1, 8, 2), (37, 128, 8), (1024, 160, 8), (300, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_triton_kernel_matches_the_chain(tokens, experts, k, dtype):
    logits = torch.randn(tokens, experts, device="cuda", dtype=dtype)
    assert kernels.routing_kernel_applies(logits, k, dtype)
    for renormalize in (True, False):
        weights, ids = kernels.routing_kernels().softmax_topk(logits, k, renormalize, dtype)
        expected_weights, _ = _chain(logits, k, renormalize, dtype)
        assert_same_choice(logits, ids, k)
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 8e-3)


@needs_kernel
@pytest.mark.skipif(not kernels.wrap_triton_available(), reason="needs torch.library.wrap_triton")
def test_inductor_launches_the_routing_kernel_from_its_generated_code():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model, _ = static_dense_loop.build(hidden=64, intermediate=32, num_experts=16, top_k=4, layers=1,
                                       dtype=torch.bfloat16)
    model = model.cuda()
    counters.clear()
    compiled = torch.compile(model, backend=moe_passes.hpu_moe, options={"inner": "inductor", "target": "portable"})
    x = torch.randn(1, 300, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        actual, codes = run_and_get_code(compiled, x)
        expected = model(x)
    assert counters[COUNTERS]["fused_routing"] == 1
    assert ((actual.float() - expected.float()).norm() / expected.float().norm()).item() < 2e-2
    code = "\n".join(codes)
    assert "_softmax_topk_kernel" in code and "aten.topk" not in code and "torch.ops.moe_passes" not in code
