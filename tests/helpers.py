"""Shared test helpers: compile with hpu_moe, keep the graphs the inner backend received, count ops."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from moe_passes.explain import explain_and_run
from moe_passes.printer import is_fused_moe

# Output tolerance per dtype (atol, rtol) for rewritten vs unrewritten models.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (1e-2, 1e-2)}


class RecordingInner:
    """An inner backend that keeps every graph it is handed, then compiles it with `then`."""

    def __init__(self, then: str = "eager"):
        self.then = then
        self.graphs: list[torch.fx.GraphModule] = []
        self.example_inputs: list[list] = []
        self.__name__ = f"recording({then})"

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs.append(gm)
        self.example_inputs.append(list(example_inputs))
        return lookup_backend(self.then)(gm, example_inputs)

    def fused_nodes(self) -> list[torch.fx.Node]:
        return [n for gm in self.graphs for n in gm.graph.nodes if is_fused_moe(n)]

    def parameter_names(self, model: torch.nn.Module, graph_index: int = 0) -> dict[torch.fx.Node, str]:
        """{placeholder: name of the model parameter it was handed} for one recorded graph."""
        by_storage = {p.data_ptr(): name for name, p in model.named_parameters()}
        placeholders = self.graphs[graph_index].graph.find_nodes(op="placeholder")
        return {
            node: by_storage[value.data_ptr()]
            for node, value in zip(placeholders, self.example_inputs[graph_index], strict=True)
            if isinstance(value, torch.Tensor) and value.data_ptr() in by_storage
        }


def run_hpu_moe(model, inputs, inner: str = "eager", **options):
    """(report, output, recorder) for one compile-and-run of `model` with the hpu_moe backend."""
    recorder = RecordingInner(inner)
    options.setdefault("target", "portable")
    report, output = explain_and_run(model, *inputs, options={"inner": recorder, **options})
    return report, output, recorder


def backward_like_eager(model, inputs, **options):
    """The report of one training step (forward and backward) of a copy of `model` compiled with hpu_moe,
    after checking its output and every parameter's gradient against the eager model's."""
    import copy

    from moe_passes.explain import explaining

    twin = copy.deepcopy(model).train()
    model.train()
    options.setdefault("target", "portable")
    with explaining(options) as session:
        output = session.compile(twin)(*inputs)
        output.sum().backward()
    expected = model(*inputs)
    expected.sum().backward()
    torch.testing.assert_close(output, expected)
    for (name, ours), theirs in zip(twin.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=f"gradient of {name}")
    return session.report


def eager_output(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return next(t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor))


def assert_close_for_dtype(actual, expected):
    actual, expected = first_tensor(actual), first_tensor(expected)
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    return (actual.float() - expected.float()).abs().max().item()


def torch_release() -> tuple[int, int]:
    """(major, minor) of the installed torch, local and pre-release tags ignored."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()))


def transformers_major() -> int | None:
    """The installed transformers' major version, None where it is not installed."""
    try:
        from importlib.metadata import version

        return int(version("transformers").split(".")[0])
    except Exception:  # noqa: BLE001 - not installed, or an unreadable version
        return None


# Tests of the 5.x model classes (`experts_implementation`, the 5.x expert modules); the 4.x families
# (the transformers of optimum-habana 1.20) are tested in tests/test_transformers4.py.
requires_transformers_5 = pytest.mark.skipif(
    (transformers_major() or 0) < 5, reason="tests transformers 5.x model classes (4.x: tests/test_transformers4.py)"
)


def skip_unless_the_dp_context_breaks(broke: bool) -> None:
    """The catalog's vLLM pattern breaks the graph in its DP context (at `.tolist()` from torch 2.11, at
    entering the context on 2.10); torch 2.9's dynamo runs it without a break, so break tests cannot
    apply there."""
    if not broke and torch_release() < (2, 11):
        pytest.skip(f"torch {torch.__version__} traces the DP context's .tolist() without a graph break")


def dynamo_breaks_on_tolist() -> bool:
    """Whether this torch's dynamo breaks the graph at `counts.tolist()` without capture_scalar_outputs
    (torch 2.9's keeps the call in the graph instead)."""

    def split_by_counts(ids, rows):
        counts = torch.zeros(4, dtype=torch.long).scatter_add(0, ids, torch.ones_like(ids)).tolist()
        return torch.cat([piece * 2 for piece in rows.split(counts)])

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        explanation = torch._dynamo.explain(split_by_counts)(torch.tensor([0, 1, 1]), torch.ones(3, 2))
    torch._dynamo.reset()
    return explanation.graph_break_count > 0


def _dynamo_captures_one_graph(fn, *args) -> bool:
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        explanation = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    return explanation.graph_break_count == 0


def _cut_at_read_offsets(rows, offsets):
    from moe_passes.adapters.offset_slices import cut  # what the adapted count loop calls

    return cut(rows, offsets[0], offsets[1]) * 2


def _write_over_offsets_read_once(rows, offsets):
    from moe_passes.adapters.offset_slices import cut, offset, write  # what an adapted offset loop calls

    out = torch.zeros_like(rows)
    start, end = offset(offsets[0]), offset(offsets[1])
    return write(out, cut(rows, start, end) * 2, start, end)


def _cut_at_read_total(rows, counts):
    return rows[: int(counts.sum().item())] * 2  # Megatron's `[:num_out_tokens]` of its sorted cells


# Catalog forms that slice rows at offsets read from the data, and the slice that dynamo must capture
# in the adapted code.
_DATA_DEPENDENT_SLICES = {
    # Megatron's permute cuts the sorted cells at the token total read with .item().
    "megatron_sequential_mlp": _cut_at_read_total,
    # Aria's module-level function: bounds read once as numbers, rows cut and written over the same rows.
    "aria4_offset_segments": _write_over_offsets_read_once,
    # The adapted count loop cuts at offsets read with .item().
    "deepseek_v2_count_loop": _cut_at_read_offsets,
}


def skip_unless_dynamo_slices_for(name: str) -> None:
    """Skip a catalog form's test where this torch's dynamo breaks the graph at the form's slice."""
    cut = _DATA_DEPENDENT_SLICES.get(name)
    if cut is not None and not _dynamo_captures_one_graph(cut, torch.ones(4, 2), torch.tensor([1, 3])):
        pytest.skip(f"torch {torch.__version__}'s dynamo breaks the graph at {name}'s data-dependent slice")


class SwiGLU(torch.nn.Module):
    """One expert as hand-written MoE code writes it: gate and up `nn.Linear`s, SiLU, a down `nn.Linear`."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, inter, bias=False)
        self.up = torch.nn.Linear(hidden, inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
