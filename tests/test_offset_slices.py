"""Functions that cut rows at cumsum offsets held in a tensor (transformers 4.x Aria's
`sequential_experts_gemm`; the catalog's `offset_matmul`): the traced copy reads each bound once as a
number, so dynamo of every supported torch captures one graph, and the constructs that stop the proof
leave the function as written, named."""

from __future__ import annotations

import pytest
import torch

from form_catalog import catalog
from form_catalog.aria4_offset_segments import offset_matmul
from moe_passes.adapters import offset_slices
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe


def rebinding_offsets(rows, weight, counts):
    """Aria's spelling: the offsets name rebound to `cat((zero, offsets))`, bounds bound one by one."""
    out = torch.zeros(rows.shape[0], weight.shape[-1], dtype=rows.dtype)
    offsets = torch.cumsum(counts, dim=0)
    zero = torch.zeros(1, dtype=torch.long)
    offsets = torch.cat((zero, offsets))
    for e in range(weight.shape[0]):
        start = offsets[e]
        end = offsets[e + 1]
        out[start:end] = torch.matmul(rows[start:end], weight[e])
    return out


@pytest.mark.parametrize("fn", [offset_matmul, rebinding_offsets])
@pytest.mark.parametrize("counts", [[2, 0, 3], [0, 0, 5], [5, 0, 0], [1, 0, 0]], ids=str)
def test_the_copy_computes_the_same_and_compiles_to_one_graph(fn, counts):
    copy = offset_slices.traced_copy(fn)
    assert copy is not None and copy is not fn
    counts = torch.tensor(counts)
    rows, weight = torch.randn(int(counts.sum()), 4), torch.randn(3, 4, 6)
    torch.testing.assert_close(copy(rows, weight, counts), fn(rows, weight, counts))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        explanation = torch._dynamo.explain(copy)(rows, weight, counts)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_offsets_beyond_the_rows_raise_instead_of_being_clamped():
    """Python slicing would clamp an end past the rows; the copy's checked bounds raise."""
    copy = offset_slices.traced_copy(offset_matmul)
    with pytest.raises(RuntimeError):
        copy(torch.randn(3, 4), torch.randn(2, 4, 6), torch.tensor([2, 3]))


def bound_read_as_a_tensor(rows, weight, counts):
    out = torch.zeros(rows.shape[0], weight.shape[-1])
    offsets = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(counts, dim=0)))
    for e in range(weight.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        out[start:end] = rows[start:end] @ weight[e] * (end - start)
    return out


def offsets_not_running_sums(rows, weight, counts):
    out = torch.zeros(rows.shape[0], weight.shape[-1])
    offsets = torch.cat((torch.ones(1, dtype=torch.long), torch.cumsum(counts, dim=0)))
    for e in range(weight.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        out[start:end] = rows[start:end] @ weight[e]
    return out


@pytest.mark.parametrize(
    "fn, construct",
    [
        (bound_read_as_a_tensor, "offset end is read other than as a slice bound"),
        (offsets_not_running_sums, "no loop over range(...) binds elements of cumsum offsets"),
    ],
)
def test_constructs_that_stop_the_proof_leave_the_function_as_written(fn, construct):
    assert offset_slices.traced_copy(fn) is None
    assert construct in offset_slices._DECISIONS.get(fn, "copy")


def test_a_written_buffer_seen_through_another_name_is_written_in_place():
    """`alias` sees `out` change: the write stays an in-place copy into the slice, not a new tensor."""

    def aliased(rows, weight, counts):
        out = torch.zeros(rows.shape[0], weight.shape[-1])
        alias = out
        offsets = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(counts, dim=0)))
        for e in range(weight.shape[0]):
            start, end = offsets[e], offsets[e + 1]
            out[start:end] = rows[start:end] @ weight[e]
        return alias

    copy = offset_slices.traced_copy(aliased)
    counts = torch.tensor([1, 2])
    rows, weight = torch.randn(3, 4), torch.randn(2, 4, 5)
    torch.testing.assert_close(copy(rows, weight, counts), aliased(rows, weight, counts))


def zero_or_bias_rows(rows, weight, counts):
    """Experts 0 and 1 write a number or a broadcast row into their slice (a review's cases)."""
    out = torch.zeros(rows.shape[0], weight.shape[-1], dtype=rows.dtype)
    offsets = torch.cat((torch.zeros(1, dtype=torch.long), torch.cumsum(counts, dim=0)))
    for e in range(weight.shape[0]):
        start, end = offsets[e], offsets[e + 1]
        if e == 0:
            out[start:end] = 0.0
        elif e == 1:
            out[start:end] = weight[e, 0]
        else:
            out[start:end] = rows[start:end] @ weight[e].to(torch.float64)
    return out


def test_a_written_number_or_row_broadcasts_as_in_the_assignment():
    copy = offset_slices.traced_copy(zero_or_bias_rows)
    counts = torch.tensor([2, 1, 2])
    rows, weight = torch.randn(5, 4, dtype=torch.float64), torch.randn(3, 4, 4)
    torch.testing.assert_close(copy(rows, weight, counts), zero_or_bias_rows(rows, weight, counts))


def test_the_catalog_form_fuses_on_every_supported_torch():
    """Where dynamo itself refuses tensor slice bounds (torch 2.9-2.11), the copy is what it traces."""
    model, inputs = catalog()["aria4_offset_segments"].build(layers=1, tokens=3)
    report, output, recorder = run_hpu_moe(model, inputs)
    assert (report.graph_count, report.graph_break_count, len(report.fused)) == (1, 0, 1), str(report)
    assert_close_for_dtype(output, eager_output(model, inputs))
