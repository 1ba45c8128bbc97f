"""The adapter for loops over the experts that were hit (transformers 4.45+ sparse MoE blocks).

    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()      # [n_hit, 1]
    for expert_idx in expert_hit:
        expert_layer = self.experts[expert_idx]
        idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
        ...
        final_hidden_states.index_add_(0, top_x, current_hidden_states)

Dynamo cannot iterate a tensor whose length depends on the data, so such a block is never captured
(the frame falls back to eager). The adapted forward is the same function with that loop running over
EVERY row of the hit test (`expert_hit` becomes `arange(E)[:, None]`, what `nonzero` gives when every
expert is hit) and the module list indexed with the Python int; the loop body is unchanged.

Why that is the same computation (checked on the source before a class is adapted, else it is left
as written and the reason logged): the body's only effect is one accumulation into a tensor defined
before the loop, at rows `torch.where(M[e])` (or `M[e].nonzero()`), where the hit test is
`M.sum(dims) > 0` over the non-leading dims of a one-hot M (so non-negative) or `M.any(dims)`. For an
expert the original loop skips, the test is false, so M[e] has no non-zero entry, the rows are empty and
the accumulation adds nothing; every other statement only binds names local to one iteration. Where M is
not known to be non-negative (handed in, or changed in place), the body reads M[e] zeroed where the test
rejected e (`hit_row`), so the same holds without that premise. An `if` on the
module's attributes (`if self.training:`) is read arm by arm from the same state. The
element bound to the loop variable is the same [1]-shaped int64 tensor as before, so indexing with it
keeps its shapes (top-1 routing included); `var = var[0]` as the body's first statement (the 0-dim
element, transformers 4.57 GPT-OSS and the 5.x `eager` experts) is allowed. A statement that skips an
iteration on a test of the loop variable and of values fixed before the loop (`if var == E: continue`,
the expert-parallel sentinel class) skips the same rows as before and nothing for an expert not hit; it
is evaluated on the Python index (equal to the row's value), so it is no data-dependent branch. Whether
the hit test really reduced every non-leading dimension is checked when the loop is traced; where it did
not, the original `nonzero` is kept.

Loops over every expert (`range(E)`) keep their iteration; a guard that skips the work when the
expert's rows are empty (`if rows.numel() > 0:` around it, `if rows.shape[0] == 0: continue` before it:
a data-dependent branch that breaks the graph) is removed when the guarded work is that one
accumulation at those same rows, which adds nothing for empty rows. `if M.any():` around the work
(minimind) is such a guard where the rows are the non-zero entries of M (or of `M.any(dim)`); an
`elif C:` arm on a static test (`self.training`) stays under C, as written, and the guard goes where C is
false.

Loops that zip the experts with per-expert tensors (`for mask, expert in zip(masks, self.experts)`,
LitGPT) select tokens by the zipped element as `range` loops do by `mask[e]`.

A loop over the hit list of a boolean mask's columns, the expert axis last (transformers 4.x Switch
Transformers: `nonzero(M.reshape(N, E).sum(0), as_tuple=True)[0].tolist()`, rows `M[:, :, e]`), is read
as a hit loop over `M.movedim(-1, 0)` (`_column_hits_as_rows` says when), and a store `T[M[e]] = v` is
its body's one effect: nothing is stored for an expert not hit.

Loops over the ids present (`for e in ids.unique().tolist():`) run over every expert where the body's
only effect is one accumulation at `torch.where(ids == e)` (`present_ids` says why that is exact).

A loop over chunks of an expert's rows inside an expert loop (`for i in range(0, n, CHUNK)` slicing
`[i : i + CHUNK]`) becomes first a choice, from what `torch.where` read, between its body run once over
all the rows and the loop as written, where `chunk_loops` and this proof show the first arm exact; the
loop around it is then proved on that arm. In a loop body, `del` of the body's names and an in-place
elementwise op on an expert's output (or on a gather at the rows) are taken: neither changes a value
outside the iteration, and for an expert not hit the tensor has no element (the experts' premise).

Loops over per-expert counts (`for i, n in enumerate(counts): if n == 0: continue`, DeepSeek-V2 4.x)
lose that guard when `count_loops` proves it removable, and methods that read per-expert counts as
numbers (`.tolist()`, such a loop, or the counts handed to a submodule) have `capture_scalar_outputs`
switched on for the compile. Where the inner backend cannot compile a graph captured that way and no MoE
was fused in it, the backend runs that graph uncompiled instead of failing the compile.

`torch.where(M[e])` has a data-dependent size: while the adapted method is traced (any method of the
class, e.g. DeepSeek-V3's `moe`), dynamo's `capture_dynamic_output_shape_ops` is turned on for that
compile (and restored when it ends), so the loop becomes one graph that the sparse-loop finder fuses.
The sequence a loop iterates is evaluated before that, as written. A method that gathers the loop's
inputs at data-dependent sizes and calls the adapted method (TensorRT-LLM's forward before its
`run_experts`) captures them too, from its first statement (`_feeding_copy`).
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import inspect
import logging
import os
import types
import weakref
from copy import deepcopy

import torch

from .chunk_loops import ChunkLoop, check_operand, check_slices, chunk_loop, inline, is_chunk_choice
from .count_loops import (
    CountLoop,
    FixedCounts,
    count_loop,
    counts_returned,
    offset_loop,
    reads_counts_as_numbers,
    split_counts,
)
from .decorators import decorated
from .host_reads import (
    CutToCapacity,
    CutToCount,
    ListIndex,
    NewTensorOfList,
    ReplaceListIndices,
    StateSizes,
    capacity_cut,
    capacity_cuts,
    check_length_reads,
    cut_to_capacity,
    cut_to_count,
    data_length_names,
    link_parents,
    list_indices,
    sizes_at_least_zero,
    split_pieces,
    split_size_lists,
    split_sizes_of_parameters,
    splits_by_host_sizes,
    tensor_like,
    true_counts,
)
from .offset_slices import CutAtOffsets, adapted_calls, compile_with_helpers, cut, sums_offsets, write
from .one_hot_cuts import adapted_one_hot_calls, sizes_one_hot_on_host
from .present_ids import (
    PresentLoop,
    counted_runs_as_counts,
    expert_one_hot,
    present_experts,
    present_loop,
    present_sequence,
)
from .row_maps import REDUCTIONS, Callees, acting_call, still_trusted
from .source_ast import (
    VIEW_METHODS,
    Decisions,
    NotAdaptable,
    bindings,
    boolean_by_construction,
    call_name,
    changes_in_place,
    decided,
    defining_bindings,
    function_source,
    in_place_name,
    loop_index,
    moves_itself,
    namespace_of,
    number_read,
    placed,
    sized_name,
    skip_test,
    span,
    stored_names,
    strip_methods,
    walk_function,
)
from .source_ast import (
    loads as names_read,
)

log = logging.getLogger(__name__)

NAME = "expert loop (hit experts traced as all experts; data-dependent shapes and per-expert counts captured)"
_HELPERS = "__moe_passes_loop_helpers"
_INDEX = "__moe_passes_expert"
_ALL = "__moe_passes_all_rows"
_TESTED = "__moe_passes_tested"  # a gated hit loop's test, one flag per row (hit_rows)
_ITERATED = "__moe_passes_iterated"  # a loop's sequence, evaluated before shapes are captured
_ACCUMULATORS = {"index_add_", "index_put_"}


@dataclasses.dataclass(frozen=True)
class HitLoop:
    """One `for <var> in <hit>:` loop that can run over every expert instead."""

    line: int
    var: str
    hit: str  # the name bound to `<test>.nonzero()`
    mask: str  # M in the hit test and in the body's torch.where(M[var])
    dims: tuple[int, ...]  # the dims of M the hit test reduces
    skips: tuple[int, ...] = ()  # lines of `if <test of var>: continue`, evaluated on the Python index
    # (container source, dim) of each `X[var]` / `X[.., var, ..]` in the body: rows beyond a container's
    # length are not visited (the original raises IndexError if such a row is ever hit).
    indexed: tuple[tuple[str, int], ...] = ()
    # `alias = int(var.item())` as the body's first statement: the expert's Python number, which the
    # body indexes and branches with (the rewrite binds it to the loop index)
    alias: str | None = None
    # With an alias: (conditions, container source, dim) for each container the body indexes with the
    # row or the alias, the conditions being the (index test, arm) of the index branches around it. A
    # row at which the body would index past a container's end (or a key a mapping lacks) is one the
    # original loop could only visit by raising: the rewritten loop skips it.
    # The last field is the index the test reads: the alias, or a key formatted from it (`f"expert_{A}"`).
    guarded_indexed: tuple[tuple[tuple[tuple[str, bool], ...], str, int, str], ...] = ()
    # The hit test is `M.sum(dims) > 0` over an M not known to be non-negative: the body reads M[var] from
    # M gated by the test (no entry for an expert the test rejects), as the original never visits it.
    gated: bool = False


# ---------------------------------------------------------------------------------------------------
# Reading the source


def _nonzero_operand(value: ast.AST) -> ast.AST | None:
    """C when `value` is `C.nonzero()` or `torch.nonzero(C)` (index rows, not the as_tuple form; an
    explicit `as_tuple=False` is the default)."""
    if call_name(value) != "nonzero" or not all(
        k.arg == "as_tuple" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords
    ):
        return None
    if isinstance(value.func, ast.Attribute) and not value.args:
        base = value.func.value
        return None if isinstance(base, ast.Name) and base.id == "torch" else base
    if len(value.args) == 1:
        return value.args[0]
    return None


def _hit_operand(value: ast.AST) -> tuple[ast.AST, bool] | None:
    """(C, flattened) when `value` is `C.nonzero()` (`_nonzero_operand`), or `C.nonzero().reshape(-1, 1)`, the
    spelling `_hit_lists_as_rows` gives a flattened hit list (`flattened` True)."""
    if (call_name(value) == "reshape" and isinstance(value.func, ast.Attribute) and not value.keywords
            and len(value.args) == 2 and _minus_one(value.args[:1])
            and isinstance(value.args[1], ast.Constant) and value.args[1].value == 1):
        operand = _nonzero_operand(value.func.value)
        return (operand, True) if operand is not None else None
    operand = _nonzero_operand(value)
    return (operand, False) if operand is not None else None


def _is_one_hot(expr: ast.AST, assignments: dict, seen: frozenset[str] = frozenset(),
                changed: frozenset[str] = frozenset()) -> bool:
    """`one_hot(...)` through view-like methods, directly or through names whose every binding is one
    (`m = one_hot(ids, E); m = m.permute(2, 1, 0)`) and that nothing changes in place (`changed`): such a
    tensor is non-negative wherever it is read."""
    while True:
        if isinstance(expr, ast.Name):
            bound = defining_bindings(expr.id, assignments)
            if expr.id in seen or expr.id in changed or bound is None:
                return False
            return all(_is_one_hot(b.value, assignments, seen | {expr.id}, changed) for b in bound)
        name = call_name(expr)
        if name == "one_hot":
            return True
        if name in VIEW_METHODS and isinstance(expr.func, ast.Attribute):
            expr = expr.func.value
            continue
        return False


def _constant_dims(call: ast.Call) -> tuple[int, ...] | None:
    """The constant dims a reduction names (`M.sum(dim)`, `M.any(dim=(1, 2))`), as written; else None."""
    dim = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "dim"), None)
    if dim is None:
        return None
    elements = dim.elts if isinstance(dim, ast.Tuple | ast.List) else [dim]
    values = [ast.literal_eval(e) if isinstance(e, ast.Constant | ast.UnaryOp) else None for e in elements]
    return tuple(values) if all(isinstance(v, int) for v in values) else None


def _reduced_dims(call: ast.Call) -> tuple[int, ...] | None:
    """The constant `dim` of `M.sum(dim)` / `M.any(dim)` when it never names dim 0."""
    dims = _constant_dims(call)
    return None if dims is None or 0 in dims else dims


def _changed_in_place(fn_def: ast.FunctionDef) -> frozenset[str]:
    """Names whose tensor the function may change where it is, directly or through a view: the root name
    of every in-place change (`m[0] -= 1`, `m[4].neg_()`, `torch.neg_(m)`, `op(..., out=m)`), and every
    name bound from one of those (`flat = m.view(-1)` shares m's storage) or that one is bound from. A
    one-hot chain with any of them is not known to be non-negative."""
    roots = set()
    for node in walk_function(fn_def):
        changed = None
        if isinstance(node, ast.Subscript | ast.Attribute) and isinstance(node.ctx, ast.Store):
            changed = node.value
        elif isinstance(node, ast.AugAssign):
            changed = node.target
        elif isinstance(node, ast.Call):
            name = call_name(node)
            if isinstance(node.func, ast.Attribute) and name is not None and in_place_name(name):
                receiver = node.func.value
                changed = node.args[0] if _is_torch(receiver) and node.args else receiver
            for keyword in node.keywords:
                if keyword.arg == "out":
                    roots.update(_names_in(keyword.value))
        if changed is not None:
            roots.update(_names_in(changed))
    links = [(set(stored_names(t)), {base}) for node in walk_function(fn_def) if isinstance(node, ast.Assign)
             and (base := _viewed_name(node.value)) is not None for t in node.targets]
    tainted = set(roots)
    grown = True
    while grown:  # names sharing storage with a changed one, either way along a binding
        grown = False
        for targets, sources in links:
            if (targets & tainted or sources & tainted) and not (targets | sources) <= tainted:
                tainted |= targets | sources
                grown = True
    return frozenset(tainted)


def _names_in(expr: ast.AST) -> set[str]:
    """The root names of a changed target (`m` of `m[4]`, `m.view(-1)`); every name where it is no plain chain."""
    base = _viewed_name(expr)
    return {base} if base is not None else {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def _viewed_name(expr: ast.AST) -> str | None:
    """N when `expr` is N, or N through subscripts and view-like methods (storage it may share with N)."""
    while True:
        if isinstance(expr, ast.Name):
            return expr.id
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and (
                call_name(expr) in VIEW_METHODS | {"squeeze", "unsqueeze", "flatten", "view_as", "expand"}):
            expr = expr.func.value
        else:
            return None


def _hit_test_mask(test: ast.AST, assignments: dict,
                   changed: frozenset[str] = frozenset()) -> tuple[str, tuple[int, ...], bool]:
    """(M, reduced dims, gated) when `test` is true exactly for the rows e where M[e] has a non-zero entry,
    or (gated True) is `M.sum(dims) > 0` over an M not known to be non-negative: a row may then sum to
    zero or less with non-zero entries, so the copy reads the rows of M gated by the test (`hit_rows`)."""
    line = getattr(test, "lineno", "?")
    if call_name(test) == "any" and isinstance(test.func, ast.Attribute):
        reduction, positive = test, True
    elif call_name(test) in ("greater", "gt") and len(test.args) == 2:
        reduction, positive = test.args[0], isinstance(test.args[1], ast.Constant) and test.args[1].value == 0
    elif isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Gt):
        reduction = test.left
        positive = isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 0
    else:
        raise NotAdaptable(f"line {line}: the hit test is not `M.sum(dims) > 0` or `M.any(dims)`")
    if not positive or call_name(reduction) not in ("sum", "any") or not isinstance(reduction.func, ast.Attribute):
        raise NotAdaptable(f"line {line}: the hit test is not `M.sum(dims) > 0` or `M.any(dims)`")
    mask = reduction.func.value
    if not isinstance(mask, ast.Name):
        raise NotAdaptable(f"line {line}: the hit test reduces an expression, not a named mask")
    dims = _reduced_dims(reduction)
    if dims is None:
        raise NotAdaptable(f"line {line}: the hit test's reduced dims are not constants other than 0")
    overflows = any(k.arg == "dtype" for k in reduction.keywords) or len(reduction.args) > 1  # a narrow sum wraps
    return mask.id, dims, reduction.func.attr == "sum" and (overflows or not _is_one_hot(mask, assignments,
                                                                                         changed=changed))


def _hit_list_operand(value: ast.AST) -> tuple[ast.AST, bool] | None:
    """(T, flattened) for the hit experts of T, as a tensor of numbers (its `.tolist()` is the hit list):
    `T.nonzero(as_tuple=True)[0]` or `torch.nonzero(T, as_tuple=True)[0]`, the first coordinates of T's
    non-zero entries (SmallThinker), or `torch.nonzero(T).flatten()` (also `.view(-1)`, `.reshape(-1)`),
    every coordinate in order: the same numbers where T is 1-D (MiniMax-M2), `flattened` True."""
    if (call_name(value) in ("flatten", "view", "reshape") and isinstance(value.func, ast.Attribute)
            and not value.keywords and (not value.args if value.func.attr == "flatten" else _minus_one(value.args))):
        operand = _nonzero_operand(value.func.value)
        return (operand, True) if operand is not None else None
    if not (isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == 0):
        return None
    call = value.value
    if call_name(call) != "nonzero" or not any(
            k.arg == "as_tuple" and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords):
        return None
    if len(call.keywords) != 1 or not isinstance(call.func, ast.Attribute):
        return None
    base = call.func.value
    if isinstance(base, ast.Name) and base.id == "torch":
        return (call.args[0], False) if len(call.args) == 1 else None
    return (base, False) if not call.args else None


def _squeezed_hits_read_as_numbers(fn_def: ast.FunctionDef, loop: ast.For, bound: ast.Assign) -> bool:
    """`hit = T.nonzero().squeeze(-1)` read only by `for e in hit:` whose first statement reads the element
    as a number (`e = e.item()`, `int(e)`; NemotronH's experts) becomes `hit = T.nonzero()` and
    `for row in hit: e = int(row.item())`, in place; True where it did. `squeeze(-1)` drops nonzero's last
    dim only where it is 1 (T 1-D): the element is then the 0-dim coordinate, and the row of `nonzero()`
    its [1]-shaped twin, whose number is the same; for any other T both are the same rows, on which
    `.item()` raises alike. The element is read by nothing else."""
    value, hit, var = bound.value, bound.targets[0], loop.target.id
    squeezed = (call_name(value) == "squeeze" and isinstance(value.func, ast.Attribute) and not value.keywords
                and len(value.args) == 1 and (_minus_one(value.args) or isinstance(value.args[0], ast.Constant)
                                              and value.args[0].value == 1))
    operand = _nonzero_operand(value.func.value) if squeezed else None
    if operand is None or not isinstance(hit, ast.Name) or not isinstance(loop.body[0], ast.Assign):
        return False
    first = loop.body[0]
    read = number_read(first.value)
    if read is not None and call_name(first.value) == "int" and call_name(read) == "item":
        read = number_read(read)
    if not (isinstance(read, ast.Name) and read.id == var and len(first.targets) == 1
            and isinstance(first.targets[0], ast.Name)):
        return False
    # every read, nested functions and lambdas included: the rename would change what they see
    reads = [n for n in ast.walk(fn_def) if isinstance(n, ast.Name) and n.id == hit.id and isinstance(n.ctx, ast.Load)]
    element_reads = [n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == var]
    inside = {id(n) for n in ast.walk(loop)}
    read_outside = any(isinstance(n, ast.Name) and n.id == var and id(n) not in inside for n in ast.walk(fn_def))
    if reads != [loop.iter] or read_outside or (first.targets[0].id != var and element_reads != [read]):
        return False
    if first.targets[0].id == var and any(n is not read and isinstance(n.ctx, ast.Load)
                                          for n in ast.walk(first.value) if isinstance(n, ast.Name) and n.id == var):
        return False
    bound.value = ast.copy_location(ast.Call(ast.Attribute(operand, "nonzero", ast.Load()), [], []), value)
    row = f"{_INDEX}_row_{var}"
    loop.target = ast.copy_location(ast.Name(row, ast.Store()), loop.target)
    loop.body[0] = placed(f"{first.targets[0].id} = int({row}.item())", first)
    return True


def _minus_one(args: list[ast.expr]) -> bool:
    """`(-1)` or `((-1,))`: the arguments of a flattening view."""
    if len(args) == 1 and isinstance(args[0], ast.Tuple | ast.List):
        args = args[0].elts
    return len(args) == 1 and isinstance(args[0], ast.UnaryOp) and isinstance(args[0].op, ast.USub) and (
        isinstance(args[0].operand, ast.Constant) and args[0].operand.value == 1)


def _tolist_of(value: ast.AST) -> ast.AST | None:
    """X of `X.tolist()`."""
    if call_name(value) == "tolist" and isinstance(value.func, ast.Attribute) and not value.args and not value.keywords:
        return value.func.value
    return None


_COLUMNS = "__moe_passes_columns"  # a mask with its trailing expert axis moved first (_column_hits_as_rows)


def _column_hits_as_rows(fn_def: ast.FunctionDef) -> None:
    """A loop over the experts whose column of a boolean mask has an entry becomes the hit loop the proof
    reads, in place (HF Switch Transformers 4.x, the expert axis last):

        counts = M.reshape(N, E).sum(dim=0)                    # E: M's last size (`b, s, E = M.shape`)
        hit = torch.nonzero(counts, as_tuple=True)[0].tolist()
        for e in hit:
            ... M[:, :, e] ...

    becomes `C = M.movedim(-1, 0)`, `hit = C.any(dim=(1, 2)).nonzero()` and
    `for row in hit: e = int(row[0])` reading `C[e]`: the same experts in the same order, since a column of
    a boolean M sums to a non-zero count exactly where it holds a True, and `C[e]` is `M[:, :, e]`. Taken
    where M is boolean by construction at the loop (`_boolean_names`), its rank is the one the method
    unpacks (`b, s, E = M.shape`, `_mask_rank`), the counts are the column sums (`M.reshape(N, E).sum(0)`
    with E M's last size, or `M.sum(dims)` over every other dim), M is read in the loop only as
    `M[:, ..., :, e]` with one full slice per other dim, and nothing binds M, the counts or the hit list
    between them and the loop (all statements of the method's own block)."""
    boolean = _boolean_names(fn_def)
    block = fn_def.body
    for at, loop in enumerate(list(block)):
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and not loop.orelse and loop.body
                and at >= 2):
            continue
        listed = _tolist_of(loop.iter)
        hit_name = listed if listed is not None else loop.iter
        hit_stmt, count_stmt = block[at - 1], block[at - 2]
        if not (isinstance(hit_name, ast.Name) and _assigns_name(hit_stmt, hit_name.id)):
            continue
        tensor = hit_stmt.value if listed is not None else _tolist_of(hit_stmt.value)
        found = _hit_list_operand(tensor) if tensor is not None else None
        if found is None or found[1] or not isinstance(found[0], ast.Name):
            continue
        counts = found[0].id
        if not _assigns_name(count_stmt, counts):
            continue
        summed = _column_sums(count_stmt.value, fn_def, count_stmt.lineno)
        if summed is None or summed[0] not in boolean:
            continue
        mask, ndim = summed
        var = loop.target.id
        columns = [n for n in ast.walk(loop) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
                   and n.value.id == mask]
        reads = [n for n in ast.walk(loop) if isinstance(n, ast.Name) and n.id == mask]
        if not columns or len(columns) != len(reads) or not all(_column_at(c.slice, var, ndim) for c in columns):
            continue
        after = hit_stmt.end_lineno or hit_stmt.lineno
        later = [n for n in walk_function(fn_def) if getattr(n, "lineno", 0) > after]
        if any(isinstance(n, ast.Name) and n.id in (counts, hit_name.id) and not isinstance(n.ctx, ast.Load)
               for n in later):
            continue  # bound again after the hit list (M cannot be: `_shape_unpacked`)
        if sum(1 for n in later if isinstance(n, ast.Name) and n.id == hit_name.id) != 1:
            continue  # the hit list is read by the loop alone
        moved = f"{_COLUMNS}_{mask}"
        dims = ", ".join(str(d) for d in range(1, ndim))
        block.insert(at - 1, placed(f"{moved} = {mask}.movedim(-1, 0)", hit_stmt))
        hits = f"{_COLUMNS}_hit_{var}"  # a name of its own: the hit list's may also name the counts
        hit_stmt.targets = [ast.copy_location(ast.Name(hits, ast.Store()), hit_stmt.targets[0])]
        hit_stmt.value = ast.copy_location(_parse_expr(f"{moved}.any(dim=({dims},)).nonzero()"), hit_stmt.value)
        loop.iter = ast.copy_location(ast.Name(hits, ast.Load()), loop.iter)
        for column in columns:
            column.value = ast.copy_location(ast.Name(moved, ast.Load()), column.value)
            column.slice = ast.copy_location(ast.Name(var, ast.Load()), column.slice)
        row = f"{_INDEX}_row_{var}"
        loop.body = [placed(f"{var} = int({row}[0])", loop.body[0]), *loop.body]
        loop.target = ast.copy_location(ast.Name(row, ast.Store()), loop.target)
    ast.fix_missing_locations(fn_def)


def _shape_unpacked(fn_def: ast.FunctionDef, mask: str, before: int) -> ast.Assign | None:
    """The statement of the method's own block that unpacks M's shape (`b, s, E = M.shape`, which raises
    for any other rank: its names give M's rank) after M's last binding and before line `before`, with
    nothing changing M in place from there; else None."""
    bound = bindings(fn_def).get(mask, [])
    last = max((b.lineno for b in bound), default=0)
    for stmt in fn_def.body:
        if not (isinstance(stmt, ast.Assign) and last < stmt.lineno < before and len(stmt.targets) == 1):
            continue
        target = stmt.targets[0]
        if (isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts)
                and ast.unparse(stmt.value) in (f"{mask}.shape", f"{mask}.size()")):
            changed = any(changes_in_place(n, mask) for n in walk_function(fn_def)
                          if isinstance(n, ast.stmt) and getattr(n, "lineno", 0) > stmt.lineno)
            return None if changed else stmt
    return None


def _assigns_name(stmt: ast.stmt, name: str) -> bool:
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == name)


def _column_sums(value: ast.AST, fn_def: ast.FunctionDef, line: int) -> tuple[str, int] | None:
    """(M, M's rank) when `value`, at `line`, sums a name M over every dim but the last, the rank being the
    one the method unpacks before it (`_shape_unpacked`): `M.reshape(N, E).sum(dim=0)` (also `view`,
    `sum(0)`) with E M's last size (`M.shape[-1]`, `M.size(-1)`, or the last name of that unpacking), or
    `M.sum(dim=(0, ..., rank - 2))`; else None."""
    if not (call_name(value) == "sum" and isinstance(value.func, ast.Attribute)):
        return None
    dims = _reduced_dims_of(value)
    viewed = value.func.value
    summed = viewed.func.value if call_name(viewed) in ("reshape", "view") and isinstance(
        viewed.func, ast.Attribute) else viewed
    unpacked = _shape_unpacked(fn_def, summed.id, line) if isinstance(summed, ast.Name) else None
    if unpacked is None:
        return None
    rank = len(unpacked.targets[0].elts)
    if summed is not viewed:
        flat_columns = len(viewed.args) == 2 and dims == (0,) and _last_size_of(viewed.args[1], summed.id, unpacked, fn_def)
        return (summed.id, rank) if flat_columns else None
    return (summed.id, rank) if dims == tuple(range(rank - 1)) and rank >= 2 else None


def _reduced_dims_of(call: ast.Call) -> tuple[int, ...] | None:
    """The constant dims a `sum` reduces (`sum(0)`, `sum(dim=(0, 1))`), sorted, none negative; else None.
    No other argument."""
    dims = _constant_dims(call) if len(call.args) + len(call.keywords) == 1 else None
    return tuple(sorted(dims)) if dims is not None and all(d >= 0 for d in dims) else None


def _last_size_of(size: ast.AST, mask: str, unpacked: ast.Assign, fn_def: ast.FunctionDef) -> bool:
    """`size` is M's last size: `M.shape[-1]`, `M.size(-1)`, or the last name of the statement that
    unpacks M's shape (`b, s, E = M.shape`), bound there alone."""
    if ast.unparse(size) in (f"{mask}.shape[-1]", f"{mask}.size(-1)"):
        return True
    return (isinstance(size, ast.Name) and size.id == unpacked.targets[0].elts[-1].id
            and bindings(fn_def).get(size.id, []) == [unpacked])


def _column_at(index: ast.AST, var: str, ndim: int) -> bool:
    """`[:, ..., :, var]`: `ndim` - 1 full slices, then the loop variable."""
    if not isinstance(index, ast.Tuple) or len(index.elts) < 2:
        return False
    *leading, last = index.elts
    full = all(isinstance(e, ast.Slice) and e.lower is None and e.upper is None and e.step is None for e in leading)
    return full and isinstance(last, ast.Name) and last.id == var and len(leading) == ndim - 1


def _hit_lists_as_rows(fn_def: ast.FunctionDef) -> None:
    """A loop over a hit list of ints becomes a loop over the rows of a `nonzero`, in place:
    `hit = T.nonzero(as_tuple=True)[0].tolist()` read only by `for e in hit:` (or `hit = <that tensor>`
    read only by `for e in hit.tolist():`) becomes `hit = T.nonzero()` and `for row in hit: e = int(row[0])`,
    the same numbers in the same order (the first coordinate of each non-zero entry, in nonzero's order), in
    the spelling the hit-loop proof reads (the expert's number under an alias, as LongCat-Flash writes it).
    A flattened `nonzero(T).flatten()` becomes `nonzero(T).reshape(-1, 1)`: one row per number, whatever
    T's dims (the rewrite of the hit test keeps that where it is not proved 1-D, `all_rows`)."""
    assignments = bindings(fn_def)
    loops = [n for n in walk_function(fn_def) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
             and not n.orelse and n.body]
    for loop in loops:
        listed = _tolist_of(loop.iter)
        iterated = listed if listed is not None else loop.iter
        if not isinstance(iterated, ast.Name):
            continue
        hit = iterated.id
        bound = assignments.get(hit, [])
        if len(bound) != 1 or not isinstance(bound[0], ast.Assign) or len(bound[0].targets) != 1:
            continue
        if listed is None and _squeezed_hits_read_as_numbers(fn_def, loop, bound[0]):
            continue
        tensor = bound[0].value if listed is not None else _tolist_of(bound[0].value)
        found = _hit_list_operand(tensor) if tensor is not None else None
        reads = [n for n in walk_function(fn_def) if isinstance(n, ast.Name) and n.id == hit and isinstance(n.ctx, ast.Load)]
        if found is None or reads != [iterated]:
            continue
        operand, flattened = found
        rows = ast.Call(ast.Attribute(operand, "nonzero", ast.Load()), [], [])
        if flattened:
            rows = ast.Call(ast.Attribute(rows, "reshape", ast.Load()), [ast.UnaryOp(ast.USub(), ast.Constant(1)),
                                                                          ast.Constant(1)], [])
        bound[0].value = ast.copy_location(rows, bound[0].value)
        loop.iter = ast.copy_location(ast.Name(hit, ast.Load()), loop.iter)
        row = f"{_INDEX}_row_{loop.target.id}"
        alias = placed(f"{loop.target.id} = int({row}[0])", loop.body[0])
        loop.target = ast.copy_location(ast.Name(row, ast.Store()), loop.target)
        loop.body = [alias, *loop.body]
    ast.fix_missing_locations(fn_def)


def _selects_row(expr: ast.AST, mask: str, var: str) -> bool:
    """`M[var]` through view-like methods (`.squeeze(0)`, ...)."""
    expr = strip_methods(expr, VIEW_METHODS | {"squeeze", "flatten"})
    return (
        isinstance(expr, ast.Subscript)
        and isinstance(expr.value, ast.Name)
        and expr.value.id == mask
        and isinstance(expr.slice, ast.Name)
        and expr.slice.id == var
    )


_FLAT_VIEWS = {"squeeze", "view", "reshape", "flatten"}


def _rows_names(stmt: ast.stmt, mask: str | None, var: str) -> list[str]:
    """Names bound to the indices of M[var]'s non-zero entries by this statement (else empty).

    With `mask` None (a loop over every expert), the non-zero entries of any tensor."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return []
    value = stmt.value
    name = call_name(value)
    as_tuple = any(k.arg == "as_tuple" and isinstance(k.value, ast.Constant) and k.value.value for k in value.keywords) if isinstance(value, ast.Call) else False
    if name == "where" and len(value.args) == 1 and not value.keywords:
        operand = value.args[0]
    elif name == "nonzero" and as_tuple:
        operand = value.func.value if not value.args else value.args[0]
    elif mask is None and call_name(strip_methods(value, _FLAT_VIEWS)) == "nonzero" and value is not strip_methods(
            value, _FLAT_VIEWS):
        operand = None  # `nonzero(m).squeeze(-1)` (makeMoE): positions, flattened to one index per row
    else:
        return []
    if mask is not None and not _selects_row(operand, mask, var):
        return []
    return stored_names(stmt.targets[0])


def _skip_when_empty(stmt: ast.stmt, rows: dict[str, int]) -> int | None:
    """`if rows.shape[0] == 0: continue` (or `.numel() == 0`, `len(rows) == 0`, `not rows.numel()`):
    the line of the statement that bound those rows, else None."""
    test = skip_test(stmt)
    if test is None:
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _size_of_rows(test.operand, rows)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        zero = test.comparators[0]
        return _size_of_rows(test.left, rows) if isinstance(zero, ast.Constant) and zero.value == 0 else None
    return None


def _emptiness_guard(stmt: ast.stmt, rows: dict[str, int]) -> int | None:
    """`if rows.numel() > 0:` / `if rows.shape[0] > 0:` / `if len(rows) > 0:` (or `!= 0`, or bare), no
    else: the line of the statement that bound those rows, else None."""
    name = _emptiness_guarded(stmt)
    return rows.get(name) if name is not None else None


def _emptiness_guarded(stmt: ast.stmt) -> str | None:
    """The name whose emptiness `stmt` tests, when it is an emptiness guard (`_emptiness_guard`)."""
    if not isinstance(stmt, ast.If) or stmt.orelse:
        return None
    test = stmt.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        zero = test.comparators[0]
        if not (isinstance(test.ops[0], ast.Gt | ast.NotEq) and isinstance(zero, ast.Constant) and zero.value == 0):
            return None
        test = test.left
    return sized_name(test)


def _mask_guarded(stmt: ast.stmt) -> str | None:
    """M for `if M.any():` / `if torch.any(M):` (minimind's skip of an expert no token chose), whose only
    other arm is none or one `elif` on a static test (`elif self.training:`, see `_static_test`); else None.
    Rows selected as the non-zero entries of M (or of `M.any(dim)`) are empty exactly when the test fails."""
    if not isinstance(stmt, ast.If):
        return None
    if stmt.orelse and not (len(stmt.orelse) == 1 and isinstance(stmt.orelse[0], ast.If)
                            and not stmt.orelse[0].orelse and _static_test(stmt.orelse[0].test)):
        return None
    subject = _any_subject(stmt.test)
    return subject.id if isinstance(subject, ast.Name) else None


def _skipped_unless_any(stmt: ast.stmt, booleans: set[str]) -> str | None:
    """M for `if not M.any(): continue` / `if not torch.any(M): continue` (TensorRT-LLM's skip of an
    expert no slot chose): what follows runs exactly where `_mask_guarded`'s `if M.any():` body would.
    Also for `if M.sum() == 0: continue` (`torch.sum(M)`, read with `.item()` or `int()`, or
    `count_nonzero`) where M is a name the body bound to booleans: none of them set, the same test."""
    test = skip_test(stmt)
    if test is None:
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        subject = _any_subject(test.operand)
        return subject.id if isinstance(subject, ast.Name) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    sides = [test.left, test.comparators[0]]
    zero = [s for s in sides if isinstance(s, ast.Constant) and s.value == 0 and not isinstance(s.value, bool)]
    if len(zero) != 1:
        return None
    counted = sides[1 - sides.index(zero[0])]
    counted = number_read(counted) or counted
    name = call_name(counted)
    if name not in ("sum", "count_nonzero") or counted.keywords:
        return None
    if isinstance(counted.func, ast.Attribute) and _is_torch(counted.func.value):
        subject = counted.args[0] if len(counted.args) == 1 else None
    else:
        subject = counted.func.value if isinstance(counted.func, ast.Attribute) and not counted.args else None
    return subject.id if isinstance(subject, ast.Name) and subject.id in booleans else None


def _gathered_at_mask(value: ast.AST, booleans: set[str]) -> str | None:
    """M for `A[M]`, M a name the body bound to a boolean expression (TensorRT-LLM's `batch_indices[mask]`):
    the entries of A where M holds, so none when M holds nowhere."""
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Name) and value.slice.id in booleans:
        return value.slice.id
    return None


def _skipped_unless_present(stmt: ast.stmt, var: str) -> str | None:
    """X for `if var not in X: continue`: a tensor's `in` is `(X == var).any()`, so the rest of the body
    runs exactly where `torch.where(X == var)` selects some rows."""
    test = skip_test(stmt)
    if test is None:
        return None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.NotIn)):
        return None
    if not (isinstance(test.left, ast.Name) and test.left.id == var and isinstance(test.comparators[0], ast.Name)):
        return None
    return test.comparators[0].id


def _any_subject(test: ast.AST) -> ast.AST | None:
    """M for the test `M.any()` or `torch.any(M)` (no dim: true when any entry of M is non-zero)."""
    if call_name(test) != "any" or test.keywords:
        return None
    if isinstance(test.func, ast.Attribute) and not test.args and not _is_torch(test.func.value):
        return test.func.value
    if len(test.args) == 1 and isinstance(test.func, ast.Attribute) and _is_torch(test.func.value):
        return test.args[0]
    return None


def _store_at_tested_mask(stmt: ast.stmt, bound: set[str]) -> ast.Assign | None:
    """`T[M] = v` for `if torch.any(M): T[M] = v` (or `M.any()`), M a boolean expression written the same
    in the test and the store (OpenNMT-py: `if torch.any(ids == i): y[ids == i] = expert(x[ids == i])`).

    Where no entry of M is set the store writes no element, so the guard skips nothing but computing v
    on empty rows: removed, the store runs for every expert. T is a tensor bound before the loop, the
    guard has no other arm, and M is boolean by construction (a comparison, `&`, `|`, `~` of them, or
    `.bool()`): an integer index whose entries are all 0 would store at row 0."""
    if not isinstance(stmt, ast.If) or stmt.orelse or len(stmt.body) != 1:
        return None
    subject, store = _any_subject(stmt.test), stmt.body[0]
    if subject is None or not boolean_by_construction(subject) or not (
            isinstance(store, ast.Assign) and len(store.targets) == 1 and isinstance(store.targets[0], ast.Subscript)):
        return None
    target = store.targets[0]
    if not isinstance(target.value, ast.Name) or target.value.id in bound or any(
            isinstance(n, ast.NamedExpr) for n in ast.walk(store)):
        return None
    return store if ast.dump(target.slice) == ast.dump(subject) else None


def _store_at_the_row(stmt: ast.stmt, mask: str, numbers: set[str], bound: set[str]) -> bool:
    """`T[M[var]] = v` (or `M[alias]`), T a tensor bound before the loop, in a hit loop over a boolean M
    (HF Switch Transformers: `next_states[mask[:, :, e]] = expert(x[mask[:, :, e]])`). For an expert not
    hit, M[var] holds no True: the store writes no element, and v is computed on no rows."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript)):
        return False
    target = stmt.targets[0]
    index = target.slice
    return (isinstance(target.value, ast.Name) and target.value.id not in bound and target.value.id != mask
            and isinstance(index, ast.Subscript) and isinstance(index.value, ast.Name) and index.value.id == mask
            and isinstance(index.slice, ast.Name) and index.slice.id in numbers
            and not any(isinstance(n, ast.NamedExpr) for n in ast.walk(stmt)))


def _is_torch(expr: ast.AST) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "torch"


def _static_test(test: ast.AST) -> bool:
    """A test of the module's attributes and constants only (`self.training`, `not self.config.aux and
    self.training`): no call, subscript or local name (which could hold a tensor), so dynamo folds it to a
    constant, and evaluating it before the guard's own test has no effect."""
    if isinstance(test, ast.BoolOp):
        return all(_static_test(value) for value in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _static_test(test.operand)
    if isinstance(test, ast.Constant):
        return True
    while isinstance(test, ast.Attribute):
        test = test.value
    return isinstance(test, ast.Name) and test.id == "self"


def _fixed_test(test: ast.AST) -> bool:
    """`_static_test`, comparisons of such values allowed (`self.moe_token_dropout > 0`): the same truth for
    every expert, whatever the data (a tensor attribute breaks the graph, as written)."""
    if isinstance(test, ast.BoolOp):
        return all(_fixed_test(value) for value in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _fixed_test(test.operand)
    if isinstance(test, ast.Compare):
        return all(_static_test(part) for part in (test.left, *test.comparators))
    return _static_test(test)


def _plain_attributes(test: ast.AST, owner: type | None) -> bool:
    """Every `self.a` the test reads is stored on the instance or the class as a value, not computed by
    a property or another descriptor (whose reads may count or change state); unknown without the class."""
    if owner is None:
        return False
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            found = inspect.getattr_static(owner, node.attr, None)
            if found is not None and hasattr(type(found), "__get__"):
                return False
    return True


def _mask_of_rows(value: ast.AST) -> str | None:
    """M when `value` selects the non-zero entries of M or of `M.any(dim)` (`M.any(dim=-1).nonzero()`,
    `torch.where(M)`, through flattening views): rows that are empty exactly when M has no non-zero entry."""
    value = strip_methods(value, _FLAT_VIEWS)
    name = call_name(value)
    if name == "where" and len(value.args) == 1 and not value.keywords:
        operand = value.args[0]
    elif name == "nonzero" and isinstance(value.func, ast.Attribute):
        operand = value.func.value if not _is_torch(value.func.value) else (value.args[0] if value.args else None)
    else:
        return None
    operand = strip_methods(operand, _FLAT_VIEWS) if operand is not None else None
    if call_name(operand) == "any" and isinstance(operand.func, ast.Attribute) and not _is_torch(operand.func.value):
        operand = operand.func.value  # M.any(dim): a row is non-zero where any of M's entries in it is
    return operand.id if isinstance(operand, ast.Name) else None


# In-place adds into an existing tensor at an index: with an empty index they touch nothing.
_SCATTERS_IN_PLACE = {"scatter_add_", "index_add_", "index_copy_"}
_FILLED_LIKE = {"ones_like", "zeros_like", "full_like", "empty_like"}


def _scatter_guards(fn_def: ast.FunctionDef, assignments: dict) -> list[int]:
    """Lines of `if R.numel() > 0:` guards (any spelling `_emptiness_guard` reads) whose body only adds
    in place at an index that is R seen elementwise (`counts.scatter_add_(0, R.long(), ones_like(R))`,
    LongCat-Flash's count of the kept slots). For an empty R the index is empty and the adds touch
    nothing: the body is a no-op there, so running it unconditionally computes the same. The values
    added must be R seen elementwise or a `*_like` of it with constant arguments: empty with it, and
    nothing evaluated that can raise."""
    found = []
    for node in walk_function(fn_def):
        rows = _emptiness_guarded(node)
        if rows in assignments and all(_adds_at(stmt, rows) for stmt in node.body):
            found.append(node.lineno)
    return found


def _adds_at(stmt: ast.stmt, rows: str) -> bool:
    """`T.scatter_add_(dim, <rows elementwise>, <values>)` (or index_add_ / index_copy_) as a statement."""
    if not (isinstance(stmt, ast.Expr) and call_name(stmt.value) in _SCATTERS_IN_PLACE):
        return False
    call = stmt.value
    if not isinstance(call.func, ast.Attribute) or not isinstance(call.func.value, ast.Name) or call.keywords:
        return False
    if len(call.args) != 3 or not isinstance(call.args[0], ast.Constant):
        return False
    index, values = call.args[1], call.args[2]
    if call_name(values) in _FILLED_LIKE and values.args:  # ones_like(R, dtype=...): R's shape, filled
        if not all(isinstance(a, ast.Constant) for a in values.args[1:]) or not all(
                _plain_value(k.value) for k in values.keywords):
            return False
        values = values.args[0]
    return _elementwise_of(index, rows) and _elementwise_of(values, rows)


_ELEMENTWISE = {"long", "int", "float", "bool", "flatten", "contiguous"}


def _elementwise_of(expr: ast.AST, rows: str) -> bool:
    """`expr` is `rows` through casts and flattening views that cannot raise on an empty tensor
    (`.long()`, `.flatten()`, `.view(-1)`, ...; no other arguments evaluated)."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and not expr.keywords:
        flat = expr.func.attr in ("view", "reshape") and len(expr.args) == 1 and ast.unparse(expr.args[0]) == "-1"
        if not (flat or (expr.func.attr in _ELEMENTWISE and not expr.args)):
            return False
        expr = expr.func.value
    return isinstance(expr, ast.Name) and expr.id == rows


def _plain_value(expr: ast.AST) -> bool:
    """A constant, a name or an attribute chain of names (`torch.long`): reading it cannot raise."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, ast.Name | ast.Constant)


def _size_of_rows(test: ast.AST, rows: dict[str, int]) -> int | None:
    """For `r.numel()`, `len(r)` or `r.shape[0]` with r in `rows`: the line that bound r, else None."""
    name = sized_name(test)
    return rows.get(name) if name is not None else None


def _indexed_containers(loop: ast.For, var: str) -> tuple[tuple[str, int], ...]:
    """(source, dim) of every container the body indexes with the loop variable.

    A row the original loop never visits (not hit) may be out of range for such a container (DBRX and
    the 5.x `eager` experts keep an extra one-hot class for expert-parallel sentinels); the rewritten
    loop stops at the shortest one, so its length is read before the loop: the container must be a
    name or attribute chain, possibly viewed, that the body does not bind.
    """
    bound = {n for stmt in loop.body for t in ast.walk(stmt) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store) for n in [t.id]}
    found = [(source, dim) for stmt in loop.body for node in ast.walk(stmt) if isinstance(node, ast.Subscript)
             for source, dim, _ in _subscript_dims(node, {var}, bound, var)]
    return tuple(dict.fromkeys(found))


def _container_source(expr: ast.AST, bound: set[str], var: str) -> str:
    names = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    calls_ok = all(
        call_name(n) in VIEW_METHODS and isinstance(n.func, ast.Attribute) for n in ast.walk(expr) if isinstance(n, ast.Call)
    )
    if names & (bound | {var}) or not calls_ok:
        raise NotAdaptable(
            f"line {expr.lineno}: `{ast.unparse(expr)[:40]}` is indexed with the loop variable, and its length "
            "cannot be read before the loop"
        )
    return ast.unparse(expr)


def _unwraps_element(stmt: ast.stmt, var: str) -> bool:
    """`var = var[0]`: the [1]-shaped row of `nonzero` replaced by its one element."""
    return (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id == var
        and isinstance(stmt.value, ast.Subscript)
        and isinstance(stmt.value.value, ast.Name)
        and stmt.value.value.id == var
        and isinstance(stmt.value.slice, ast.Constant)
        and stmt.value.slice.value == 0
    )


def _element_alias(stmt: ast.stmt, var: str) -> str | None:
    """A for `A = int(var.item())` (or `var.item()`, `int(var)`, `int(var[0])`, `var[0].item()`): the
    expert's number under a new name, read from the [1]-shaped row of `nonzero`."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    value = number_read(stmt.value)  # int(...) or ....item(), one around the other allowed
    if value is None:
        return None
    if call_name(stmt.value) == "int" and call_name(value) == "item":
        value = number_read(value)
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == 0:
        value = value.value
    alias = stmt.targets[0].id
    return alias if isinstance(value, ast.Name) and value.id == var and alias != var else None


def _read_only_at_the_row(loop: ast.For, mask: str) -> bool:
    """Every read of `mask` in the loop is `mask[var]` (or `mask[alias]`): the copy reads the gated mask."""
    var = loop.target.id
    numbers = {var, _element_alias(loop.body[0], var) if loop.body else None}
    rows = {id(n.value) for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Subscript)
            and isinstance(n.value, ast.Name) and n.value.id == mask and isinstance(n.slice, ast.Name)
            and n.slice.id in numbers}
    return all(id(n) in rows for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Name)
               and n.id == mask)


def _formatted_numbers_as_alias(loop: ast.For) -> None:
    """`f"expert_{var[0]}"` in a hit loop's body (transformers 5.x Switch Transformers keys its ModuleDict so)
    reads the expert's number: a 0-dim integer tensor formats as its Python int (`Tensor.__format__`), so
    the body gets `A = int(var[0])` first (or uses the alias it has) and the f-string formats A, the
    spelling the alias proof reads. A conversion (`!r`, `!s`) formats the tensor itself and stays."""
    var = loop.target.id
    formatted = [n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.FormattedValue)
                 and n.conversion == -1 and isinstance(n.value, ast.Subscript) and isinstance(n.value.value, ast.Name)
                 and n.value.value.id == var and isinstance(n.value.slice, ast.Constant) and n.value.slice.value == 0]
    if not formatted:
        return
    stored = {n.id for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Name)
              and isinstance(n.ctx, ast.Store)}
    alias = _element_alias(loop.body[0], var)
    if var in stored or (alias is not None and sum(1 for stmt in loop.body for n in ast.walk(stmt) if isinstance(
            n, ast.Name) and n.id == alias and isinstance(n.ctx, ast.Store)) != 1):
        return  # the row or its alias bound again: `var[0]` may be another value where it is formatted
    if alias is None:
        alias = f"{_INDEX}_number_{var}"
        loop.body.insert(0, placed(f"{alias} = int({var}[0])", loop.body[0]))
    for value in formatted:
        value.value = ast.copy_location(ast.Name(alias, ast.Load()), value.value)


def _index_test(test: ast.AST, var: str, bound: set[str]) -> bool:
    """`test` reads `var` and otherwise only values fixed before the loop (names not bound in the body,
    attributes, constants; no calls): the same for a row whatever the data."""
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    if any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == var for n in ast.walk(test)):
        return False  # `var.attr` differs between the row and its Python index
    allowed = (ast.Name, ast.Attribute, ast.Constant, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.cmpop, ast.boolop,
               ast.unaryop, ast.expr_context, ast.Tuple, ast.List)
    return (var in names and not (names - {var}) & bound and all(isinstance(n, allowed) for n in ast.walk(test))
            and not any(_membership_by_hash(n) for n in ast.walk(test)))


def _membership_by_hash(node: ast.AST) -> bool:
    """`x in S` with S not a tuple or list written out: a set or dict looks a tensor up by identity (never
    found) and an int by value, so the row and its Python index may test differently."""
    return isinstance(node, ast.Compare) and any(
        isinstance(op, ast.In | ast.NotIn) and not isinstance(right, ast.Tuple | ast.List)
        for op, right in zip(node.ops, node.comparators, strict=True))


def _branches_on_index(stmt: ast.stmt, var: str, bound: set[str]) -> bool:
    """`if <test of var>: ... else: ...` that is not a skip (LongCat-Flash's `if expert_idx >=
    num_routed: identity else: MLP`): which arm runs is fixed for a row."""
    return isinstance(stmt, ast.If) and _index_test(stmt.test, var, bound) and skip_test(stmt) is None


def _guarded_containers(loop: ast.For, alias: str) -> tuple[tuple[tuple[tuple[str, bool], ...], str, int], ...]:
    """(conditions, container, dim) for each container the body indexes with the row or `alias`; the
    conditions are the (test, arm) of the index branches around the subscript (`if`/`elif`/`else`
    statements and conditional expressions whose test is fixed by the number). A subscript under a
    conditional expression whose test is not fixed by it cannot be placed: NotAdaptable."""
    var = loop.target.id
    stored = {n.id for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    varying = stored - {alias}  # names an index test may not read
    found: list = []

    def visit(node, conditions):
        if isinstance(node, ast.If | ast.IfExp) and _index_test(node.test, alias, varying):
            test = ast.unparse(node.test)
            arms = (node.body, node.orelse) if isinstance(node, ast.If) else ([node.body], [node.orelse])
            for arm, statements in zip((True, False), arms, strict=True):
                for child in statements:
                    visit(child, (*conditions, (test, arm)))
            return
        if isinstance(node, ast.IfExp) and _indexes_with(node, {var, alias}):
            raise NotAdaptable(f"line {node.lineno}: a container is indexed with the expert's number under a "
                               "condition the number does not fix")
        if isinstance(node, ast.Subscript):
            for source, dim, key in _subscript_dims(node, {var, alias}, stored, var):
                found.append((conditions, source, dim, key or alias))
        for child in ast.iter_child_nodes(node):
            visit(child, conditions)

    for stmt in loop.body[1:]:
        visit(stmt, ())
    return tuple(dict.fromkeys(found))


def _indexes_with(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Subscript) and any(
        isinstance(e, ast.Name) and e.id in names
        for e in (n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice])) for n in ast.walk(node))


def _subscript_dims(node: ast.Subscript, names: set[str], bound: set[str],
                    var: str) -> list[tuple[str, int, str | None]]:
    """(container source, dim, key) for each place of `node`'s index that is one of `names` (key None), or
    a string formatted from them and from values fixed before the loop (key: the f-string's source)."""
    if isinstance(node.value, ast.Name) and node.value.id in names:
        return []  # `row[0]`: the element itself
    elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    found, dim = [], 0
    for element in elements:
        if isinstance(element, ast.Constant) and element.value is Ellipsis:
            if any(isinstance(e, ast.Name) and e.id in names for e in elements):
                raise NotAdaptable(f"line {node.lineno}: the loop variable indexes past an ellipsis")
            break
        if isinstance(element, ast.Constant) and element.value is None:
            continue  # a new axis: no dim of the container
        if isinstance(element, ast.Name) and element.id in names:
            found.append((_container_source(node.value, bound, var), dim, None))
        elif isinstance(element, ast.JoinedStr) and {n.id for n in ast.walk(element) if isinstance(n, ast.Name)} & names:
            if any(not isinstance(n, ast.JoinedStr | ast.FormattedValue | ast.Constant | ast.Name | ast.Attribute
                                  | ast.expr_context) for n in ast.walk(element)) or _mentions(element, bound - names):
                raise NotAdaptable(f"line {node.lineno}: a container is indexed with a key formatted from the "
                                   "expert's number and from values the loop computes")
            parent = getattr(node, "_moe_parent", None)
            if not (isinstance(parent, ast.Call) and parent.func is node):
                # a mapping of values may make a missing key (a defaultdict) for an expert no token chose
                raise NotAdaptable(f"line {node.lineno}: `{ast.unparse(node)[:40]}` reads a value by a key formatted "
                                   "from the expert's number; only an expert looked up so and called is taken")
            found.append((_container_source(node.value, bound, var), dim, ast.unparse(element)))
        dim += 1
    return found


def _skips_on_index(stmt: ast.stmt, var: str, bound: set[str]) -> bool:
    """`if <test>: continue` whose test reads the loop variable and otherwise only values fixed before
    the loop (names not bound in the body, attributes, constants; no calls)."""
    test = skip_test(stmt)
    return test is not None and _index_test(test, var, bound)


def _skips_on_count(stmt: ast.stmt, var: str) -> str | None:
    """C for `if C[var] == 0: continue` / `if not C[var]: continue` (DeepSeek-V3's skip of an expert no
    token chose, on counts read to the host before the loop)."""
    test = skip_test(stmt)
    if test is None:
        return None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        read = test.operand
    elif (
        isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 0
    ):
        read = test.left
    else:
        return None
    if (
        isinstance(read, ast.Subscript) and isinstance(read.value, ast.Name)
        and isinstance(read.slice, ast.Name) and read.slice.id == var
    ):
        return read.value.id
    return None


def _selected_by_equality(loop: ast.For, line: int, var: str) -> str | None:
    """S when the statement at `line` of the loop binds rows that are empty wherever no entry of S equals
    var: `torch.where(S == var)` (either side), or the non-zero entries of `(S == var).any(dim)` (through
    flattening views, and names the loop binds once: `mask = S == e; rows = mask.any(-1).nonzero()`)."""
    once: dict[str, ast.expr] = {}
    for stmt in ast.walk(loop):
        if isinstance(stmt, ast.Assign):
            for name in (n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                once[name] = stmt.value if name not in once and len(stmt.targets) == 1 and isinstance(
                    stmt.targets[0], ast.Name) else None
    for stmt in ast.walk(loop):
        if isinstance(stmt, ast.Assign) and stmt.lineno == line:
            tested = _mask_of_rows(stmt.value)
            for _ in range(3):  # through names bound once in the loop, and `.any(dim)` of them
                test = once.get(tested) if tested is not None else None
                if test is None:
                    break
                inner = _any_operand(test)
                tested = inner.id if isinstance(inner, ast.Name) else None
                if inner is test:
                    return _equality_with(test, var)
            if call_name(stmt.value) == "where" and len(stmt.value.args) == 1:
                return _equality_with(stmt.value.args[0], var)
    return None


def _any_operand(expr: ast.expr) -> ast.expr:
    """M of `M.any(dim)` (or `M.any()`), through flattening views; else `expr` itself."""
    stripped = strip_methods(expr, _FLAT_VIEWS)
    if call_name(stripped) == "any" and isinstance(stripped.func, ast.Attribute) and not _is_torch(stripped.func.value):
        return strip_methods(stripped.func.value, _FLAT_VIEWS)
    return expr


def _equality_with(test: ast.expr, var: str) -> str | None:
    """S for `S == var` or `var == S`."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        names = [s.id for s in (test.left, test.comparators[0]) if isinstance(s, ast.Name)]
        if len(names) == 2 and var in names and names[0] != names[1]:
            return names[1 - names.index(var)]
    return None


_FLATTENING = {"flatten", "view", "reshape", "cpu", "numpy", "tolist"}


def _bincount_of(counts: str, source: str, fn_def: ast.FunctionDef) -> bool:
    """`counts` is bound once, to `bincount(source.flatten(), ...)` read to the host or not, and `source`
    is bound at most once (or is a parameter), so the counts and the loop's selections read the same ids."""
    assignments = bindings(fn_def)
    bound = assignments.get(counts, [])
    if len(bound) != 1 or not isinstance(bound[0], ast.Assign) or len(assignments.get(source, [])) > 1:
        return False
    value = strip_methods(bound[0].value, _FLATTENING)
    if call_name(value) != "bincount" or not value.args or len(value.args) > 2:
        return False
    if len(value.args) == 2 or any(k.arg != "minlength" for k in value.keywords):
        return False  # `weights=`: a count can be 0 where an id is present (padding weighted 0)
    ids = strip_methods(value.args[0], _FLATTENING)
    return isinstance(ids, ast.Name) and ids.id == source


def _piece_rows(zipped) -> dict[str, int]:
    """The pieces of a split loop as rows for `_check_body`: pieces split at the same counts are empty
    together, so they share one key (a negative number standing for the counts)."""
    keys = {source: -1 - i for i, source in enumerate(dict.fromkeys(zipped.pieces.values()))}
    return {name: keys[source] for name, source in zipped.pieces.items()}


def _check_body(
    loop: ast.For, var: str, mask: str | None, fn_def: ast.FunctionDef, given_rows: dict[str, int] | None = None,
    present_ids: str | None = None, callees: Callees | None = None, boolean_mask: bool = False,
) -> tuple[list[int], list[int]]:
    """The body's only effect is one accumulation at rows that are empty for an expert not hit.

    `mask` None: a loop over every expert, where only the guards need the proof (a guard that skips
    the body when the rows are empty skips nothing but an accumulation of nothing). Returns the lines of
    those guards, which the rewrite removes (dynamo breaks the graph on a data-dependent `if`), and, for
    a hit loop, the lines of the `continue`s on a test of the loop variable, which it evaluates on the
    Python index. With `present_ids` (a loop over the unique values of that name), the accumulation's rows
    must be `torch.where(present_ids == var)`: empty for an id not present. Every call in the body but the
    accumulation must act only through its value (`callees`, reading them for effects: a helper that stores
    a statistic on the module would store one for an expert no token chose); the experts, modules, are
    taken to compute their output alone.
    """
    bound: set[str] = set()
    rows: dict[str, int] = dict(given_rows or {})  # name -> line of the torch.where / nonzero that bound it
    accumulations = []
    guards: list[tuple[int, int]] = []  # (line of the guard, line that bound the rows it tests)
    # (line of `if M.any():`, (M, its binding then), S where M is `S == var`)
    mask_guards: list[tuple[int, tuple, str | None]] = []
    masks_of: dict[str, tuple] = {}  # rows name -> (the mask whose non-zero entries they are, its binding)
    versions: dict[str, int] = {}  # name -> how many times the body has bound it so far
    count_guards: list[tuple[int, str]] = []  # (line of `if counts[var] == 0: continue`, counts)
    absent_skips: list[tuple[int, str]] = []  # (line of `if var not in ids: continue`, ids)
    stores: list[int] = []  # lines of `if torch.any(M): T[M] = v`
    row_stores: list[int] = []  # lines of `T[mask[var]] = v` in a hit loop over a boolean mask
    booleans: set[str] = set()  # names the body bound to boolean expressions (`mask = ids == e`)
    fresh: set[str] = set()  # names bound to a gather at the rows, or an expert's output of one: empty with them
    equal_to: dict[str, ast.expr] = {}  # names the body bound to a comparison, with it (`mask = ids == e`)
    made: set[str] = set()  # names bound to arithmetic (`y = a * w`): a new tensor, no view of another
    skips: list[int] = []
    loop_names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    body, row = loop.body, var  # the row itself selects as its alias does (`M[var]`, `M[alias]`)
    if mask is not None and body and _unwraps_element(body[0], var):
        body = body[1:]
    elif (mask is not None or present_ids is not None) and body and (alias := _element_alias(body[0], var)) is not None:
        body, var = body[1:], alias  # the body reads the expert's number under the alias

    def at_mask(accumulation) -> None:
        """`out[A[M]] += y` (or index_add_ at `A[M]`), M bound in the body to booleans, in a loop over every
        expert: rows empty where M holds nowhere, as for `rows = A[M]` bound first."""
        gathered = _gathered_at_mask(_index_expression(accumulation), booleans)
        index = _accumulation_index(accumulation)  # None unless A is a name
        if mask is None and gathered is not None and index is not None:
            rows[index] = accumulation.lineno
            masks_of[index] = (gathered, versions.get(gathered))

    state = (rows, masks_of, versions, booleans, fresh, equal_to, made)
    effects = (accumulations, guards, mask_guards, count_guards, absent_skips, stores, skips)

    def static_arms(stmt: ast.If) -> None:
        """`if <static test>: A else: B` (`if self.training:`, NLLB-MoE's token dropout): dynamo folds the
        test and one arm runs for every expert alike, so each arm is read as the body would be, from the
        same state, and what holds after the `if` is what holds after both. The arms may bind names and
        change their own new tensors; the accumulation and the guards stay outside them."""
        numbers = {var, row}
        if any(isinstance(n, ast.Subscript) and _mentions(n.slice, numbers) for arm in (stmt.body, stmt.orelse)
               for part in arm for n in ast.walk(part)):
            raise NotAdaptable(f"line {stmt.lineno}: a container is indexed with the expert's number under "
                               f"`if {ast.unparse(stmt.test)[:40]}`, whose arm may not run")
        if not _plain_attributes(stmt.test, callees.owner if callees is not None else None):
            raise NotAdaptable(f"line {stmt.lineno}: `if {ast.unparse(stmt.test)[:40]}` reads an attribute the "
                               "class computes (a property or descriptor), which may act each time it is read")
        before = [dict(part) if isinstance(part, dict) else set(part) for part in state]
        counts = [len(effect) for effect in effects]
        after = []
        for arm in (stmt.body, stmt.orelse):
            for part, saved in zip(state, before, strict=True):
                part.clear()
                part.update(saved)
            visit(arm)
            if [len(effect) for effect in effects] != counts:
                raise NotAdaptable(f"line {stmt.lineno}: the loop body accumulates or skips under "
                                   f"`if {ast.unparse(stmt.test)[:40]}`")
            after.append([dict(part) if isinstance(part, dict) else set(part) for part in state])
        first, second = after
        for part, one, other, saved in zip(state, first, second, before, strict=True):
            part.clear()
            if part is versions:  # a name bound again in an arm holds neither arm's binding for sure
                part.update({n: max(one.get(n, 0), other.get(n, 0)) + (one.get(n) != other.get(n) or
                                                                         one.get(n) != saved.get(n))
                             for n in one.keys() | other.keys()})
            elif isinstance(part, dict):
                part.update({n: v for n, v in one.items() if n in other and (other[n] is v or other[n] == v)})
            else:
                part.update(one & other)

    def visit(statements):
        for stmt in statements:
            if is_chunk_choice(stmt):
                visit(stmt.body)  # a loop over chunks run once: its else arm is that loop, proved on its own
                continue
            walrus = next((n for n in ast.walk(stmt) if isinstance(n, ast.NamedExpr)), None)
            if walrus is not None:
                raise NotAdaptable(f"line {stmt.lineno}: `{ast.unparse(walrus)[:40]}` binds a name in the loop body "
                                   "inside an expression, which may act for an expert no token chose")
            if moves_itself(stmt):
                continue  # `out = out.to(device)`: the same values under the same name, for any expert
            if (added := _added_as_a_store(stmt)) is not None:
                accumulations.append(added)
                at_mask(added)
                continue
            if boolean_mask and mask is not None and _store_at_the_row(stmt, mask, {var, row}, bound):
                row_stores.append(stmt.lineno)
                continue
            if isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names = [n for t in targets for n in stored_names(t)]
                if var in names:
                    raise NotAdaptable(f"line {stmt.lineno}: the loop variable {var} is re-bound in the body")
                selected = _rows_names(stmt, mask, var) or (_rows_names(stmt, mask, row) if row != var else [])
                cut = _cut_rows(stmt, rows)
                masked = _mask_of_rows(stmt.value)
                if masked is None and mask is None and len(names) == 1 and (
                        gathered := _gathered_at_mask(stmt.value, booleans)):
                    # `A[M]`: rows that are empty where M holds nowhere (a loop over every expert: a hit
                    # loop's rows must be those of its hit mask, which A[M] says nothing of)
                    masked, selected = gathered, names
                for name in names:  # a re-bound name no longer holds what an earlier statement bound to it
                    rows.pop(name, None)
                    masks_of.pop(name, None)
                    booleans.discard(name)
                    versions[name] = versions.get(name, 0) + 1
                if len(names) == 1 and isinstance(stmt, ast.Assign) and boolean_by_construction(stmt.value):
                    booleans.add(names[0])
                    if mask is None:  # a loop over every expert: `out[M] += y` adds at M's set entries, none
                        selected, masked = names, names[0]  # where M holds nowhere (the mask is its own)
                rows.update(dict.fromkeys(selected, stmt.lineno))
                if masked is not None:
                    masks_of.update(dict.fromkeys(stored_names(targets[0]), (masked, versions.get(masked))))
                if cut is not None:
                    rows[cut] = stmt.lineno  # the first rows of rows empty for an expert not hit: empty too
                fresh.difference_update(names)
                made.difference_update(names)
                if len(names) == 1 and isinstance(targets[0], ast.Name) and isinstance(stmt.value, ast.BinOp):
                    made.add(names[0])
                for name in names:
                    equal_to.pop(name, None)
                if len(names) == 1 and isinstance(stmt.value, ast.Compare):
                    equal_to[names[0]] = stmt.value
                if len(names) == 1 and _fresh_at_rows(stmt.value, rows, fresh, callees):
                    fresh.add(names[0])
                bound.update(names)
            elif isinstance(stmt, ast.With):
                if any(item.optional_vars is not None for item in stmt.items):
                    raise NotAdaptable(f"line {stmt.lineno}: `with ... as` in the loop body")
                for item in stmt.items:
                    if not _torch_context(item.context_expr, callees):
                        raise NotAdaptable(f"line {stmt.lineno}: `with {ast.unparse(item.context_expr)[:40]}` in the "
                                           "loop body may act for an expert no token chose (only torch's contexts "
                                           "are taken)")
                visit(stmt.body)
            elif isinstance(stmt, ast.Expr) and call_name(stmt.value) in _ACCUMULATORS:
                accumulations.append(stmt.value)
                at_mask(stmt.value)
            elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Subscript):
                accumulations.append(stmt)
                at_mask(stmt)
            elif isinstance(stmt, ast.Pass):
                pass
            elif isinstance(stmt, ast.Delete) and all(isinstance(t, ast.Name) and t.id in bound for t in stmt.targets):
                pass  # `del y`: a name of this iteration unbound, no value changed
            elif isinstance(stmt, ast.Expr) and _in_place_on(stmt.value) in fresh:
                pass  # `y.mul_(w)` on an expert's output: nothing for an expert not hit, whose y is empty
            elif (isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name)
                  and stmt.target.id in (fresh | made) and stmt.target.id in bound):
                pass  # `y *= c` on a tensor this iteration made: it changes nothing outside the iteration
            elif (source := _emptiness_guard(stmt, rows)) is not None:
                guards.append((stmt.lineno, source))
                visit(stmt.body)
            elif (tested := _mask_guarded(stmt)) is not None and tested in bound and not any(
                    tested in stored_names(t) for n in stmt.body for a in ast.walk(n)
                    if isinstance(a, ast.Assign | ast.AugAssign | ast.AnnAssign)
                    for t in (a.targets if isinstance(a, ast.Assign) else [a.target])):
                mask_guards.append((stmt.lineno, (tested, versions.get(tested)), None))  # the `elif` arm stays, as written
                visit(stmt.body)
            elif (tested := _skipped_unless_any(stmt, booleans)) is not None and tested in bound:
                # `if not M.any(): continue`; where M is `S == var`, that is `var not in S` too
                mask_guards.append((stmt.lineno, (tested, versions.get(tested)), _equality_with(equal_to.get(tested), var)))
            elif _store_at_tested_mask(stmt, bound) is not None:
                stores.append(stmt.lineno)
            elif (source := _skip_when_empty(stmt, rows)) is not None:
                guards.append((stmt.lineno, source))  # skipping on no rows skips an accumulation of nothing
            elif mask is not None and _skips_on_index(stmt, var, bound):
                skips.append(stmt.lineno)
            elif mask is not None and var not in loop_names and _branches_on_index(stmt, var, bound):
                visit(stmt.body)  # an alias's branch: one arm runs for a row, fixed by its number
                visit(stmt.orelse)
            elif (counts := _skips_on_count(stmt, var)) is not None:
                count_guards.append((stmt.lineno, counts))
            elif isinstance(stmt, ast.If) and _fixed_test(stmt.test):
                static_arms(stmt)
            elif (present_in := _skipped_unless_present(stmt, var)) is not None:
                absent_skips.append((stmt.lineno, present_in))
            else:
                word = type(stmt).__name__.lower()
                kind = "a call" if isinstance(stmt, ast.Expr) else f"{'an' if word[0] in 'aeiou' else 'a'} `{word}` statement"
                code = ast.unparse(stmt).splitlines()[0][:60]
                raise NotAdaptable(
                    f"line {stmt.lineno}: {kind} in the loop body (`{code}`) may act for an expert no token "
                    "chose; only one accumulation into the output may"
                )

    visit(body)
    if row_stores:  # `T[M[var]] = v`: no element stored where the boolean row holds no True (an expert not hit)
        if accumulations or stores or mask_guards or count_guards or absent_skips or guards or len(row_stores) != 1:
            raise NotAdaptable(f"line {row_stores[0]}: a store at the expert's row of the mask is not the loop "
                               "body's only effect")
        _check_locals(loop, bound, fn_def)
        return [], skips
    if stores:  # `if torch.any(M): T[M] = v` is the whole effect of the body
        if accumulations or mask_guards or count_guards or absent_skips or guards or len(stores) != 1:
            raise NotAdaptable(f"line {stores[0]}: a store at its tested mask is not the loop body's only effect")
        _check_locals(loop, bound, fn_def)
        return stores, skips
    if len(accumulations) != 1:
        raise NotAdaptable(f"line {loop.lineno}: the loop body accumulates {len(accumulations)} times, not once")
    accumulated_rows = _check_accumulation(accumulations[0], rows, bound)
    accumulated_at = _accumulation_index(accumulations[0])
    if callees is not None:
        _check_added_rows(loop, accumulations[0], callees)
    if present_ids is not None and (
            _selected_by_equality(loop, accumulated_rows, var) != present_ids or present_ids in bound):
        raise NotAdaptable(f"line {accumulated_rows}: the accumulation's rows are not `torch.where({present_ids} == "
                           f"{var})`, so an expert absent from {present_ids} may add something")
    for line, tested, equal_in in mask_guards:
        if masks_of.get(accumulated_at) != tested and equal_in is not None:
            absent_skips.append((line, equal_in))  # checked below as `if var not in S: continue`
            continue
        if masks_of.get(accumulated_at) != tested:
            raise NotAdaptable(
                f"line {line}: the guard tests {tested[0]} as bound there, not the mask whose non-zero entries "
                "the accumulation's rows are"
            )
        guards.append((line, accumulated_rows))
    for line, counts in count_guards:
        source = _selected_by_equality(loop, accumulated_rows, var)
        if source is None or source in bound or not _bincount_of(counts, source, fn_def):
            raise NotAdaptable(
                f"line {line}: the skip reads counts that are not the bincount of the ids the loop selects "
                "its rows by"
            )
        guards.append((line, accumulated_rows))  # counts[var] == 0: no id equals var, no rows
    for line, ids in absent_skips:
        if ids in bound or _selected_by_equality(loop, accumulated_rows, var) != ids:
            raise NotAdaptable(
                f"line {line}: the skip tests {ids}, and the accumulation's rows are not `torch.where({ids} == {var})`"
            )
        guards.append((line, accumulated_rows))  # var not in ids: no id equals var, no rows
    for line, source in guards:
        if source != accumulated_rows:
            raise NotAdaptable(
                f"line {line}: the guard tests other rows than the accumulation's (bound at line {source}, "
                f"not {accumulated_rows})"
            )
    _check_locals(loop, bound, fn_def)
    return [line for line, _ in guards], skips


def _check_added_rows(loop: ast.For, accumulation, callees: Callees) -> None:
    """What the loop adds has no rows where the expert's rows are none: no reduction over its rows that
    keeps a row (`_reduces_rows`) in the added value or the body's bindings it is computed from. Else an
    expert no token chose would add a row of its own in the copy, or fail the trace's size check where
    the written loop never runs it (`y.sum(0, keepdim=True)`)."""
    if isinstance(accumulation, ast.AugAssign):
        added = accumulation.value
    else:
        arguments = accumulation.args[2:3] if call_name(accumulation) == "index_add_" else accumulation.args[1:2]
        keyword = "source" if call_name(accumulation) == "index_add_" else "values"
        added = next(iter(arguments), None) or next((k.value for k in accumulation.keywords if k.arg == keyword), None)
    if added is None:
        return
    definitions = [(node.lineno, name, node.value) for node in ast.walk(loop) if isinstance(node, ast.Assign)
                   for target in node.targets if not isinstance(target, ast.Subscript)  # `A[I] = A[I] + v`
                   for name in stored_names(target)]
    sources, pending, seen = [], [(added, accumulation.lineno)], set()
    while pending:
        value, line = pending.pop()
        sources.append(value)
        for name in names_read(value):
            earlier = [(at, v) for at, bound_name, v in definitions if bound_name == name and at < line]
            if earlier and (name, earlier[-1][0]) not in seen:
                seen.add((name, earlier[-1][0]))
                pending.append((earlier[-1][1], earlier[-1][0]))
    dropping = next(filter(None, (_reduces_rows(source) for source in sources)), None)
    if dropping is not None:
        raise NotAdaptable(f"line {accumulation.lineno}: what the loop adds goes through {dropping}, which may give "
                           "a value with rows for an expert no token chose")


def _reduces_rows(value: ast.AST) -> str | None:
    """The first reduction in `value` that keeps a row of its own (`keepdim=True`) over dim 0 or over every
    dim (`y.sum(0, keepdim=True)`), named; None. Without keepdim the rows' dim is gone, and the value
    broadcasts back onto no rows (`y - y.mean(0)`) or fails in the written code too; over a later or a
    negative dim it reduces a row's own values."""
    for node in ast.walk(value):
        name = call_name(node)
        if name not in REDUCTIONS or not isinstance(node.func, ast.Attribute | ast.Name):
            continue
        function = isinstance(node.func, ast.Name) or (isinstance(node.func.value, ast.Name)
                                                        and node.func.value.id in ("torch", "F"))
        positional = list(node.args[1:] if function else node.args)
        kept = [k.value for k in node.keywords if k.arg == "keepdim"] + positional[1:2]  # `y.sum(0, True)`
        if not any(not (isinstance(k, ast.Constant) and not k.value) for k in kept):
            continue
        dims = [k.value for k in node.keywords if k.arg in ("dim", "axis")] or positional[:1]
        if len(dims) == 1 and isinstance(dims[0], ast.Tuple | ast.List):
            dims = list(dims[0].elts)
        whole = not dims and (len(node.args) == (1 if function else 0))
        if whole or any(isinstance(d, ast.Constant) and d.value == 0 for d in dims):
            return f"`{ast.unparse(node)[:40]}`"
    return None


def _check_calls(loop: ast.For, callees: Callees) -> None:
    """Every call in the loop body but the accumulations (`out.index_add_(...)` statements, read by
    `_check_body`) acts only through its value (`row_maps.effect_of`): checked last, where the loop's
    other constructs passed, so a construct stopping the proof first is the one named."""
    bound = {n.id for stmt in ast.walk(loop) if isinstance(stmt, ast.Assign) for t in stmt.targets for n in ast.walk(t)
             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    accumulations = {id(stmt.value) for stmt in ast.walk(loop) if isinstance(stmt, ast.Expr)
                     and (call_name(stmt.value) in _ACCUMULATORS or _in_place_on(stmt.value) in bound)}
    acting = acting_call(loop.body, accumulations, callees)
    if acting is not None:
        call, found = acting
        raise NotAdaptable(f"line {call.lineno}: the call `{ast.unparse(call)[:50]}` in the loop body goes "
                           f"through {found}, which may act for an expert no token chose")


# In-place elementwise methods: they change the values of their tensor where it has elements, nothing else
# (not its storage, shape or other tensors: `set_`, `resize_`, `scatter_` and the like are not among them)
_ELEMENTWISE_IN_PLACE = frozenset({"mul_", "div_", "add_", "sub_", "neg_", "abs_", "pow_", "sqrt_", "rsqrt_", "exp_",
                                   "sigmoid_", "tanh_", "relu_", "clamp_", "clamp_min_", "clamp_max_", "nan_to_num_"})


def _in_place_on(call: ast.expr) -> str | None:
    """N of `N.op_(...)`, an in-place elementwise tensor method called on a name."""
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
            and call.func.attr in _ELEMENTWISE_IN_PLACE):
        return call.func.value.id
    return None


def _fresh_at_rows(value: ast.expr, rows: dict[str, int], fresh: set[str], callees: Callees | None) -> bool:
    """`value` is a new tensor with no element where the rows are empty: a gather at the rows
    (`x.index_select(0, rows)`, `x[rows]`, `x[rows, slot]`: copies), or an expert called on such (a module,
    taken to map rows to rows)."""
    if isinstance(value, ast.Subscript) and isinstance(value.ctx, ast.Load):
        first = value.slice.elts[0] if isinstance(value.slice, ast.Tuple) and value.slice.elts else value.slice
        return isinstance(first, ast.Name) and first.id in rows
    if call_name(value) == "index_select" and isinstance(value.func, ast.Attribute) and len(value.args) == 2:
        torch_function = isinstance(value.func.value, ast.Name) and value.func.value.id == "torch"
        dim, index = (value.args[0], value.args[1]) if not torch_function else (None, None)
        return isinstance(dim, ast.Constant) and dim.value == 0 and isinstance(index, ast.Name) and index.id in rows
    if isinstance(value, ast.Call) and callees is not None and callees.an_expert(value.func):
        return bool(value.args) and not value.keywords and all(
            (isinstance(a, ast.Name) and a.id in fresh) or _fresh_at_rows(a, rows, fresh, None) for a in value.args)
    return False


def _torch_context(expr: ast.expr, callees: Callees | None) -> bool:
    """`expr` makes one of torch's context managers (`torch.no_grad()`, `torch.autocast(...)`,
    `record_function(...)`): grad mode, autocast or a profiler range, nothing the output or the module sees."""
    if not isinstance(expr, ast.Call):
        return False
    made = callees.resolved(expr.func) if callees is not None else None
    return isinstance(made, type) and (made.__module__ or "").split(".")[0] == "torch"


def _cut_rows(stmt: ast.stmt, rows: dict[str, int]) -> str | None:
    """N for `N = R[:c]` or `N = R[:c] if R.numel() > c else R` (a capacity cut), R selected rows."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
        return None
    value = stmt.value
    cut = capacity_cut(value)
    if cut is not None:
        return stmt.targets[0].id if cut[0] in rows else None
    if (isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in rows
            and isinstance(value.slice, ast.Slice) and value.slice.step is None):
        return stmt.targets[0].id
    return None


def _added_as_a_store(stmt: ast.stmt) -> ast.AugAssign | None:
    """`A[I] = A[I] + v` (or `v + A[I]`) read as the accumulation it is, `A[I] += v`: the same values
    stored at the same entries (and nothing stored where I selects nothing)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript)
            and isinstance(stmt.value, ast.BinOp) and isinstance(stmt.value.op, ast.Add)):
        return None
    target, value = stmt.targets[0], stmt.value
    written = ast.unparse(target)
    for same, other in ((value.left, value.right), (value.right, value.left)):
        if isinstance(same, ast.Subscript) and ast.unparse(same) == written:
            return ast.copy_location(ast.AugAssign(target=target, op=ast.Add(), value=other), stmt)
    return None


def _index_expression(acc) -> ast.expr | None:
    """The index an accumulation statement (`_check_accumulation`'s forms) adds at, as written."""
    if isinstance(acc, ast.AugAssign):
        return acc.target.slice
    if acc.func.attr == "index_add_":
        return acc.args[1] if len(acc.args) > 1 else next((k.value for k in acc.keywords if k.arg == "index"), None)
    indices = acc.args[0] if acc.args else None
    return indices.elts[0] if isinstance(indices, ast.Tuple | ast.List) and len(indices.elts) == 1 else None


def _accumulation_index(acc) -> str | None:
    """The name of the rows an accumulation statement adds at, or `A[M]` for rows gathered at a mask in
    the statement itself (`out[tok[m]] += y`)."""
    index = _index_expression(acc)
    if isinstance(index, ast.Subscript) and isinstance(index.value, ast.Name) and isinstance(index.slice, ast.Name):
        return ast.unparse(index)
    return index.id if isinstance(index, ast.Name) else None


def _check_accumulation(acc, rows: dict[str, int], bound: set[str]) -> int:
    """The line that bound the accumulation's rows, when it is one accumulation into an outer tensor."""
    line = acc.lineno
    if isinstance(acc, ast.AugAssign):
        target = acc.target.value
        if not isinstance(acc.op, ast.Add):
            raise NotAdaptable(f"line {line}: the accumulation is not `+=`")
    else:
        target = acc.func.value
        if acc.func.attr == "index_add_":
            dim = acc.args[0] if acc.args else next((k.value for k in acc.keywords if k.arg == "dim"), None)
            if not (isinstance(dim, ast.Constant) and dim.value == 0):
                raise NotAdaptable(f"line {line}: index_add_ along another dim than 0")
        else:  # index_put_((rows,), values, accumulate=True)
            accumulate = next((k.value for k in acc.keywords if k.arg == "accumulate"), None)
            if len(acc.args) >= 3:
                accumulate = acc.args[2]
            if not (isinstance(accumulate, ast.Constant) and accumulate.value is True):
                raise NotAdaptable(f"line {line}: index_put_ without accumulate=True")
    if not isinstance(target, ast.Name) or target.id in bound:
        raise NotAdaptable(f"line {line}: the accumulator is not a tensor defined before the loop")
    index = _accumulation_index(acc)
    if index not in rows:
        raise NotAdaptable(
            f"line {line}: the accumulated rows are not the non-zero entries of the expert's mask row"
        )
    return rows[index]


def _not_read_after(loop: ast.For, var: str, fn_def: ast.FunctionDef) -> None:
    """The loop variable (or the expert's number it is read into) is read only inside the loop, nested
    functions and lambdas included: after a loop that now runs over every expert it would hold the last
    expert's number, not the last one the original visited."""
    inside = {id(n) for n in ast.walk(loop)}
    for node in ast.walk(fn_def):
        if id(node) not in inside and isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id == var:
            raise NotAdaptable(f"line {node.lineno}: the loop variable {var} is read outside the loop")


def _check_locals(loop: ast.For, bound: set[str], fn_def: ast.FunctionDef) -> None:
    """Names bound in the body are bound before use in each iteration and not read after the loop
    (reads in the other arm of an `if` that holds the loop never see the loop's bindings)."""
    inside = {id(n) for n in ast.walk(loop)} | _other_arms(fn_def, loop)
    for node in walk_function(fn_def):
        if id(node) in inside:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in bound:
            raise NotAdaptable(f"line {node.lineno}: {node.id}, bound in the loop body, is read outside the loop")

    def read_here(node: ast.AST, seen: set[str], line: int) -> None:
        loads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        carried = (loads & bound) - seen
        if carried:
            raise NotAdaptable(f"line {line}: {sorted(carried)[0]} is read before the loop body binds it")

    def check(statements, seen: set[str]) -> set[str]:
        for stmt in statements:
            if is_chunk_choice(stmt):  # the else arm is the loop the first arm runs once
                read_here(stmt.test, seen, stmt.lineno)
                seen = check(stmt.body, seen)
            elif isinstance(stmt, ast.With):
                seen = check(stmt.body, seen)
            elif isinstance(stmt, ast.If):  # a checked guard, skip or index branch: its test reads too
                read_here(stmt.test, seen, stmt.lineno)
                after = check(stmt.body, set(seen))
                # an arm that ends the iteration binds nothing for what follows; the other arm's does
                ends = bool(stmt.body) and isinstance(stmt.body[-1], ast.Continue)
                seen = check(stmt.orelse, set(seen)) if ends else (
                    after & check(stmt.orelse, set(seen)) if stmt.orelse else after)
            else:
                read_here(stmt, seen, stmt.lineno)
                if isinstance(stmt, ast.Assign | ast.AnnAssign):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    # a store into a tensor (`T[M] = v`) binds no name
                    seen = seen | {n for t in targets if not isinstance(t, ast.Subscript) for n in stored_names(t)}
        return seen

    check(loop.body, set())


def _other_arms(fn_def: ast.FunctionDef, loop: ast.For) -> set[int]:
    """ids of the nodes in the arm of each enclosing `if` that the loop is not in."""
    found: set[int] = set()
    for node in walk_function(fn_def):
        if isinstance(node, ast.If):
            for arm, other in ((node.body, node.orelse), (node.orelse, node.body)):
                if any(loop is n for stmt in arm for n in ast.walk(stmt)):
                    found.update(id(n) for stmt in other for n in ast.walk(stmt))
    return found


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the traced copy of a function changes: hit loops, emptiness guards, shape capture."""

    hit_loops: list[HitLoop]
    guards: list[int]  # lines of `if rows.numel() > 0:` guards whose body runs unconditionally
    captures_shapes: bool  # some loop selects tokens with torch.where / nonzero
    captures_scalars: bool = False  # per-expert counts are read as Python numbers (`.tolist()`)
    kept_guards: tuple[str, ...] = ()  # why guards of loops over the counts stay
    count_loops: tuple[CountLoop, ...] = ()  # loops over the counts whose guard goes
    calls: dict = dataclasses.field(default_factory=dict)  # module functions cutting at offsets: their copies
    list_indices: tuple[ListIndex, ...] = ()  # `.tolist()` of selected rows read only as indices (host_reads)
    selecting: tuple[int, ...] = ()  # lines of the loops that select tokens (shapes captured around them)
    dropped: tuple[int, ...] = ()  # lines of bindings read only by removed guards (host-read counts)
    cuts: tuple[int, ...] = ()  # lines of `A[:c] if A.numel() > c else A` in token-selecting loops (host_reads)
    fixed_counts: tuple[FixedCounts, ...] = ()  # bincounts an offset loop reads, counted into one bin per expert
    # {attribute: (function, its traced copy)}: `self.attribute(...)` calls a module function held there
    held: dict = dataclasses.field(default_factory=dict)
    present_loops: tuple[PresentLoop, ...] = ()  # loops over `ids.unique()` that run over every expert
    # parameters whose `.tolist()` sizes a split: numbers are captured only where they have a fixed length
    static_lengths: tuple[str, ...] = ()
    size_lists: frozenset[str] = frozenset()  # host-read lists that size a split: stated >= 0 (host_reads)
    chunk_loops: tuple[int, ...] = ()  # lines of loops over chunks of an expert's rows, run as one (chunk_loops)

    def changes_anything(self) -> bool:
        return bool(
            self.hit_loops or self.guards or self.captures_shapes or self.captures_scalars or self.calls
            or self.list_indices or self.dropped or self.cuts or self.fixed_counts or self.held or self.present_loops
            or self.chunk_loops
        )


def analyse(fn, owner: type | None = None) -> tuple[ast.FunctionDef, str, Plan]:
    """Every expert loop of `fn`: hit loops proved equivalent to loops over all experts, emptiness
    guards proved removable, and whether data-dependent shapes must be captured.

    Raises NotAdaptable naming the first construct that stops the proof of a hit loop (a loop over all
    experts whose guard cannot be proved removable keeps it, and its graph break). Guards are
    `if rows.numel() > 0:` around the work and `if rows.shape[0] == 0: continue` before it.
    """
    fn_def, filename = function_source(fn)
    _column_hits_as_rows(fn_def)
    _hit_lists_as_rows(fn_def)
    counted_runs_as_counts(fn_def, _HELPERS)
    link_parents(fn_def)
    assignments = bindings(fn_def)
    namespace = namespace_of(fn)
    callees = Callees(fn_def, namespace, owner, effects=True)  # what the calls in an expert loop may do
    chunked = _chunk_loops_as_one(fn_def, callees)
    if chunked:
        link_parents(fn_def)
        assignments = bindings(fn_def)
    loads = [n for n in walk_function(fn_def) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    loops, guards, captures, kept, count_loops, lists, selecting, fixed = [], [], False, [], [], [], [], []
    present: list[PresentLoop] = []
    pieces: dict[str, str] = {}  # names of pieces of rows split at host counts -> the counts
    selected_anywhere = {n for stmt in walk_function(fn_def) for n in _rows_names(stmt, None, "")}
    boolean = _boolean_names(fn_def)
    for node in walk_function(fn_def):
        if not isinstance(node, ast.For):
            continue
        if _selects_tokens(node, boolean):
            selected = {n for stmt in node.body for n in _rows_names(stmt, None, "")}
            lists.extend(list_indices(node, selected, fn_def))
        try:
            counted = count_loop(node, assignments, fn_def, namespace, owner)
            if counted is None and (over_offsets := offset_loop(node, assignments, fn_def)) is not None:
                counted = over_offsets[0]
                fixed.extend(over_offsets[1:2] if over_offsets[1] is not None else [])
            if counted is not None:
                count_loops.append(counted)
                guards.append(counted.guard)
        except NotAdaptable as exc:
            kept.append(f"the `if` that skips an expert with no rows is kept (a graph break): {exc}")
            log.info("guard of the loop over the counts kept: %s", exc)
        selects = _selects_tokens(node, boolean)
        captures = captures or selects
        if selects:
            selecting.append(node.lineno)
        zipped = split_pieces(node, assignments)
        if zipped is not None:  # rows split at host counts, zipped with the experts (Arctic)
            for sizes in dict.fromkeys(zipped.pieces.values()):
                counted_into = split_counts(sizes, assignments)
                fixed.extend([counted_into] if counted_into is not None and counted_into not in fixed else [])
            pieces.update(zipped.pieces)
            lists.extend(list_indices(node, set(zipped.pieces), fn_def))
            if any(isinstance(s, ast.If) for s in node.body):
                try:
                    removable = _check_body(node, "", None, fn_def, _piece_rows(zipped), callees=callees)[0]
                    _check_calls(node, callees)
                    guards.extend(removable)
                except NotAdaptable as exc:
                    kept.append(f"the `if` that skips an expert with no rows is kept (a graph break): {exc}")
            continue
        if selects and (sequence := present_sequence(node, assignments, fn_def)) is not None:
            ids, bound_at = sequence  # `for e in ids.unique().tolist():`, or over `u = torch.unique(ids)`
            alias = _element_alias(node.body[0], node.target.id) if node.body else None
            loop = present_loop(node, ids, alias, bound_at)
            removable = _check_body(node, node.target.id, None, fn_def, present_ids=ids, callees=callees)[0]
            for name in {node.target.id, loop.var}:
                _not_read_after(node, name, fn_def)
            _check_calls(node, callees)
            guards.extend(removable)
            present.append(loop)
            continue
        hit = node.iter.value if _is_full_slice(node.iter) else node.iter
        bound = assignments.get(hit.id, []) if isinstance(hit, ast.Name) else []
        found = _hit_operand(bound[0].value) if len(bound) == 1 and isinstance(bound[0], ast.Assign) else None
        operand = found[0] if found is not None else None
        if operand is None:
            index = loop_index(node)
            if selects and index is not None and any(isinstance(s, ast.If) for s in node.body):
                try:
                    removable = _check_body(node, index, None, fn_def, callees=callees)[0]
                    _check_calls(node, callees)
                    guards.extend(removable)
                except NotAdaptable as exc:  # named in the report where the method broke the graph
                    kept.append(f"the loop over the experts keeps its `if` as written: {exc}")
                    log.info("expert loop guard kept: %s", exc)
                    if _tests_a_value_of_the_body(node):  # under captured shapes dynamo would raise there
                        selecting.remove(node.lineno)
            continue
        if not isinstance(node.target, ast.Name) or node.orelse:
            raise NotAdaptable(f"line {node.lineno}: the loop target is not a single name, or has an else")
        if sum(1 for n in loads if n.id == hit.id) != 1:
            raise NotAdaptable(f"line {node.lineno}: {hit.id} is used outside the loop")
        mask, dims, gated = _hit_test_mask(operand, assignments, _changed_in_place(fn_def))
        if gated and not _read_only_at_the_row(node, mask):
            raise NotAdaptable(f"line {node.lineno}: `{mask}.sum(...) > 0` proves a hit only for a non-negative "
                               f"mask, {mask} is not built by one_hot, and the loop reads it other than as "
                               f"{mask}[{node.target.id}]")
        if any(bound[0].lineno < b.lineno < node.lineno for b in assignments.get(mask, [])) or any(
                bound[0].lineno < getattr(n, "lineno", 0) < node.lineno and changes_in_place(n, mask)
                for n in walk_function(fn_def)):
            raise NotAdaptable(f"line {node.lineno}: {mask} is bound again between the hit test and the loop, so "
                               "the rows the loop selects are not those the hit test tested")
        _formatted_numbers_as_alias(node)
        removable, skips = _check_body(node, node.target.id, mask, fn_def, callees=callees,
                                       boolean_mask=mask in boolean)
        _not_read_after(node, node.target.id, fn_def)
        alias = _element_alias(node.body[0], node.target.id) if node.body else None
        if alias is not None:
            _not_read_after(node, alias, fn_def)
        if alias is None:
            indexed, guarded = _indexed_containers(node, node.target.id), ()
        else:  # every container is checked row by row (rows_to_visit bounds nothing)
            indexed, guarded = (), _guarded_containers(node, alias)
        _check_calls(node, callees)
        guards.extend(removable)
        loops.append(HitLoop(node.lineno, node.target.id, hit.id, mask, dims, tuple(skips), indexed, alias,
                             guarded, gated))
    calls = adapted_calls(fn)  # cuts at offsets: their bounds are read as numbers
    returned = counts_returned(fn, fn_def, assignments)
    scalars = (bool(calls) or bool(count_loops) or bool(pieces) or splits_by_host_sizes(fn_def, assignments)
               or reads_counts_as_numbers(fn_def, assignments, returned))
    captures = captures and bool(selecting)
    comprehended = [n for n in walk_function(fn_def) if isinstance(n, ast.ListComp | ast.GeneratorExp)
                    and _selects_tokens(_as_loop(n), boolean)]
    if comprehended:  # `[eq(routes, i).nonzero() for i in range(E)]`: the shapes are captured as in a loop
        captures = True
        selecting.extend(n.lineno for n in comprehended)
    cuts = tuple(line for node in walk_function(fn_def) if isinstance(node, ast.For) and _selects_tokens(node, boolean)
                 for line in capacity_cuts(node))
    if loops or guards or captures or scalars or count_loops:  # a method adapted anyway: its no-op guards go too
        guards.extend(line for line in _scatter_guards(fn_def, assignments) if line not in guards)
    plan = Plan(
        loops, guards, captures, scalars, tuple(kept), tuple(count_loops), {**adapted_one_hot_calls(fn), **calls},
        tuple(lists), tuple(selecting),
        (*_read_only_by(fn_def, set(guards)), *(p.bound_at for p in present if p.bound_at is not None)),
        cuts, tuple(fixed), present_loops=tuple(present),
        static_lengths=split_sizes_of_parameters(fn_def, assignments) if scalars else (),
        size_lists=split_size_lists(fn_def, assignments) if scalars else frozenset(),
        chunk_loops=tuple(chunked),
    )
    if plan.captures_shapes or plan.captures_scalars:
        lengths = data_length_names(fn_def, selected_anywhere | set(pieces))
        check_length_reads(fn_def, lengths, _handled_reads(fn_def, plan))
    return fn_def, filename, plan


def _tests_a_value_of_the_body(loop: ast.For) -> bool:
    """Some `if` of the loop body tests the selected rows or a value computed from them (`if len(rows) % 2:
    continue`): data, on which dynamo raises rather than breaks the graph once data-dependent shapes are
    captured, so the loop keeping it is traced as written. Tests of other names (`if lora is not None:`)
    do not count."""
    data = {n for stmt in ast.walk(loop) if isinstance(stmt, ast.stmt) for n in _rows_names(stmt, None, "")}
    assigns = [stmt for stmt in ast.walk(loop) if isinstance(stmt, ast.Assign | ast.AugAssign | ast.AnnAssign)]
    while True:  # names bound from the rows, directly or through names bound so
        grown = data | {n.id for stmt in assigns if stmt.value is not None and names_read(stmt.value) & data
                        for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                        for n in ast.walk(t) if isinstance(n, ast.Name)}
        if grown == data:
            break
        data = grown
    return any(isinstance(n, ast.If | ast.IfExp | ast.While) and names_read(n.test) & data
               for stmt in loop.body for n in ast.walk(stmt))


def _chunk_loops_as_one(fn_def: ast.FunctionDef, callees: Callees) -> list[int]:
    """Loops over chunks of an expert's rows, replaced in place by their body run once over all the rows
    where `chunk_loops` and the expert-loop proof show that exact; the lines of those replaced. A chunk loop
    that is not shown so stays, and the reason is logged (the loop around it is then not adapted)."""
    assignments = bindings(fn_def)
    replaced = []
    for parent in list(walk_function(fn_def)):
        for field in ("body", "orelse"):
            statements = getattr(parent, field, None)
            if not isinstance(statements, list):
                continue
            for stmt in list(statements):
                chunk = chunk_loop(stmt, assignments) if isinstance(stmt, ast.For) else None
                if chunk is None:
                    continue
                try:
                    _prove_chunk_loop(chunk, fn_def, callees)
                except NotAdaptable as exc:
                    log.info("chunk loop kept: %s", exc)
                    continue
                inline(chunk, statements)
                replaced.append(chunk.loop.lineno)
    return replaced


def _prove_chunk_loop(chunk: ChunkLoop, fn_def: ast.FunctionDef, callees: Callees) -> None:
    """The loop's only effect is one accumulation at a chunk of the rows (none for no rows), and what its
    `torch.where` read can be evaluated again for its size (`chunk_loops` says why that is enough)."""
    check_slices(chunk)
    check_operand(chunk, fn_def)
    _check_body(chunk.loop, "", None, fn_def, dict.fromkeys(chunk.rows, chunk.bound_at), callees=callees)
    _check_calls(chunk.loop, callees)


def _handled_reads(fn_def: ast.FunctionDef, plan: Plan) -> set[int]:
    """ids of the `.tolist()` calls the traced copy does without (list indices, dropped bindings)."""
    lines = {item.line for item in plan.list_indices if item.at is None}
    handled = set()
    for node in walk_function(fn_def):
        if isinstance(node, ast.Assign) and node.lineno in lines:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            handled.update(id(v) for v in values)
        if isinstance(node, ast.Assign) and node.lineno in plan.dropped:
            handled.update(id(n) for n in ast.walk(node.value))
    inline = {item.at for item in plan.list_indices if item.at is not None}
    for node in walk_function(fn_def):
        if isinstance(node, ast.Call) and span(node) in inline:
            handled.add(id(node))
    fixed = {f.at for f in plan.fixed_counts}  # counted into one bin per expert: a fixed length
    for node in walk_function(fn_def):
        if call_name(node) == "tolist" and isinstance(node.func, ast.Attribute):
            receiver = strip_methods(node.func.value, {"cpu", "numpy"})
            if span(receiver) in fixed:
                handled.add(id(node))
    return handled


def _read_only_by(fn_def: ast.FunctionDef, guards: set[int]) -> tuple[int, ...]:
    """Lines of `name = <bincount ... .tolist()>` bindings whose name is read only in the tests of the
    removed guards: once the guards go, the host read that made the name goes too."""
    if not guards:
        return ()
    in_guards = {id(n) for node in walk_function(fn_def) if isinstance(node, ast.If) and node.lineno in guards
                 for n in ast.walk(node.test)}
    dropped = []
    for node in walk_function(fn_def):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        if call_name(strip_methods(node.value, _FLATTENING)) != "bincount":
            continue
        reads = [n for n in walk_function(fn_def)
                 if isinstance(n, ast.Name) and n.id == node.targets[0].id and isinstance(n.ctx, ast.Load)]
        if reads and all(id(n) in in_guards for n in reads):
            dropped.append(node.lineno)
    return tuple(dropped)


def _selects_tokens(loop: ast.For, boolean: frozenset[str] = frozenset()) -> bool:
    """The loop selects the tokens of its expert: `torch.where(M)` (one argument) or a `nonzero` of M,
    where M compares with or is indexed by the loop variable (`ids == e`, `mask[e]`, `ids == start + e`),
    directly or through names bound in the loop, or a boolean-mask index `x[M]` with M boolean by
    construction (a comparison, `.bool()`, `.any()`, or, in a `range` loop or one enumerating the layer's
    experts, a lookup `mask[e]` / `mask[:, e]` in a name `boolean` holds: the function binds it only to
    booleans), or an expert's column of a token-major table compared with a constant (`gates[:, e] > 0`).
    Loops that select rows by anything else (cluster bounds, padding masks) are not expert loops and are
    left alone."""
    values: dict[str, list[ast.AST]] = {}
    for stmt in ast.walk(loop):
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        values.setdefault(name.id, []).append(stmt.value)
    varying = _index_variables(loop)
    zipped = _zipped_with_modules(loop)
    # `for mask, expert in zip(masks, self.experts)`: each zipped element is the expert's row, `masks[e]`
    masks: set[str] = set(zipped)  # names holding one expert's mask, a lookup `mask[e]` included
    compared: set[str] = {name for name, source in zipped.items() if source in boolean}  # comparison, `.bool()`
    weighted: set[str] = set()  # values zero off one expert's entries: `((ids == e) * w).sum(-1)`
    if call_name(loop.iter) != "range" and not _enumerates_modules(loop):
        boolean = frozenset()  # `mask[i]` over `enumerate(batch)` picks a sequence's tokens, not an expert's
    while True:  # names whose value depends on the loop variable, and names holding such masks
        grown_varying = varying | {k for k, vs in values.items() if any(_mentions(v, varying) for v in vs)}
        grown_masks = masks | {k for k, vs in values.items() if any(_is_expert_mask(v, grown_varying, masks) for v in vs)}
        grown_weighted = weighted | {k for k, vs in values.items()
                                     if any(_zero_off_the_expert(v, grown_varying, weighted) for v in vs)}
        grown_compared = compared | {
            k for k, vs in values.items()
            if any(_is_expert_mask(v, grown_varying, compared, lookups=False, boolean=boolean)
                   or _compares_a_masked_value(v, grown_varying, grown_weighted) for v in vs)
        }
        if (grown_varying, grown_masks, grown_compared, grown_weighted) == (varying, masks, compared, weighted):
            break
        varying, masks, compared, weighted = grown_varying, grown_masks, grown_compared, grown_weighted
    for inner in ast.walk(loop):
        operand = _selection_operand(inner)
        if operand is None:
            continue
        if _compares_a_masked_value(operand, varying, weighted):
            return True
        if isinstance(inner, ast.Subscript):
            # `x[M]` selects by a mask only where M is boolean: `table[key[e]]` is a lookup, not a selection
            if _is_expert_mask(operand, varying, compared, lookups=False, boolean=boolean):
                return True
        elif _is_expert_mask(operand, varying, masks):
            return True
    return False


def _compares_a_masked_value(expr: ast.AST, varying: set[str], weighted: set[str]) -> bool:
    """`w_e > 0` for a value zero off one expert's entries (`w_e = ((ids == e) * w).sum(-1)`): the
    tokens of that expert with a weight that passes a fixed threshold."""
    compared = _compared_with_a_number(strip_methods(expr, _MASK_VIEWS))
    return compared is not None and _zero_off_the_expert(compared, varying, weighted)


def _zero_off_the_expert(expr: ast.AST, varying: set[str], weighted: set[str]) -> bool:
    """An equality with the expert index (`ids == e`), a product with one, or a sum of such a product
    (`((ids == e) * w).sum(-1)`), or a name holding one: zero wherever the token did not choose the
    expert. A lookup `scores[b]` is not one (a row of anything)."""
    expr = strip_methods(expr, _MASK_VIEWS)
    if isinstance(expr, ast.Name):
        return expr.id in weighted
    if _equals_the_index(expr, varying):
        return True
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
        return any(_zero_off_the_expert(side, varying, weighted) for side in (expr.left, expr.right))
    if call_name(expr) == "sum" and isinstance(expr.func, ast.Attribute) and (expr.args or expr.keywords):
        return _zero_off_the_expert(expr.func.value, varying, weighted)
    return False


def _zipped_with_modules(loop: ast.For) -> dict[str, str]:
    """{target: zipped name} for the names a `zip(...)` loop binds next to a module container of the
    layer (`for mask, expert in zip(masks, self.experts)`, a slice of it included): each is the row of its
    tensor that goes with one expert. Empty for other loops (`zip` of per-sequence data binds no expert)."""
    if call_name(loop.iter) != "zip" or not isinstance(loop.target, ast.Tuple):
        return {}
    pairs = list(zip(loop.target.elts, loop.iter.args, strict=False))
    if len(pairs) != len(loop.iter.args) or not any(_is_self_attribute(arg) for _, arg in pairs):
        return {}
    return {target.id: source.id for target, source in pairs
            if isinstance(target, ast.Name) and isinstance(source, ast.Name)}


def _enumerates_modules(loop: ast.For) -> bool:
    """`for i, expert in enumerate(self.experts)` (`.values()` of it, or a slice, included): `i` numbers
    the layer's experts, so a lookup `mask[:, i]` in a boolean table is one expert's tokens, as in a
    `range` loop."""
    if call_name(loop.iter) != "enumerate" or len(loop.iter.args) != 1 or loop.iter.keywords:
        return False
    container = loop.iter.args[0]
    if call_name(container) == "values" and isinstance(container.func, ast.Attribute) and not container.args:
        container = container.func.value
    return _is_self_attribute(container)


def _is_self_attribute(expr: ast.AST) -> bool:
    """`self.experts` or a slice of it (`self.experts[lo:hi]`)."""
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice):
        expr = expr.value
    return isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self"


def _as_loop(comprehension: ast.ListComp | ast.GeneratorExp) -> ast.For:
    """A one-generator comprehension read as the loop it spells (`[f(i) for i in it]`)."""
    generator = comprehension.generators[0]
    return ast.For(target=generator.target, iter=generator.iter, body=[ast.Expr(comprehension.elt)], orelse=[],
                   lineno=comprehension.lineno)


def _index_variables(loop: ast.For) -> set[str]:
    """Names that step through expert indices: `e` of `for e in range(E)` / `for e in hit`, `i` of
    `for i, x in enumerate(...)`; none for `zip(...)` (per-sequence data, not experts)."""
    target, iterated = loop.target, loop.iter
    name = call_name(iterated)
    if name == "zip":
        return set()
    if name == "enumerate" and isinstance(target, ast.Tuple) and target.elts:
        target = target.elts[0]
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _selection_operand(node: ast.AST) -> ast.AST | None:
    """M for `torch.where(M)`, `M.nonzero(...)`, `torch.nonzero(M, ...)` and a boolean-mask index
    (`x[M]`, `out[M] = ...`, `probs[M, e]`: a nonzero underneath)."""
    if isinstance(node, ast.Subscript):
        index = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) and node.slice.elts else node.slice
        return None if isinstance(index, ast.Slice) else index
    name = call_name(node)
    if name == "where" and len(node.args) == 1 and not node.keywords:
        return node.args[0]
    if name != "nonzero":
        return None
    receiver = node.func.value if isinstance(node.func, ast.Attribute) else None
    if receiver is not None and not (isinstance(receiver, ast.Name) and receiver.id == "torch"):
        return receiver
    return node.args[0] if node.args else None


def _mentions(expr: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(expr))


_MASK_VIEWS = VIEW_METHODS | {"squeeze", "unsqueeze", "flatten", "bool", "movedim"}


def _is_expert_mask(expr: ast.AST, varying: set[str], masks: set[str], lookups: bool = True,
                    boolean: frozenset[str] = frozenset()) -> bool:
    """`expr` is one expert's mask: an equality with a value that changes with the expert index
    (`ids == e`, `torch.eq(ids, e)`), an indexing by it (`mask[e]`; with `lookups` off, only when cast
    by `.bool()` or when `mask` is in `boolean`), a name holding one, or `&`/`|` with one, through
    view-like methods. With `lookups` off, a cast to another dtype (`(ids == e).long()`) makes it an
    index, not a mask. Range tests (`lo <= t < hi`) pick clusters or spans, not one expert's tokens."""
    cast = _outer_cast(expr)
    if cast is not None and cast != "bool" and not lookups:
        return False
    lookups = lookups or cast == "bool"
    expr = strip_methods(expr, _MASK_VIEWS)
    if isinstance(expr, ast.Name):
        return expr.id in masks
    if _equals_the_index(expr, varying):
        return True
    if isinstance(expr, ast.Compare):
        return _thresholds_an_entry(expr, varying)
    if isinstance(expr, ast.Subscript):
        held = isinstance(expr.value, ast.Name) and expr.value.id in boolean
        return (lookups or held) and _mentions(expr.slice, varying)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitAnd | ast.BitOr):
        return any(_is_expert_mask(side, varying, masks, lookups, boolean) for side in (expr.left, expr.right))
    if isinstance(expr, ast.IfExp):  # `a > 0 if self.signed else a != 0`: a mask whichever arm runs
        return all(_is_expert_mask(arm, varying, masks, lookups, boolean) for arm in (expr.body, expr.orelse))
    if call_name(expr) == "any" and isinstance(expr.func, ast.Attribute) and (expr.args or expr.keywords):
        # `(ids == e).any(dim=-1)`, boolean whatever it reduces: the tokens that chose the expert in any slot
        return _is_expert_mask(expr.func.value, varying, masks, True, boolean)
    return False


def _thresholds_an_entry(test: ast.Compare, varying: set[str]) -> bool:
    """`table[:, e] > 0` (any one comparison with a constant): the tokens whose entry for expert e in a
    token-major table (`[:, e]`, `[..., e]`: every token, one expert's column) passes a fixed threshold,
    one expert's tokens (a dense routing table's non-zero weights). A bound that changes with the index
    (`t >= offsets[e]`) picks a span, and a row `scores[b] > 0` a sequence's tokens: neither is one."""
    entry = _compared_with_a_number(test)
    entry = strip_methods(entry, _MASK_VIEWS) if entry is not None else None
    if not isinstance(entry, ast.Subscript):
        return False
    index = entry.slice.elts if isinstance(entry.slice, ast.Tuple) else [entry.slice]
    every_token = all(isinstance(i, ast.Slice) and i.lower is i.upper is i.step is None
                      or isinstance(i, ast.Constant) and i.value is Ellipsis for i in index[:-1])
    return (len(index) > 1 and every_token and _mentions(index[-1], varying)
            and not _mentions(entry.value, varying))


def _equals_the_index(expr: ast.AST, varying: set[str]) -> bool:
    """`ids == e` / `torch.eq(ids, e)`: an equality with a value that changes with the expert index."""
    if isinstance(expr, ast.Compare):
        return all(isinstance(op, ast.Eq) for op in expr.ops) and _mentions(
            ast.Tuple([expr.left, *expr.comparators]), varying)
    return call_name(expr) == "eq" and _mentions(ast.Tuple(list(expr.args)), varying)


def _compared_with_a_number(test: ast.AST) -> ast.expr | None:
    """X of `X <op> c` or `c <op> X`, one comparison with a number c written in the source."""
    if not (isinstance(test, ast.Compare) and len(test.comparators) == 1):
        return None
    left, right = test.left, test.comparators[0]
    return left if _is_constant(right) else right if _is_constant(left) else None


def _is_constant(expr: ast.AST) -> bool:
    """A number written in the source (`0`, `-1`, `0.5`)."""
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub | ast.UAdd):
        expr = expr.operand
    return isinstance(expr, ast.Constant) and isinstance(expr.value, int | float) and not isinstance(expr.value, bool)


_DTYPE_CASTS = {"bool", "long", "int", "float", "half", "double", "byte", "bfloat16"}
_DTYPE_NAMES = _DTYPE_CASTS | {"int64", "int32", "int16", "int8", "uint8", "float32", "float16", "float64"}


def _outer_cast(expr: ast.AST) -> str | None:
    """The outermost dtype cast among the view-like calls that end `expr` ("bool" for
    `mask[e].bool().squeeze(0)`, "long" for `(ids == e).long()`, `.to(torch.long)` included), or None."""
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in _MASK_VIEWS:
        method = expr.func.attr
        if method in _DTYPE_CASTS:
            return method
        if method == "to":
            named = [a.attr for a in (*expr.args, *(k.value for k in expr.keywords))
                     if isinstance(a, ast.Attribute) and a.attr in _DTYPE_NAMES]
            if named:
                return named[0]
        expr = expr.func.value
    return None


def _boolean_names(fn_def: ast.FunctionDef) -> frozenset[str]:
    """Names every binding of which in `fn_def` is boolean by construction (a comparison, `eq`-like calls,
    `.bool()`, `.any()`/`.all()`, `~`, `&`/`|` of booleans), or whose last binding is, where that binding is
    a statement of the function's own block (every other binding runs before it) and no loop reads the
    name before it (HF Switch's `router_mask = router_mask.bool()`: every loop sees the booleans)."""
    assigned: dict[str, list[ast.AST]] = {}
    own_block = {id(st) for st in fn_def.body}
    for name, statements in bindings(fn_def).items():
        simple = [isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name)
                  for st in statements]
        last = max(statements, key=lambda st: st.lineno)
        if all(simple):
            assigned[name] = [st.value for st in statements]
        if (len(statements) > 1 and simple[statements.index(last)] and id(last) in own_block
                and not _read_in_a_loop_before(fn_def, name, last.lineno)):
            assigned[name] = [last.value]
    found: set[str] = set()
    while True:
        grown = found | {name for name, values in assigned.items() if all(_is_boolean(v, found) for v in values)}
        if grown == found:
            return frozenset(found)
        found = grown


