"""Small classes that mirror the structure of vLLM's MoE layers, for testing the vLLM adapter here.

Real vLLM runs in its own environment (`tools/vllm_env.py`, `tests/test_vllm_real.py`: 0.32.0, 0.22.1 and
0.17.1, where the mirror of each convention is checked against the real classes); vLLM pins its own torch
and transformers, so it cannot share the main suite's environment, and these mirrors keep every
convention the adapter knows tested there. What the adapter detects and
hooks is mirrored from vLLM's sources, release by release: the class layout, the attribute holding the opaque op, `_encode_layer_name`,
the op's body (find the layer by name in the forward context, run the impl), and the impl's signature.
The MoE compute is the catalog's (`form_catalog/vllm_fused_moe.py`: vLLM's routing and the Gaudi static
expert loop), so the hpu_moe passes can fuse it. Each factory returns fresh classes, so that a test can
adapt (or not) classes of its own.

- `mirror_033()`: 0.25 to 0.33, `fused_moe/runner/moe_runner.py`: the layer is a `MoERunner`.
- `mirror_022()`: 0.20 to 0.22, `runner/moe_runner.py` + `layer.py`: `FusedMoE.__init__` builds
  `self.runner = MoERunner(layer_name, ...)`; the op runs `layer.runner._forward_impl(layer, ...)`.
- `mirror_019()`: 0.17 to 0.19, `runner/default_moe_runner.py` + `layer.py`: `DefaultMoERunner(layer=...)`
  is a plain object; the op runs `layer.ensure_moe_quant_config_init()` then
  `runner.forward_impl(layer, ...)` in the runner's sequence-parallel context.
- `FusedMoE016`: 0.10 to 0.16, `layer.py`: `FusedMoE(CustomOp).forward_native` calls the op itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from form_catalog import vllm_fused_moe

HIDDEN, EXPERTS, INTERMEDIATE, TOP_K = 16, 4, 32, 2
OP_CALLS = {"moe_forward": 0}
_USE_LAYERNAME = False  # vllm.utils.torch_utils: opaque LayerName objects instead of strings (torch >= 2.11)


def is_forward_context_available() -> bool:
    return vllm_fused_moe._forward_context is not None


def get_forward_context():
    return vllm_fused_moe.get_forward_context()


def get_layer_from_name(layer_name: str):
    """`get_layer_from_name`: by name, or the next of `all_moe_layers` (`fast_moe_cold_start`)."""
    forward_context = get_forward_context()
    if layer_name == "from_forward_context":
        layer_name = forward_context.all_moe_layers[forward_context.moe_layer_index]
        forward_context.moe_layer_index += 1
    return forward_context.no_compile_layers[layer_name]


@contextlib.contextmanager
def forward_context(model, dp_ranks: int = 1, count_layers: bool = False, tokens: int = 9):
    """vLLM's model runner context; `count_layers` sets `all_moe_layers` (`fast_moe_cold_start`)."""
    across_dp = [tokens] * dp_ranks if dp_ranks > 1 else None
    with vllm_fused_moe.set_forward_context(model, num_tokens_across_dp=across_dp) as context:
        context.all_moe_layers = list(model.static_forward_context) if count_layers else None
        context.moe_layer_index = 0
        yield context


@dataclass
class FusedMoEConfig:
    """The fields of `fused_moe/config.py::FusedMoEConfig` the runners read on their forward path."""

    hidden_dim: int = HIDDEN
    dp_size: int = 1
    pcp_size: int = 1
    sp_size: int = 1
    is_sequence_parallel: bool = False


def routed_experts(hidden: int = HIDDEN) -> nn.Module:
    """Stacked w13/w2 with vLLM's routing and the static expert loop (`forward_impl(hidden, logits)`)."""
    cfg = {"num_experts": EXPERTS, "hidden": hidden, "intermediate": INTERMEDIATE, "top_k": TOP_K}
    experts = vllm_fused_moe.FusedMoE(cfg, "experts", {})
    experts.lora_base_layer_prefix = ""  # RoutedExperts without LoRA; FusedMoEWithLoRA sets "base_layer."
    return experts


