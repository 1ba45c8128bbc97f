"""Evaluating a small pure sub-graph on concrete probe tensors.

Dense expert loops compute each expert's routing weight with index and mask arithmetic (a column of
`zeros(T, E).scatter_(ids, w)`, or `(w * (ids == e)).sum(-1)`, through views and permutes). Rather than
pattern-match every spelling, the finder checks what such a sub-graph computes: it runs the few
index/mask ops on probe inputs and compares the result with the column the fused kernel uses.
Only deterministic index, mask and shape ops are allowed, so equal results on distinct probes mean the
same function for routing tensors of that shape.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true
from torch.fx.node import map_arg

from ..fx_utils import SHAPE_ONLY_OPS, TRANSPOSE_OPS, dtype, is_call, is_cast, is_getitem

aten = torch.ops.aten

PROBE_OPS = (
    SHAPE_ONLY_OPS
    | TRANSPOSE_OPS
    | {
        aten.select.int,
        aten.slice.Tensor,
        aten.index.Tensor,
        aten.eq.Scalar,
        aten.eq.Tensor,
        aten.mul.Tensor,
        aten.where.self,
        aten.where.ScalarOther,
        aten.sum.dim_IntList,
        aten.any.dim,  # a token chose the expert in any of its k slots: `(ids == e).any(-1)`
        aten.any.dims,
        aten.histc.default,
        aten.scatter.src,
        aten.scatter.value,
        aten.scatter_add.default,
        aten.index_add.default,  # counts as `zeros(E).index_add_(0, ids, ones)`
        aten.index_put.default,
        aten.one_hot.default,
        aten.ones.default,
        aten.ones_like.default,
        aten.zeros.default,
        aten.zeros_like.default,
        aten.full.default,
        aten.full_like.default,
        aten.new_zeros.default,
        aten.scalar_tensor.default,
        aten.lift_fresh_copy.default,
        aten._to_copy.default,
        aten.arange.default,
        aten.arange.start,
        aten.arange.start_step,
        aten.nonzero.default,
        aten.masked_select.default,  # the entries where a mask holds, in row-major order, as `x[mask]`
        aten.unbind.int,
        operator.getitem,
    }
    # Id arithmetic: expert parallelism remaps the router's ids onto a rank's experts before a loop
    # compares them with each expert (`where(ids // E_local != rank, E_local, ids % E_local)`).
    | {
        aten.ne.Scalar,
        aten.ne.Tensor,
        aten.ge.Scalar,
        aten.gt.Scalar,
        aten.le.Scalar,
        aten.lt.Scalar,
        aten.remainder.Scalar,
        aten.floor_divide.default,
        aten.logical_not.default,
        aten.logical_and.default,
        aten.logical_or.default,
        aten.bitwise_not.default,
        aten.bitwise_and.Tensor,
        aten.bitwise_or.Tensor,
        aten.clamp.default,
        aten.masked_fill.Scalar,
        aten.where.ScalarSelf,
    }
)


# The slot order and segment offsets of a loop over sorted segments that accumulates each expert's
# output (DeepSeek-MoE's `moe_infer`: `order = ids.argsort()`, `offsets = counts.cumsum(0)`, rows
# `order[offsets[e-1]:offsets[e]] // k`, bounds read as numbers). Exact functions of the ids, except
# where a position or offset is compared with a threshold: `evaluate` refuses that (a capacity).
ORDER_OPS = frozenset(
    {
        aten.sort.default,
        aten.sort.stable,
        aten.argsort.default,
        aten.argsort.stable,
        aten.cumsum.default,
        aten.split_with_sizes.default,
        aten.split.Tensor,
        aten._local_scalar_dense.default,
        aten.add.Tensor,
        aten.sub.Tensor,
        operator.add,
        operator.sub,
        aten.bincount.default,  # counts, and the largest count: a capacity that cuts nothing
        aten.max.default,
        aten.amax.default,
    }
)
PROBE_OPS = PROBE_OPS | ORDER_OPS

# Comparisons and clamps: applied to a position or offset derived from a sort or a running sum, they
# keep rows up to a capacity, which random probes rarely reach (GShard's `cumsum(mask) - 1 < C`).
_THRESHOLDS = frozenset(
    {
        aten.lt.Scalar, aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor,
        aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar, aten.ge.Tensor,
        aten.clamp.default, aten.clamp.Tensor, aten.clamp_max.default, aten.clamp_max.Tensor,
        aten.clamp_min.default, aten.minimum.default, aten.maximum.default,
        operator.lt, operator.le, operator.gt, operator.ge, torch.sym_min, torch.sym_max,
    }
)
_SORTS = (aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)

# Offsets from counts (running sums, cumsum, a leading zero) and their reads as numbers: segment bounds.
# Kept apart from PROBE_OPS, whose integer ops also mark where routing masks begin.
OFFSET_OPS = frozenset(
    {
        aten.cumsum.default,
        aten.cat.default,
        aten.add.Tensor,
        aten.sub.Tensor,
        aten._local_scalar_dense.default,
        operator.add,
        operator.sub,
        torch.sym_min,
        torch.sym_max,
        # a running sum of numbers read on the host (`end = start + n`), as dynamo before torch 2.11 traces it
        *((torch.sym_sum,) if hasattr(torch, "sym_sum") else ()),
    }
)
# ... and, where the ids' sort order is cut to the routed slots (`order[:(ids < R).sum().item()]`,
# LongCat-Flash; the cut itself proved by the slot algebra), the count that cuts it.
ROUTED_OFFSET_OPS = OFFSET_OPS | {aten.sum.default}
_BOUND_OPS = (OFFSET_OPS, ROUTED_OFFSET_OPS)


class NotProbeable(Exception):
    """The sub-graph uses an op outside the probe set (so the finder cannot vouch for it)."""


def concrete(value):
    """`value` with symbolic ints, floats and bools replaced by their hints (the traced example's)."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        hint = getattr(value.node, "hint", None)
        if hint is None:
            raise NotProbeable(f"symbolic value {value} has no hint")
        return type(hint)(hint)
    return value


def concrete_args(args, env: dict):
    """`args` (of a node) with each node replaced by its value in `env`, or by its concrete scalar value."""
    def lookup(node: Node):
        if node in env:
            return env[node]
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool | int | float):
            return concrete(value)
        raise NotProbeable(f"{node.name} is outside the probed sub-graph")

    mapped = map_arg(args, lookup)
    return torch.utils._pytree.tree_map(concrete, mapped)