def _read_in_a_loop_before(fn_def: ast.FunctionDef, name: str, line: int) -> bool:
    """Some loop of `fn_def` that starts before `line` reads `name`."""
    return any(isinstance(loop, ast.For | ast.While | ast.comprehension) and getattr(loop, "lineno", 0) < line
               and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(loop))
               for loop in walk_function(fn_def))


_BOOLEAN_CALLS = {"eq", "ne", "lt", "le", "gt", "ge", "isin", "logical_and", "logical_or", "logical_not", "any", "all"}


def _is_boolean(expr: ast.AST, boolean: set[str]) -> bool:
    cast = _outer_cast(expr)
    if cast is not None:
        return cast == "bool"
    expr = strip_methods(expr, _MASK_VIEWS)
    if isinstance(expr, ast.Compare):
        return True
    if isinstance(expr, ast.Name):
        return expr.id in boolean
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Invert):
        return _is_boolean(expr.operand, boolean)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitAnd | ast.BitOr):
        return _is_boolean(expr.left, boolean) and _is_boolean(expr.right, boolean)
    if call_name(expr) in _FACTORIES and any(k.arg == "dtype" and isinstance(k.value, ast.Attribute)
                                             and k.value.attr == "bool" for k in expr.keywords):
        return True  # `torch.zeros(T, E, dtype=torch.bool)`
    if call_name(expr) in _WRITES_KEEP_DTYPE and isinstance(expr.func, ast.Attribute):
        return _is_boolean(expr.func.value, boolean)  # `<bool tensor>.scatter_(1, ids, True)`: still bool
    return call_name(expr) in _BOOLEAN_CALLS


