"""vLLM-style MoE layers: one compile for every layer, no graph break, a fused call in every layer.

The catalog's `vllm_fused_moe` reproduces vLLM's calling convention (layer registry, `layer_name`, an
opaque op that finds the layer through the forward context). Compiled per decoder layer with plain
inductor it recompiles once per layer until dynamo gives up; with `hpu_moe` the adapters make one
compiled graph serve all layers. Both are asserted here, so the difference is pinned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

import moe_passes
from form_catalog import vllm_fused_moe
from moe_passes.explain import explain_and_run
from moe_passes.printer import is_fused_moe
from moe_passes.report import collecting
from tests.helpers import skip_unless_the_dp_context_breaks

ROOT = Path(__file__).resolve().parent.parent
LAYERS = 32
PORTABLE_EAGER = {"inner": "eager", "target": "portable"}


class CountingInner:
    """An inner backend that counts how often the compiled graphs run their fused MoE calls."""

    __name__ = "counting(eager)"

    def __init__(self):
        self.fused_runs = 0
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        fused = sum(1 for n in gm.graph.nodes if is_fused_moe(n))
        compiled = lookup_backend("eager")(gm, example_inputs)

        def run(*args):
            self.fused_runs += fused
            return compiled(*args)

        return run


def compile_each_layer(model, backend: str, **kwargs):
    return [torch.compile(layer, backend=backend, **kwargs) for layer in model.layers]


def run_layers(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def forward_context(model, x):
    """vLLM's model runner context, with DP metadata (one rank) so the sequence-parallel path runs."""
    return vllm_fused_moe.set_forward_context(model, num_tokens_across_dp=[x.shape[1]])


@pytest.fixture
def model_and_input():
    model, (x,) = vllm_fused_moe.build(num_layers=LAYERS)
    with torch.no_grad(), forward_context(model, x):
        expected = model(x)
    torch._dynamo.reset()
    moe_passes.install_discovery_hook()  # reset() clears dynamo's start callbacks, ours among them
    counters.clear()
    return model, x, expected


