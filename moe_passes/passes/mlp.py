"""Reading the gated MLP that every expert computes: down(act(gate(x)) * up(x)).

Shared by the finders of every expert form: they differ in how tokens reach the experts and how the
outputs are combined, not in the MLP itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from ..fx_utils import TRANSPOSE_OPS, const_int, is_call, is_getitem, shape, strip_casts, strip_shape_ops
from .matches import NOT_GATED, NoMatch, unsupported_activation

aten = torch.ops.aten

def activation_of(node: Node) -> tuple[str | None, str]:
    """(kernel activation name, description) for an activation node; name None when unsupported."""
    if is_call(node, aten.silu):
        return "silu", "silu"
    if is_call(node, aten.relu):
        return "relu", "relu"
    if is_call(node, aten.gelu):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approximate == "tanh":
            return "gelu", "gelu(tanh)"
        return None, "gelu (exact erf; the kernel's gelu is the tanh approximation)"
    name = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.op
    return None, name


@dataclass(frozen=True)
class GatedProduct:
    """act(gate) * up, where gate and up are either halves of one projection or two projections."""

    activation_node: Node
    gate: Node  # the pre-activation gate values
    up: Node


# Unary ops an expert may use as its activation; only the first three are fusable, the others are
# recognised so that the form can be declined with the activation named.
_FUSABLE_ACTS = (aten.silu, aten.gelu, aten.relu)
_OTHER_ACTS = (
    aten.sigmoid,
    aten.tanh,
    aten.elu,
    aten.leaky_relu,
    aten.mish,
    aten.hardswish,
    aten.hardsigmoid,
)


def gated_product(node: Node) -> GatedProduct | None:
    """Match mul(act(gate), up) in either operand order."""
    node = strip_shape_ops(node)
    if not is_call(node, aten.mul.Tensor) or not all(isinstance(a, Node) for a in node.args):
        return None
    pairs = ((node.args[0], node.args[1]), (node.args[1], node.args[0]))
    for acts in (_FUSABLE_ACTS, _OTHER_ACTS):
        for act, up in pairs:
            act = strip_shape_ops(act)
            if is_call(act, *acts):
                return GatedProduct(act, strip_shape_ops(act.args[0]), strip_shape_ops(up))
    return None


def row_scaled(node: Node) -> tuple[Node, Node] | None:
    """(h, c) for act(gate) * up * c with one c per row ([N, 1], casts allowed): a routing weight applied
    between the activation and a bias-free down projection, which carries it to its output unchanged
    (down(h * c) = down(h) * c; Megatron's experts scale there)."""
    node = strip_casts(node)
    if not is_call(node, aten.mul.Tensor) or not all(isinstance(a, Node) for a in node.args):
        return None
    for h, c in (node.args, node.args[::-1]):
        rows, scale = shape(h), shape(c)
        if rows and scale and len(rows) == len(scale) == 2 and const_int(scale[1]) == 1:
            if gated_product(strip_casts(h)) is not None:
                return strip_casts(h), c
    return None


def halves(gate: Node, up: Node) -> tuple[Node, int] | None:
    """When gate and up are the first and second half of one tensor on the last dim: (tensor, I)."""
    # chunk(2, -1) / split(I, -1) -> getitem 0 and 1 of one split node
    if is_getitem(gate, 0) and is_getitem(up, 1) and same_value(gate.args[0], up.args[0]):
        split = gate.args[0]
        if is_call(split, aten.split.Tensor, aten.split_with_sizes, aten.split_copy.Tensor) and _last_dim(
            split, split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        ):
            source = split.args[0]
            width = shape(source)[-1]
            pieces = split.args[1]
            size = const_int(pieces) if not isinstance(pieces, list | tuple) else None
            if isinstance(pieces, list | tuple) and len(pieces) == 2:
                a, b = (const_int(p) for p in pieces)
                size = a if a == b else None
            if size is not None and const_int(width) == 2 * size:
                return source, size
        return None
    # x[..., :I] and x[..., I:] -> two slices of the same tensor
    if is_call(gate, aten.slice.Tensor) and is_call(up, aten.slice.Tensor) and gate.args[0] is up.args[0]:
        source = gate.args[0]
        width = const_int(shape(source)[-1])
        if width is None or width % 2:  # `h[:, :1] * act(h[:, 1:])` of 3 features: unequal parts, no halves
            return None
        g = _slice_bounds(gate, width)
        u = _slice_bounds(up, width)
        if g and u and _last_dim(gate, g[0]) and g[1:] == (0, width // 2) and u[1:] == (width // 2, width):
            return source, width // 2
    return None


GATE_SECOND = ("the activation reads the second half of the joined gate/up projection (up * act(gate) with up "
               "first, as dolomite-engine's GLU `x[0] * act(x[1])`); the fused kernel's joined weights take the "
               "gate first")


def gate_second(product: GatedProduct) -> bool:
    """act(gate) * up where gate and up are the second and the first half of one tensor (`halves` swapped)."""
    return halves(product.up, product.gate) is not None


def same_value(a: object, b: object, depth: int = 4) -> bool:
    """Whether two nodes compute the same value: the same node, or the same op on the same arguments.

    Tracing can duplicate a split and its squeeze (one copy per half); the halves are still one tensor's.
    """
    if a is b:
        return True
    if not (isinstance(a, Node) and isinstance(b, Node)) or depth == 0:
        return not isinstance(a, Node) and not isinstance(b, Node) and a == b
    if a.op != "call_function" or a.op != b.op or a.target != b.target or a.kwargs != b.kwargs:
        return False
    if len(a.args) != len(b.args) or torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ()):
        return False
    return all(same_value(x, y, depth - 1) for x, y in zip(a.args, b.args, strict=True))


def _slice_bounds(node: Node, width: int | None) -> tuple[int, int, int] | None:
    args = list(node.args) + [None] * (5 - len(node.args))
    dim, start, end, step = args[1] if args[1] is not None else 0, args[2], args[3], args[4]
    start = 0 if start is None else const_int(start)
    end = width if end is None else const_int(end)
    if step not in (None, 1) or start is None or end is None or width is None:
        return None
    return dim, max(start, 0), min(end, width)


def _last_dim(node: Node, dim) -> bool:
    rank = len(shape(node.args[0]))
    return dim in (-1, rank - 1)


@dataclass(frozen=True)
class Projection:
    """x @ W.T (out_in=True, W like nn.Linear.weight) or x @ W (out_in=False) for one 2-D weight."""

    input: Node
    weight: Node
    out_in: bool
    out_rows: tuple[int, int] | None = None  # only these output features of W are this projection's


def projection(node: Node) -> Projection | None:
    """Match a bias-free linear layer on 2-D (or flattened) input: mm(x, t(W)) or mm(x, W), or x @ W.T
    written in slices of W (see _sliced_projection)."""
    node = strip_shape_ops(node)
    if not is_call(node, aten.mm.default):
        return _sliced_projection(node)
    x, w = node.args
    if is_call(w, *TRANSPOSE_OPS) and _is_2d_swap(w):
        return Projection(strip_shape_ops(x), w.args[0], True)
    return Projection(strip_shape_ops(x), w, False)


def _sliced_projection(node: Node) -> Projection | None:
    """x @ W.T written in slices of W (LLaMA's `pretraining_tp > 1`, which DiT-MoE's experts keep): the
    columns `cat([x @ W_i.T for W_i in W.split(s, 0)], -1)` in order, or the sum `sum(x_i @ W_i.T)` over
    x.split(s, -1) and W.split(s, 1) paired by index. Both are x @ W.T (the sum up to the order in which
    floats are added, as any matmul kernel chooses)."""
    if is_call(node, aten.cat.default) and len(node.args[0]) > 1:
        dim, rank = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape(node) or ())
        if not rank or not isinstance(dim, int) or dim % rank != rank - 1:
            return None
        reads = [_plain_projection(piece) for piece in node.args[0]]
        if any(r is None or not r.out_in for r in reads) or len({r.input for r in reads}) != 1:
            return None
        weights = [_piece(r.weight) for r in reads]
        if any(w is None for w in weights) or len({(w[0], w[1], w[3]) for w in weights}) != 1:
            return None
        source, split_dim, _, count = weights[0]
        if split_dim != 0 or count != len(reads) or [w[2] for w in weights] != list(range(count)):
            return None
        return Projection(reads[0].input, source, True)
    terms = _summed_terms(node)
    if terms is None or len(terms) < 2:
        return None
    reads = [_plain_projection(term) for term in terms]
    if any(r is None or not r.out_in for r in reads):
        return None
    inputs, weights = [_piece(r.input) for r in reads], [_piece(r.weight) for r in reads]
    if any(p is None for p in inputs + weights):
        return None
    if len({(p[0], p[1], p[3]) for p in inputs}) != 1 or len({(p[0], p[1], p[3]) for p in weights}) != 1:
        return None
    (x, x_dim, _, count), (w, w_dim, _, _) = inputs[0], weights[0]
    paired = [a[2] for a in inputs] == [b[2] for b in weights] and sorted(a[2] for a in inputs) == list(range(count))
    if not paired or count != len(reads) or x_dim != len(shape(x)) - 1 or w_dim != 1 or len(shape(w)) != 2:
        return None
    return Projection(x, w, True)