_FACTORIES = {"zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
              "new_ones", "new_full", "new_empty", "tensor", "as_tensor"}
# Methods that write values into a tensor (or a copy of it) of the receiver's dtype
_WRITES_KEEP_DTYPE = {"scatter", "scatter_", "index_fill", "index_fill_", "masked_fill", "masked_fill_", "fill_",
                      "index_put", "index_put_", "clone", "contiguous"}


def _is_full_slice(expr: ast.AST) -> bool:
    return (
        isinstance(expr, ast.Subscript)
        and isinstance(expr.slice, ast.Slice)
        and expr.slice.lower is None
        and expr.slice.upper is None
        and expr.slice.step is None
    )


# ---------------------------------------------------------------------------------------------------
# Rewriting the function


class _Rewrite(ast.NodeTransformer):
    """`H = C.nonzero()` -> `H, all = all_rows(C, M, dims)`; `for v in H:` -> loop over indices."""

    def __init__(self, plan: Plan, this: str | None = None):
        self.this = this  # the method's instance argument
        self.by_hit = {loop.hit: loop for loop in plan.hit_loops}
        self.by_line = {loop.line: loop for loop in plan.hit_loops}
        self.guards = set(plan.guards)
        self.count_loops = {loop.line: loop for loop in plan.count_loops}
        self.calls = set(plan.calls)
        self.selecting = set(plan.selecting)
        self.dropped = set(plan.dropped)
        self.fixed_counts = {f.at: f for f in plan.fixed_counts}
        self.held = set(plan.held)
        self.present_loops = {loop.line: loop for loop in plan.present_loops}

    def visit_Call(self, node: ast.Call):
        fixed = self.fixed_counts.get(span(node))
        if fixed is not None:  # bincount -> one bin per expert (count_loops.offset_loop says why)
            ids = node.func.value if isinstance(node.func, ast.Attribute) and not node.args else node.args[0]
            call = _parse_expr(f"{_HELPERS}.expert_counts(__X__, {fixed.length})")
            call.args[0] = self.generic_visit(ids)
            return ast.copy_location(call, node)
        node = self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in self.calls:  # the copy that cuts at numbers
            node.func = ast.copy_location(_parse_expr(f"{_HELPERS}.call_{node.func.id}"), node.func)
        elif _held_call(node, self.this) in self.held:  # `self.gate(...)` -> `held_gate(self.gate)(...)`
            held = ast.Call(_parse_expr(f"{_HELPERS}.held_{node.func.attr}"), [node.func], [])
            node.func = ast.copy_location(held, node.func)
        return node

    def visit_If(self, node: ast.If):
        if node.lineno in self.guards:  # a proved emptiness guard: its body runs unconditionally
            if len(node.body) == 1 and isinstance(node.body[0], ast.Continue):
                return ast.copy_location(ast.Pass(), node)
            as_written = deepcopy(node)  # before visiting: the visit rewrites the body in place
            body = [stmt for body in (self.visit(s) for s in node.body) for stmt in _as_list(body)]
            if not node.orelse:
                return body
            # `if M.any(): body elif C: other` -> `if C: <as written> else: body`: C is static (dynamo folds
            # it), and where it is false the original ran body, or nothing when M had no non-zero entry
            elif_arm = node.orelse[0]
            kept = ast.If(test=elif_arm.test, body=[as_written], orelse=body)
            return ast.copy_location(kept, node)
        return self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign):
        if node.lineno in self.dropped:  # read only by guards the copy removes
            return ast.copy_location(ast.Pass(), node)
        comprehends = any(isinstance(n, ast.ListComp | ast.GeneratorExp) and n.lineno in self.selecting
                          for n in ast.walk(node.value))
        if comprehends:  # `rows = [eq(ids, e).nonzero() for e in ...]`: shapes captured while it is traced
            return [_statement("capture_dynamic_output_shapes", node), self._visit_assign(node),
                    _statement("stop_capturing_dynamic_output_shapes", node)]
        return self._visit_assign(node)

    def _visit_assign(self, node: ast.Assign):
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and node.targets[0].id in self.by_hit:
            loop = self.by_hit[node.targets[0].id]
            operand, flattened = _hit_operand(node.value)
            helper, gated = ("hit_rows", f", {_TESTED}_{loop.hit}") if loop.gated else ("all_rows", "")
            call = _parse_expr(f"{_HELPERS}.{helper}(__C__, {loop.mask}, {loop.dims!r}, {flattened})")
            call.args[0] = operand
            new = ast.Assign(
                targets=[_parse_expr(f"({loop.hit}, {_ALL}_{loop.hit}{gated})", ctx=ast.Store())], value=call
            )
            return [_statement("capture_dynamic_output_shapes", node), ast.copy_location(new, node)]
        return self.generic_visit(node)

    def visit_For(self, node: ast.For):
        new = self._visit_for(node)
        if node.lineno not in self.selecting:
            return new
        # Data-dependent shapes are captured while the loop is traced, and only then: code before and
        # after it (and what it calls) breaks the graph where it would without hpu_moe. That includes the
        # sequence the loop iterates (`ids.unique().tolist()`, the experts present): evaluated first, as
        # written, it breaks the graph where it would without hpu_moe; captured, its data-dependent length
        # would make dynamo raise where it unrolls the loop.
        hoisted = []
        if isinstance(new, ast.For) and not _static_sequence(new.iter):
            name = f"{_ITERATED}_{node.lineno}"
            hoisted = [ast.copy_location(ast.Assign(targets=[ast.Name(name, ast.Store())], value=new.iter), node)]
            new.iter = ast.copy_location(ast.Name(name, ast.Load()), new.iter)
        return [*hoisted, _statement("capture_dynamic_output_shapes", node), *_as_list(new),
                _statement("stop_capturing_dynamic_output_shapes", node)]

    def _visit_for(self, node: ast.For):
        present = self.present_loops.get(node.lineno)
        if present is not None:  # over the ids present -> over every expert (present_ids says why)
            lengths = ", ".join(f"len({c})" for c in present.containers)
            shortest = lengths if len(present.containers) == 1 else f"min({lengths})"
            node.iter = ast.copy_location(_parse_expr(
                f"range({_HELPERS}.present_experts({present.ids}, {shortest}))"), node.iter)
            if present.alias is not None:  # `for t in u: e = int(t.item())` -> `for e in range(...)`
                node.target = ast.copy_location(ast.Name(present.alias, ast.Store()), node.target)
                node.body = node.body[1:]
            ast.fix_missing_locations(node)
        if node.lineno in self.count_loops:
            count_loop = self.count_loops[node.lineno]
            node = CutAtOffsets(count_loop.bounds, count_loop.fresh, _HELPERS).visit(node)
        loop = self.by_line.get(node.lineno)
        if loop is None:
            return self.generic_visit(node)
        index = f"{_INDEX}_{loop.var}"
        every_row = f"{_ALL}_{loop.hit}"
        visited = [stmt for body in (self.visit(s) for s in node.body) for stmt in _as_list(body)]
        gated = {loop.mask: f"{_TESTED}_{loop.hit}"} if loop.gated else {}
        body = [_Subscripts(loop.var, index, every_row, gated, loop.alias).visit(stmt) for stmt in visited]
        body = [_IndexTests(loop, index).visit(stmt) for stmt in body]
        if loop.alias is not None:  # `A = int(var.item())` -> the loop index, when rows are 0..n-1
            first = body[0]
            first.value = ast.copy_location(ast.IfExp(ast.Name(every_row, ast.Load()), ast.Name(index, ast.Load()),
                                                      first.value), first.value)
            past_end = " or ".join(
                "(" + " and ".join([*(f"{'' if arm else 'not '}({test})" for test, arm in conditions),
                                    f"{_HELPERS}.out_of({source}, {dim}, {key})"]) + ")"
                for conditions, source, dim, key in loop.guarded_indexed)
            if past_end:  # rows at which the body indexes past a container: the original never visits them
                skip = placed(f"if {every_row} and ({past_end}):\n    continue", first)
                body = [first, skip, *body[1:]]
        bind = ast.parse(f"{loop.var} = {loop.hit}[{index}]").body[0]
        sized = ", ".join(f"({source}, {dim})" for source, dim in loop.indexed)
        target = ast.Name(index, ast.Store())
        iterate = _parse_expr(f"range({_HELPERS}.rows_to_visit({loop.hit}, {_ALL}_{loop.hit}, [{sized}]))")
        for new in (bind, target, iterate):  # the new nodes report the loop's own line; the body keeps its lines
            for part in ast.walk(new):
                if isinstance(part, ast.expr | ast.stmt):
                    ast.copy_location(part, node)
        return ast.copy_location(ast.For(target=target, iter=iterate, body=[bind, *body], orelse=[]), node)


