"""Per-expert weights in separate allocations are moved once into stacks for the portable op, and stay right."""

from __future__ import annotations

import pytest
import torch

import moe_passes
from form_catalog import dynamo_config, mixtral4_sparse_loop
from moe_passes.stacks import movable, restack
from moe_passes.stacks import stacked_view as _stacked_view


def _experts(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == 4)


def test_modulelist_weights_become_one_stack_and_stay_right_when_changed():
    model, (x,) = mixtral4_sparse_loop.build(layers=2, num_experts=4)
    experts = _experts(model)
    before = [e.w1.weight.data_ptr() for e in experts]
    assert _stacked_view([e.w1.weight for e in experts]) is None
    torch._dynamo.reset()
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        expected = model(x)
        report = moe_passes.explain(model, x, options={"inner": "eager", "target": "portable"})
        compiled = torch.compile(model, backend=moe_passes.hpu_moe, options={"inner": "eager", "target": "portable"})
        torch.testing.assert_close(compiled(x), expected)
        assert [f.restacked for f in report.fused] == [12, 12], str(report)
        assert "12 per-expert weights moved into stacks" in str(report)
        assert "compiled as moe_passes::mixture_of_experts.stacked on stacked inputs" in str(report)
        for role in ("w1", "w2", "w3"):
            assert _stacked_view([getattr(e, role).weight for e in experts]) is not None, role
        assert [e.w1.weight.data_ptr() for e in experts] != before
        experts[2].w1.weight.mul_(2)  # in place: lands in the stack
        torch.testing.assert_close(compiled(x), model(x))
        experts[3].w3.weight.data = experts[3].w3.weight.data.clone() * 0.5  # pointed elsewhere
        assert _stacked_view([e.w3.weight for e in experts]) is None
        with pytest.warns(RuntimeWarning, match="stacked on every call"):
            torch.testing.assert_close(compiled(x), model(x))


def test_stacked_weights_are_left_alone():
    from form_catalog import static_dense_loop

    model, (x,) = static_dense_loop.build(num_experts=4)
    torch._dynamo.reset()
    with torch.no_grad():
        report = moe_passes.explain(model, x, options={"inner": "eager", "target": "portable"})
    assert report.fused and all(f.restacked == 0 for f in report.fused), str(report)


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: [torch.randn(3, 2) for _ in range(1)], "one tensor"),
        (lambda: [torch.randn(3, 2), torch.randn(2, 3)], "shapes differ"),
        (lambda: [torch.randn(3, 2), torch.randn(3, 2).double()], "dtypes differ"),
        (lambda: list(torch.randn(2, 3, 2).unbind(0)), "already one stack"),
        (lambda: [torch.randn(3, 2).t(), torch.randn(3, 2).t()], "not contiguous"),
        (lambda: [torch.randn(6)[:4].view(2, 2), torch.randn(2, 2)], "a view of a larger storage"),
    ],
)
def test_tensors_that_others_can_see_into_are_not_moved(make, why):
    assert not movable(make()), why


def test_a_tensor_with_a_view_held_elsewhere_is_not_moved():
    tensors = [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(3)]
    assert movable(tensors)
    held = tensors[1].view(6)  # someone reads this storage: moving would leave them the old data
    assert not movable(tensors)
    del held
    same = [tensors[0], tensors[0], tensors[1]]
    assert not movable(same), "one tensor listed twice (tied experts) must keep its storage"


def test_restack_keeps_values_and_parameters():
    tensors = [torch.nn.Parameter(torch.randn(3, 2)) for _ in range(4)]
    values = [t.detach().clone() for t in tensors]
    restack(tensors)
    assert all(isinstance(t, torch.nn.Parameter) for t in tensors)
    assert all(torch.equal(t, v) for t, v in zip(tensors, values, strict=True))
    assert torch.equal(_stacked_view(tensors), torch.stack(values))


def test_moved_weights_save_and_load_with_transformers(tmp_path):
    """Moved tensors alias one allocation through storages of their own: save_pretrained and torch.save keep them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    restack([layer.mlp.gate_proj.weight for layer in model.model.layers])
    model.save_pretrained(tmp_path / "model")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model")
    for (name, expected), actual in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), name
    torch.save(model.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def _compiled_modulelist_model(inner: str):
    model, (x,) = mixtral4_sparse_loop.build(layers=2, num_experts=4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=moe_passes.hpu_moe, options={"inner": inner, "target": "portable"})
    with torch.no_grad(), dynamo_config(mixtral4_sparse_loop):
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))  # the second call reuses the stacks it found
    assert _stacked_view([e.w1.weight for e in _experts(model)]) is not None  # moved into stacks
    return model, compiled, x


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_deleted_compiled_model_frees_every_expert_weight(inner):
    import gc
    import weakref

    from moe_passes import stacks

    model, compiled, _ = _compiled_modulelist_model(inner)
    parameters = [weakref.ref(p) for p in model.parameters()]
    made = list(stacks._MADE.values())
    assert made and not any(ref.expired() for ref in made)
    del model, compiled
    gc.collect()
    assert [r for r in parameters if r() is not None] == []  # no dynamo reset needed
    assert all(ref.expired() for ref in made)  # the stacks' memory too


def test_saving_one_moved_expert_writes_that_expert_alone():
    import io

    def saved_size(module) -> int:
        buffer = io.BytesIO()
        torch.save(module.state_dict(), buffer)
        return len(buffer.getvalue())

    model, _ = mixtral4_sparse_loop.build(layers=2, num_experts=4)
    before = saved_size(_experts(model)[1])
    model, compiled, x = _compiled_modulelist_model("eager")
    expert = _experts(model)[1]
    assert saved_size(expert) == before  # not the whole stack of 4 experts
    buffer = io.BytesIO()
    torch.save(expert.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert all(torch.equal(loaded[k], v) for k, v in expert.state_dict().items())


def test_a_moved_model_saves_with_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, compiled, x = _compiled_modulelist_model("eager")
    safetensors_torch.save_model(model, tmp_path / "model.safetensors")
    fresh, _ = mixtral4_sparse_loop.build(layers=2, num_experts=4)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    safetensors_torch.load_model(fresh, tmp_path / "model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), compiled(x))