def test_each_layer_compiled_alone_shares_one_compile_under_hpu_moe(model_and_input):
    model, x, expected = model_and_input
    inner = CountingInner()
    layers = compile_each_layer(model, "hpu_moe", options={**PORTABLE_EAGER, "inner": inner})
    with torch.no_grad(), forward_context(model, x), collecting() as collector:
        out = run_layers(layers, x)
    assert counters["frames"]["ok"] == 1 and counters["frames"]["total"] == 1, dict(counters["frames"])
    assert not counters["graph_break"] and not counters["recompiles"]
    (record,) = collector.records
    assert len(record.fused) == 1 and not record.declined and record.fallback is None
    assert inner.fused_runs == LAYERS  # every layer ran the fused call
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_plain_inductor_recompiles_per_layer_then_falls_back_to_eager(model_and_input):
    model, x, expected = model_and_input
    limit = torch._dynamo.config.recompile_limit
    layers = compile_each_layer(model, "inductor")
    with torch.no_grad(), forward_context(model, x):
        out = run_layers(layers, x)
    # The context access breaks the graph; one compile per layer until the limit; later layers run eagerly.
    skip_unless_the_dp_context_breaks(bool(counters["graph_break"]))
    # `.tolist()` in the DP context (torch 2.11+), or entering that context (torch 2.10 does not inline it)
    assert any(
        "_local_scalar_dense" in reason or "__enter__" in reason for reason in counters["graph_break"]
    ), dict(counters["graph_break"])
    assert counters["frames"]["ok"] >= limit and counters["frames"]["total"] > counters["frames"]["ok"]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_adapters_can_be_turned_off_by_option(model_and_input):
    model, x, expected = model_and_input
    layers = compile_each_layer(model, "hpu_moe", options={**PORTABLE_EAGER, "adapters": False})
    with torch.no_grad(), forward_context(model, x), collecting() as collector:
        out = run_layers(layers, x)
    assert counters["frames"]["ok"] >= torch._dynamo.config.recompile_limit
    assert counters["frames"]["total"] > counters["frames"]["ok"]  # the recompile limit was hit
    assert not any(record.fused for record in collector.records)  # the experts stay inside the opaque op
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_adapters_can_be_turned_off_by_environment():
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from torch._dynamo.utils import counters
        import moe_passes
        from form_catalog import vllm_fused_moe
        model, (x,) = vllm_fused_moe.build(num_layers=10)
        layers = [torch.compile(l, backend="hpu_moe", options={PORTABLE_EAGER!r}) for l in model.layers]
        with torch.no_grad(), vllm_fused_moe.set_forward_context(model):
            for layer in layers:
                x = layer(x)
        print(counters["frames"]["ok"], moe_passes.adapters.adapted_classes())
        """
    )
    env = {**os.environ, "MOE_PASSES_ADAPTERS": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    compiles, adapted = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(compiles) == torch._dynamo.config.recompile_limit and adapted == "{}", result.stdout


def test_whole_model_compiles_into_one_graph_with_a_fused_call_per_layer():
    model, (x,) = vllm_fused_moe.build(num_layers=4)
    with torch.no_grad(), vllm_fused_moe.set_forward_context(model):
        expected = model(x)
        report, out = explain_and_run(model, x, options=PORTABLE_EAGER)
    assert (report.graph_count, report.graph_break_count, report.compile_count) == (1, 0, 1), str(report)
    assert [f.layer for f in report.fused] == [f"layers.{i}.experts" for i in range(4)], str(report)
    assert {f.overload for f in report.fused} == {"moe_passes::mixture_of_experts.stacked_fused_weights"}
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_dynamic_token_counts_do_not_recompile():
    """T in {1, 7, 64, 513} with mark_dynamic: one compile (size-oblivious so T=1 is not specialised)."""
    model, _ = vllm_fused_moe.build(num_layers=2)
    torch._dynamo.reset()
    moe_passes.install_discovery_hook()
    counters.clear()
    compiled = torch.compile(model, backend="hpu_moe", options=PORTABLE_EAGER)
    oblivious = torch.fx.experimental._config.patch(backed_size_oblivious=True)
    with torch.no_grad(), vllm_fused_moe.set_forward_context(model), oblivious, collecting() as collector:
        for tokens in (7, 1, 64, 513):
            x = torch.randn(1, tokens, 16, generator=torch.Generator().manual_seed(tokens))
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])
    (record,) = collector.records
    assert len(record.fused) == 2


def test_explicit_adapt_reports_what_it_adapted():
    model, _ = vllm_fused_moe.build(num_layers=1)
    moe_passes.adapt(model)  # idempotent: the class is already adapted by discovery
    assert moe_passes.adapters.adapted_classes()["form_catalog.vllm_fused_moe.FusedMoE"].startswith("vllm-style")
    with pytest.raises(TypeError, match="nn.Module"):
        moe_passes.adapt("model")


def test_eager_and_other_backends_keep_the_original_forward():
    """The adapter changes nothing outside hpu_moe tracing: eager still goes through the opaque op."""
    model, (x,) = vllm_fused_moe.build(num_layers=1)
    layer = model.layers[0].experts
    with torch.no_grad(), pytest.raises(RuntimeError, match="forward context is not set"):
        layer(x.reshape(-1, 16), torch.zeros(x.shape[1], 4))


class AttentionWithForwardImpl(torch.nn.Module):
    """vLLM's MLA attention shape: forward reads `layer_name` and there is a `forward_impl`, but of
    attention inputs. Rerouting it would call forward_impl with the wrong arguments."""

    layer_name = "model.layers.0.self_attn.attn"

    def forward(self, q, kv_c_normed, k_pe):
        return torch.ops.moe_passes_absent.unified_mla(q, kv_c_normed, k_pe, self.layer_name)

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output):
        return output


class MixerWithForwardImpl(AttentionWithForwardImpl):
    """vLLM's Mamba mixer shape: `forward_impl(hidden_states, output)`."""

    def forward(self, hidden_states, router_logits):
        return self.forward_impl(hidden_states, self.layer_name)

    def forward_impl(self, hidden_states, output):
        return output


@pytest.mark.parametrize("cls", [AttentionWithForwardImpl, MixerWithForwardImpl])
def test_layers_that_only_look_like_the_convention_are_not_adapted(cls):
    from moe_passes.adapters import vllm_style

    class MoELayer(torch.nn.Module):
        layer_name = "model.layers.0.mlp.experts"

        def forward(self, hidden_states, router_logits):
            return torch.ops.moe_passes_absent.moe_forward(hidden_states, router_logits, self.layer_name)

        def forward_impl(self, hidden_states, router_logits):
            return hidden_states

    assert not vllm_style.follows_convention(cls)
    assert vllm_style.follows_convention(MoELayer)
