"""Training: MoE layers fused in graphs that need gradients, with eager's losses and weights.

Each model is trained twice from the same weights, eagerly and compiled with hpu_moe (inner backend
aot_eager: AOTAutograd differentiates the rewritten graph as inductor would, without inductor's
compile time), and the two runs must agree step by step.
"""

from __future__ import annotations

import copy

import pytest
import torch

import moe_passes
from form_catalog import catalog, dynamo_config
from moe_passes.tiny_models import NotBuildable, inputs, output_tensor, tiny_model
from tests.helpers import TOLERANCE, first_tensor, skip_unless_dynamo_slices_for

FORMS = catalog()
FUSED = sorted(n for n, f in FORMS.items() if f.EXPECTED.fused)
STEPS = 20


def _trainable(model: torch.nn.Module, train_mode: bool = True) -> torch.nn.Module:
    model.train(train_mode)
    for p in model.parameters():
        p.requires_grad_(p.is_floating_point())
    return model


def train_side_by_side(model, loss_of, options=None, config=None, steps=STEPS, lr=0.05, train_mode=True):
    """(eager losses, compiled losses, eager model, compiled model, report) after `steps` SGD steps."""
    eager, twin = _trainable(model, train_mode), _trainable(copy.deepcopy(model), train_mode)
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (eager, twin)]
    losses = ([], [])
    with config or dynamo_config(None), moe_passes.explaining({"target": "portable", **(options or {})}) as session:
        compiled = torch.compile(twin, backend=session.backend)
        for _ in range(steps):
            for run, optimizer, record in zip((eager, compiled), optimizers, losses, strict=True):
                loss = loss_of(run)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                record.append(loss.detach().float())
    return torch.stack(losses[0]), torch.stack(losses[1]), eager, twin, session.report


def assert_trained_alike(eager_losses, compiled_losses, eager, twin, initial):
    for name, p in eager.named_parameters():
        atol, rtol = TOLERANCE[p.dtype]
        torch.testing.assert_close(dict(twin.named_parameters())[name], p, atol=atol, rtol=rtol, msg=name)
    atol, rtol = TOLERANCE[max((p.dtype for p in eager.parameters()), key=lambda d: TOLERANCE[d][0])]
    torch.testing.assert_close(compiled_losses, eager_losses, atol=atol, rtol=rtol)
    moved = [name for name, p in twin.named_parameters() if not torch.equal(p, initial[name])]
    assert moved, "no parameter changed: the steps trained nothing"


@pytest.mark.parametrize("name", FUSED)
def test_catalog_form_trains_fused_like_eager(name):
    skip_unless_dynamo_slices_for(name)
    form = FORMS[name]
    model, args = form.build()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    eager_losses, compiled_losses, eager, twin, report = train_side_by_side(
        model, lambda m: first_tensor(m(*args)).float().square().mean(), {"inner": "aot_eager"}, dynamo_config(form)
    )
    assert len(report.fused) == form.EXPECTED.fused and all(f.training for f in report.fused), str(report)
    assert report.compile_count == 1, str(report)
    assert_trained_alike(eager_losses, compiled_losses, eager, twin, initial)


FAMILIES = [("mixtral", "grouped_mm"), ("qwen3_moe", "batched_mm"), ("gpt_oss", None), ("deepseek_v3", None)]


@pytest.mark.parametrize("family, implementation", FAMILIES)
def test_transformers_model_trains_fused_like_eager(family, implementation):
    """In eval mode with gradients on (as tools/coverage.py --training): the families' train-mode branches
    add dropout or router noise, and transformers 4.x GPT-OSS runs another expert loop when training."""
    try:
        model = tiny_model(family, implementation, layers=2)
    except NotBuildable as why:
        pytest.skip(str(why))
    args, kwargs = inputs(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    eager_losses, compiled_losses, eager, twin, report = train_side_by_side(
        model, lambda m: output_tensor(m(*args, **kwargs)).float().square().mean(), {"inner": "aot_eager"}, steps=4,
        train_mode=False,
    )
    assert report.fused and all(f.training for f in report.fused), str(report)
    assert not report.declined, str(report)
    assert_trained_alike(eager_losses, compiled_losses, eager, twin, initial)


def test_inductor_trains_a_fused_layer_in_bfloat16():
    """The default inner backend on a bfloat16 model: inductor compiles forward and backward."""
    form = FORMS["hf_grouped_mm"]
    model, args = form.build()
    model = model.to(torch.bfloat16)
    args = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    eager_losses, compiled_losses, eager, twin, report = train_side_by_side(
        model, lambda m: first_tensor(m(*args)).float().square().mean(), {"inner": "inductor"}, steps=5
    )
    assert len(report.fused) == form.EXPECTED.fused and all(f.training for f in report.fused), str(report)
    assert_trained_alike(eager_losses, compiled_losses, eager, twin, initial)


def test_report_says_fused_in_training():
    model, args = FORMS["static_dense_loop"].build()
    *_, report = train_side_by_side(model, lambda m: first_tensor(m(*args)).sum(), {"inner": "aot_eager"}, steps=1)
    assert "fused (training, recompute), " in str(report)
    assert all(not f.routing_fused and not f.restacked and f.compiled_as is None for f in report.fused)


def test_per_expert_parameters_get_their_gradients_and_updates_are_read():
    """Experts kept as separate parameters: each one's .grad is filled, and an in-place update between
    calls changes the compiled output as it changes eager's."""
    model, args = FORMS["modulelist_dense_mask"].build()
    _trainable(model)
    with moe_passes.explaining({"target": "portable", "inner": "aot_eager"}) as session:
        compiled = torch.compile(model, backend=session.backend)
        first_tensor(compiled(*args)).sum().backward()
        experts = [p for name, p in model.named_parameters() if "experts" in name]
        assert experts and all(p.grad is not None for p in experts)
        with torch.no_grad():
            experts[0].mul_(2.0)
        torch.testing.assert_close(first_tensor(compiled(*args)), first_tensor(model(*args)))
    assert all(f.training for f in session.report.fused) and session.report.fused, str(session.report)


@pytest.mark.parametrize("name", ["hf_grouped_mm", "torchtitan_grouped_experts"])
def test_saved_activations_train_like_eager(name):
    """recompute=False: calls over stacked weights become grouped matmuls whose activations are saved."""
    form = FORMS[name]
    model, args = form.build()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    eager_losses, compiled_losses, eager, twin, report = train_side_by_side(
        model, lambda m: first_tensor(m(*args)).float().square().mean(),
        {"inner": "aot_eager", "recompute": False}, dynamo_config(form), steps=5,
    )
    assert len(report.fused) == form.EXPECTED.fused, str(report)
    assert all(f.training_backward == "saved activations" for f in report.fused), str(report)
    assert "fused (training, saved activations), " in str(report)
    assert_trained_alike(eager_losses, compiled_losses, eager, twin, initial)


def test_per_expert_lists_keep_the_recompute_backward_with_recompute_off():
    """Saving applies to calls over stacked weights; a ModuleList's call keeps the op's backward."""
    model, args = FORMS["mixtral4_sparse_loop"].build()
    *_, report = train_side_by_side(
        model, lambda m: first_tensor(m(*args)).sum(), {"inner": "aot_eager", "recompute": False}, steps=1
    )
    assert report.fused and all(f.training_backward == "recompute" for f in report.fused), str(report)


def test_recompute_must_be_a_bool():
    with pytest.raises(TypeError, match="recompute must be a bool"):
        moe_passes.Options.parse({"recompute": "no"})