_SEQUENCE_BUILTINS = {"range", "enumerate", "zip", "len", "reversed", "min", "max", "int"}


def _static_sequence(expr: ast.AST) -> bool:
    """A loop's sequence made of names, attributes, constants and the builtins that count and pair them
    (`range(self.num_experts)`, `enumerate(self.experts)`, `zip(masks, self.experts)`): no tensor op in it."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _SEQUENCE_BUILTINS):
            return False
        if isinstance(node, ast.Subscript | ast.Lambda | ast.NamedExpr):
            return False
    return True


def _prepend_calls(fn_def: ast.FunctionDef, helpers: tuple[str, ...], gate: tuple[str, ...] = ()) -> None:
    """`<helpers>.<helper>()` for each helper, in order, as the first statements after the docstring; with
    `gate`, under `if` every dim of each of those tensors is a plain int when traced: a length fixed at
    trace time (a `.tolist()` of a data-dependent length cannot be captured, and then breaks the graph as
    written)."""
    at = _docstring_count(fn_def)
    calls = [_statement(helper, fn_def.body[0]) for helper in helpers]
    if gate:
        test = " and ".join(
            f"getattr({name}, 'shape', None) is not None and all(isinstance(d, int) for d in {name}.shape)"
            for name in gate)
        guarded = ast.parse(f"if {test}:\n    pass").body[0]
        guarded.body = calls
        for part in ast.walk(guarded):
            if isinstance(part, ast.expr | ast.stmt) and part not in calls:
                ast.copy_location(part, fn_def.body[0])
        calls = [guarded]
    fn_def.body[at:at] = calls


def _as_list(visited) -> list:
    return visited if isinstance(visited, list) else [visited]


def _statement(helper: str, at: ast.AST) -> ast.stmt:
    """`<helpers>.<helper>()` as a statement, reported at `at`'s line."""
    return placed(f"{_HELPERS}.{helper}()", at)