def _plain_projection(node: Node) -> Projection | None:
    node = strip_shape_ops(node)
    return projection(node) if is_call(node, aten.mm.default) else None


def _piece(node: Node) -> tuple[Node, int, int, int] | None:
    """(source, dim, index, number of pieces) for `split(source, size, dim)[index]`."""
    if not is_getitem(node):
        return None
    split, index = node.args
    if not is_call(split, aten.split.Tensor, aten.split_with_sizes.default) or not isinstance(index, int):
        return None
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    pieces, rank = split.meta.get("val"), len(shape(split.args[0]) or ())
    if not isinstance(pieces, list | tuple) or not isinstance(dim, int) or not rank:
        return None
    return split.args[0], dim % rank, index, len(pieces)


def _summed_terms(node: Node) -> list[Node] | None:
    """The tensors an `add` chain sums (Python's `sum(list)` starts at 0: a literal 0 is left out)."""
    if not is_call(node, aten.add.Tensor) or node.kwargs.get("alpha", 1) != 1:
        return [node]
    terms = []
    for operand in node.args[:2]:
        if isinstance(operand, Node):
            inner = _summed_terms(operand)
            if inner is None:
                return None
            terms.extend(inner)
        elif operand != 0:
            return None
    return terms


def _is_2d_swap(node: Node) -> bool:
    if is_call(node, aten.t.default, aten.t_copy.default):
        return True
    if is_call(node, aten.transpose.int):
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    if is_call(node, aten.permute.default):
        return list(node.args[1]) == [1, 0]
    return False