def evaluate(nodes: list[Node], env: dict, extra_ops: frozenset = frozenset(), crowded: bool = False) -> dict:
    """Run `nodes` (in graph order) with `env` holding the values of their inputs. `crowded`: the caller
    also probes routings that put every token on the same experts, where positions and counts are
    largest, so a threshold on them bites there first and may be evaluated."""
    env = dict(env)
    sorted_, summed = set(), set()  # nodes computed from a sort / from a running sum
    for node in nodes:
        if node in env:
            continue
        allowed = (node.target in PROBE_OPS or node.target in extra_ops or is_cast(node) or _size_arithmetic(node)
                   or _reads_at_slots(node))
        if node.op != "call_function" or not allowed:
            raise NotProbeable(f"{node.name} ({node.target}) is not an index/mask op")
        inputs = node.all_input_nodes
        from_sort = is_call(node, *_SORTS) or any(n in sorted_ for n in inputs)
        from_sum = is_call(node, aten.cumsum.default) or any(n in summed for n in inputs)
        # Segment bounds (OFFSET_OPS) may clamp running sums to the rows they cut (`min(end, n)`): the
        # segments finder compares them with the runs themselves. Nothing else may threshold them.
        if node.target in _THRESHOLDS and not crowded and (
            from_sort or (from_sum and not any(extra_ops is ops for ops in _BOUND_OPS))
        ):
            raise NotProbeable(
                f"{node.name} compares a position or offset with a threshold (a capacity, which probes rarely reach)"
            )
        if (untested := _untested_comparison(node)) is not None:
            raise NotProbeable(f"{node.name} {untested}")
        if from_sort:
            sorted_.add(node)
        if from_sum:
            summed.add(node)
        args_env = env
        if node.target in SHAPE_READERS and node.args[0] not in env:  # only its size and dtype: a stand-in
            like = node.args[0].meta.get("val")
            if not isinstance(like, torch.Tensor):
                raise NotProbeable(f"{node.name} reads the size of a value that is not a tensor")
            args_env = {**env, node.args[0]: torch.zeros([concrete(d) for d in like.shape], dtype=like.dtype)}
        kwargs = dict(concrete_args(node.kwargs, env))
        if "device" in kwargs:  # factory ops: probes run on the CPU whatever device was traced
            kwargs["device"] = "cpu"
        env[node] = node.target(*concrete_args(node.args, args_env), **kwargs)
    return env