class _Subscripts(ast.NodeTransformer):
    """`X[var]` -> `pick(X, var, index, all)`: a module list takes the Python int (dynamo needs it)."""

    def __init__(self, var: str, index: str, all_rows: str, gated: dict[str, str] | None = None,
                 alias: str | None = None):
        self.var, self.index, self.all_rows = var, index, all_rows
        self.gated = gated or {}  # {mask: the hit test's flags}: the mask is read gated by them (HitLoop.gated)
        self.alias = alias

    def visit_Subscript(self, node: ast.Subscript):
        node = self.generic_visit(node)
        if (isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name) and node.value.id in self.gated
                and isinstance(node.slice, ast.Name) and node.slice.id in (self.var, self.alias)):
            tested = self.gated[node.value.id]
            call = _parse_expr(f"{_HELPERS}.hit_row({node.value.id}, {tested}, {node.slice.id}, {self.index}, "
                               f"{self.all_rows})")
            return ast.copy_location(call, node)
        if isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Name) and node.slice.id == self.var:
            call = _parse_expr(f"{_HELPERS}.pick(__X__, {self.var}, {self.index}, {self.all_rows})")
            call.args[0] = node.value
            return ast.copy_location(call, node)
        if isinstance(node.slice, ast.Tuple):  # X[rows, var, None]: a 0-dim var indexes as its value
            node.slice.elts = [
                ast.copy_location(
                    _parse_expr(f"{_HELPERS}.scalar_index({self.var}, {self.index}, {self.all_rows})"), element
                )
                if isinstance(element, ast.Name) and element.id == self.var
                else element
                for element in node.slice.elts
            ]
        return node


