"""Expert terms: one expert's MLP scaled by its per-token routing coefficient, and which expert each is.

    term_e = MLP_e(x) * c_e        c_e[t] = w[t, j] if ids[t, j] == e else 0

Read the same way by every form that unrolls a loop over the experts into terms (the dense loop's sum,
the sparse loop's index_add, the segments' joins): `read_term` reads one term's MLP structurally
(mlp.py), `match_terms` checks that a list of terms are the experts of one MoE layer, the same MLP with
one weight per expert, each coefficient matched to its expert by evaluating the index/mask sub-graph on
probe routing tensors (probe.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..fx_utils import (
    const_int,
    dtype,
    is_call,
    shape,
    strip_casts,
    strip_shape_ops,
)
from . import probe
from .expert_ids import choice_width
from .matches import (
    EMPTY_BATCH,
    IDS_WEIGHTS_SHAPES,
    MIXED_GATE_UP,
    Decline,
    ExpertsMatch,
    ExpertWeights,
    NoMatch,
    unprobeable,
    unsupported_activation,
)
from .mlp import (
    ClampedSwiglu,
    Projection,
    activation_of,
    clamped_swiglu,
    gated_product,
    halves,
    projection,
    row_scaled,
    stacked_gate,
    ungated_activation,
    ungated_reason,
)
from .slots import same_shape

aten = torch.ops.aten
NOT_ONE_IDS_AND_WEIGHTS = NoMatch("the per-expert routing weights do not derive from one ids tensor and one weights tensor")
NOT_SCATTERED = "the per-expert weights are not scattered into a zero [T, E] table"
STORES_UNDER_TOP_K = (
    "experts store their outputs (`out[rows] = y`) under top-k routing with k > 1: a token two experts "
    "chose keeps only the last store, which is not the sum the kernel computes"
)


@dataclass(frozen=True)
class ExpertTerm:
    """One leaf of the accumulation: MLP(x) scaled by a per-token coefficient."""

    term: Node
    mlp_out: Node
    coefficient: Node | None
    hidden: Node
    activation: str | None
    activation_desc: str
    gate_up: Projection | None
    gate: Projection | None
    up: Projection | None
    down: Projection
    input_scaled_by: Node | None = None  # set when the routing weight multiplies the MLP input
    # Further factors of the coefficient (`MLP(x) * w[:, e:e+1] * chose`: a weight and a mask); the
    # expert's per-token weight is their product with `coefficient`.
    more_factors: tuple[Node, ...] = ()
    # The coefficient holds one value per token ([T, 1]) and scales the accumulated output after the loop
    # (labml's Switch: `out * p_max[:, None]`); each row of a sparse term then takes its token's value.
    coefficient_by_token: bool = False
    # Sparse loops (experts_sparse_loop.py): the token indices this expert gathers its rows from and
    # adds its output back to. None for a dense term, which covers every token.
    rows: Node | None = None
    # How the output reaches the rows: "adds" (index_add), "rewrites" (out[tok] += y: read, added and
    # written back, so rows must not repeat) or "stores" (out[mask] = y: no other expert may write them).
    rows_write: str = "adds"
    # Rows in slot space (DeepSeek-V2's training loop: `y = empty_like(x.repeat_interleave(k))`, then
    # `y[ids.view(-1) == e] = MLP_e(...)` and `(y.view(T, k, H) * w[..., None]).sum(1)`): `rows` picks
    # slots, slot s is token s // k, and the coefficient is the [T, k] table the combine reads at slot s.
    # With rows_write "fills" the buffer held nothing: every slot must be stored by exactly one expert.
    # "overwrites": stores at token rows into a buffer that already holds values (HF Switch's
    # `next_states = hidden_states.clone()`): every token's row must be stored by one expert, else it keeps
    # the value it had, which the kernel does not compute.
    slots_per_token: int | None = None
    # GPT-OSS experts: interleaved gate/up with per-expert biases and the clamped swiglu.
    swiglu: ClampedSwiglu | None = None
    gate_up_bias: Node | None = None
    down_bias: Node | None = None

    def outputs(self) -> list[Node]:
        """The nodes whose values decide which tokens this expert serves, and with which weight."""
        return [self.coefficient, *self.more_factors] + ([self.rows] if self.rows is not None else [])


@dataclass(frozen=True)
class MlpRead:
    """One expert's MLP as read from the graph: its projections, activation and (GPT-OSS) biases."""

    hidden: Node
    down: Projection
    activation: str | None
    activation_desc: str
    gate_up: Projection | None = None  # one fused gate/up projection, or
    gate: Projection | None = None  # separate gate and up projections
    up: Projection | None = None
    scaled_by: Node | None = None  # a per-row scale applied before the down projection
    swiglu: ClampedSwiglu | None = None
    gate_up_bias: Node | None = None
    down_bias: Node | None = None


