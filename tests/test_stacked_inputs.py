"""The compiled graph takes a ModuleList layer's weight lists as stacks found per call."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import moe_passes
from form_catalog import dynamo_config, mixtral4_sparse_loop
from moe_passes import backend_passes, weight_stacks
from moe_passes.stacks import stacked_view as _stacked_view
from moe_passes.steps import COUNTERS
from moe_passes.weight_stacks import InputPlan, StackedGroup

PORTABLE_INDUCTOR = {"inner": "inductor", "target": "portable"}


def _experts(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == 4)


def _inner_graphs(monkeypatch) -> list[torch.fx.GraphModule]:
    """Records every graph handed to the inner compiler."""
    seen, compile_inner = [], backend_passes.compile_inner

    def recording(compiler, inner, graph, example_inputs, mode):
        seen.append(graph)
        return compile_inner(compiler, inner, graph, example_inputs, mode)

    monkeypatch.setattr(backend_passes, "compile_inner", recording)
    return seen


def _assert_own_allocations(experts):
    for role in ("w1", "w2", "w3"):
        weights = [getattr(e, role).weight for e in experts]
        assert _stacked_view(weights) is None, role
        assert all(w.storage_offset() == 0 for w in weights), role


def _fail_inner_compiles_of_fused_graphs(monkeypatch) -> None:
    """The inner compiler raises on any graph holding a fused call (the captured graph still compiles)."""
    compile_inner = backend_passes.compile_inner

    def failing_on_fused(compiler, inner, graph, example_inputs, mode):
        if _moe_calls(graph):
            raise RuntimeError("inner backend broke")
        return compile_inner(compiler, inner, graph, example_inputs, mode)

    monkeypatch.setattr(backend_passes, "compile_inner", failing_on_fused)


def _moe_calls(graph):
    return [n.target._overloadname for n in graph.graph.nodes if getattr(n.target, "namespace", None) == "moe_passes"]


def test_the_inner_graph_takes_three_stacks_and_stays_right_when_weights_change(monkeypatch):
    model, (x,) = mixtral4_sparse_loop.build(layers=2, num_experts=4)
    experts = _experts(model)
    seen = _inner_graphs(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        expected = model(x)
        compiled = torch.compile(model, backend=moe_passes.hpu_moe, options=PORTABLE_INDUCTOR)
        torch.testing.assert_close(compiled(x), expected)
        assert counters[COUNTERS]["stacked_inputs"] == 6  # 2 layers x (w1, w2, w3)
        assert counters[COUNTERS]["restacked_weights"] == 24
        assert [_moe_calls(g) for g in seen] == [["stacked", "stacked"]]
        placeholders = seen[0].graph.find_nodes(op="placeholder")
        stacks = [p.meta["val"] for p in placeholders if p.name.endswith("_stack")]
        assert [tuple(s.shape[:1]) for s in stacks] == [(4,)] * 6
        assert not any(p.meta["val"].shape == experts[0].w1.weight.shape for p in placeholders)
        experts[2].w1.weight.mul_(2)  # in place: read through the stack
        torch.testing.assert_close(compiled(x), model(x))
        experts[3].w3.weight.data = experts[3].w3.weight.data.clone() * 0.5  # pointed elsewhere
        with pytest.warns(RuntimeWarning, match="no longer slices of one stack"):
            torch.testing.assert_close(compiled(x), model(x))
        assert counters["stats"]["unique_graphs"] == 1


def test_a_recompile_finds_the_weights_already_stacked(monkeypatch):
    model, (x,) = mixtral4_sparse_loop.build(layers=1, num_experts=4)
    seen = _inner_graphs(monkeypatch)
    torch._dynamo.reset()
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        compiled = torch.compile(model, backend=moe_passes.hpu_moe, options=PORTABLE_INDUCTOR, dynamic=False)
        compiled(x)
        longer = torch.randn(1, x.shape[1] + 3, x.shape[2])
        with warnings.catch_warnings():  # no per-call stacking: the second graph finds the stacks
            warnings.filterwarnings("error", message=".*stacked on every call")
            torch.testing.assert_close(compiled(longer), model(longer))
    assert [_moe_calls(g) for g in seen] == [["stacked"], ["stacked"]]


def test_stack_inputs_carry_dynamos_static_mark_and_user_backends_keep_the_lists(monkeypatch):
    assert backend_passes.takes_stacks("inductor") and backend_passes.takes_stacks("eager")
    assert not backend_passes.takes_stacks(lambda gm, inputs: gm), "a user's backend gets the inputs dynamo captured"
    model, (x,) = mixtral4_sparse_loop.build(layers=1, num_experts=4)
    seen = _inner_graphs(monkeypatch)
    torch._dynamo.reset()
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        torch.compile(model, backend=moe_passes.hpu_moe, options=PORTABLE_INDUCTOR)(x)
    stacks = [p for p in seen[0].graph.find_nodes(op="placeholder") if p.name.endswith("_stack")]
    assert len(stacks) == 3
    assert all(p.meta["tensor_dict"]["_dynamo_static_input_type"] for p in stacks)


def _assert_fallback_gives_weights_back(match: str) -> None:
    """A fresh ModuleList layer whose rewritten compile fails: right result with the warning `match`, and
    every weight back in its own allocation."""
    model, (x,) = mixtral4_sparse_loop.build(layers=1, num_experts=4)
    experts = _experts(model)
    torch._dynamo.reset()
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        compiled = torch.compile(model, backend=moe_passes.hpu_moe, options=PORTABLE_INDUCTOR)
        with pytest.warns(RuntimeWarning, match=match):
            torch.testing.assert_close(compiled(x), model(x))
    _assert_own_allocations(experts)


def test_an_inner_failure_gives_the_captured_graph_its_weights_back(monkeypatch):
    _fail_inner_compiles_of_fused_graphs(monkeypatch)
    _assert_fallback_gives_weights_back("inner backend failed")


def test_separate_tensors_are_stacked_per_call_and_one_stack_is_read_in_place():
    separate = [torch.randn(3, 2) for _ in range(4)]
    group = StackedGroup((0, 1, 2, 3), (4, 3, 2), (6, 2, 1), torch.float32)
    with pytest.warns(RuntimeWarning, match="stacked on every call"):
        stack = InputPlan((), (group,)).inner_inputs(separate)[0]
    assert torch.equal(stack, torch.stack(separate))
    stacked = list(torch.randn(4, 3, 2).unbind(0))
    group = StackedGroup((0, 1, 2, 3), (4, 3, 2), (6, 2, 1), torch.float32)
    assert group.stack(stacked).data_ptr() == stacked[0].data_ptr()


@pytest.mark.parametrize("check", ["torch's C checks", "Python addresses", "is_set_to"])
def test_a_found_stack_is_reused_only_while_every_input_is_still_its_slice(check, monkeypatch):
    if check != "torch's C checks":
        monkeypatch.setattr(weight_stacks, "_pointers_equal", None)
    if check == "is_set_to":
        monkeypatch.setattr(weight_stacks, "_TensorGuards", None)
    stacked = list(torch.randn(4, 3, 2).unbind(0))
    group = StackedGroup((0, 1, 2, 3), (4, 3, 2), (6, 2, 1), torch.float32)
    first = group.stack(stacked)
    assert group.stack(stacked) is first
    reinterpreted = list(stacked)
    reinterpreted[1] = reinterpreted[1].view(torch.int32)  # same storage, offset, sizes and strides
    assert reinterpreted[1].is_set_to(stacked[1])
    with pytest.warns(RuntimeWarning, match="stacked on every call"):
        assert group.stack(reinterpreted) is not first
    assert group.last.entry is None  # the old stack is let go
    first = group.stack(stacked)
    restrided = list(stacked)
    restrided[3] = restrided[3].as_strided((3, 2), (1, 3))  # same address and sizes, read in another order
    with pytest.warns(RuntimeWarning, match="stacked on every call"):
        torch.testing.assert_close(group.stack(restrided)[3], restrided[3])
    moved = list(stacked)
    moved[2] = moved[2].clone()
    with pytest.warns(RuntimeWarning, match="stacked on every call"):
        group.stack(moved)
    again = group.stack(stacked)
    assert again is not first and torch.equal(again, first) and group.stack(stacked) is again
    group = StackedGroup((0, 1, 2, 3), (4, 3, 2), (6, 2, 1), torch.float32)  # found from the parameters
    parameters = [torch.nn.Parameter(t, requires_grad=False) for t in stacked]
    assert group.stack(parameters) is group.stack(parameters)
    parameters[1].data = torch.zeros(3, 2)  # the same object pointed elsewhere, as load_state_dict(assign=True)
    with pytest.warns(RuntimeWarning, match="stacked on every call"):
        assert torch.equal(group.stack(parameters)[1], torch.zeros(3, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replays_read_the_stacks_in_place():
    model, (x,) = mixtral4_sparse_loop.build(layers=1, num_experts=4, dtype=torch.bfloat16)
    model, x = model.cuda(), x.cuda()
    experts = _experts(model)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        compiled = torch.compile(model, backend=moe_passes.hpu_moe, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            torch.testing.assert_close(compiled(x), model(x), atol=2e-2, rtol=2e-2)
        assert counters[COUNTERS]["stacked_inputs"] == 3
        assert counters["inductor"]["cudagraph_skips"] == 0
        experts[1].w2.weight.mul_(3)  # in place: the replay reads it
        torch.testing.assert_close(compiled(x), model(x), atol=2e-2, rtol=2e-2)
        experts[0].w1.weight.data = experts[0].w1.weight.data.clone()  # pointed elsewhere: stacked per call
        with pytest.warns(RuntimeWarning, match="stacked on every call"):
            for _ in range(2):
                torch.testing.assert_close(compiled(x), model(x), atol=2e-2, rtol=2e-2)


def test_a_failure_while_taking_stacks_gives_the_weights_back(monkeypatch):
    from moe_passes import weight_stacks

    def broken(*args, **kwargs):
        raise RuntimeError("rewrite broke")

    monkeypatch.setattr(weight_stacks, "_rewrite", broken)
    _assert_fallback_gives_weights_back("taking the weight lists as stacked inputs failed.*rewrite broke")


def test_a_failed_compile_leaves_stacks_it_did_not_make(monkeypatch):
    """Weights stacked by an earlier compile stay stacked when a later compile falls back."""
    model, (x,) = mixtral4_sparse_loop.build(layers=1, num_experts=4)
    experts = _experts(model)
    torch._dynamo.reset()
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        torch.compile(model, backend=moe_passes.hpu_moe, options=PORTABLE_INDUCTOR, dynamic=False)(x)
        stacked = {role: _stacked_view([getattr(e, role).weight for e in experts]) for role in ("w1", "w2", "w3")}
        assert all(s is not None for s in stacked.values())
        _fail_inner_compiles_of_fused_graphs(monkeypatch)
        longer = torch.randn(1, x.shape[1] + 3, x.shape[2])
        compiled = torch.compile(model, backend=moe_passes.hpu_moe, options=PORTABLE_INDUCTOR, dynamic=False)
        with pytest.warns(RuntimeWarning, match="inner backend failed"):
            torch.testing.assert_close(compiled(longer), model(longer))
    for role, stack in stacked.items():
        assert _stacked_view([getattr(e, role).weight for e in experts]).data_ptr() == stack.data_ptr(), role


def test_a_changed_layout_at_the_same_address_is_read_as_it_is_now():
    """With parameter guards filtered away, a weight transposed in place (same address, new strides) must
    not be read through the stack's old layout."""
    model, (x,) = mixtral4_sparse_loop.build(layers=1, num_experts=4, hidden=16, intermediate=16)
    experts = _experts(model)
    torch._dynamo.reset()
    options = {**PORTABLE_INDUCTOR, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        compiled = torch.compile(model, backend=moe_passes.hpu_moe, options=options)
        torch.testing.assert_close(compiled(x), model(x))
        weight = experts[2].w1.weight
        address = weight.data_ptr()
        weight.data = weight.data.t()  # same storage and address, transposed layout
        assert weight.data_ptr() == address
        with pytest.warns(RuntimeWarning, match="stacked on every call"):
            torch.testing.assert_close(compiled(x), model(x))


def test_the_per_call_stack_is_laid_out_as_compiled():
    """A slow-path stack (tensors no longer one stack) takes the compiled stack's strides, not torch.stack's."""
    base = torch.randn(3, 2, 4)
    compiled_layout = base.transpose(0, 1)  # [2, 3, 4], stride (4, 8, 1): slices of a non-contiguous stack
    tensors = list(compiled_layout.unbind(0))
    group = StackedGroup((0, 1), (2, 3, 4), compiled_layout.stride(), torch.float32)
    moved = [t.clone() for t in tensors]  # separate allocations: the slow path
    with pytest.warns(RuntimeWarning, match="stacked on every call"):
        stack = group.stack(moved)
    assert stack.stride() == compiled_layout.stride() and torch.equal(stack, compiled_layout)
