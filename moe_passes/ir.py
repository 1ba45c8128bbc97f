"""The canonical IR the passes read: a functional ATen inference graph traced from dynamo's graph.

Dynamo graphs hold torch-level calls in many spellings (methods, functionals, modules inlined,
in-place updates). Tracing them once with `make_fx` under functionalization gives one spelling:
ATen ops, no mutation, parameters as placeholders in dynamo's order, and fake values with the same
symbolic shapes on every node. Every inner backend accepts such a graph as if dynamo had produced it.
"""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx


def fake_inputs(example_inputs, fake_mode):
    """Fake twins of the backend's example inputs in the compile's fake mode.

    Dynamo records a symbolic context for every tensor it fakified; reusing it keeps the dynamic
    dimensions of the captured graph symbolic here too (the same step AOTAutograd takes).
    """
    context = torch._guards.TracingContext.try_get()
    out = []
    with fake_mode:
        for value in example_inputs:
            if not isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, torch._subclasses.FakeTensor) and value.fake_mode is fake_mode:
                out.append(value)
            elif context is not None and value in context.tensor_to_context:
                symbolic = context.tensor_to_context[value]
                out.append(
                    fake_mode.from_tensor(value, symbolic_context=symbolic, source=symbolic.tensor_source)
                )
            else:
                out.append(fake_mode.from_tensor(value))
    return out


def to_canonical_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Trace `gm` to functional ATen with the placeholders of `gm`, one per example input."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    args = fake_inputs(example_inputs, fake_mode)

    def run(*flat):
        # Running node by node under preserve_node_meta carries dynamo's nn_module_stack and stack
        # traces onto the ATen nodes, which is how reports name the layer each rewrite came from.
        return torch.fx.Interpreter(gm).run(*flat)

    with fake_mode, fx_traceback.preserve_node_meta():
        traced = make_fx(torch.func.functionalize(run, remove="mutations"))(*args)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def views_to_reshapes(gm: torch.fx.GraphModule) -> None:
    """Turn `view`s into `reshape`s before the graph is handed on.

    The inner backend re-traces the graph with its own decompositions, which may lay intermediates out
    with other strides than this trace saw; a `view` recorded here can then be impossible there, while
    a `reshape` means the same values and copies only when it must.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (
            torch.ops.aten.view.default,
            torch.ops.aten._unsafe_view.default,
        ):
            node.target = torch.ops.aten.reshape.default
    gm.recompile()