def encode_layer_name(runner):
    """`_encode_layer_name` of 0.20+ with `_USE_LAYERNAME` off (0.17-0.19 test HAS_OPAQUE_TYPE the same way)."""
    if is_forward_context_available() and get_forward_context().all_moe_layers is not None:
        return "from_forward_context"
    return runner.layer_name


def sequence_parallel_context(runner):
    """`_sequence_parallel_context`: the DP metadata's local sizes while it is set, else nothing."""
    ctx = get_forward_context()
    return (
        ctx.dp_metadata.sp_local_sizes(runner.moe_config.sp_size)
        if ctx.dp_metadata
        else contextlib.nullcontext()
    )


def entry_op(qualname: str, run_layer):
    """An op with the signature of vLLM's 0.20+ `moe_forward`: finds the layer by name, runs `run_layer`."""

    def moe_forward(
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        shared_experts_input: torch.Tensor | None,
        input_ids: torch.Tensor | None,
        layer_name: str,
        hidden_dim_unpadded: int,
    ) -> torch.Tensor:
        OP_CALLS["moe_forward"] += 1
        layer = get_layer_from_name(layer_name)
        return run_layer(layer, hidden_states, router_logits, shared_experts_input, input_ids).clone()

    op = torch.library.custom_op(qualname, moe_forward, mutates_args=())
    op.register_fake(lambda hidden_states, *args: torch.empty_like(hidden_states))
    return op


# --- 0.25 to 0.33 ---

# `_moe_forward`: `get_layer_from_name(layer_name)._forward_impl(...)`.
entry_op("vllm_033_mirror::moe_forward", lambda layer, *args: layer._forward_impl(*args))