def ungated_activation(node: Node) -> str | None:
    """The activation's description when `node` is an ungated MLP, down(act(up(x))) (a bias on either
    projection allowed: Megatron's SwitchMLP, nomic-embed's experts); None otherwise. The kernel has no
    such form (it multiplies the activation by an up projection), so this only names a decline."""
    down = _biased_projection(node)
    return ungated_input(down.input) if down is not None else None


def ungated_reason(activation: str) -> str:
    return (f"an expert is an ungated MLP, down({activation}(up(x))); the fused kernel computes gated experts, "
            "down(act(gate(x)) * up(x))")


def ungated_input(down_input: Node) -> str | None:
    """The activation's description when the input of a down projection is act(up(x)), else None."""
    act = strip_shape_ops(strip_casts(down_input))
    squared = is_call(act, aten.pow.Tensor_Scalar) and act.args[1] == 2  # relu², Nemotron-H and Primer's
    if squared:
        act = strip_shape_ops(strip_casts(act.args[0]))
    if not is_call(act, *_FUSABLE_ACTS, *_OTHER_ACTS) or _biased_projection(act.args[0]) is None:
        return None
    return act.target.overloadpacket.__name__ + ("²" if squared else "")


def _biased_projection(node: Node) -> Projection | None:
    """x @ W.T or x @ W, plus a bias row or not (`addmm`: nn.Linear with a bias)."""
    node = strip_shape_ops(strip_casts(node))
    if is_call(node, aten.addmm.default) and len(shape(node.args[0]) or ()) == 1:
        x, w = node.args[1:3]
        if is_call(w, *TRANSPOSE_OPS) and _is_2d_swap(w):
            return Projection(strip_shape_ops(x), w.args[0], True)
        return Projection(strip_shape_ops(x), w, False)
    if is_call(node, aten.add.Tensor) and all(isinstance(a, Node) for a in node.args[:2]):
        for y, bias in (node.args[:2], node.args[1::-1]):
            if len(shape(bias) or ()) == 1 and projection(y) is not None:
                return projection(y)
    return projection(node)