def _with_expert_bias(node: Node) -> tuple[Node, Node | None]:
    """(y, b) for y + b with b one expert's 1-D bias; (node, None) otherwise."""
    node = strip_shape_ops(node)
    if is_call(node, aten.add.Tensor) and all(isinstance(a, Node) for a in node.args):
        for y, bias in ((node.args[0], node.args[1]), (node.args[1], node.args[0])):
            if len(shape(bias) or ()) == 1 and projection(y) is not None:
                return strip_shape_ops(y), bias
    return node, None


def _read_swiglu_mlp(node: Node) -> MlpRead | None:
    """GPT-OSS's expert: (down(clamped swiglu(gate_up(x) + b1)) + b2), gate/up interleaved."""
    down_out, down_bias = _with_expert_bias(node)
    down = projection(down_out)
    swiglu = clamped_swiglu(down.input) if down is not None else None
    if swiglu is None or not swiglu.interleaved:
        return None
    gate_up_out, gate_up_bias = _with_expert_bias(swiglu.projection)
    fused = projection(gate_up_out)
    if fused is None or (gate_up_bias is None) != (down_bias is None):
        return None
    desc = swiglu.description
    return MlpRead(
        hidden=fused.input, down=down, activation=desc, activation_desc=desc, gate_up=fused,
        swiglu=swiglu, gate_up_bias=gate_up_bias, down_bias=down_bias,
    )


def _read_mlp(node: Node) -> MlpRead | None:
    """Read down(act(gate(x)) * up(x)); gate/up from one fused projection or two projections."""
    down = projection(node)
    if down is None:
        return _read_swiglu_mlp(node)
    product, scaled_by = gated_product(down.input), None
    if product is None and row_scaled(down.input) is not None:
        inner, scaled_by = row_scaled(down.input)
        product = gated_product(inner)
    if product is None:
        return None
    activation, desc = activation_of(product.activation_node)
    read = dict(down=down, activation=activation, activation_desc=desc, scaled_by=scaled_by)
    split = halves(product.gate, product.up)
    if split is not None:
        fused = projection(split[0])
        if fused is None:
            return None
        return MlpRead(hidden=fused.input, gate_up=fused, **read)
    swapped = halves(product.up, product.gate)  # `up, gate = gate_up(x).chunk(2)`: the gate second
    if swapped is not None:
        fused, size = projection(swapped[0]), swapped[1]
        if fused is None:
            return None
        gate = replace(fused, out_rows=(size, 2 * size))  # two views of one weight
        return MlpRead(hidden=fused.input, gate=gate, up=replace(fused, out_rows=(0, size)), **read)
    gate, up = projection(product.gate), projection(product.up)
    if gate is None or up is None or gate.input is not up.input:
        return None
    return MlpRead(hidden=gate.input, gate=gate, up=up, **read)


def read_term(node: Node) -> ExpertTerm | None:
    """MLP(x) * c (either order, casts allowed), or an unscaled MLP; None when `node` is neither."""
    node_s = strip_casts(node)
    if is_call(node_s, aten.mul.Tensor):
        factors = _factors(node_s)
        for i, a in enumerate(factors):
            mlp = _read_mlp(strip_casts(a))
            if mlp is not None and mlp.scaled_by is None:
                rest = factors[:i] + factors[i + 1:]
                return _term(node, strip_casts(a), rest[0], mlp, more_factors=tuple(rest[1:]))
    mlp = _read_mlp(node_s)
    if mlp is not None and mlp.scaled_by is not None:  # scaled before the down projection
        return _term(node, node_s, mlp.scaled_by, mlp)
    if mlp is not None:  # an unscaled MLP: is its input scaled instead?
        hidden = strip_casts(mlp.hidden)
        scaled_by = None
        if is_call(hidden, aten.mul.Tensor):
            scaled_by = hidden.args[1]
        return _term(node, node_s, None, mlp, input_scaled_by=scaled_by)
    return None


def reads_as_mlp(output: Node) -> bool:
    """`output` (through casts and views) is one expert's gated MLP."""
    return _read_mlp(strip_casts(output)) is not None


def weighted_output(output: Node, coefficient: Node) -> ExpertTerm | None:
    """`output` read as an expert's MLP whose per-token weight is `coefficient`, applied by a combine that
    is no product with this output alone (a column of a table the stacked outputs are multiplied by)."""
    mlp = _read_mlp(strip_casts(output))
    return None if mlp is None else _term(output, strip_casts(output), coefficient, mlp)


