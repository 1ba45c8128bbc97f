"""What hpu_moe's capture layer changes, and when: nothing at `import moe_passes`; its adapters and
dynamo callback only once hpu_moe is used; discovery that survives `torch._dynamo.reset()`.

Each check that needs a process that never saw the package runs in a subprocess of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from moe_passes.explain import explain_and_run
from tests.helpers import assert_close_for_dtype, eager_output
from tests.loop_models import GatedExpert

ROOT = Path(__file__).resolve().parent.parent


def run(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_package_changes_no_class_and_no_dynamo_state():
    state = run(
        """
        import json, sys, torch
        sys.path.insert(0, ".")
        from transformers.models.mixtral import modeling_mixtral  # noqa: F401  (model classes loaded first)
        from form_catalog import hf4_hit_expert_loop, mistral_where_loop  # noqa: F401  (classes the adapters take)

        def classes():
            found, stack = {}, [torch.nn.Module]
            while stack:
                for sub in type.__subclasses__(stack.pop()):
                    found[sub] = {k: id(v) for k, v in vars(sub).items()}
                    stack.append(sub)
            return found

        def dynamo():
            handler = torch._dynamo.callback_handler
            return (repr(torch._dynamo.config.get_config_copy()), len(handler.start_callbacks),
                    len(handler.end_callbacks))

        before, config = classes(), dynamo()
        import moe_passes  # noqa: F401
        after = classes()
        changed = [c.__qualname__ for c in before if after.get(c) != before[c]]
        print(json.dumps({"changed": changed, "dynamo_same": dynamo() == config, "classes": len(before)}))
        """
    )
    assert state["classes"] > 100 and state["changed"] == [] and state["dynamo_same"], state


OTHER_BACKEND = """
    import json, sys, torch
    sys.path.insert(0, ".")
    {imports}
    from form_catalog import catalog, dynamo_config
    results = {{}}
    for name in ("hf4_hit_expert_loop", "deepseek_v2_count_loop", "mistral_where_loop"):
        form = catalog()[name]
        model, inputs = form.build()
        torch._dynamo.reset()
        with torch.no_grad(), dynamo_config(form):
            out = torch._dynamo.explain(model)(*inputs)
        results[name] = [out.graph_count, out.graph_break_count, len(out.break_reasons),
                         sorted(str(g.guard_types) for g in out.out_guards or [])]
    print(json.dumps(results))