@dataclass(frozen=True)
class ClampedSwiglu:
    """GPT-OSS's gate: gate/up interleaved in one projection, clamped, (up + 1) * gate * sigmoid(alpha * gate)."""

    projection: Node  # [..., 2I], gate in the even columns, up in the odd ones (or halves, see below)
    alpha: float
    limit: float
    interleaved: bool = True  # False: gate is the first half, up the second (MiniMax-M3, privacy filter)

    @property
    def description(self) -> str:
        return f"clamped swiglu (alpha={self.alpha:g}, limit={self.limit:g})"


def _interleaved_half(node: Node, start: int) -> Node | None:
    """The source of `node` = source[..., start::2] (a last-dim slice with step 2)."""
    node = strip_shape_ops(node)
    if not is_call(node, aten.slice.Tensor) or len(node.args) < 5:
        return None
    source, dim, begin, _end, step = node.args[:5]
    if step != 2 or begin != start or not _last_dim(node, dim):
        return None
    return strip_shape_ops(source)


def clamped_swiglu(node: Node) -> ClampedSwiglu | None:
    """Match (clamp(up, -L, L) + 1) * (g * sigmoid(g * alpha)) with g = clamp(gate, max=L)."""
    node = strip_shape_ops(node)
    if not is_call(node, aten.mul.Tensor) or not all(isinstance(a, Node) for a in node.args):
        return None
    for plus_one, glu in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
        plus_one, glu = strip_shape_ops(plus_one), strip_shape_ops(glu)
        if not (
            is_call(plus_one, aten.add.Tensor) and plus_one.args[1] == 1 and is_call(glu, aten.mul.Tensor)
        ):
            continue
        up = strip_shape_ops(plus_one.args[0])
        if not (is_call(up, aten.clamp.default) and len(up.args) == 3):
            continue
        gate, sigmoid = (strip_shape_ops(a) for a in glu.args)
        if is_call(gate, aten.sigmoid.default):
            gate, sigmoid = sigmoid, gate
        if not (is_call(gate, aten.clamp.default) and is_call(sigmoid, aten.sigmoid.default)):
            continue
        scaled = strip_shape_ops(sigmoid.args[0])
        if not (is_call(scaled, aten.mul.Tensor) and strip_shape_ops(scaled.args[0]) is gate):
            continue
        alpha, limit = scaled.args[1], up.args[2]
        gate_bounds = (
            gate.args[1] if len(gate.args) > 1 else None,
            gate.args[2] if len(gate.args) > 2 else None,
        )
        if gate_bounds != (None, limit) or up.args[1] != -limit or not isinstance(alpha, float | int):
            continue
        source = _interleaved_half(gate.args[0], 0)
        if source is not None and _interleaved_half(up.args[0], 1) is source:
            return ClampedSwiglu(source, float(alpha), float(limit))
        split = halves(strip_shape_ops(gate.args[0]), strip_shape_ops(up.args[0]))
        if split is not None:
            return ClampedSwiglu(split[0], float(alpha), float(limit), interleaved=False)
    return None