RESIDUAL_INSIDE = (
    "an expert adds a tensor to its MLP's output inside the expert (a residual: `x + MLP(norm(x))`); the "
    "fused kernel computes the gated MLP alone"
)


def no_mlp_reason(node: Node, reason: str) -> str:
    """Why an expert's output `node` (scaled or not) reads as no gated MLP: a residual inside the expert, an
    ungated MLP (named with its activation), what the stacked finders name in the input of its down
    projection (no act(gate) * up, a clamped SwiGLU, GPT-OSS's halves, the gate second), else `reason`."""
    if adds_inside(node):
        return RESIDUAL_INSIDE
    node = strip_casts(node)
    factors = [f for f in (_factors(node) if is_call(node, aten.mul.Tensor) else [node]) if isinstance(f, Node)]
    for factor in factors:
        activation = ungated_activation(factor)
        if activation is not None:
            return ungated_reason(activation)
    for factor in factors:
        down = projection(_with_expert_bias(strip_casts(factor))[0])
        gate = stacked_gate(down.input, separate=True) if down is not None else None
        if isinstance(gate, NoMatch):
            return gate.reason
    return reason


def adds_inside(node: Node) -> bool:
    """`MLP(h) + r` with r a tensor, not a bias row: why an expert's output is no plain gated MLP (an
    expert with its own residual, OpenNMT-py's `PositionwiseFeedForward`)."""
    node = strip_shape_ops(strip_casts(node))
    if not is_call(node, aten.add.Tensor) or not all(isinstance(a, Node) for a in node.args[:2]):
        return False
    pairs = (node.args[:2], node.args[1::-1])
    return any(_read_mlp(strip_shape_ops(strip_casts(a))) is not None and len(shape(b) or ()) > 1 for a, b in pairs)


def _factors(product: Node) -> list[Node]:
    """The tensor factors of a product of tensors (`MLP(x) * w[:, e:e+1] * chose`), through casts."""
    factors = []
    for arg in product.args[:2]:
        inner = strip_casts(arg) if isinstance(arg, Node) else None
        if inner is None or not isinstance(product.args[0], Node) or not isinstance(product.args[1], Node):
            return []
        both_tensors = is_call(inner, aten.mul.Tensor) and all(isinstance(a, Node) for a in inner.args[:2])
        factors.extend(_factors(inner) if both_tensors else [arg])
    return factors


def _term(
    node: Node, mlp_out: Node, coefficient: Node | None, mlp: MlpRead, input_scaled_by=None, more_factors=()
) -> ExpertTerm:
    return ExpertTerm(
        term=node,
        mlp_out=mlp_out,
        coefficient=coefficient,
        more_factors=more_factors,
        hidden=strip_shape_ops(mlp.hidden),
        activation=mlp.activation,
        activation_desc=mlp.activation_desc,
        gate_up=mlp.gate_up,
        gate=mlp.gate,
        up=mlp.up,
        down=mlp.down,
        input_scaled_by=input_scaled_by,
        swiglu=mlp.swiglu,
        gate_up_bias=mlp.gate_up_bias,
        down_bias=mlp.down_bias,
    )