_COMPARISONS = frozenset(
    {
        aten.lt.Scalar, aten.lt.Tensor, aten.le.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.gt.Tensor,
        aten.ge.Scalar, aten.ge.Tensor, aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor,
    }
)


def _untested_comparison(node: Node) -> str | None:
    """A comparison of a floating-point tensor that the probes cannot test: the probes' weights are whole
    numbers from 1 up, so a cut at another threshold (`gates[:, e] > 0.3`) never bites on them, and an
    order test with 0 (`gates[:, e] > 0`) drops the routes of negative weight that real routing may give
    (raw logits as weights) unless the value is proved non-negative (a softmax's). `!= 0` / `== 0` pick the
    non-zero entries whatever their sign. Says what the comparison does, or None where probes test it."""
    if node.target not in _COMPARISONS or not isinstance(node.args[0], Node):
        return None
    if _truncates_floats(node.args[0]):
        return ("compares a floating-point value cast to integers (`(w * 4).long() > 0` cuts the weights "
                "below 0.25, which the probes' whole-number weights never reach)")
    left = dtype(node.args[0])
    if left is None or not left.is_floating_point or _cast_from_integers(node.args[0]):
        return None
    other = node.args[1]
    if isinstance(other, Node) or not (isinstance(other, int | float) and other == 0):
        return ("compares a floating-point value with a threshold other than 0 (a routing weight cut at a "
                "threshold drops the routes below it, which the probes' weights never reach)")
    if node.target in (aten.eq.Scalar, aten.ne.Scalar) or non_negative(node.args[0]):
        return None
    return ("tests the sign of a value not proved non-negative (routes of negative weight would be dropped, "
            "and the probes' weights are all positive)")


# Ops whose result is >= 0 whatever their input (a softmax, a sigmoid, ...), and ops whose result is >= 0
# where every tensor input (and number) is: picks, views, sums, products, scatters of such values.
_NON_NEGATIVE_OUTPUTS = frozenset({
    aten._softmax.default, aten.softmax.int, aten.sigmoid.default, aten.exp.default, aten.abs.default,
    aten.relu.default, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.ones.default,
    aten.ones_like.default, aten.one_hot.default,
})
_KEEP_NON_NEGATIVE = SHAPE_ONLY_OPS | TRANSPOSE_OPS | {
    aten.select.int, aten.slice.Tensor, aten.index.Tensor, aten.gather.default, aten.index_select.default,
    aten.sum.dim_IntList, aten.sum.default, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.cat.default,
    aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.index_put.default,
    aten.index_add.default, aten.masked_fill.Scalar, aten.where.self, aten.topk.default, aten.sort.default,
    aten.max.dim, aten.amax.default, aten.full.default, aten.full_like.default, aten.clamp.default,
    aten.clamp_min.default, aten.scalar_tensor.default, aten.lift_fresh_copy.default, operator.getitem,
}