"""


def test_other_backends_compile_adapted_families_as_if_never_imported():
    plain = run(OTHER_BACKEND.format(imports=""))
    imported = run(OTHER_BACKEND.format(imports="import moe_passes  # noqa: F401"))
    assert imported == plain


def test_discovery_survives_a_dynamo_reset_and_classes_imported_after_it():
    from form_catalog import catalog, dynamo_config

    first = catalog()["hf4_hit_expert_loop"]
    model, inputs = first.build()
    with dynamo_config(first):
        report, output = explain_and_run(model, *inputs, options={"inner": "eager", "target": "portable"})
    assert len(report.fused) == first.EXPECTED.fused, str(report)
    torch._dynamo.reset()
    # A family whose module is first imported now, compiled as a user would (no explain, no adapt()).
    code = run(
        """
        import json, sys, torch
        sys.path.insert(0, ".")
        import moe_passes
        from form_catalog import catalog, dynamo_config
        first = catalog()["hf4_hit_expert_loop"]
        model, inputs = first.build()
        with torch.no_grad(), dynamo_config(first):
            torch.compile(model, backend="hpu_moe", options={"inner": "eager"})(*inputs)
        torch._dynamo.reset()
        from form_catalog import gpt_oss4_hit_loop  # imported after the reset
        model, inputs = gpt_oss4_hit_loop.build()
        from torch._dynamo.utils import counters
        counters.clear()
        with torch.no_grad(), dynamo_config(gpt_oss4_hit_loop):
            out = torch.compile(model, backend="hpu_moe", options={"inner": "eager"})(*inputs)
            error = (out - model(*inputs)).abs().max().item()
        print(json.dumps({"fused": counters["moe_passes"]["fused"], "expected": gpt_oss4_hit_loop.EXPECTED.fused,
                          "error": error}))
        """
    )
    assert code["fused"] == code["expected"] and code["error"] < 1e-4, code
    assert_close_for_dtype(output, eager_output(model, inputs))


def test_discovery_looks_at_each_class_once(monkeypatch):
    """Adapting installs on the class, so a class needs one look: a compile after new classes were
    defined looks at those only (looking at every loaded class again cost ~0.6 s per compile)."""
    from moe_passes.adapters import discovery, hit_expert_loops

    discovery.prepare()  # every class loaded so far looked at
    seen_before = set(discovery._examined)
    looked_at = []
    original = hit_expert_loops.adaptations_of
    monkeypatch.setattr(hit_expert_loops, "adaptations_of", lambda cls: looked_at.append(cls) or original(cls))

    class DefinedAfterwards(torch.nn.Module):
        def forward(self, x):
            return x

    discovery.adapt_new_classes()
    # A class made elsewhere and not looked at yet (a GraphModule's own subclass, made as another was
    # freed, leaves the count of classes as it was) is looked at with it, once.
    assert looked_at.count(DefinedAfterwards) == 1 and not seen_before & set(looked_at), looked_at
    first = list(looked_at)
    discovery.adapt_new_classes()
    assert looked_at == first


def test_a_class_made_as_another_is_freed_is_looked_at(monkeypatch):
    """The count of loaded classes stays as it was when one is freed and another made (a GraphModule's
    own subclass): the new one is still looked at before the next hpu_moe compile."""
    import gc

    from moe_passes.adapters import discovery, hit_expert_loops

    class Freed(torch.nn.Module):
        def forward(self, x):
            return x

    discovery.prepare()
    del Freed
    gc.collect()

    class MadeInstead(torch.nn.Module):
        def forward(self, x):
            return x

    looked_at = []
    original = hit_expert_loops.adaptations_of
    monkeypatch.setattr(hit_expert_loops, "adaptations_of", lambda cls: looked_at.append(cls) or original(cls))
    discovery.adapt_new_classes()
    assert MadeInstead in looked_at


def test_a_class_looked_at_is_freed_with_its_last_use():
    """Discovery looks at every loaded class (each GraphModule makes its own): none is kept alive by it."""
    import gc
    import weakref

    from moe_passes.adapters import discovery

    class Gone(torch.nn.Module):
        def forward(self, x):
            return x

    discovery.prepare()
    gone = weakref.ref(Gone)
    del Gone
    gc.collect()
    assert gone() is None


def test_a_class_whose_forward_is_replaced_is_looked_at_again(monkeypatch):
    """LongCat-Next patches its MoE class's forward at run time: the class is looked at again then."""
    from moe_passes.adapters import discovery, hit_expert_loops

    class PatchedLater(torch.nn.Module):
        def forward(self, x):
            return x

    discovery.prepare()
    looked_at = []
    original = hit_expert_loops.adaptations_of
    monkeypatch.setattr(hit_expert_loops, "adaptations_of", lambda cls: looked_at.append(cls) or original(cls))
    monkeypatch.setattr(PatchedLater, "forward", lambda self, x: x + 1)
    discovery.adapt()
    assert looked_at == [PatchedLater]


