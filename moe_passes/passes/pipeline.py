"""The MoE fusion pass: find (every registered finder), decide (checks every form shares), rewrite.

    find_layers(graph) -> Found(accepted, rejected)        nothing is changed
    apply(gm, found, target) -> the fused call nodes       the graph is rewritten

Finders are independent (one module per expert form, registered with the ops that anchor them, and
switchable by name). Checks that hold for every form (nothing inside the region is used outside it, the
ids that can reach the experts are ones the kernel computes the same way (`expert_ids`), token counts
line up) live here once; so does lowering a rank's remapped ids onto the router's own ids and window. The pass knows
nothing of reports or printers: the backend turns `Found` into the report.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from ..fx_utils import backward_slice, const_int, dtype, escaping_users, shape, source_line, strip_casts
from . import routing
from .expert_ids import ExpertIds, UnboundedIds, check_unbounded_ids, read_expert_ids, vanishing_choices
from .finder import Finder, discover
from .matches import Decline, ExpertsMatch, RoutingInfo
from .rewrite import rewrite_experts
from .unread_routing import UnreadRouting, unread_routings

log = logging.getLogger(__name__)

# Every form's finder, in priority order (each `experts_*` module registers its own: finder.py).
FINDERS: tuple[Finder, ...] = discover()
FORMS = tuple(f.name for f in FINDERS)
PARTIAL_RANGE_FORMS = tuple(f.name for f in FINDERS if f.partial_ranges)

# Runtime checks dynamo records on data-dependent sizes (e.g. the row counts `nonzero` yields in a
# sparse expert loop). They have no users, so they keep the values they check alive after a rewrite.
ASSERTION_OPS = (
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
)


def layer_name(node: Node | None) -> str:
    """The module path a node came from (dynamo's nn_module_stack), e.g. "model.layers.0.mlp.experts"."""
    if node is None:
        return "<graph>"
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top level>"
    path, module_type = list(stack.values())[-1][:2]
    return _module_path(path) or getattr(module_type, "__name__", str(module_type))


def _module_path(source: str) -> str:
    """"model.layers.0.mlp" from dynamo's source names of any torch version:
    `L['self'].model.layers[0].mlp`, `L['self']._modules['model']._modules['layers']._modules['0']`, ..."""
    path = re.sub(r"^L\['(?:self|fn|mod)'\]", "", source)
    path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return ".".join(part for part in path.split(".") if part)


def _layer_of(match: ExpertsMatch) -> str:
    """Name the MoE block: the common module path of the region's output and the routing ids."""
    out, ids = layer_name(match.output).split("."), layer_name(match.ids).split(".")
    common = []
    for a, b in zip(out, ids, strict=False):
        if a != b:
            break
        common.append(a)
    return ".".join(common) if len(common) > 1 else layer_name(match.output)


def _is_size_value(node: Node) -> bool:
    """A symbolic size (or other scalar) or a runtime check on one: not a tensor at all."""
    return isinstance(
        node.meta.get("val"), int | float | bool | torch.SymInt | torch.SymFloat | torch.SymBool
    ) or (node.op == "call_function" and node.target in ASSERTION_OPS)


def read_only_for_sizes(graph: torch.fx.Graph) -> set[Node]:
    """Size values, and tensors whose every use is one (a slice cut at data-dependent offsets whose row
    count dynamo asserts on; an offset read only to check its range). One pass from the graph's end."""
    found: set[Node] = set()
    for node in reversed(graph.nodes):
        if _is_size_value(node) or (node.op == "call_function" and node.users and node.users.keys() <= found):
            found.add(node)
    return found


def region_of(match: ExpertsMatch) -> set[Node]:
    """The nodes the fused call replaces: everything between the region's inputs and its output."""
    boundary = {match.hidden, match.ids, match.weights, *match.weight_nodes()}
    # Views and casts of the region's inputs are aliases of those inputs, and symbolic size
    # arithmetic is not a tensor at all: both are free to be shared with the rest of the graph.
    return {
        n for n in backward_slice(match.output, boundary) if strip_casts(n) not in boundary and not _is_size_value(n)
    }


def check(
    match: ExpertsMatch, region: frozenset[Node], info: RoutingInfo, expert_ids: ExpertIds | None = None
) -> str | None:
    """A reason to decline a structurally matched region, or None when it is safe to rewrite."""
    sizes = read_only_for_sizes(match.output.graph)
    # A size read off a region tensor (and the runtime checks on it) is not a use of its values; id
    # arithmetic the weights share (an expert-parallel rank mask) stays, computed once, for its other users.
    computing = _on_expert_side(match, region)
    routing = _on_expert_side(match, region, (match.weights,)) - computing
    # A routing value (made from the ids and weights alone) that the layer also returns as it is, as
    # GPT-OSS's MLP returns its [T, E] table, stays for the caller, computed once; one that other
    # arithmetic reads keeps the region as written.
    escapes = [(a, b) for a, b in escaping_users(region, match.output)
               if b not in sizes and (a in computing or (a in routing and b.op != "output"))]
    if escapes:
        inside, outside = escapes[0]
        return f"an intermediate value of the expert region escapes it ({inside.name} is also used by {outside.name})"
    reason = _ids_reason(match, info, expert_ids)
    if reason is not None:
        return reason
    # Sizes are read through their hints (const_int): int() on a SymInt would add a guard and make
    # dynamo recompile for every new token count.
    hidden, ids = shape(match.hidden), shape(match.ids)
    tokens = 1
    for size in hidden[:-1]:
        tokens = tokens * const_int(size) if tokens is not None and const_int(size) is not None else None
    if tokens is not None and len(ids) == 2 and const_int(ids[0]) not in (None, tokens):
        return "the hidden states and the routing table hold different numbers of tokens"
    if match.top_k > (info.num_experts or (expert_ids and expert_ids.router_experts) or match.num_experts):
        return "top-k exceeds the number of experts"
    return None


def _on_expert_side(match: ExpertsMatch, region: frozenset[Node], starts: tuple = ()) -> set[Node]:
    """The region's nodes that compute with the hidden states or the expert weights (with `starts`: with
    those too, e.g. the routing weights)."""
    side, stack = set(), [match.hidden, *match.weight_nodes(), *starts]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in region and user not in side:
                side.add(user)
                stack.append(user)
    return side


def _ids_reason(match: ExpertsMatch, info: RoutingInfo, ids: ExpertIds | None) -> str | None:
    """Why an id could reach the region's experts otherwise than the kernel's, or None.

    The kernel runs the experts held on the ids in experts_min..experts_max and skips every other id.
    Loops were checked expert by expert (probes) and skip every other id too. The GEMM forms index their
    stacks with the ids, so every id must be held, unless their sentinel handling drops ids >= E (then
    no id may be negative); that is read from the values the ids can take, else from the router's width.
    """
    held = f"{match.experts_min}..{match.experts_max}"
    if match.form in PARTIAL_RANGE_FORMS:
        if info.num_experts is not None and info.num_experts <= match.experts_max:
            return f"the router scores {info.num_experts} experts but the region holds experts {held}"
        return None
    if ids is not None:
        if match.slots_scaled and match.sentinels and _unheld_choices_weigh_nothing(match, ids):
            return None
        if match.sentinels == "dropped":
            if ids.low < 0:
                return f"the routing ids can be negative ({ids.low}), and the experts drop only ids >= {match.num_experts}"
            return None
        if ids.low < match.experts_min or ids.high > match.experts_max:
            how = "clamp them onto held experts" if match.sentinels == "clamped" else "index their stacks with them"
            return f"the routing ids take values {ids.low}..{ids.high}, the experts hold {held} and {how}"
        return None
    if match.sentinels is not None and info.num_experts != match.num_experts:
        return (
            "the experts clamp or mask ids outside 0..E-1 (expert-parallel sentinels), and the routing does "
            "not show that every id is one of the experts held (top-k over exactly E router columns)"
        )
    if info.num_experts is not None and info.num_experts != match.num_experts:
        return f"the router scores {info.num_experts} experts but the region holds experts {held}"
    return None


def _unheld_choices_weigh_nothing(match: ExpertsMatch, ids: ExpertIds) -> bool:
    """Every router choice whose id falls outside the held experts has a weight of zero (`weights *
    mine`): the region clamps such an id onto a held expert and scales that slot by zero, the kernel
    skips it; both add nothing while the expert's output and the weight are finite (strict mode declines
    it: 0 * inf is NaN)."""
    if ids.by_choice is None:
        return False
    unheld = {g for g, v in enumerate(ids.by_choice) if not match.experts_min <= v <= match.experts_max}
    return unheld <= vanishing_choices(match.weights, ids.choices)


def on_router_ids(match: ExpertsMatch, ids: ExpertIds | None) -> ExpertsMatch:
    """The match on the router's own ids, with the held experts' global range, when its ids are those
    remapped onto the experts held (expert parallelism: `where(ids // E_local != rank, E_local, ids %
    E_local)` and the like); else the match as it is.

    Valid once `check` passed: an id outside the held range contributes nothing in the region, and a
    router choice outside the global window contributes nothing in the kernel.
    """
    if ids is None or ids.choices is None or ids.router_experts == match.num_experts:
        return match
    first = ids.window(match.experts_min, match.num_experts)
    if first is None:
        return match
    return dataclasses.replace(match, ids=ids.choices, experts_min=first, router_experts=ids.router_experts)


def rounding_needed(match: ExpertsMatch, region: frozenset[Node]) -> str | None:
    """What the rewrite rounds that the model keeps wider, or None when the call is exact in dtypes.

    The kernel takes router weights in the hidden dtype and returns the hidden dtype: float32 router
    weights (or a float32 combine) under bfloat16 experts are rounded. The default mode tolerates
    this (the outputs agree within the dtype's tolerance); strict mode declines it.
    """
    hidden = dtype(match.hidden)
    if hidden is None:
        return None
    wide = [d for d in _dtypes_used_at(match.weights, region) if torch.promote_types(d, hidden) != hidden]
    what = "router weights"
    if not wide and dtype(match.output) is not None and torch.promote_types(dtype(match.output), hidden) != hidden:
        wide, what = [dtype(match.output)], "combined expert output"
    if not wide:
        return None
    return (
        f"strict: the {what} are used in {str(wide[0]).removeprefix('torch.')} and the fused kernel "
        f"takes them in {str(hidden).removeprefix('torch.')} (a rounding the default mode tolerates)"
    )


def _not_exact(match: ExpertsMatch, region: frozenset[Node], ids: ExpertIds | None) -> str | None:
    """Strict mode: why the fused call could give another result than the layer as written, or None."""
    if not match.picks_routed and any(f.reads_every_expert for f in FINDERS if f.name == match.form):
        return (
            "strict: the layer as written runs every expert on every token, so a NaN or inf in an expert no "
            "token is routed to reaches its output; the fused kernel reads only the routed experts"
        )
    if match.sentinels and ids is not None and (ids.low < match.experts_min or ids.high > match.experts_max):
        return (
            "strict: the layer as written runs a held expert for the slots of experts it does not hold and "
            "scales them by a zero weight, so a NaN or inf there reaches its output (0 * inf); the fused "
            "kernel skips those slots"
        )
    return rounding_needed(match, region)


def _dtypes_used_at(node: Node, region: set[Node]) -> set[torch.dtype]:
    """The dtypes in which the region computes with `node`'s values (after the casts the model made)."""
    used, stack, seen = set(), [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if strip_casts(user) is not user:  # a cast or a view (an alias of the input): follow it
                stack.append(user)
            elif user in region and dtype(current) is not None:
                used.add(dtype(current))
    return used


@dataclass(frozen=True)
class Accepted:
    """A match that passed every check, with what was computed about it once."""

    match: ExpertsMatch
    layer: str
    routing: RoutingInfo
    region: frozenset[Node]


@dataclass(frozen=True)
class Rejected:
    """A candidate left as it is: the layer, the form, why, and the node where matching stopped."""

    layer: str
    form: str
    reason: str
    stopped_at: Node | None = None


@dataclass
class Found:
    """What `find_layers` saw in one graph; the graph itself is not changed."""

    accepted: list[Accepted] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    internal_errors: list[str] = field(default_factory=list)  # "form: ExceptionType: message"


def selected_finders(forms: tuple[str, ...] | None = None) -> tuple[Finder, ...]:
    """The registered finders, or those named in `forms` (for bisecting a wrong rewrite)."""
    if forms is None:
        return FINDERS
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise ValueError(f"unknown MoE form(s) {unknown}; known forms: {list(FORMS)}")
    return tuple(f for f in FINDERS if f.name in forms)


def find_layers(graph: torch.fx.Graph, forms: tuple[str, ...] | None = None, strict: bool = False) -> Found:
    """Read every candidate MoE region of `graph` and decide each; nothing is rewritten here.

    Each candidate is read on its own: a finder that raises costs that candidate only (an "internal
    error in <form>" decline). strict: also decline matches whose rewrite needs a rounding.
    """
    found, results = Found(), []
    for finder in selected_finders(forms):
        try:
            candidates = list(finder.candidates(graph, finder.anchor_nodes(graph)))
        except Exception as error:  # noqa: BLE001 - a bug in one finder must not stop the others
            found.internal_errors.append(f"{finder.name}: {type(error).__name__}: {error}")
            log.debug("finder %s raised while listing candidates", finder.name, exc_info=True)
            continue
        for candidate in candidates:
            try:
                results.append(finder.match(candidate.payload))
            except Exception as error:  # noqa: BLE001 - the layer is declined, the graph still compiles
                what = f"{finder.name}: {type(error).__name__}: {error}"
                found.internal_errors.append(what)
                log.debug("finder %s raised at %s", finder.name, candidate.anchor, exc_info=True)
                results.append(Decline(finder.name, f"internal error in {what}", candidate.anchor))
    results = [r for r in results if r is not None]
    _decide(results, found, strict)
    if forms is None:  # with forms left out, the others' layers would look unread
        try:
            declined_at = {r.anchor for r in results if isinstance(r, Decline) and r.anchor is not None}
            found.rejected.extend(_unread(graph, found, declined_at))
        except Exception as error:  # noqa: BLE001 - naming unread routers must never cost a fusion
            found.internal_errors.append(f"unread routing: {type(error).__name__}: {error}")
            log.debug("naming unread routers raised", exc_info=True)
    return found


UNREAD_FORM = "routing"


def _unread(graph: torch.fx.Graph, found: Found, declined_at: set[Node]) -> list[Rejected]:
    """Routers no finder read (unread_routing says which), unless a layer around or inside one was read:
    fused, or declined (`declined_at`: the outputs of the regions the finders declined)."""
    read = {a.match.output for a in found.accepted} | {a.match.ids for a in found.accepted} | declined_at
    read |= {r.stopped_at for r in found.rejected if r.stopped_at is not None}
    layers = [a.layer for a in found.accepted] + [r.layer for r in found.rejected]
    rejected = []
    for unread in unread_routings(graph, read):
        layer = layer_name(unread.choice)
        if any(_nested(layer, other) for other in layers):
            continue
        layers.append(layer)  # one entry per layer (NLLB's router chooses twice)
        rejected.append(Rejected(layer, UNREAD_FORM, _unread_reason(unread), unread.reader))
    return rejected


def _nested(a: str, b: str) -> bool:
    """One module path is the other or inside it ("m.layers.0.mlp" and "m.layers.0.mlp.gate")."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _unread_reason(unread: UnreadRouting) -> str:
    chose = {torch.ops.aten.topk.default: f"top-{unread.top_k}", torch.ops.aten.max.dim: "max"}.get(
        unread.choice.target, "argmax")
    where = source_line(unread.choice)
    return (
        f"a router chooses experts ({chose} of {unread.experts}{', at ' + where if where else ''}), but no expert "
        f"form reads what is done with its choices: {unread.read_as()} (where matching stopped), and the experts' "
        "computation after it is not a form the passes follow (docs/forms.md lists those); the layer runs as written"
    )


def _decide(results: list[ExpertsMatch | Decline], found: Found, strict: bool) -> None:
    """Accept each match that passes every check (once per region output); keep the other declines."""
    matches = [r for r in results if isinstance(r, ExpertsMatch)]
    matched_anchors = {m.output for m in matches} | {a for m in matches for a in m.output.all_input_nodes}
    taken: set[Node] = set()
    for result in results:
        if isinstance(result, Decline):
            if result.anchor not in matched_anchors:  # else another finder matched this region
                stopped = result.stopped_at or result.anchor
                found.rejected.append(Rejected(layer_name(result.anchor), result.form, result.reason, stopped))
            continue
        if result.output in taken:
            continue
        taken.add(result.output)
        region = frozenset(region_of(result))
        info = routing.describe(result.ids, result.weights, result.weights_at_ids)
        ids = read_expert_ids(result.ids)
        reason = check(result, region, info, ids) or (_not_exact(result, region, ids) if strict else None)
        if reason is not None:
            found.rejected.append(Rejected(_layer_of(result), result.form, reason, result.output))
            continue
        if ids is None and info.num_experts is None:  # no op of the graph bounds the ids
            try:
                result = _with_ids_check(result, region)
            except UnboundedIds as error:
                found.rejected.append(Rejected(_layer_of(result), result.form, str(error), result.output))
                continue
        lowered = on_router_ids(result, ids)
        if lowered is not result:
            info = routing.describe(lowered.ids, lowered.weights, lowered.weights_at_ids)
        found.accepted.append(Accepted(lowered, _layer_of(result), info, region))


def _with_ids_check(match: ExpertsMatch, region: frozenset[Node]) -> ExpertsMatch:
    """`match` with the check its call makes of ids no op of the graph bounds (expert_ids.IdsCheck)."""
    ids_check = check_unbounded_ids(
        match.ids, region, match.experts_min, match.num_experts, match.form in PARTIAL_RANGE_FORMS
    )
    if ids_check is None:
        return match
    message = (
        f"hpu_moe: a routing id of {_layer_of(match)} lies outside {ids_check.low}..{ids_check.high}, where "
        f"the layer as written raises or gives no meaningful result ({ids_check.read_by})"
    )
    return dataclasses.replace(match, ids_check=dataclasses.replace(ids_check, message=message))


def apply(gm: GraphModule, found: Found, target: str) -> list[Node]:
    """Rewrite every accepted layer of `found` in `gm` (in place); returns the fused call nodes, in order."""
    fused = []
    for accepted in found.accepted:
        fused.append(rewrite_experts(gm.graph, accepted.match, target))
        log.debug("fused %s (%s) into %s", accepted.layer, accepted.match.form, fused[-1].target)
    if fused:
        gm.graph.eliminate_dead_code()
        replaced = set().union(*(a.region for a in found.accepted))
        if _drop_size_assertions_on(gm.graph, replaced):
            gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return fused


def _drop_size_assertions_on(graph: torch.fx.Graph, replaced: set[Node]) -> int:
    """Erase runtime size checks that only concern tensors of rewritten regions; returns how many.

    After dead-code elimination such a tensor (a sparse loop's `nonzero`) is still alive only because
    an assertion on its size reads it; the fused call no longer needs that size, so neither the check
    nor the tensor (and its host sync) should stay.
    """
    dropped = 0
    sizes = read_only_for_sizes(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in ASSERTION_OPS:
            continue
        sources, stack, seen = set(), list(node.all_input_nodes), set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if _is_size_value(current) or (current in sizes and current not in replaced):
                stack.extend(current.all_input_nodes)  # through sizes, and tensors only checked
            else:
                sources.add(current)
        if (
            sources
            and sources <= replaced
            and all(all(user in sizes for user in source.users) for source in sources)
        ):
            graph.erase_node(node)
            dropped += 1
    return dropped