def non_negative(node: Node, depth: int = 0) -> bool:
    """`node`'s values are proved >= 0 from the ops that made them (a softmax's top-k weights divided by
    their sum and scattered into zeros); False where that is not shown."""
    if depth > 64 or not isinstance(node, Node) or node.op != "call_function":
        return False
    if dtype(node) == torch.bool or node.target in _NON_NEGATIVE_OUTPUTS or is_cast(node) and _cast_from_integers(node):
        return True
    if node.target not in _KEEP_NON_NEGATIVE and not is_cast(node):
        return False
    if node.target is operator.getitem:  # a topk's / sort's / max's values (index 0), not its indices
        return node.args[1] == 0 and non_negative(node.args[0], depth + 1)
    if node.target in (aten.clamp.default, aten.clamp_min.default):
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        if isinstance(low, int | float) and low >= 0:
            return True
    if node.target is aten.where.self:  # the condition picks, the two values are what must be >= 0
        return all(non_negative(a, depth + 1) for a in node.args[1:3])
    given = [a for i, a in enumerate(node.args) if not (node.target is aten.scatter.value and i == 1)]  # not its dim
    numbers = [a for a in (*given, *node.kwargs.values()) if isinstance(a, int | float) and not isinstance(a, bool)]
    if node.target in _VALUED_BY_NUMBERS and any(n < 0 for n in numbers):
        return False
    index_args = _INDEX_ARGUMENTS.get(node.target, ())
    tensors = [a for i, a in enumerate(node.args) if i not in index_args
               for a in (a if isinstance(a, list | tuple) else [a]) if isinstance(a, Node)]
    if not tensors:  # a tensor of a number, checked >= 0 above
        return node.target in (aten.full.default, aten.scalar_tensor.default)
    return all(non_negative(a, depth + 1) for a in tensors)


# Ops whose numbers (a fill value, a bound, a scale, an addend) become or scale the values
_VALUED_BY_NUMBERS = frozenset({
    aten.full.default, aten.full_like.default, aten.masked_fill.Scalar, aten.scalar_tensor.default,
    aten.scatter.value, aten.clamp.default, aten.clamp_min.default, aten.mul.Tensor, aten.add.Tensor,
    aten.div.Tensor,
})

# Arguments that only say where (ids, positions), whose sign does not reach the values
_INDEX_ARGUMENTS = {
    aten.index.Tensor: (1,), aten.gather.default: (2,), aten.index_select.default: (2,), aten.scatter.src: (2,),
    aten.scatter.value: (2,), aten.scatter_add.default: (2,), aten.index_put.default: (1,),
    aten.index_add.default: (2,), aten.masked_fill.Scalar: (1,),
}


def _truncates_floats(node: Node, depth: int = 0) -> bool:
    """A cast from a floating-point dtype to an integer one among the ops that made `node`, up to where
    ids are chosen (a top-k's, sort's or argmax's indices, which are no weights)."""
    if depth > 32 or not isinstance(node, Node) or node.op != "call_function":
        return False
    if is_call(node, *_CHOOSES_IDS) or is_getitem(node) and node.args[1] == 1 and is_call(node.args[0], *_CHOOSES_IDS):
        return False
    if is_cast(node) and isinstance(node.args[0], Node):
        source, target = dtype(node.args[0]), dtype(node)
        if (source is not None and source.is_floating_point and target is not None
                and not target.is_floating_point and target != torch.bool):
            return True
    return any(_truncates_floats(a, depth + 1) for a in node.all_input_nodes)


_CHOOSES_IDS = (aten.topk.default, aten.sort.default, aten.sort.stable, aten.max.dim, aten.argmax.default,
                aten.argsort.default, aten.argsort.stable)


# Ops that keep a tensor's values whole numbers when they are (views, picks, sums of them)
_KEEP_WHOLE = SHAPE_ONLY_OPS | TRANSPOSE_OPS | {
    aten.select.int, aten.slice.Tensor, aten.index.Tensor, aten.sum.dim_IntList, aten.sum.default,
}


def _cast_from_integers(node: Node) -> bool:
    """`mask.float()` (through views, picks and sums): whole numbers, an integer or boolean tensor's,
    compared as such (`one_hot(ids).float()[e] == 1`), not a weight."""
    while isinstance(node, Node) and node.op == "call_function":
        if is_cast(node) and isinstance(node.args[0], Node):
            source = dtype(node.args[0])
            if source is not None and not source.is_floating_point:
                return True
        elif node.target not in _KEEP_WHOLE:
            return False
        node = node.args[0]
    return False


# Reads at positions: exact index functions, evaluated inside a term's slice but not looked through to
# find where the routing begins (an argmax of the router's scores is where top-1 ids begin)
_GATHERS = frozenset({aten.gather.default, aten.index_select.default})