class StackedExpertLoop:
    """A plain helper object (not an nn.Module) that runs the expert loop over stacked weights, held by
    the layer (ktransformers' `KExpertsTorch`, written afresh): looked at beside the layer's class."""

    def __init__(self, experts: int, hidden: int, generator: torch.Generator):
        self.gate = torch.randn(experts, 2 * hidden, hidden, generator=generator) / hidden**0.5
        self.up = torch.randn(experts, 2 * hidden, hidden, generator=generator) / hidden**0.5
        self.down = torch.randn(experts, hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5

    def run(self, x, ids, weights):
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(ids, num_classes=self.gate.shape[0]).permute(2, 1, 0)
        for e in range(self.gate.shape[0]):
            slot, token = torch.where(mask[e])
            h = x[token]
            y = (torch.nn.functional.silu(h @ self.gate[e].T) * (h @ self.up[e].T)) @ self.down[e].T
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


class LayerWithALoopHelper(torch.nn.Module):
    def __init__(self, experts=4, hidden=8):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.loop = StackedExpertLoop(experts, hidden, torch.Generator().manual_seed(0))

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), 2)
        return self.loop.run(x, ids, weights)


def test_an_expert_loop_in_a_helper_object_beside_the_layer_is_captured_and_fused():
    torch.manual_seed(0)
    model, inputs = LayerWithALoopHelper().eval(), (torch.randn(6, 8),)
    report, output = explain_and_run(model, *inputs, options={"inner": "eager", "target": "portable"})
    assert (report.graph_count, report.graph_break_count, len(report.fused)) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))


class InjectedLoopMoE(torch.nn.Module):
    """An MoE injected into a dense MLP the way MixLoRA does it (written afresh): not a submodule, held in a
    plain dict, its forward bound onto the MLP instance, and its loop reached through a method it bound
    onto itself in `__init__`; both bound before any adapter was installed."""

    def __init__(self, experts=4, hidden=8):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(GatedExpert(hidden) for _ in range(experts))
        self.run_experts = self._loop

    def _loop(self, x, ids, weights):
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out

    def forward(self, x):
        weights, ids = torch.topk(self.router(x).softmax(-1), 2)
        return self.run_experts(x, ids, weights)


class DenseMLP(torch.nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.proj(x)


def test_a_forward_bound_onto_another_instance_is_traced_through_its_adapted_copy():
    torch.manual_seed(0)
    mlp, moe = DenseMLP(), InjectedLoopMoE()
    mlp.moes = {"adapter": moe}
    mlp.forward = moe.forward
    model, inputs = torch.nn.Sequential(mlp).eval(), (torch.randn(6, 8),)
    expected = eager_output(model, inputs)
    report, output = explain_and_run(model, *inputs, options={"inner": "eager", "target": "portable"})
    assert (report.graph_count, report.graph_break_count, len(report.fused)) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, expected)
    assert mlp.forward.__self__ is moe and moe.run_experts.__self__ is moe  # bound to the same instances
    assert_close_for_dtype(model(*inputs), expected)  # eager calls run the methods as written


def test_an_adapted_class_and_its_copies_are_freed_with_the_model():
    """A deleted model frees all it held: the class whose expert loop hpu_moe adapted (its forward calls
    `super()`, so the traced copy refers to the class) and the copy itself."""
    import gc
    import inspect
    import weakref

    from loop_models import PresentIds

    class Adapted(PresentIds):
        def forward(self, x):
            w, ids = self.route(x)
            out = torch.zeros_like(x)
            for e in range(len(self.experts)):
                token, slot = torch.where(ids == e)
                out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
            return super().forward(x) * 0 + out

    model = Adapted()
    torch._dynamo.reset()
    torch.compile(model, backend="hpu_moe")(torch.randn(5, 8))
    adapted, forward = weakref.ref(Adapted), weakref.ref(Adapted.forward)
    assert getattr(forward(), "__moe_passes_original__", None) is not None  # the loop was adapted
    del model, Adapted
    torch._dynamo.reset()
    # Python 3.12's inspect.getattr_static (dynamo's, ours) keeps the last 128 classes' MROs in a bounded
    # cache of its own: not a hold of this package's
    if hasattr(inspect, "_shadowed_dict_from_mro_tuple"):
        inspect._shadowed_dict_from_mro_tuple.cache_clear()
    gc.collect()
    assert adapted() is None and forward() is None