def _clamp_text(node: Node, name: str) -> tuple[Node, str] | None:
    """(the clamped tensor, "name in [lo, hi]") for a clamp with constant bounds."""
    if not is_call(node, aten.clamp.default):
        return None
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    text = name if low is None else f"{low:g} <= {name}"
    text = text if high is None else f"{text} <= {high:g}"
    return strip_shape_ops(node.args[0]), text if (low, high) != (None, None) else f"clamped {name}"


def _clamped_halves(gate: Node, up: Node) -> str | None:
    """A description of the clamps when gate and up are clamped halves of one projection."""
    gate_clamp, up_clamp = _clamp_text(gate, "gate"), _clamp_text(up, "up")
    if gate_clamp is None and up_clamp is None:
        return None
    inner_gate = gate_clamp[0] if gate_clamp else gate
    inner_up = up_clamp[0] if up_clamp else up
    if halves(inner_gate, inner_up) is None:
        return None
    return "; ".join(text for _, text in filter(None, (gate_clamp, up_clamp)))


@dataclass(frozen=True)
class StackedGate:
    """What sits between the gate/up projection and the down projection of a stacked-weight expert form."""

    activation: str  # kernel activation name, or the clamped swiglu's description
    gate_up_output: Node | None  # the [.., 2I] gate/up projection output (bias still added, if any)
    swiglu: ClampedSwiglu | None  # set for GPT-OSS's gate (the bias_fused_weights overload)
    # Gate and up as two projections (torchtitan's w1 / w3), when gate_up_output is None.
    gate_output: Node | None = None
    up_output: Node | None = None


def stacked_gate(down_input: Node, separate: bool = False) -> StackedGate | NoMatch:
    """Read act(gate) * up over halves of one projection, or GPT-OSS's clamped swiglu; else why not
    (stopped at `down_input`).

    separate: also accept gate and up that are two projections (the caller reads both)."""
    swiglu = clamped_swiglu(down_input)
    if swiglu is not None and not swiglu.interleaved:
        return NoMatch(
            "GPT-OSS's clamped swiglu on concatenated gate/up halves; the kernel's bias_fused_weights "
            "overload reads gate and up interleaved (even/odd rows), so the weights would need a re-layout "
            "(interleave gate_up_proj rows once at load time to get this layer fused)",
            down_input,
        )
    if swiglu is not None:
        return StackedGate(swiglu.description, swiglu.projection, swiglu)
    product = gated_product(down_input)
    if product is None:
        ungated = ungated_input(down_input)
        return NoMatch(NOT_GATED if ungated is None else ungated_reason(ungated), down_input)
    activation, described = activation_of(product.activation_node)
    if activation is None:
        return NoMatch(unsupported_activation(described), down_input)
    split = halves(product.gate, product.up)
    if split is None:
        clamped = _clamped_halves(product.gate, product.up)
        if clamped is not None:
            return NoMatch(
                f"gate and up are clamped before act(gate) * up ({clamped}: a clamped SwiGLU as in "
                "DeepSeek-V4); the fused kernel has no such clamp (only its GPT-OSS overload clamps, and it "
                "computes (up + 1) * gate * sigmoid(alpha * gate))",
                down_input,
            )
        if separate:
            return StackedGate(activation, None, None, product.gate, product.up)
        if gate_second(product):
            return NoMatch(GATE_SECOND, down_input)
        return NoMatch("gate and up are not the two halves of one projection", down_input)
    return StackedGate(activation, split[0], None)


def stacked_weight(node: Node) -> tuple[Node, bool]:
    """(stacked [E, ., .] weight, out_in) for a batched weight operand W^T (transposed last dims) or W."""
    if is_call(node, aten.transpose.int) and sorted(d % 3 for d in node.args[1:3]) == [1, 2]:
        return node.args[0], True
    return node, False