def _reads_at_slots(node: Node) -> bool:
    """A gather or index_select, or the argmax of integers: the slot where a token chose the expert,
    `(ids == e).int().argmax(-1)` (LLMs-from-scratch), and the weight read there."""
    if node.target in _GATHERS:
        return True
    if node.target is not aten.argmax.default or not node.args or not isinstance(node.args[0], Node):
        return False
    source = dtype(node.args[0])
    return source is not None and not source.is_floating_point


# Sizes read off probed tensors and integer arithmetic on them: exact on concrete probes. Allowed only
# where they yield a number, so no tensor op enters by this door; a min or max only where the shape
# environment proves which argument it picks (a cut's `min(len(rows), C)` with C >= every len), since a
# min that could pick either is a capacity, which random probes rarely reach.
_SIZE_ARITHMETIC = frozenset({aten.sym_size.int, operator.add, operator.sub, operator.mul, operator.floordiv})


def _size_arithmetic(node: Node) -> bool:
    if not isinstance(node.meta.get("val"), int | torch.SymInt):
        return False
    if node.target in (torch.sym_min, torch.sym_max):
        return _picks_statically(node)
    return node.target in _SIZE_ARITHMETIC


def _picks_statically(node: Node) -> bool:
    """The min (max) of `node` is proved to be one given argument: it is <= (>=) every other."""
    values = [a.meta.get("val") if isinstance(a, Node) else a for a in node.args]
    if not all(isinstance(v, int | torch.SymInt) for v in values):
        return False
    picked = (lambda v, other: other >= v) if node.target is torch.sym_min else (lambda v, other: other <= v)
    return any(all(statically_known_true(picked(v, other)) for other in values) for v in values)


def slice_between(outputs: Node | list[Node], inputs: set[Node]) -> list[Node]:
    """Nodes on paths from `inputs` to `outputs` (inclusive of the outputs), in graph order."""
    outputs = [outputs] if isinstance(outputs, Node) else list(outputs)
    seen: set[Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node in seen or node in inputs:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(outputs[0].graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _small_integers(shape, generator, dtype) -> torch.Tensor:
    """Values 1..120: exact in every float dtype, so probe comparisons can be exact.

    Distinct while there are few enough of them, so that two experts chosen in the same probe never
    receive equal weights (with one token, that is all that tells their columns apart).
    """
    count = math.prod(shape)
    if count <= 120:
        return (torch.randperm(120, generator=generator)[:count] + 1).reshape(shape).to(dtype)
    return torch.randint(1, 121, shape, generator=generator).to(dtype)


def routing_probes(tokens: int, top_k: int, num_experts: int, weight_dtype: torch.dtype, count: int = 3):
    """Distinct-per-row ids (what top-k yields) and small positive weights, for `count` seeds."""
    probes = []
    generator = torch.Generator()
    for seed in range(count):
        generator.manual_seed(1234 + seed)
        rows = [torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)]
        ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.int64)
        probes.append((ids, _small_integers((tokens, top_k), generator, weight_dtype)))
    # With few tokens (decode: one) the random probes may never pick some expert, whose weight would
    # then be zero in every probe and indistinguishable from another's: add probes that pick them.
    uncovered = sorted(set(range(num_experts)) - {int(i) for ids, _ in probes for i in ids.reshape(-1)})
    while uncovered and tokens:
        rows = []
        for _ in range(tokens):
            first, uncovered = uncovered[:top_k], uncovered[top_k:]
            rest = [e for e in torch.randperm(num_experts, generator=generator).tolist() if e not in first]
            rows.append(torch.tensor(first + rest[: top_k - len(first)]))
        probes.append((torch.stack(rows), _small_integers((tokens, top_k), generator, weight_dtype)))
    return probes


def crowded_probes(tokens: int, top_k: int, num_experts: int, weight_dtype: torch.dtype) -> list:
    """Routings that put every token on the same k experts (e .. e + k - 1, wrapping), one per e: where
    counts and positions are largest (a threshold on them bites there first), and where two top-1 masks
    that can share a token do."""
    generator = torch.Generator().manual_seed(4321)
    return [
        ((torch.arange(top_k) + e).remainder(num_experts).expand(tokens, top_k).clone(),
         _small_integers((tokens, top_k), generator, weight_dtype))
        for e in range(num_experts)
    ]


