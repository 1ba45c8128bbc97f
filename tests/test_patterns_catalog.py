"""The catalog's own contract: every form builds, runs, compiles, honours overrides, states EXPECTED."""

from __future__ import annotations

import pytest
import torch

from patterns import Expected, catalog

FORMS = catalog()


def test_catalog_lists_the_forms_in_a_stable_order():
    assert list(FORMS) == list(catalog())
    assert {"static_dense_loop", "modulelist_dense_mask", "hf_grouped_mm", "hf_batched_mm"} <= set(FORMS)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_builds_runs_and_states_its_expectation(name):
    form = FORMS[name]
    assert isinstance(form.EXPECTED, Expected)
    assert form.__doc__ and ".py" in form.__doc__, "the docstring must cite the code the form mirrors"
    model, inputs = form.build()
    assert not model.training
    with torch.no_grad():
        out = model(*inputs)
        compiled = torch.compile(model, backend="eager", fullgraph=True)(*inputs)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(compiled, out)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_overrides_take_effect_and_unknown_ones_are_errors(name):
    form = FORMS[name]
    model, _ = form.build(num_experts=6, layers=3)
    stacked = [p for p in model.parameters() if p.dim() == 3]
    experts = {p.shape[0] for p in stacked} if stacked else {len(m.experts) for m in model.moes}
    assert experts == {6}
    assert len(model.moes) == 3
    with pytest.raises(TypeError, match="unknown override"):
        form.build(not_an_option=1)
