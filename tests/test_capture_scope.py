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
    looked_at = []
    original = hit_expert_loops.adaptations_of
    monkeypatch.setattr(hit_expert_loops, "adaptations_of", lambda cls: looked_at.append(cls) or original(cls))

    class DefinedAfterwards(torch.nn.Module):
        def forward(self, x):
            return x

    discovery.adapt_new_classes()
    assert looked_at == [DefinedAfterwards]
    discovery.adapt_new_classes()
    assert looked_at == [DefinedAfterwards]


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
