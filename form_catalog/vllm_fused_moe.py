"""vLLM's FusedMoE calling convention: layers found again by name, through a forward context.

Mirrors vllm-project/vllm `vllm/model_executor/layers/fused_moe/layer.py` (mid-2025, commit 0014ec6:
`FusedMoE.__init__` registers `compilation_config.static_forward_context[prefix] = self` and sets
`self.layer_name = prefix`; `FusedMoE.forward` calls the opaque custom op
`torch.ops.vllm.moe_forward(hidden_states, router_logits, self.layer_name)`, whose body looks the layer
up with `get_forward_context().no_compile_layers[layer_name]` and runs `forward_impl`), with
`vllm/forward_context.py` (`set_forward_context`, `get_forward_context`), vLLM's routing `fused_topk`
(softmax → top-k → renormalise) and, as the experts, the Gaudi static loop over stacked `w13_weight
[E, 2I, H]` / `w2_weight [E, H, I]` (vllm-hpu-extension `StaticFusedMOE`, see `static_dense_loop.py`).
`forward` enters the sequence-parallel context in Python, as vLLM 0.20's `MoERunner` does
(`_sequence_parallel_context` → `DPMetadata.sp_local_sizes`, which turns the per-rank token counts into
a list with `.tolist()`: a graph break whenever DP metadata is set).

Under torch.compile this costs three ways (vllm-gaudi PR #158): the context access breaks the graph,
the MoE compute hides inside the opaque op, and `self.layer_name` becomes a guard, so a decoder-layer
code object compiled per layer recompiles once per layer until dynamo's `recompile_limit` (8) sends the
rest to eager. The `hpu_moe` backend's adapters (moe_passes/adapters) must make each layer traceable:
ONE compile serves every layer, no graph break, and each layer's experts become ONE `fused_weights`
call.

`build(num_layers=N)` returns `(model, (x,))`; `model.layers` holds the decoder layers, which can be
compiled one by one. Run the model (compiled or not) inside `set_forward_context(model)` (with
`num_tokens_across_dp=[T]` for the DP metadata), as vLLM's model runner does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ._common import finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="fused_weights")
# Not one of the catalog's forms: it runs only inside `set_forward_context` (tests/test_vllm_style.py).
IN_CATALOG = False


class DPMetadata:
    """`vllm.forward_context.DPMetadata`: per-rank token counts, held on the CPU."""

    def __init__(self, num_tokens_across_dp_cpu: torch.Tensor):
        self.num_tokens_across_dp_cpu = num_tokens_across_dp_cpu
        self.local_sizes: list[int] | None = None

    @contextlib.contextmanager
    def sp_local_sizes(self, sequence_parallel_size: int):
        """Token counts per sequence-parallel rank, as Python ints (`.tolist()`) while active."""
        sp_tokens = (self.num_tokens_across_dp_cpu + sequence_parallel_size - 1) // sequence_parallel_size
        self.local_sizes = sp_tokens.repeat_interleave(sequence_parallel_size).tolist()
        try:
            yield self.local_sizes
        finally:
            self.local_sizes = None


class ForwardContext:
    """`vllm.forward_context.ForwardContext`: what the model runner sets around each forward."""

    def __init__(self, no_compile_layers: dict[str, nn.Module], dp_metadata: DPMetadata | None = None):
        self.no_compile_layers = no_compile_layers
        self.dp_metadata = dp_metadata


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("the forward context is not set: run the model inside set_forward_context()")
    return _forward_context


@contextlib.contextmanager
def set_forward_context(model: VllmStyleModel, num_tokens_across_dp: list[int] | None = None):
    """The model runner's `set_forward_context`: layers can be found by name while it is active.

    `num_tokens_across_dp` (one count per data-parallel rank) sets the DP metadata that vLLM's MoE
    layers read on their sequence-parallel path.
    """
    global _forward_context
    previous = _forward_context
    dp_metadata = None if num_tokens_across_dp is None else DPMetadata(torch.tensor(num_tokens_across_dp))
    _forward_context = ForwardContext(model.static_forward_context, dp_metadata)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


@torch.library.custom_op("vllm_style::moe_forward", mutates_args=())
def moe_forward(hidden_states: torch.Tensor, router_logits: torch.Tensor, layer_name: str) -> torch.Tensor:
    """`torch.ops.vllm.moe_forward`: find the layer by name in the forward context, run it."""
    layer = get_forward_context().no_compile_layers[layer_name]
    return layer.forward_impl(hidden_states, router_logits)


@moe_forward.register_fake
def _(hidden_states, router_logits, layer_name):
    return torch.empty_like(hidden_states)


def fused_topk(hidden_states, gating_output, topk: int, renormalize: bool):
    """vLLM's `fused_topk`: softmax(float32) → top-k → optional renormalise; (weights, ids)."""
    scores = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(scores, topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """The layer: stacked expert weights, registered under its prefix, run through the opaque op."""

    def __init__(self, cfg: dict, prefix: str, static_forward_context: dict[str, nn.Module]):
        super().__init__()
        e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.num_experts, self.top_k, self.renormalize = e, cfg["top_k"], True
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2_weight = nn.Parameter(torch.empty(e, h, i))
        if prefix in static_forward_context:
            raise ValueError(f"duplicate layer name: {prefix}")
        static_forward_context[prefix] = self
        self.layer_name = prefix
        self.sp_size = 1

    def _sequence_parallel_context(self):
        """`MoERunner._sequence_parallel_context`: the DP metadata's local sizes, or nothing."""
        ctx = get_forward_context()
        return ctx.dp_metadata.sp_local_sizes(self.sp_size) if ctx.dp_metadata else contextlib.nullcontext()

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        with self._sequence_parallel_context():
            return torch.ops.vllm_style.moe_forward(hidden_states, router_logits, self.layer_name)

    def forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Routing and experts (what the opaque op runs): the Gaudi static MoE loop."""
        weights, ids = fused_topk(hidden_states, router_logits, self.top_k, self.renormalize)
        tokens = hidden_states.shape[0]
        padded = torch.zeros(tokens, self.num_experts, dtype=hidden_states.dtype, device=hidden_states.device)
        padded.scatter_(-1, ids, weights.to(hidden_states.dtype))
        out = torch.zeros_like(hidden_states)
        half = self.w2_weight.shape[-1]
        for e in range(self.num_experts):
            gate_up = hidden_states @ self.w13_weight[e].t()
            h = F.silu(gate_up[..., :half]) * gate_up[..., half:]
            out = out + (h @ self.w2_weight[e].t()) * padded[:, e : e + 1]
        return out


class DecoderLayer(nn.Module):
    """norm → router gate → FusedMoE, with a residual; one code object shared by every layer."""

    def __init__(self, cfg: dict, index: int, static_forward_context: dict[str, nn.Module]):
        super().__init__()
        self.post_attention_layernorm = nn.LayerNorm(cfg["hidden"])
        self.gate = nn.Linear(cfg["hidden"], cfg["num_experts"], bias=False)
        self.experts = FusedMoE(cfg, f"model.layers.{index}.mlp.experts", static_forward_context)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = self.post_attention_layernorm(hidden_states).reshape(-1, shape[-1])
        router_logits = self.gate(x)
        return hidden_states + self.experts(x, router_logits).reshape(shape)


class VllmStyleModel(nn.Module):
    """A stack of decoder layers and the registry their MoE layers put themselves in."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.static_forward_context: dict[str, nn.Module] = {}
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, index, self.static_forward_context) for index in range(cfg["layers"])
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


def forward_context(model: VllmStyleModel, example_inputs):
    """The context a run of `model` needs (the model runner's, without DP metadata): the dump tool
    enters it around the compiled run."""
    return set_forward_context(model)


def build(num_layers: int | None = None, **overrides):
    """(VllmStyleModel, (x [1, T, H],)); `num_layers` (or `layers`) decoder layers, DEFAULTS otherwise.

    Routing is vLLM's (softmax, top-k, renormalise) and the experts SiLU: those keys are not overrides.
    """
    if num_layers is not None:
        overrides["layers"] = num_layers
    cfg = settings(overrides, exclude=("routing", "router_fp32", "activation"))
    return finish(VllmStyleModel(cfg), cfg)