def column_probes(tokens: int, num_experts: int, dtype: torch.dtype, count: int = 3):
    """Probe [T, E] tables standing in for the padded per-expert weights."""
    return [
        _small_integers((tokens, num_experts), torch.Generator().manual_seed(99 + seed), dtype)
        for seed in range(count)
    ]


def padded_columns(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The kernel's per-expert weights: zeros(T, E).scatter_(-1, ids, w)."""
    return torch.zeros(ids.shape[0], num_experts, dtype=weights.dtype).scatter_(-1, ids, weights)


_TUPLES = (aten.sort.default, aten.sort.stable, aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int)


def builds_mask(node: Node) -> bool:
    """An integer/boolean value computed by a probe-able op: where the routing masks a loop indexes
    begin, looked through to reach the ids. Tensors, and the tuples and numbers of integer tensors (the
    sort of the ids, pieces of selected rows, a count read as a number); of getitems, only those of such
    tuples (not the ids of a top-k, say)."""
    if node.op != "call_function" or node.target not in PROBE_OPS:
        return False
    if is_getitem(node) and not is_call(node.args[0], *_TUPLES):
        return False
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        value_dtype = value.dtype
    else:
        value_dtype = next((dtype(n) for n in node.all_input_nodes if dtype(n) is not None), None)
    return value_dtype is not None and not value_dtype.is_floating_point


def gathers_at_data_size(node: Node) -> bool:
    """A tensor of any dtype that a probe-able op makes with a data-dependent size (`w[rows]` at the rows of
    a `nonzero` or a boolean mask, TensorRT-LLM's scales): what the routing hands a loop after gathering
    its slots, looked through to reach the ids and weights it was gathered from."""
    if node.op != "call_function" or node.target not in PROBE_OPS or is_getitem(node):
        return False
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and bool(free_unbacked_symbols(value.shape))


# Ops that read their first argument's size, dtype and device only (never its values).
SHAPE_READERS = frozenset({
    aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.new_zeros.default,
})


def builds_table(node: Node) -> bool:
    """A tensor that probe-able ops make from integer ids (a routing table of any dtype: scatter_add,
    one_hot(ids) * w summed over the slots), a view or cast on the way to one (`w[..., None]`), or a
    constant tensor made from sizes alone (the zeros a table is scattered into)."""
    if node.op != "call_function" or node.target not in PROBE_OPS or is_getitem(node):
        return False
    if node.target in SHAPE_ONLY_OPS or is_cast(node) or node.target in SHAPE_READERS:
        return True
    if not any(isinstance(n.meta.get("val"), torch.Tensor) for n in node.all_input_nodes):  # sizes only
        return isinstance(node.meta.get("val"), torch.Tensor)
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        for source in current.all_input_nodes:
            if source in seen:
                continue
            seen.add(source)
            value = dtype(source)
            if value is not None and not value.is_floating_point and value != torch.bool:
                return True
            if source.op == "call_function" and source.target in PROBE_OPS:
                stack.append(source)
    return False


def ids_and_weights(tensors: set[Node]) -> tuple[Node, Node] | None:
    """(ids, weights) when `tensors` are exactly one integer and one floating tensor: what routing hands
    the experts, read from whatever they were computed with."""
    ints = [n for n in tensors if not dtype(n).is_floating_point and dtype(n) != torch.bool]
    floats = [n for n in tensors if dtype(n).is_floating_point]
    return (ints[0], floats[0]) if len(ints) == 1 and len(floats) == 1 and len(tensors) == 2 else None


def table_sources(table: Node) -> tuple[set[Node], list[Node]]:
    """(the tensors a [T, E] routing table is built from, the nodes that build it, in graph order),
    looking through the ops that make masks and tables out of the ids."""
    nodes, sources, stack, seen = [], set(), [table], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node is table or builds_mask(node) or builds_table(node):
            nodes.append(node)
            # `zeros_like(probs)` reads only probs' size: probs is no source of the table
            stack.extend(node.all_input_nodes if node.target not in SHAPE_READERS else node.all_input_nodes[1:])
        elif isinstance(node.meta.get("val"), torch.Tensor):
            sources.add(node)
    order = {n: i for i, n in enumerate(table.graph.nodes)}
    return sources, sorted(nodes, key=order.__getitem__)
