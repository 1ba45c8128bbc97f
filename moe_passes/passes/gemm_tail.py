"""The GEMM tail every stacked-weight form shares: down(act(gate) * up) over [E, ., .] weight stacks.

The grouped and batched forms differ only in how one projection picks each row's expert (group
offsets over rows sorted by expert; weights gathered per slot by the ids). Given a reader for their
projection, the rest is read once, here: the gate between the projections (`mlp.stacked_gate`), the
gate/up projection(s) on the same rows with the same choice of expert as the down projection, expert
biases only with GPT-OSS's clamped swiglu, and one expert count for every stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.fx import Node

from ..fx_utils import const_int, shape, strip_shape_ops
from .matches import BIASES_NEED_SWIGLU, GATE_UP_ROWS_DIFFER, STACK_COUNTS_DIFFER, ExpertWeights, NoMatch
from .mlp import StackedGate, same_value, stacked_gate


@dataclass(frozen=True)
class StackedLinear:
    """rows @ stack[e] (+ bias[e]) for each row's expert e, as one form spells it."""

    output: Node  # the projection's result, before its bias
    rows: Node
    stack: Node  # [E, out, in] (out_in) or [E, in, out]
    out_in: bool
    chosen_by: Node  # what picks each row's expert: the group offsets, or the ids the weights are gathered with
    bias: Node | None = None  # stacked [E, out] bias
    bias_ids: Node | None = None  # the ids the bias is gathered with


@dataclass(frozen=True)
class GatedTail:
    """The projections of a gated expert MLP and the gate between them."""

    gate: StackedGate
    projections: dict[str, StackedLinear]  # "gate_up", or "gate" and "up"
    down: StackedLinear

    @property
    def rows(self) -> Node:
        return next(iter(self.projections.values())).rows

    @property
    def up(self) -> StackedLinear:
        """The gate/up projection (the first of two when gate and up are separate)."""
        return next(iter(self.projections.values()))


def read_gated_tail(
    down: StackedLinear, read: Callable[[Node], StackedLinear | None], kind: str, separate: bool = False
) -> GatedTail | NoMatch:
    """The gate and gate/up projection(s) feeding `down`, each read by `read` (a projection spelled as
    `kind`, e.g. "a grouped matmul"); else why not. `separate`: gate and up may be two projections
    (torchtitan's w1 / w3)."""
    gate = stacked_gate(down.rows, separate=separate)
    if isinstance(gate, NoMatch):
        return gate
    if gate.gate_up_output is not None:
        outputs = {"gate_up": gate.gate_up_output}
    else:
        outputs = {"gate": gate.gate_output, "up": gate.up_output}
    projections = {}
    for name, output in outputs.items():
        linear = read(output)
        if linear is None:
            return NoMatch(f"gate/up is not {kind}", output)
        if not same_value(strip_shape_ops(linear.chosen_by), strip_shape_ops(down.chosen_by)):
            return NoMatch("gate/up and down choose each row's expert differently (other group offsets or ids)", output)
        projections[name] = linear
    first_rows = next(iter(projections.values())).rows  # one tensor of rows, if written twice
    if not all(same_value(p.rows, first_rows) for p in projections.values()):
        return NoMatch(GATE_UP_ROWS_DIFFER, outputs["up"])
    if any(p.bias is not None for p in projections.values()) and gate.swiglu is None:
        return NoMatch(BIASES_NEED_SWIGLU, next(iter(outputs.values())))
    if gate.swiglu is not None and (projections["gate_up"].bias is None or down.bias is None):
        return NoMatch(BIASES_NEED_SWIGLU, gate.gate_up_output)
    if down.bias is not None and gate.swiglu is None:
        return NoMatch(BIASES_NEED_SWIGLU, down.output)
    return GatedTail(gate, projections, down)


def expert_weights(tail: GatedTail, num_experts: int | None) -> dict[str, ExpertWeights] | NoMatch:
    """{role: ExpertWeights} of the tail's stacks, each holding `num_experts` experts (None: whatever
    count the stacks agree on); else why not (where: the caller's choice)."""
    linears = {**tail.projections, "down": tail.down}
    counts = set()
    for linear in linears.values():
        dims = shape(linear.stack)
        if dims is None or len(dims) != 3:
            return NoMatch("expert weights are not stacked [E, ., .] tensors")
        counts.add(const_int(dims[0]))
    if len(counts) != 1:
        return NoMatch(STACK_COUNTS_DIFFER)
    if num_experts is not None and counts != {num_experts}:
        return NoMatch("the number of stacked experts differs from the expert count of the routing")
    return {name: ExpertWeights(stacked=linear.stack, out_in=linear.out_in) for name, linear in linears.items()}


def stack_count(tail: GatedTail) -> int | None:
    """The expert count of the tail's down stack (checked against the others by `expert_weights`)."""
    dims = shape(tail.down.stack)
    return const_int(dims[0]) if dims is not None and len(dims) == 3 else None