class _IndexTests(ast.NodeTransformer):
    """In `if <test of var>: continue`, `var` -> `index_value(var, index, all)` (the Python index)."""

    def __init__(self, loop: HitLoop, index: str):
        self.loop, self.index = loop, index

    def visit_If(self, node: ast.If):
        if node.lineno not in self.loop.skips:
            return self.generic_visit(node)
        node.test = _Replace(self.loop.var, f"{_HELPERS}.index_value({{}}, {self.index}, {_ALL}_{self.loop.hit})").visit(
            node.test
        )
        return node


class _Replace(ast.NodeTransformer):
    def __init__(self, name: str, template: str):
        self.name, self.template = name, template

    def visit_Name(self, node: ast.Name):
        if node.id != self.name or not isinstance(node.ctx, ast.Load):
            return node
        return ast.copy_location(_parse_expr(self.template.format(self.name)), node)


def _parse_expr(text: str, ctx=None) -> ast.expr:
    expr = ast.parse(text, mode="eval").body
    if ctx is not None:
        for node in ast.walk(expr):
            if isinstance(node, ast.Name | ast.Tuple):
                node.ctx = ctx
    return expr


def rewrite(fn, fn_def: ast.FunctionDef, filename: str, plan: Plan) -> types.FunctionType:
    """`fn` with each hit loop running over all experts and each proved guard removed; same globals,
    closure, defaults and file. Data-dependent shapes are captured when the copy is traced."""
    new_def = _Rewrite(plan, _instance_name(fn_def)).visit(ReplaceListIndices(list(plan.list_indices)).visit(fn_def))
    if plan.cuts:
        new_def = CutToCapacity(f"{_HELPERS}.cut_to_capacity").visit(new_def)
    new_def = NewTensorOfList(f"{_HELPERS}.tensor_like").visit(new_def)
    new_def = StateSizes(f"{_HELPERS}.sizes_at_least_zero", plan.size_lists).visit(new_def)
    new_def = CutToCount(f"{_HELPERS}.cut_to_count", true_counts(fn_def, bindings(fn_def)), plan.size_lists).visit(new_def)
    # A method that reads per-expert counts as numbers captures data-dependent shapes throughout (its
    # counts feed sorts, masked selects and splits anywhere in it); else only around its expert loops.
    if plan.captures_scalars:
        _prepend_calls(new_def, ("capture_dynamic_output_shapes", "capture_scalar_outputs"), plan.static_lengths)
    new_def.decorator_list = []
    helpers = _helpers_namespace()
    for name, copy in plan.calls.items():
        setattr(helpers, f"call_{name}", copy)
    for attribute, (original, copy) in plan.held.items():
        setattr(helpers, f"held_{attribute}", _held_copy(original, copy))
    return compile_with_helpers(fn, new_def, filename, _HELPERS, helpers)


