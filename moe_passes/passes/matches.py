"""The small records that pass between finding and rewriting.

A finder either returns an `ExpertsMatch` (everything the rewrite needs, nothing more) or a `Decline`
(why a candidate was left as it is). Finders never edit the graph; the rewrite never searches it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node


@dataclass(frozen=True)
class Decline:
    """A candidate MoE region left untouched, with a reason a person can act on."""

    form: str
    reason: str
    anchor: Node | None = None  # the node the candidate was found at (its output)
    stopped_at: Node | None = None  # the node where matching stopped (the anchor when not given)


@dataclass(frozen=True)
class NoMatch:
    """A reader's "no": why the graph is not what it reads, and the node where reading stopped.

    Every reader of the passes returns either what it read or a `NoMatch` (like inductor's
    `FailedMatch`, it is falsy); callers test `isinstance(x, NoMatch)`. `decline` is the one place a
    `NoMatch` becomes the `Decline` a finder hands to the pipeline.
    """

    reason: str
    at: Node | None = None  # where matching stopped (None: the reader cannot tell; see `decline`)

    def __bool__(self) -> bool:
        return False

    def decline(self, form: str, anchor: Node | None, at: Node | None = None) -> Decline:
        """The candidate at `anchor` declined for this reason; `at`: where matching stopped when the
        reader did not say (it only knows part of the region)."""
        return Decline(form, self.reason, anchor, self.at if self.at is not None else at)


# Reasons more than one reader gives, written once.
IDS_WEIGHTS_SHAPES = "routing ids and weights are not [T, k] tensors of the same shape"
GATE_UP_ROWS_DIFFER = "gate and up read different rows"
NOT_GATED = "the down projection input is not act(gate) * up (the kernel needs gated experts)"
STACK_COUNTS_DIFFER = "gate/up and down stacks hold different numbers of experts"
MIXED_GATE_UP = "experts mix fused gate/up and separate gate and up projections"
UNSCALED_OUTPUTS = "routing weights do not scale the expert outputs"
BIASES_NEED_SWIGLU = "expert biases come only with GPT-OSS's clamped swiglu in the fused kernel"
# A graph compiled for zero tokens gives the probes nothing to check the routing on (and has no work).
EMPTY_BATCH = "the batch is empty at compile time, so which expert takes which weight cannot be checked"


def unsupported_activation(described: str) -> str:
    return f"activation {described} is not supported by the fused kernel (silu, gelu(tanh), relu)"


def unprobeable(what: str, why: Exception) -> str:
    """`what` (e.g. "the routing table") is computed by ops outside the probe set (`probe.NotProbeable`)."""
    return f"{what} is computed with ops the finder cannot check ({why})"


@dataclass(frozen=True)
class ExpertWeights:
    """One weight role (gate, up, gate+up, down) for all experts.

    Either `stacked` ([E, out, in] or [E, in, out]) or `per_expert` (one 2-D node per expert).
    `out_in` says whether each expert's matrix is laid out [out, in] like `nn.Linear.weight`.
    """

    stacked: Node | None = None
    per_expert: tuple[Node, ...] = ()
    out_in: bool = True
    # The role is these output features [start, stop) of each expert's matrix: the gate and the up half
    # of a joined gate/up weight whose activation reads the second half (`up * act(gate)`, up first).
    out_rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if (self.stacked is None) == (not self.per_expert):
            raise ValueError("ExpertWeights needs exactly one of `stacked` or `per_expert`")

    def nodes(self) -> tuple[Node, ...]:
        return (self.stacked,) if self.stacked is not None else self.per_expert


@dataclass(frozen=True)
class RoutingInfo:
    """How the top-k ids and weights feeding an expert region were produced (for the report)."""

    kind: str  # "softmax_topk", "topk_softmax", "sigmoid_topk", or "opaque"
    renormalized: bool | None = None
    softmax_fp32: bool | None = None
    num_experts: int | None = None
    bias_corrected: bool | None = None  # sigmoid_topk: experts chosen on scores + a correction bias
    grouped: bool | None = None  # sigmoid_topk: experts outside the best groups masked out first
    scale: float | None = None  # a constant factor on the weights (DeepSeek's routed_scaling_factor)
    masked: bool | None = None  # weights zeroed by a mask (expert parallelism: other ranks' experts)


@dataclass(frozen=True)
class IdsCheck:
    """What the fused call does first with routing ids no op of the graph bounds (ids handed in as an
    input, from routing computed elsewhere), so that it computes what the region computes, or raises
    where the region cannot have computed anything.

    The kernel skips ids outside its held range; the region's own ops may instead wrap a negative id
    (Python indexing of `wrap` rows), raise on an id out of range, or read one inconsistently. `wrap`:
    `wrap` is added to negative ids first; then every id must lie in `low..high`, else the call raises
    (`_assert_async`: checked on the device, no host synchronisation).
    """

    low: int
    high: int
    wrap: int | None
    read_by: str  # the op of the region whose treatment of an out-of-range id decides, e.g. "aten.index"
    message: str = ""


@dataclass(frozen=True)
class ExpertsMatch:
    """An expert region that computes, for every token t: sum_j w[t,j] * MLP_{ids[t,j]}(x[t])."""

    form: str
    output: Node  # the node whose value the fused call replaces
    hidden: Node  # x, [T, H] (or a view of it)
    ids: Node  # [T, k] expert ids
    weights: Node  # [T, k] routing weights ([T, E] with weights_at_ids)
    num_experts: int
    top_k: int
    activation: str
    down: ExpertWeights
    gate_up: ExpertWeights | None = None  # fused_weights: gate rows then up rows
    gate: ExpertWeights | None = None  # default: separate gate and up
    up: ExpertWeights | None = None
    gate_up_bias: ExpertWeights | None = None  # bias_fused_weights (GPT-OSS): per-expert biases
    down_bias: ExpertWeights | None = None
    alpha: float | None = None  # clamped swiglu parameters of bias_fused_weights
    limit: float | None = None
    # Global id of the first expert held: a loop over a contiguous range of the router's experts (one
    # rank's share under expert parallelism) holds experts_min .. experts_min + num_experts - 1.
    experts_min: int = 0
    # The router's expert count when the region holds only part of it (the kernel's total_experts).
    router_experts: int | None = None
    # How the region treats ids outside 0..E-1 (transformers' expert-parallel sentinels): None, it does
    # not (it indexes its stacks with them, so none may occur); "clamped", onto a held expert (none may
    # occur either); "dropped", an id >= E contributes nothing, as in the kernel (no id may be negative).
    # The pipeline checks this against the values the routing ids can take.
    sentinels: str | None = None
    # Each slot's output is its (clamped) expert's output times its own weight (transformers' batched
    # experts): a slot whose weight is zero contributes nothing, whatever its id was clamped onto.
    slots_scaled: bool = False
    # `weights` is the [T, E] table of every expert's weight (the router's probabilities, no
    # renormalisation), read at the ids (`probs[tok, e]`): the call takes table.gather(1, ids).
    weights_at_ids: bool = False
    # The region runs every expert on every token but keeps only each token's chosen outputs (picked at
    # its ids, not weighted by zero): an unrouted expert's NaN or inf never reaches its result either.
    picks_routed: bool = False
    # Set by the pipeline where the ids' range is not proved: what the call checks before it runs.
    ids_check: IdsCheck | None = None

    @property
    def experts_max(self) -> int:
        return self.experts_min + self.num_experts - 1

    @property
    def overload(self) -> str:
        if self.gate_up_bias is not None:
            return "bias_fused_weights"
        return "fused_weights" if self.gate_up is not None else "default"

    def weight_nodes(self) -> tuple[Node, ...]:
        roles = (self.gate_up, self.gate, self.up, self.down, self.gate_up_bias, self.down_bias)
        return tuple(n for role in roles if role is not None for n in role.nodes())