@torch.library.custom_op("vllm_033_mirror::moe_forward_shared", mutates_args=())
def moe_forward_shared_033(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    shared_experts_input: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    layer_name: str,
    hidden_dim_unpadded: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_moe_forward_shared`: the same lookup; (shared experts' output, routed experts' output)."""
    OP_CALLS["moe_forward"] += 1
    layer = get_layer_from_name(layer_name)
    shared, fused = layer._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids)
    return shared.clone(), fused.clone()


@moe_forward_shared_033.register_fake
def _(hidden_states, router_logits, shared_experts_input, input_ids, layer_name, hidden_dim_unpadded):
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states)


def mirror_033():
    """`MoERunner` (0.33.0): the layer itself, registered by name, run through `_forward_entry`."""

    class MoERunner(nn.Module):
        def __init__(
            self, layer_name, moe_config, static_forward_context, shared_experts=None, hidden=HIDDEN
        ):
            super().__init__()
            self.moe_config = moe_config
            self.enable_dbo = False
            self.routed_experts = routed_experts(hidden)
            self._shared_experts = shared_experts
            self.layer_name = layer_name
            self.dispatches = 0
            self._forward_entry = self._select_forward()
            static_forward_context[layer_name] = self  # register_layer_for_moe_forward_op

        def _select_forward(self):
            ops = torch.ops.vllm_033_mirror
            return ops.moe_forward if self._shared_experts is None else ops.moe_forward_shared

        def _encode_layer_name(self):
            return encode_layer_name(self)

        def _maybe_pad_hidden_states(self, shared_experts_input, hidden_states):
            transformed = hidden_states.shape[-1]
            if self.moe_config.hidden_dim != transformed:
                hidden_states = F.pad(hidden_states, (0, self.moe_config.hidden_dim - transformed))
            trunc = None if transformed == hidden_states.shape[-1] else transformed
            return hidden_states, None, trunc

        def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
            if shared_experts_input is None and self._shared_experts is not None:
                shared_experts_input = hidden_states  # apply_routed_input_transform without a transform
            hidden_states, _, og_hidden_dim_post_xform = self._maybe_pad_hidden_states(
                shared_experts_input, hidden_states
            )
            result = self._forward_entry(
                hidden_states, router_logits, shared_experts_input, input_ids, self._encode_layer_name(), 0
            )
            shared_output, fused_output = result if isinstance(result, tuple) else (None, result)  # _unpack
            if og_hidden_dim_post_xform is not None:
                fused_output = fused_output[..., :og_hidden_dim_post_xform]
            return fused_output if shared_output is None else shared_output + fused_output

        def _sequence_parallel_context(self):
            return sequence_parallel_context(self)

        def _maybe_dispatch(self, hidden_states, router_logits):
            if self.moe_config.dp_size > 1 or self.moe_config.is_sequence_parallel:
                self.dispatches += 1  # get_ep_group().dispatch_router_logits(...) with one rank
            return hidden_states, router_logits

        def _forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
            with self._sequence_parallel_context():
                hidden_states, router_logits = self._maybe_dispatch(hidden_states, router_logits)
                shared = None if self._shared_experts is None else self._shared_experts(shared_experts_input)
                fused = self.routed_experts.forward_impl(hidden_states, router_logits)
                return fused if shared is None else (shared, fused)  # _maybe_combine

    return MoERunner


# --- 0.20 to 0.22 ---


# `_moe_forward` (0.22): `layer.runner._forward_impl(layer, ...)`, the layer found by name.
entry_op("vllm_022_mirror::moe_forward", lambda layer, *args: layer.runner._forward_impl(layer, *args))


class QuantConfigOnFirstUse(nn.Module):
    """`FusedMoE.ensure_moe_quant_config_init`: built once, after weight loading, on first use."""

    def ensure_moe_quant_config_init(self):
        if getattr(self, "moe_quant_config", None) is None:
            self.moe_quant_config = "unquantized"


def mirror_022():
    """(`MoERunner`, `FusedMoE`) of 0.22.0: the runner knows its layer only by name."""

    class MoERunner(nn.Module):  # MoERunnerInterface(PluggableLayer): an nn.Module
        def __init__(self, layer_name, moe_config):
            super().__init__()
            self.moe_config = moe_config
            self.enable_dbo = False
            self.layer_name = layer_name
            self._forward_entry = self._select_forward()

        def _select_forward(self):
            return torch.ops.vllm_022_mirror.moe_forward

        def _encode_layer_name(self):
            return encode_layer_name(self)

        def forward(self, hidden_states, router_logits, input_ids=None):
            return self._forward_entry(
                hidden_states, router_logits, None, input_ids, self._encode_layer_name(), 0
            )

        def _sequence_parallel_context(self):
            return sequence_parallel_context(self)

        def _forward_impl(self, layer, hidden_states, router_logits, shared_experts_input, input_ids=None):
            layer.ensure_moe_quant_config_init()
            with self._sequence_parallel_context():
                return layer.experts.forward_impl(hidden_states, router_logits)

    class FusedMoE(QuantConfigOnFirstUse):
        def __init__(self, layer_name, moe_config, static_forward_context):
            super().__init__()
            self.layer_name = layer_name
            static_forward_context[layer_name] = self
            self.experts = routed_experts()
            self.runner = MoERunner(layer_name, moe_config)

        def forward(self, hidden_states, router_logits, input_ids=None):
            return self.runner.forward(hidden_states, router_logits, input_ids)

    return MoERunner, FusedMoE


# --- 0.17 to 0.19 ---


@torch.library.custom_op("vllm_019_mirror::moe_forward", mutates_args=())
def moe_forward_019(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor,
    shared_experts_input: torch.Tensor | None,
    layer_name: str,
) -> torch.Tensor:
    """`_moe_forward` (0.19): quant config, then the runner's impl in its sequence-parallel context."""
    OP_CALLS["moe_forward"] += 1
    layer = get_layer_from_name(layer_name)
    layer.ensure_moe_quant_config_init()
    runner = layer.runner
    with runner._sequence_parallel_context():
        return runner.forward_impl(layer, hidden_states, router_logits, shared_experts_input).clone()


@moe_forward_019.register_fake
def _(hidden_states, router_logits, shared_experts_input, layer_name):
    return torch.empty_like(hidden_states)


class CustomOp(nn.Module):
    """`vllm/model_executor/custom_op.py`: forward dispatches to the platform's forward_* method."""

    def forward(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


def mirror_019():
    """(`DefaultMoERunner`, `FusedMoE`) of 0.19.0: the runner is handed its layer and keeps its name."""

    class DefaultMoERunner:  # MoERunner(ABC): not an nn.Module
        def __init__(self, layer, moe_config, enable_dbo=False):
            self.moe_config = moe_config
            self.enable_dbo = enable_dbo
            self.layer_name = layer.layer_name
            self.moe_forward = self._select_forward(layer)

        def _select_forward(self, layer):
            return torch.ops.vllm_019_mirror.moe_forward

        @property
        def use_dp_chunking(self) -> bool:
            return False  # deepep_ll / mori / fi_all2allv kernels only

        def _encode_layer_name(self):
            return encode_layer_name(self)

        def forward(self, hidden_states, router_logits):
            return self.moe_forward(hidden_states, router_logits, None, self._encode_layer_name())

        def _sequence_parallel_context(self):
            return sequence_parallel_context(self)

        def forward_impl(self, layer, hidden_states, router_logits, shared_input):
            return layer.experts.forward_impl(hidden_states, router_logits)

    class FusedMoE(QuantConfigOnFirstUse, CustomOp):
        def __init__(self, layer_name, moe_config, static_forward_context):
            super().__init__()
            self.layer_name = layer_name
            static_forward_context[layer_name] = self
            self.experts = routed_experts()
            self.moe_config = moe_config
            self.runner = self._init_runner()

        def _init_runner(self):
            return DefaultMoERunner(layer=self, moe_config=self.moe_config)

        def forward_native(self, hidden_states, router_logits):
            return self.runner.forward(hidden_states, router_logits)

    return DefaultMoERunner, FusedMoE


# --- 0.10 to 0.16 ---


class FusedMoE016(CustomOp):
    """`FusedMoE` (0.16.0): forward_native calls the op itself; `forward_impl(hidden, logits)`."""

    def forward_native(self, hidden_states, router_logits):
        return torch.ops.vllm_033_mirror.moe_forward(
            hidden_states, router_logits, None, None, self.layer_name, 0
        )

    def forward_impl(self, hidden_states, router_logits):
        raise AssertionError("not called in these tests")


# --- a decoder stack around any of them ---


class DecoderLayer(nn.Module):
    """norm -> router gate -> the MoE layer, with a residual; one code object for every layer."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = experts

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = self.norm(hidden_states).reshape(-1, shape[-1])
        return hidden_states + self.experts(x, self.gate(x)).reshape(shape)


class Model(nn.Module):
    def __init__(self, layers: int, make_experts):
        super().__init__()
        self.static_forward_context: dict[str, nn.Module] = {}
        self.layers = nn.ModuleList(
            DecoderLayer(make_experts(f"model.layers.{i}.mlp.experts", self.static_forward_context))
            for i in range(layers)
        )


def build(layers: int, make_experts):
    """(Model, x [1, 9, HIDDEN]) with seeded weights; `make_experts(name, registry)` builds each MoE."""
    model = Model(layers, make_experts)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5)
    return model.eval(), torch.randn(1, 9, HIDDEN, generator=generator)


def run(layers, model, x, dp_ranks: int = 1, count_layers: bool = False):
    """The layers one after another inside vLLM's forward context."""
    with torch.no_grad(), forward_context(model, dp_ranks, count_layers, x.shape[1]):
        for layer in layers:
            x = layer(x)
    return x