# ---------------------------------------------------------------------------------------------------
# What the rewritten loop calls


def all_rows(test: torch.Tensor, mask: torch.Tensor, dims: tuple[int, ...], flattened: bool = False):
    """(every row index as nonzero would list it, True), or (test.nonzero(), False) when unproved
    (`test.nonzero().reshape(-1, 1)` for a flattened hit list: every coordinate, one per row, as written).

    The proof needs the hit test to be one flag per leading row of the mask: 1-D, as long as the
    mask's first dim, and reduced over dims that are all the others.
    """
    others = {d % mask.dim() for d in dims} if mask.dim() else set()
    if test.dim() == 1 and test.shape[0] == mask.shape[0] and others == set(range(1, mask.dim())):
        return torch.arange(test.shape[0], device=test.device).unsqueeze(-1), True
    return (test.nonzero().reshape(-1, 1) if flattened else test.nonzero()), False


def hit_rows(test: torch.Tensor, mask: torch.Tensor, dims: tuple[int, ...], flattened: bool = False):
    """`all_rows`, and the test's flags (one per row) where every row is visited, else None: the loop
    reads each row of the mask through `hit_row`."""
    rows, every_row = all_rows(test, mask, dims, flattened)
    return rows, every_row, (test if every_row else None)


def hit_row(mask: torch.Tensor, tested: torch.Tensor | None, row, index: int, every_row: bool):
    """`mask[row]` as the body reads it, zeroed where the hit test rejected the row: a `sum > 0` test over
    a mask that may hold negative entries (or was changed since the test) can reject a row with entries,
    which the original never visits; the copy finds no entry in it. The mask is read when the body reads
    it, the flags when the test ran, as in the original."""
    picked = pick(mask, row, index, every_row) if isinstance(row, torch.Tensor) else mask[row]
    if not every_row or tested is None:
        return picked
    return torch.where(tested[index], picked, picked.new_zeros(()))


def rows_to_visit(hit: torch.Tensor, every_row: bool, indexed) -> int:
    """The rows of `hit` to loop over: with every row, no more than the shortest container the body
    indexes with the row (a longer row is one the original loop could only visit by raising)."""
    rows = hit.shape[0]
    if every_row:
        for container, dim in indexed:
            length = _length(container, dim)
            rows = rows if length is None else min(rows, length)
    return rows


def pick(container, row: torch.Tensor, index: int, every_row: bool):
    """container[row], with the Python int when rows are 0..n-1 and the int selects the same thing: for
    module containers, and for a 0-dim row (indexing with a 0-dim integer tensor is indexing with its
    value; dynamo would read that value from the data)."""
    if every_row and (isinstance(container, torch.nn.Module) or row.dim() == 0):
        return container[index]
    return container[row]


def out_of(container, dim: int, value: int) -> bool:
    """Whether `container[..., value, ...]` (`value` at `dim`) would raise: a key a mapping lacks, or
    past the end of a module list, a sequence or a tensor's dim (False for anything else: as written)."""
    if isinstance(container, dict) and hasattr(type(container), "__missing__"):
        return False  # a defaultdict makes the key: as written
    if isinstance(container, (dict, torch.nn.ModuleDict, torch.nn.ParameterDict)):  # a tuple: dynamo 2.9
        return value not in container
    if not isinstance(value, int):  # a formatted key into a sequence: raises in both, as written
        return False
    length = _length(container, dim)
    return length is not None and value >= length


def _length(container, dim: int) -> int | None:
    if isinstance(container, torch.nn.Module):
        return len(container)
    if isinstance(container, torch.Tensor):
        return container.shape[dim]
    if isinstance(container, (list, tuple)) and dim == 0:
        return len(container)
    return None


def index_value(row: torch.Tensor, index: int, every_row: bool):
    """The Python int equal to the row's one value when rows are 0..n-1 (a static test), else the row."""
    return index if every_row else row


def expert_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """`bincount(ids)` in `experts` bins: one count per expert, a fixed length the trace can iterate
    (the bins past the largest id are zero); an id outside 0..experts-1 raises, as indexing the
    experts with it would."""
    flat = ids.reshape(-1)
    return torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))


def scalar_index(row: torch.Tensor, index: int, every_row: bool):
    """The Python int for a 0-dim row when rows are 0..n-1: the same index, read without the data."""
    return index if every_row and row.dim() == 0 else row


@torch.compiler.assume_constant_result
def _capture_dynamic_output_shapes() -> bool:
    """Let the compile in progress capture ops with data-dependent output shapes (`nonzero`).

    Runs in plain Python while dynamo traces (a trace-time constant). Dynamo fixes the setting in the
    frame's shape environment when tracing starts, so both that environment and dynamo's config flag
    are switched for this compile; the flag is restored when the compile ends.
    """
    return _switch_on_for_this_compile("capture_dynamic_output_shape_ops", "allow_dynamic_output_shape_ops")


