"""The rewritten graph keeps dynamo's metadata, so inductor's CUDA graphs treat weights as static inputs."""

from __future__ import annotations

import torch

import form_catalog
import moe_passes
from moe_passes import backend_passes, ir


def test_rewritten_graph_carries_dynamo_metadata(monkeypatch):
    carried = []

    def spy(captured, canonical):
        result = ir.carry_dynamo_metadata(captured, canonical)
        carried.append((result, canonical))
        return result

    monkeypatch.setattr(backend_passes, "carry_dynamo_metadata", spy)
    model, inputs = form_catalog.catalog()["hf_grouped_mm"].build(layers=2)
    torch._dynamo.reset()
    with torch.no_grad():
        # aot_eager runs AOTAutograd, which reads the metadata (and asserts it is consistent)
        out = torch.compile(model, backend=moe_passes.hpu_moe, options={"inner": "aot_eager"})(*inputs)
        torch.testing.assert_close(out, model(*inputs), atol=3e-2, rtol=3e-2)  # bfloat16
    assert [result for result, _ in carried] == [True]
    canonical = carried[0][1]
    assert "dynamo_compile_id" in canonical.meta and hasattr(canonical, "_param_name_to_source")
    sources = [node._dynamo_source for node in canonical.graph.find_nodes(op="placeholder")]
    assert any("gate_up_proj" in str(source) for source in sources)


def test_metadata_is_not_carried_between_mismatched_graphs():
    def f(x, y):
        return x + y

    captured = torch.fx.symbolic_trace(f)
    canonical = torch.fx.symbolic_trace(lambda x: x * 2)
    assert not ir.carry_dynamo_metadata(captured, canonical)  # not from dynamo at all
    captured.meta["dynamo_compile_id"] = "0/0"
    captured._param_name_to_source = {}
    for node in captured.graph.find_nodes(op="placeholder"):
        node._dynamo_source = None
    assert not ir.carry_dynamo_metadata(captured, canonical)  # two placeholders against one