def is_zero_init(node: Node) -> bool:
    node = strip_casts(node)
    if is_call(node, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
        return True
    if is_call(node, aten.full.default, aten.full_like.default, aten.new_full.default):
        return node.args[-1] == 0 or node.args[1] == 0
    return False


def _activation_node(term: ExpertTerm) -> Node:
    """The node applying an expert's activation (where a decline about it stops), else its output."""
    product = gated_product(term.down.input)
    return product.activation_node if product is not None else term.mlp_out


def match_terms(root: Node, terms: list[ExpertTerm], form: str) -> ExpertsMatch | Decline:
    """The match for experts summed into `root` (one term each), or why they cannot be fused."""

    def no(reason: str, at: Node | None = None) -> Decline:
        return Decline(form, reason, root, at)

    uniform = _uniform_terms(terms)
    if uniform is not None:
        return uniform.decline(form, root)
    hidden = {t.hidden for t in terms}
    if len(hidden) != 1:
        return no("experts do not all read the same hidden states")
    if len({t.gate_up is not None for t in terms}) != 1:
        return no(MIXED_GATE_UP)

    assignment = _expert_ids(terms)
    if isinstance(assignment, NoMatch):
        return assignment.decline(form, root)
    ids, weights, order, first_expert, weights_at_ids = assignment
    ordered = [terms[i] for i in order]

    gate_up = role_weights(ordered, "gate_up")
    gate, up, down = role_weights(ordered, "gate"), role_weights(ordered, "up"), role_weights(ordered, "down")
    swiglu = terms[0].swiglu
    biases = {}
    if swiglu is not None:
        if terms[0].gate_up_bias is None:
            return no("GPT-OSS's clamped swiglu without expert biases (the kernel's overload adds them)")
        biases = dict(
            gate_up_bias=role_weights(ordered, "gate_up_bias"),
            down_bias=role_weights(ordered, "down_bias"),
            alpha=swiglu.alpha,
            limit=swiglu.limit,
        )
    bias_roles = (biases.get("gate_up_bias"), biases.get("down_bias"))
    unread = first_no_match(gate_up, gate, up, down, *bias_roles)
    if unread is not None:
        return unread.decline(form, root)
    return ExpertsMatch(
        form=form,
        output=root,
        hidden=terms[0].hidden,
        ids=ids,
        weights=weights,
        num_experts=len(terms),
        top_k=const_int(shape(ids)[-1]) if len(shape(ids)) >= 2 else 1,  # [T, k], or [B, S, k] (_token_rows)
        activation=terms[0].activation,
        experts_min=first_expert,
        weights_at_ids=weights_at_ids,
        gate_up=gate_up,
        gate=gate,
        up=up,
        down=down,
        **biases,
    )


def _uniform_terms(terms: list[ExpertTerm]) -> NoMatch | None:
    """Why not, unless every term is routing-weighted on its output with one supported activation."""
    if any(t.coefficient is None for t in terms):
        scaled = [t for t in terms if t.input_scaled_by is not None]
        if scaled:
            return NoMatch(
                "routing weights scale each expert's input, not its output; the fused kernel weights "
                "outputs, and with a non-linear MLP the two are not equal",
                scaled[0].hidden,  # the product of the input and the routing weight
            )
        unweighted = next(t for t in terms if t.coefficient is None)
        return NoMatch("some experts' outputs are summed without a routing weight", unweighted.term)
    return one_activation(terms)


def one_activation(terms: list[ExpertTerm]) -> NoMatch | None:
    """Why not, unless every expert uses the same activation, one the kernel supports."""
    activations = {t.activation_desc for t in terms}
    if len(activations) > 1:
        odd = next(t for t in terms if t.activation_desc != terms[0].activation_desc)
        return NoMatch(
            f"experts use different activations ({', '.join(sorted(activations))}); the kernel takes one",
            _activation_node(odd),
        )
    if terms[0].activation is None:
        return NoMatch(unsupported_activation(terms[0].activation_desc), _activation_node(terms[0]))
    return None


def role_weights(terms: list[ExpertTerm], name: str) -> ExpertWeights | NoMatch | None:
    """One weight role of every expert: a projection's weight, or a 1-D bias node (None: no expert has
    the role); else why not."""
    projections = [getattr(t, name) for t in terms]
    if projections[0] is None:
        return None
    if any(p is None for p in projections):
        return NoMatch(f"some experts have no {name}")
    if isinstance(projections[0], Node):  # biases: no layout
        weights, out_in = projections, True
    elif len({(p.out_in, p.out_rows) for p in projections}) != 1:
        return NoMatch(f"the {name} weights of the experts are laid out differently")
    else:
        weights, out_in = [p.weight for p in projections], projections[0].out_in
    shapes = {shape(w) for w in weights}
    dtypes = {dtype(w) for w in weights}
    if len(shapes) != 1 or len(dtypes) != 1:
        return NoMatch(f"the {name} weights of the experts differ in shape or dtype")
    out_rows = None if isinstance(projections[0], Node) else projections[0].out_rows
    stacked = _stacked_source(weights)
    if stacked is not None:  # w[e] for e = 0..E-1 of one stacked parameter: pass the stack itself
        return ExpertWeights(stacked=stacked, out_in=out_in, out_rows=out_rows)
    return ExpertWeights(per_expert=tuple(weights), out_in=out_in, out_rows=out_rows)


def first_no_match(*roles: ExpertWeights | NoMatch | None) -> NoMatch | None:
    """The first role `role_weights` could not read, if any."""
    return next((r for r in roles if isinstance(r, NoMatch)), None)


def _stacked_source(weights: list[Node]) -> Node | None:
    """S when weights[e] is select(S, 0, e) for every e and S holds exactly these experts."""
    if not all(is_call(w, aten.select.int) for w in weights):
        return None
    source = weights[0].args[0]
    for index, w in enumerate(weights):
        if w.args[0] is not source or w.args[1] != 0 or const_int(w.args[2]) != index:
            return None
    return source if const_int(shape(source)[0]) == len(weights) else None


def _frontier(terms: list[ExpertTerm], through_tables: bool = False) -> tuple[set[Node], list[list[Node]]]:
    """The routing tensors every term derives from, and each term's slice of index/mask ops.

    Starts at the first common ancestors of the terms. A common ancestor that is itself an integer or
    boolean mask computed by probe-able ops (the one-hot expert mask a sparse loop indexes, say) is
    looked through, so that the frontier reaches the ids and weights that routing produced. With
    `through_tables`, so is a dense [T, E] weight table that probe-able ops build from integer ids
    (`zeros(T, E).scatter_add(1, ids, w)`, `(one_hot(ids) * w[..., None]).sum(1)`), together with the
    constant tensors its construction starts from: each column is then checked from the ids and
    weights themselves, however the table was spelled.
    """
    ancestry = []
    for term in terms:
        seen, stack = set(), list(term.outputs())
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(node.all_input_nodes)
        ancestry.append(seen)
    common = set.intersection(*ancestry)
    while True:
        slices, frontier = [], set()
        for term in terms:
            nodes = probe.slice_between(term.outputs(), common)
            slices.append(nodes)
            for node in nodes:
                frontier.update(n for n in node.all_input_nodes if n in common)
            frontier.update(n for n in term.outputs() if n in common)  # one weight every term shares
        masks = {n for n in frontier if probe.builds_mask(n) or probe.gathers_at_data_size(n)
                 or (through_tables and probe.builds_table(n))}
        if not masks:
            return frontier, slices
        common -= masks


def _expert_ids(terms: list[ExpertTerm]):
    """(ids, weights, order, first) with order[i] = index of the term of expert first + i; else why not."""
    assignment = _expert_ids_from(*_frontier(terms), terms)
    if assignment is NOT_ONE_IDS_AND_WEIGHTS:  # a dense table built from the ids: check it from them
        assignment = _expert_ids_from(*_frontier(terms, through_tables=True), terms)
    return assignment


def _expert_ids_from(frontier: set[Node], slices: list[list[Node]], terms: list[ExpertTerm]):
    tensors = {n for n in frontier if isinstance(n.meta.get("val"), torch.Tensor)}
    padded = [n for n in tensors if is_call(strip_casts(n), aten.scatter.src, aten.scatter.value)]
    try:
        if len(tensors) == 1 and padded:
            return _assign_from_padded(strip_casts(padded[0]), padded[0], terms, slices)
        if len(tensors) == 2 and len(padded) == 1:  # the table and the ids it was scattered with
            table, scatter = padded[0], strip_casts(padded[0])
            ids = next(iter(tensors - {table}))
            if strip_shape_ops(scatter.args[2]) is ids and isinstance(scatter.args[3], Node):
                return _assign_from_routing({ids, strip_shape_ops(scatter.args[3])}, terms, slices, table)
        return _assign_from_routing(tensors, terms, slices)
    except probe.NotProbeable as why:
        return NoMatch(unprobeable("the per-expert routing weight", why))


def _token_axis_values(value: torch.Tensor, out_shape: tuple, rows: int) -> torch.Tensor | None:
    """The coefficient broadcast against an expert output of `out_shape`, as one value per row."""
    try:
        full = value.expand(torch.broadcast_shapes(value.shape, out_shape))
    except RuntimeError:
        return None
    flat = full.reshape(-1, full.shape[-1]) if full.dim() >= 2 else None
    if flat is None or flat.shape[0] != rows or not bool((flat == flat[:, :1]).all()):
        return None
    return flat[:, 0]


def _coefficient_value(term: ExpertTerm, env: dict) -> torch.Tensor:
    """The term's per-token coefficient under one probe (`_assign` checks first that every factor was
    evaluated from the routing)."""
    value = env[term.coefficient]
    for factor in term.more_factors:
        value = value * env[factor]
    return value


def _dense_weight(term: ExpertTerm, env: dict, tokens: int, width: int) -> torch.Tensor | None:
    """A dense term's weight per token: the coefficient against the MLP's [T, H] output, or against the
    product's own shape where the output was viewed with the tokens split over leading dims first
    (`y.reshape(B, S, H) * c[B, S, 1]`: row-major, so its rows are the output's rows in order)."""
    value = _coefficient_value(term, env)
    shapes = [term.mlp_out.meta["val"].shape]
    product = term.term.meta.get("val")
    if isinstance(product, torch.Tensor) and product.dim() > 2:
        shapes.append(product.shape)
    for out_shape in shapes:
        out_shape = tuple(int(d) for d in probe.concrete_args(tuple(out_shape), {}))
        if out_shape[-1] != width or math.prod(out_shape) != tokens * width:
            continue
        per_token = _token_axis_values(value, out_shape, tokens)
        if per_token is not None:
            return per_token
    return None


def _per_token_weight(term: ExpertTerm, env: dict, tokens: int) -> torch.Tensor | None:
    """The weight each token's MLP output gets from `term` under one probe ([T]), or None.

    Dense terms scale the output for all T tokens. Sparse terms scale the rows they gathered and add
    them back at those rows, so a token's weight is the sum of its rows' coefficients.
    """
    width = probe.concrete(term.mlp_out.meta["val"].shape[-1])
    if term.rows is None:
        return _dense_weight(term, env, tokens, int(width))
    rows = _row_indices(env[term.rows])
    if term.slots_per_token is not None:
        k = term.slots_per_token
        table = _coefficient_value(term, env)
        if rows.dim() != 1 or rows.dtype.is_floating_point or tuple(table.shape) != (tokens, k):
            return None
        if bool(((rows < 0) | (rows >= tokens * k)).any()) or rows.unique().numel() != rows.numel():
            return None
        return torch.zeros(tokens, dtype=table.dtype).index_add_(0, rows // k, table.reshape(-1)[rows])
    if rows.dim() != 1 or rows.dtype.is_floating_point or bool(((rows < 0) | (rows >= tokens)).any()):
        return None
    if term.rows_write != "adds" and rows.unique().numel() != rows.numel():
        return None
    if term.coefficient_by_token:
        value = _coefficient_value(term, env)
        if value.dim() > 2:  # [B, S, 1] scaling the [B, S, H] view of the rows' buffer: one value per row
            value = value.reshape(-1, value.shape[-1])
        per_token = _token_axis_values(value, (tokens, int(width)), tokens)
        per_row = per_token[rows] if per_token is not None else None
    else:
        per_row = _token_axis_values(_coefficient_value(term, env), (rows.shape[0], int(width)), rows.shape[0])
    if per_row is None:
        return None
    return torch.zeros(tokens, dtype=per_row.dtype).index_add_(0, rows, per_row)


def _row_indices(rows: torch.Tensor) -> torch.Tensor:
    """Token indices of an expert's rows: a boolean mask over the tokens (`x[mask]`) read as its nonzeros,
    an [n, 1] column of indices (`nonzero()` without as_tuple) as its one column."""
    if rows.dtype == torch.bool and rows.dim() == 1:
        return rows.nonzero().squeeze(-1)
    return rows.squeeze(-1) if rows.dim() == 2 and rows.shape[-1] == 1 and not rows.dtype.is_floating_point else rows


def _stores_overlap(envs_per_term, terms) -> bool:
    """Some token's row is stored by one expert (`out[mask] = y`) and written by another under a probe:
    the store would replace, not add to, what the other wrote. Stores are taken under top-1 routing only,
    where a token's rows depend on its one id: the crowded probes (every token on id v, for each v) then
    show every pair of experts whose masks can share a token."""
    for envs in zip(*envs_per_term, strict=True):
        rows = [_row_indices(env[term.rows]) for env, term in zip(envs, terms, strict=True) if term.rows is not None]
        stored = [r for r, term in zip(rows, [t for t in terms if t.rows is not None], strict=True)
                  if term.rows_write in ("stores", "fills", "overwrites")]
        if stored and torch.cat(rows).unique().numel() != sum(r.numel() for r in rows):
            return True
    return False


def _slots_left_unfilled(envs_per_term, terms, tokens: int) -> bool:
    """Some slot of a "fills" or "overwrites" buffer is stored by no expert under a probe (stores are
    disjoint already)."""
    filling = [t for t in terms if t.rows_write in ("fills", "overwrites")]
    if not filling:
        return False
    if len(filling) != len(terms) or len({(t.rows_write, t.slots_per_token) for t in filling}) != 1:
        return True
    slots = tokens * (filling[0].slots_per_token or 1)
    for envs in zip(*envs_per_term, strict=True):
        written = sum(_row_indices(env[term.rows]).numel() for env, term in zip(envs, terms, strict=True))
        if written != slots:
            return True
    return False


def _assign(columns_per_probe, envs_per_term, tokens: int, num_columns: int, terms):
    """(order, first expert) of the terms, else why not; the loop may hold a contiguous range of the
    router's experts (expert parallelism: this rank's experts; the others contribute zero here)."""
    if _stores_overlap(envs_per_term, terms):
        return NoMatch("experts store their outputs (`out[rows] = y`) at rows another expert writes too")
    if _slots_left_unfilled(envs_per_term, terms, tokens):
        if any(t.rows_write == "overwrites" for t in terms):
            return NoMatch(
                "the experts store their outputs into a buffer that already holds values (not zeros: a copy "
                "of the hidden states, `x.clone()`), and under a routing some token's row is stored by no expert "
                "(dropped past an expert's capacity, or routed nowhere): that token keeps the old value, "
                "which the fused kernel does not compute"
            )
        return NoMatch(
            "the experts store their outputs into an uninitialised buffer (`empty_like`) and leave some of its "
            "rows unwritten under a routing: those rows hold whatever memory held"
        )
    order: dict[int, int] = {}
    for index, term in enumerate(terms):
        matches = None
        for columns, env in zip(columns_per_probe, envs_per_term[index], strict=True):
            unmade = next((f for f in (term.coefficient, *term.more_factors) if f not in env), None)
            if unmade is not None:
                return NoMatch("an expert's output is also scaled by a value not made from the routing ids and "
                               "weights (a number read before a graph break, or a tensor from elsewhere), so its "
                               "weight per token cannot be checked", unmade)
            per_token = _per_token_weight(term, env, tokens)
            if per_token is None:
                return NoMatch("an expert's routing weight is not one value per token")
            hits = {e for e in range(num_columns) if torch.equal(per_token.to(columns.dtype), columns[:, e])}
            matches = hits if matches is None else matches & hits
        if not matches or len(matches) != 1:
            return NoMatch("an expert's routing weight is not the routing weight of one expert")
        expert = matches.pop()
        if expert in order:
            return NoMatch(f"two experts in the loop take the routing weight of expert {expert}")
        order[expert] = index
    first = min(order)
    if sorted(order) != list(range(first, first + len(terms))):
        return NoMatch("the loop's experts are not a contiguous range of the routing's experts")
    return [order[e] for e in range(first, first + len(terms))], first


def _assign_from_padded(scatter: Node, padded: Node, terms, slices):
    base, dim, ids, weights = scatter.args[:4]
    if not is_zero_init(base) or dim not in (-1, 1) or len(shape(base)) != 2:
        return NoMatch(NOT_SCATTERED)
    tokens, width = (int(probe.concrete(d)) for d in shape(base))
    if tokens == 0:
        return NoMatch(EMPTY_BATCH)
    if not isinstance(weights, Node) or not same_shape(shape(ids), shape(weights)):
        return NoMatch("routing ids and weights differ in shape")
    # Dense tables tell every column apart; tables of top-k routings (zero off the chosen experts) show
    # what a mask read from the table selects (`gates[:, e] > 0`), which a dense table selects everywhere
    top_k = int(probe.concrete(shape(ids)[-1])) if len(shape(ids) or ()) == 2 else 1
    routed = [probe.padded_columns(i, w, width) for i, w in
              probe.routing_probes(tokens, min(top_k, width), width, dtype(padded))]
    columns = probe.column_probes(tokens, width, dtype(padded)) + routed
    envs = [[probe.evaluate(nodes, {padded: table}) for table in columns] for nodes in slices]
    order = _assign(columns, envs, tokens, width, terms)
    return order if isinstance(order, NoMatch) else (strip_shape_ops(ids), strip_shape_ops(weights), *order, False)


def _assign_from_routing(tensors: set[Node], terms, slices, table: Node | None = None):
    """Assignment on probe routing; `table`, when given, is the [T, E] table scattered from the ids and
    weights (GPT-OSS's router scores), evaluated from each probe."""
    routing = probe.ids_and_weights(tensors)
    if routing is None:
        return NOT_ONE_IDS_AND_WEIGHTS
    ids, weights, views = _through_views(*routing)
    at_ids = _read_at_ids(ids, weights, len(terms))
    # [B, S, k] routing read beside its [B*S, k] view (a topk over (batch, seq) logits): probes are [T, k]
    unflattened = {node: shape(node) for node in (ids, weights) if len(shape(node) or ()) > 2}
    ids_shape = _token_rows(ids)
    single = len(ids_shape or ()) == 1  # one id per token (an argmax): top-1
    if (not at_ids and not same_shape(ids_shape, _token_rows(weights))) or len(ids_shape or ()) not in (1, 2):
        return NoMatch(IDS_WEIGHTS_SHAPES)
    tokens, top_k = int(probe.concrete(ids_shape[0])), 1 if single else int(probe.concrete(ids_shape[1]))
    if tokens == 0:
        return NoMatch(EMPTY_BATCH)
    width = max(len(terms), _routing_width(ids) or 0)
    if at_ids:
        width = int(probe.concrete(shape(weights)[1]))
    if top_k > width:
        return NoMatch("top-k is larger than the number of experts")
    if table is not None:
        scatter = strip_casts(table)
        if not is_zero_init(scatter.args[0]) or scatter.args[1] not in (-1, 1) or len(shape(table)) != 2:
            return NoMatch(NOT_SCATTERED)
        width = int(probe.concrete(shape(table)[1]))
    if any(t.rows_write == "overwrites" for t in terms):
        chosen_from = _chosen_among(ids)
        if chosen_from is None or chosen_from > width:
            return NoMatch(OVERWRITES_UNBOUNDED_IDS)
    probes = probe.routing_probes(tokens, top_k, width, dtype(weights))
    if any(t.rows_write in ("stores", "overwrites") and t.slots_per_token is None for t in terms):  # token rows
        if top_k > 1:
            return NoMatch(STORES_UNDER_TOP_K)
        probes += probe.crowded_probes(tokens, 1, width, dtype(weights))  # no id in two experts' masks
    if at_ids:  # every cell of the table holds a weight; the kernel's are those at the ids
        tables = probe.column_probes(tokens, width, dtype(weights), count=len(probes))
        probes = [(i, table) for (i, _), table in zip(probes, tables, strict=True)]
    columns = [probe.padded_columns(i, w.gather(1, i) if at_ids else w, width) for i, w in probes]

    def inputs(i: torch.Tensor, w: torch.Tensor, columns: torch.Tensor) -> dict:
        env = {ids: i.to(dtype(ids)), weights: w}
        if single:
            env = {ids: i[:, 0].to(dtype(ids)), weights: w if at_ids else w[:, 0]}
        for node, dims in unflattened.items():
            env[node] = env[node].reshape([int(probe.concrete(d)) for d in dims])
        for viewed, _base, chain in views.values():
            env[viewed] = probe.evaluate(chain, env)[viewed]
        if table is not None:
            env[table] = columns.to(dtype(table))
        return env

    envs = [
        [probe.evaluate(nodes, inputs(i, w, c)) for (i, w), c in zip(probes, columns, strict=True)]
        for nodes in slices
    ]
    order = _assign(columns, envs, tokens, width, terms)
    return order if isinstance(order, NoMatch) else (ids, weights, *order, at_ids)


def _through_views(ids: Node, weights: Node) -> tuple[Node, Node, dict]:
    """(ids, weights, views): where the loop reads views of the [T, k] routing (DeepSeek-MoE's flat
    `weight.view(-1, 1)`), the routing tensors they view, and {role: (view, base, the nodes between)}."""
    views = {}
    if not same_shape(shape(ids), shape(weights)):
        for name, node in (("ids", ids), ("weights", weights)):
            base = strip_shape_ops(node)
            if base is not node and len(shape(base) or ()) in (1, 2):  # [T, k], or [T] for top-1
                views[name] = (node, base, probe.slice_between(node, {base}))
    ids, weights = (views[name][1] if name in views else node for name, node in (("ids", ids), ("weights", weights)))
    return ids, weights, views


def _token_rows(node: Node) -> tuple | None:
    """The shape of `node` as rows of tokens: [B, S, k] read as [B*S, k]; 1-D and 2-D shapes as they are."""
    dims = shape(node)
    if dims is None or len(dims) <= 2:
        return tuple(dims) if dims is not None else None
    tokens = 1
    for d in dims[:-1]:
        tokens = tokens * d
    return tokens, dims[-1]


def _read_at_ids(ids: Node, weights: Node, num_terms: int) -> bool:
    """`weights` is a [T, E] table of every expert's weight, read at the [T, k] (or [T]) ids (`probs[tok, e]`:
    the router's probabilities with no renormalisation, Switch / Hunyuan style); the probes then check
    that each expert's coefficient is its column of the table at the tokens that chose it, and nothing
    else (a loop that read an expert no token chose would differ on them)."""
    ids_shape, table_shape = shape(ids), shape(weights)
    if len(ids_shape or ()) not in (1, 2) or len(table_shape or ()) != 2 or ids_shape == table_shape:
        return False
    width = const_int(table_shape[1])
    return (
        statically_known_true(ids_shape[0] == table_shape[0]) and width is not None and width >= num_terms
        and dtype(weights).is_floating_point and not dtype(ids).is_floating_point
    )


OVERWRITES_UNBOUNDED_IDS = (
    "the experts store their outputs into a buffer that already holds values (not zeros: `x.clone()`), and "
    "the routing ids are not a choice made in this graph among the experts' columns (handed in, or made by "
    "ops other than top-k / max / argmax over the router's scores): an id outside the experts (a drop "
    "sentinel) would leave its token's old value, which the fused kernel does not compute"
)
def _chosen_among(ids: Node) -> int | None:
    """W when every id is the index of a choice among W columns made in this graph (through casts and
    views), so each lies in 0..W-1; else None."""
    return choice_width(strip_shape_ops(strip_casts(strip_shape_ops(ids))))


def _routing_width(ids: Node) -> int | None:
    from .routing import describe

    return describe(ids, ids).num_experts