@torch.compiler.assume_constant_result
def _capture_scalar_outputs() -> bool:
    """Let the compile in progress keep `.tolist()` / `.item()` values symbolic (unbacked SymInts)."""
    return _switch_on_for_this_compile("capture_scalar_outputs", "allow_scalar_outputs")


def _switch_on_for_this_compile(flag: str, setting: str) -> bool:
    """Dynamo's `flag` and the frame's ShapeEnv `setting` on until the compile in progress ends."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        shape_env = tx.output.shape_env if tx is not None else None
        settings = getattr(shape_env, "settings", None)
        handler = torch._dynamo.callback_handler
    except Exception:  # noqa: BLE001 - another torch's internals: the loop then breaks the graph as written
        return False
    if settings is None or not dataclasses.is_dataclass(settings) or not hasattr(handler, "register_end_callback"):
        return False
    if not hasattr(settings, setting) or not hasattr(torch._dynamo.config, flag):
        return False
    if not getattr(settings, setting):
        shape_env.settings = dataclasses.replace(settings, **{setting: True})
        _SWITCHED_SETTINGS.add(setting)
    config = torch._dynamo.config
    if not getattr(config, flag):
        setattr(config, flag, True)
        _SWITCHED_FLAGS.add(flag)
        _SWITCHED_IN_THIS_COMPILE.add(flag)
        if _restore_switched_flags not in getattr(handler, "end_callbacks", ()):
            handler.register_end_callback(_restore_switched_flags)
    return True


@torch.compiler.assume_constant_result
def _stop_capturing_dynamic_output_shapes() -> bool:
    """Undo `_capture_dynamic_output_shapes` once the loop that needed it is traced (where it switched
    anything on): what follows traces as it would without hpu_moe."""
    return _switch_back("capture_dynamic_output_shape_ops", "allow_dynamic_output_shape_ops")


def _switch_back(flag: str, setting: str) -> bool:
    """Dynamo's `flag` and the frame's ShapeEnv `setting` off again, where this compile switched them on."""
    if setting not in _SWITCHED_SETTINGS:
        return False
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        shape_env = tx.output.shape_env if tx is not None else None
    except Exception:  # noqa: BLE001 - another torch's internals: left on until the compile ends
        return False
    if shape_env is not None and getattr(shape_env.settings, setting, False):
        shape_env.settings = dataclasses.replace(shape_env.settings, **{setting: False})
    _SWITCHED_SETTINGS.discard(setting)
    if flag in _SWITCHED_FLAGS:
        setattr(torch._dynamo.config, flag, False)
        _SWITCHED_FLAGS.discard(flag)
    return True


_SWITCHED_FLAGS: set[str] = set()
_SWITCHED_IN_THIS_COMPILE: set[str] = set()  # every flag switched on while this compile traced, even if off again
_SWITCHED_SETTINGS: set[str] = set()  # ShapeEnv settings switched on in the trace in progress


def run_switches_as_plain_python() -> None:
    """Have dynamo run the switches above as plain Python wherever a frame calling them runs eagerly (a
    frame it gave up on): compiled as frames of their own, they broke on `current_tx` and the report
    showed those breaks, at this file's lines, as the user's. Dynamo's reset() forgets this, so the
    backend asks again before each compile; traced inside a frame, they still run at trace time."""
    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip_code is None:  # another torch: the breaks show, nothing else changes
        return
    for fn in (_capture_dynamic_output_shapes, _capture_scalar_outputs, _stop_capturing_dynamic_output_shapes,
               _switch_on_for_this_compile, _switch_back):
        skip_code(fn.__code__)


def switched_settings_for_this_compile() -> tuple[str, ...]:
    """The dynamo flags an adapted method switched on for the compile in progress (at any point of its
    trace: a loop's capture is switched off again once the loop is traced)."""
    return tuple(sorted(_SWITCHED_IN_THIS_COMPILE))


def _restore_switched_flags(*_args) -> None:
    """End-of-compile callback: switch off what this compile switched on. It stays registered (a
    callback that removed itself while dynamo iterates the list would make it skip the next one)."""
    while _SWITCHED_FLAGS:
        setattr(torch._dynamo.config, _SWITCHED_FLAGS.pop(), False)
    _SWITCHED_IN_THIS_COMPILE.clear()
    _SWITCHED_SETTINGS.clear()  # they lived in the compiled frame's ShapeEnv, gone with it


def _docstring_count(fn_def: ast.FunctionDef) -> int:
    first = fn_def.body[0]
    return int(isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str))


def _helpers_namespace() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        all_rows=all_rows,
        hit_rows=hit_rows,
        hit_row=hit_row,
        pick=pick,
        rows_to_visit=rows_to_visit,
        index_value=index_value,
        cut=cut,
        write=write,
        cut_to_capacity=cut_to_capacity,
        cut_to_count=cut_to_count,
        sizes_at_least_zero=sizes_at_least_zero,
        out_of=out_of,
        tensor_like=tensor_like,
        scalar_index=scalar_index,
        capture_dynamic_output_shapes=_capture_dynamic_output_shapes,
        stop_capturing_dynamic_output_shapes=_stop_capturing_dynamic_output_shapes,
        capture_scalar_outputs=_capture_scalar_outputs,
        expert_counts=expert_counts,
        present_experts=present_experts,
        expert_one_hot=expert_one_hot,
    )


# ---------------------------------------------------------------------------------------------------
# Recognition, cached per class

# Keyed by the function as well: a method replaced on the class after a decision (LongCat-Next patches
# `moe` over a loaded model's class) is decided again, never served the old method's copy.
# Per class, keyed by (method name, function): a copy of a method, or the reason it is left as written.
_DECISIONS = Decisions("expert_loop_decisions")
_KEPT_GUARDS = Decisions("kept_loop_guards")  # adapted methods whose guards stay: (name, function) -> reasons
# Names a method with an expert loop or per-expert counts calls (a cheap filter before parsing it).
_SIGNS = {"nonzero", "where", "tolist", "histc", "argsort", "sort"}


def adaptations_of(cls: type) -> dict[str, types.FunctionType]:
    """{method name: the copy to trace under hpu_moe} for the methods of `cls` with expert loops.

    Reasons for methods left as written are kept for `declined_classes` and the report.
    """
    found = {}
    held = {}
    for klass in cls.__mro__[:-1]:  # functions stored by this class's __init__ or a base's
        held = {**held_functions(klass), **held}
    for name, fn in _methods_resolved(cls).items():
        fn = getattr(fn, "__moe_passes_original__", fn)  # already installed: decide on the original
        inner = _undecorated(fn) if isinstance(fn, types.FunctionType) else None
        if not isinstance(fn, types.FunctionType) or not (
            may_hold_expert_loop(inner or fn) or _calls_adaptable_helper(inner or fn)
            or set(held) & set((inner or fn).__code__.co_names)
        ):
            continue  # cheap filter: no token selection, nothing to adapt
        traced = _decide(cls, name, fn, held)
        if traced is not None:
            found[name] = traced
    for name, fn in _methods_resolved(cls).items() if found else ():
        fn = getattr(fn, "__moe_passes_original__", fn)
        if name not in found and isinstance(fn, types.FunctionType):
            traced = _feeding_copy(cls, name, fn, frozenset(found))
            if traced is not None:
                found[name] = traced
    return found


def _methods_resolved(cls: type) -> dict[str, object]:
    """{name: what `cls.name` resolves to} for the attributes `cls` and its user-defined bases define (not
    nn.Module's or object's): an inherited method is decided for `cls` too, since the proof reads the
    class's attributes (a subclass may override a helper the loop calls)."""
    found: dict[str, object] = {}
    for klass in cls.__mro__:
        if klass is torch.nn.Module or klass is object:
            break
        for name, value in list(vars(klass).items()):
            found.setdefault(name, value)
    return found


_FEEDING = Decisions("feeding_copies")  # per class, keyed by (method name, function)


def _feeding_copy(cls: type, name: str, fn: types.FunctionType, adapted: frozenset[str]) -> types.FunctionType | None:
    """The copy of a method that calls an adapted method of its own instance and gathers at data-dependent
    sizes (TensorRT-LLM's forward: `ids[in_range]`, `torch.where(in_range)`, then `self.run_experts(...)`).

    Those gathers prepare the expert loop's inputs: left to break the graph, they would split the layer
    across graphs. The copy is the method as written, with dynamo's `capture_dynamic_output_shape_ops`
    switched on for the compile from its first statement (the adapted loop switches it off after it).
    None where the method calls no adapted method or gathers nothing at a data-dependent size."""
    key = (name, fn)

    def decide():
        target, rewrap = decorated(fn)
        fn_def, filename = function_source(target)
        this = _instance_name(fn_def)
        if not {_held_call(node, this) for node in walk_function(fn_def)} & adapted or not _gathers_at_data_sizes(fn_def):
            return "nothing to feed"
        new_def = deepcopy(fn_def)
        _prepend_calls(new_def, ("capture_dynamic_output_shapes",))
        new_def.decorator_list = []
        return rewrap(compile_with_helpers(target, new_def, filename, _HELPERS, _helpers_namespace()))

    decisions = _FEEDING.of(cls)
    decision = decided(decisions, key, f"{cls.__module__}.{cls.__qualname__}.{name}", decide,
                       "method feeding an expert loop")
    return decision if isinstance(decision, types.FunctionType) else None


def _gathers_at_data_sizes(fn_def: ast.FunctionDef) -> bool:
    """`fn_def` indexes with a boolean mask (a name bound only to booleans, or a boolean expression) or
    calls one-argument `torch.where`, `nonzero` or `masked_select`: results sized by the data."""
    boolean = _boolean_names(fn_def)
    for node in walk_function(fn_def):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and (
                isinstance(node.slice, ast.Name) and node.slice.id in boolean or _is_boolean(node.slice, boolean)):
            return True
        if call_name(node) == "where" and len(node.args) == 1 or _nonzero_operand(node) is not None or (
                call_name(node) == "masked_select"):
            return True
    return False


def _undecorated(fn: types.FunctionType) -> types.FunctionType:
    """What the cheap filters read of `fn`: the function it runs under its decorators, also where that
    is not taken (`decorated` then names why when the method is decided)."""
    try:
        return decorated(fn)[0]
    except NotAdaptable:
        inner = inspect.unwrap(fn)
        return inner if isinstance(inner, types.FunctionType) else fn


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names `code` uses, its comprehensions' included (their own code objects
    before Python 3.12)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


_LOOP_MASK_OPS = [
    frozenset(dis.opmap[name] for name in names if name in dis.opmap)
    for names in (("FOR_ITER",), ("COMPARE_OP",), ("BINARY_SUBSCR", "STORE_SUBSCR", "BINARY_OP"))
]


def may_hold_expert_loop(fn: types.FunctionType) -> bool:
    """A cheap filter: `fn` names an op that selects tokens or reads counts, or its bytecode loops over
    comparisons and indexing, and its source then shows a loop selecting tokens (read under decorators)."""
    fn = _undecorated(fn)
    names = _names(fn.__code__)
    return bool(_SIGNS & names) or (_masks_in_a_loop(fn.__code__, "bool" in names) and _selects_in_a_loop(fn))


def _masks_in_a_loop(code: types.CodeType, casts_to_bool: bool = False) -> bool:
    """The bytecode loops, compares (or casts to bool: `table.bool()`, then `x[table[:, e]]`) and indexes:
    where a boolean-mask gather (`x[ids == e]`) can be, with no name to show it (3.14 indexes with
    BINARY_OP). Read with `dis` only when it may."""
    ops = set(code.co_code[::2])
    loops, compares, indexes = (bool(ops & wanted) for wanted in _LOOP_MASK_OPS)
    if not (loops and (compares or casts_to_bool) and indexes):
        return False
    return any(i.opname in ("BINARY_SUBSCR", "STORE_SUBSCR") or i.argrepr == "[]" for i in dis.get_instructions(code))


def _selects_in_a_loop(fn: types.FunctionType) -> bool:
    """Some loop of `fn`'s source selects an expert's tokens (read only for methods the bytecode filter
    flags: a loop that indexes with a comparison may be anything, and only expert loops are reported)."""
    try:
        fn_def, _ = function_source(fn)
    except (NotAdaptable, OSError, TypeError, SyntaxError):
        return False
    boolean = _boolean_names(fn_def)
    return any(isinstance(node, ast.For) and _selects_tokens(node, boolean) for node in walk_function(fn_def))


def _calls_adaptable_helper(fn: types.FunctionType) -> bool:
    """`fn` calls, by a global name, a function that computes a cumsum (offsets, maybe to cut at) or
    sizes a one-hot on the host (a cut of it may not need the size)."""
    return any(sums_offsets(callee := fn.__globals__.get(name)) or sizes_one_hot_on_host(callee)
               for name in fn.__code__.co_names)


def _held_copy(original: types.FunctionType, copy: types.FunctionType):
    """What a held call calls: the copy while the attribute still holds `original` (a trace-time test:
    dynamo guards on the attribute), else whatever it holds now."""

    def held(current):
        return copy if current is original else current

    return held


def _held_call(node: ast.AST, this: str | None) -> str | None:
    """`attr` for a call `this.attr(...)`, `this` the method's first argument (its instance)."""
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == this:
        return func.attr
    return None


def _instance_name(fn_def: ast.FunctionDef) -> str | None:
    return fn_def.args.args[0].arg if fn_def.args.args else None


# weak: a class looked at (every class discovery sees, GraphModules' own included) is freed with its last use
_HELD: weakref.WeakKeyDictionary[type, dict[str, tuple[types.FunctionType, types.FunctionType]]] = (
    weakref.WeakKeyDictionary())


def held_functions(cls: type) -> dict[str, tuple[types.FunctionType, types.FunctionType]]:
    """{attribute: (function, traced copy)} for module functions with expert loops that `cls.__init__`
    stores on the instance (`self.gate = gating`, Skywork MoE++'s router), as adapted for hpu_moe."""
    if cls not in _HELD:
        _HELD[cls] = {}
        init = cls.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        functions = {
            name: fn for name in (code.co_names if code else ())
            if isinstance(fn := init.__globals__.get(name), types.FunctionType) and _SIGNS & _names(fn.__code__)
        }
        if functions:
            for attribute, name in _stored_globals(init).items():
                copy = function_copy(functions[name]) if name in functions else None
                if copy is not None:
                    _HELD[cls][attribute] = (functions[name], copy)
    return _HELD[cls]


def _stored_globals(init: types.FunctionType) -> dict[str, str]:
    """{attribute: global name} for each `self.attribute = NAME` of `init` (its only binding there)."""
    try:
        fn_def, _ = function_source(init)
    except (NotAdaptable, OSError, TypeError, SyntaxError):
        return {}
    this = _instance_name(fn_def)
    if this is None:
        return {}
    stored: dict[str, list] = {}
    for node in walk_function(fn_def):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == this:
                    stored.setdefault(target.attr, []).append(node.value)
    return {a: v[0].id for a, v in stored.items() if len(v) == 1 and isinstance(v[0], ast.Name)}


_FUNCTION_DECISIONS = Decisions("expert_loop_copy")  # on the function: its copy, or the reason


def function_copy(fn: types.FunctionType) -> types.FunctionType | None:
    """The traced copy of a module function with an expert loop, or None (the reason is logged)."""

    def decide():
        if getattr(fn, "__wrapped__", None) is not None:  # its source would be the wrapped function's
            raise NotAdaptable(f"{fn.__qualname__} is a decorated module function (its wrapper is not read)")
        fn_def, filename, plan = analyse(fn)
        # reported where a graph break lies in the function: the kept guards, or the capture left off
        notes = list(plan.kept_guards)
        if plan.static_lengths:
            notes.append(f"the numbers of {', '.join(plan.static_lengths)} are captured only where its length is "
                         "fixed when traced; of a data-dependent length (a bincount) its host read breaks the graph "
                         "as written")
        if notes:
            _KEPT_GUARDS.of(fn)["copy"] = [f"{fn.__module__}.{fn.__qualname__}: {r}" for r in notes]
        if not plan.changes_anything():
            return "nothing to adapt"
        return rewrite(fn, fn_def, filename, plan)

    decision = decided(_FUNCTION_DECISIONS.of(fn), "copy", f"{fn.__module__}.{fn.__qualname__}", decide,
                       "expert loop")
    return decision if isinstance(decision, types.FunctionType) else None


_TRUSTED = "__moe_passes_trusted__"  # on a traced copy: what its proofs read (row_maps.still_trusted)


def _with_trusted(traced: types.FunctionType, plan: Plan) -> types.FunctionType:
    setattr(traced, _TRUSTED, tuple(read for loop in plan.count_loops for read in loop.trusted))
    return traced


def reads_helpers(traced) -> bool:
    """The copy's proofs read helpers of a namespace or class (so the copy holds only while they stay)."""
    return bool(getattr(traced, _TRUSTED, ()))


def still_holds(traced) -> bool:
    """Every helper the copy's proofs read is still the one a name gives."""
    return still_trusted(getattr(traced, _TRUSTED, ()))


def traceable_forward_of(cls: type) -> types.FunctionType | None:
    """The copy of `cls.forward` to trace under hpu_moe, or None."""
    return adaptations_of(cls).get("forward")


def _decide(cls: type, name: str, fn: types.FunctionType, held: dict) -> types.FunctionType | None:
    key = (name, fn)
    where = f"{cls.__module__}.{cls.__qualname__}.{name}"

    def decide():
        target, rewrap = decorated(fn)
        fn_def, filename, plan = analyse(target, cls)
        this = _instance_name(fn_def)
        called = {_held_call(node, this) for node in walk_function(fn_def)}
        plan = dataclasses.replace(plan, held={a: pair for a, pair in held.items() if a in called})
        if plan.kept_guards:
            _KEPT_GUARDS.of(cls)[key] = [f"{where}: {reason}" for reason in plan.kept_guards]
        if not plan.changes_anything():
            return "nothing to adapt"
        traced = rewrite(target, fn_def, filename, plan)
        return _with_trusted(rewrap(traced), plan)

    cache = _DECISIONS.of(cls)
    if isinstance(cache.get(key), types.FunctionType) and not still_holds(cache[key]):
        del cache[key]  # a helper its proof read was replaced since: decided again from the code as it is
        log.info("%s: a helper its expert-loop proof read was replaced; decided again", where)
    decision = decided(cache, key, where, decide, "expert loop")
    return decision if isinstance(decision, types.FunctionType) else None


def declined_at(locations) -> list[str]:
    """Reasons for the code left as written (classes not adapted, guards kept) in methods that hold one
    of `locations` ("file:line")."""
    wanted = set()
    for location in locations:
        path, _, line = location.rpartition(":")
        if line.isdigit():
            wanted.add((os.path.realpath(path), int(line)))
    found = []
    methods = ((key[1], decision, _KEPT_GUARDS.get(cls, key, [])) for cls, key, decision in _DECISIONS.items())
    functions = ((fn, decision, _KEPT_GUARDS.get(fn, "copy", [])) for fn, _, decision in _FUNCTION_DECISIONS.items())
    for fn, decision, reasons in (*methods, *functions):
        if isinstance(decision, str) and decision != "nothing to adapt":
            reasons = [decision, *reasons]
        code = getattr(fn, "__code__", None)
        if not reasons or code is None:
            continue
        path = os.path.realpath(code.co_filename)
        lines = {line for _, _, line in code.co_lines() if line is not None}
        if any(p == path and line in lines for p, line in wanted):
            found.extend(reasons)
    return found


def declined_classes() -> dict[str, str]:
    """{"module.Class": reason} for classes whose hit-expert loops were left as written."""
    return {
        f"{cls.__module__}.{cls.__qualname__}": reason
        for cls, _key, reason in _DECISIONS.items()
        if isinstance(reason, str) and reason != "nothing to adapt"
    }
