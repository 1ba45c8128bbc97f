"""MixLoRA's `MixLoraSparseMoe`: a frozen dense LLaMA MLP turned into 8 LoRA experts that share its base weights,
patched in by overwriting the MLP instance's `forward`, with a plain-tensor router and a plain-dict of experts.

Mirrors TUDB-Labs/MixLoRA at commit d59d09b (the repository's newest stored commit, "[bugfix] remove assign of
gate_"): `mixlora/model.py` (`_slice_tensor`, `MixLoraSparseMoe.__init__` / `_llama_forward` / `forward`,
`_inject_mlp_module`), `mixlora/lora_linear.py` (`LoraLinear.__init__` / `_get_weight_norm` / `reset_parameters`
/ `apply_dora` / `lora_forward`) and `mixlora/config.py` (the `MixLoraConfig` fields, with the README's
"mixlora" top-k routing example: 8 experts, top-2, jitter 0.0, r 8, alpha 16, dropout 0.05, LoRA on gate_proj,
up_proj and down_proj; `act_fn` "silu" as in its `tests/test_moe_layer.py`). The base MLP is transformers'
`LlamaMLP` (gate_proj / up_proj / down_proj, bias-free, SiLU), mirrored here.
Injection (`_inject_mlp_module`): a `MixLoraSparseMoe` wraps the dense MLP as `base_layer_`, takes the router
weight as a PLAIN TENSOR attribute `gate_` (not a Parameter), keeps one `LoraLinear` per (expert, projection) in a
PLAIN `dict` `experts_` (not a ModuleDict; each LoraLinear holds the SAME shared base nn.Linear), stores itself in
a plain dict `mlp.mixlora_moes`, and sets `mlp.forward = moe_layer.forward`: the decoder keeps calling the MLP
module, whose instance attribute `forward` is now the bound method of an unregistered module.
`MixLoraSparseMoe.forward`: `if self.jitter_noise_ > 0` an in-place uniform jitter (off here, as configured),
`view(-1, H).to(dtype_)`, `F.linear` with `gate_.to(hidden_states)`, a float softmax, `topk`, in-place `/=`
renormalisation, a `zeros` accumulator, a one-hot `permute(2, 1, 0)` expert mask; then `_llama_forward` (chosen
in `__init__` by `getattr` on a model-type table) runs the BASE gate_proj and up_proj once on ALL tokens and, for
EVERY expert (`range(num_experts_)`, no skip of empty ones), `torch.where` on its mask, `experts_.get(...)`
look-ups with `is not None` branches, row gathers via `_slice_tensor` (`data[None, top_x].reshape(-1, H)`) of the
common projections and of the input, `LoraLinear.lora_forward` (`lora_B(lora_A(dropout(x))) * scaling` added to
the gathered base output, behind an `if self.use_dora_` branch), `act_fn(gate) * up`, the base `down_proj` plus
its LoRA delta, appended to a Python list. A second loop over all experts repeats `torch.where`, weights each
list entry by `routing_weights[top_x, idx, None]` and `index_add_`s it; the result is reshaped to [B, S, H] and
cast back to the input dtype.
Left out: attention and its LoRA injection (`_inject_attn_module`), `_phi_forward` / `_phi3_forward` (other
model types), `load_adapter_weights` / `from_pretrained` (the router and LoRA weights are drawn here from a fixed
generator, scaled like the shell's and LoRA B by a further 0.1, to stand in for a loaded `adapter_model.bin`;
the base MLP weights are the shell's), bitsandbytes dequantisation (`_get_weight_norm` reads the plain Linear weight, which is what
`dequantize_module_weight` returns for one), the shell's pre-MoE norm and residual. One setup difference: the
LoraLinears live in a plain dict, so `model.eval()` never reaches them and upstream leaves their LoRA dropout
(p=0.05) ACTIVE at inference; the factory calls `.eval()` on each so that the output is deterministic. Nothing of
the MoE forward was left out.
Sizes: MixLoRA is typically applied to LLaMA-2-7B (hidden 4096, intermediate 11008) with 8 experts, top-2, r 8;
here hidden 16, intermediate 32, 8 experts, top-2, r 8, alpha 16, one layer.
Constructs: an instance-attribute `forward` override on the called module, an unregistered plain-tensor router
weight and a plain dict of unregistered LoRA modules sharing one base Linear, a config-valued jitter branch,
`F.linear` with `.to(tensor)`, softmax + `topk` + in-place `/=`, a one-hot permuted mask, shared base
projections on all tokens then per-expert `torch.where` + `[None, idx]` gathers, dict `.get` + `is not None`
branches, LoRA deltas (`B(A(dropout(x))) * scaling`) added to gathered base outputs, a DoRA branch, a Python list
of per-expert outputs consumed by a second loop, `index_add_`, dtype round-trips.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("TUDB-Labs/MixLoRA", "mixlora/model.py", "d59d09b647a9b07b0808cb0b669306c9c9215b29",
                "MixLoraSparseMoe.forward")
HIDDEN, INTER, EXPERTS, TOP_K, LORA_R, LORA_ALPHA = 16, 32, 8, 2, 8, 16

ACT2FN = {"silu": nn.SiLU()}


class MixLoraConfig:
    """The `MixLoraConfig` fields the MoE layer reads (README "mixlora" example; model_type set on injection)."""

    def __init__(self):
        self.dtype_ = torch.float32
        self.model_type_ = "llama"
        self.adapter_name_ = "default"
        self.use_dora_ = False
        self.use_rslora_ = False
        self.lora_init_ = "original"
        self.lora_r_ = LORA_R
        self.lora_alpha_ = LORA_ALPHA
        self.lora_dropout_ = 0.05
        self.target_modules_ = {"gate_proj": True, "down_proj": True, "up_proj": True}
        self.routing_strategy_ = "mixlora"
        self.jitter_noise_ = 0.0
        self.num_experts_ = EXPERTS
        self.act_fn_ = "silu"
        self.top_k_ = TOP_K


class LlamaMLP(nn.Module):
    """transformers' dense `LlamaMLP` (bias-free, SiLU): the base layer MixLoRA wraps."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN["silu"]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Module, config: MixLoraConfig, weight=(None, None), device: str = None):
        super().__init__()
        out_dim, in_dim = base_layer.weight.shape

        self.base_layer_ = base_layer
        self.device_ = torch.device(device) if device else base_layer.weight.device
        self.dtype_ = config.dtype_

        self.initializer_ = config.lora_init_
        self.r_ = config.lora_r_
        self.alpha_ = config.lora_alpha_
        if config.use_rslora_:
            self.scaling_ = self.alpha_ / math.sqrt(self.r_)
        else:
            self.scaling_ = self.alpha_ / self.r_

        self.in_features_ = in_dim
        self.out_features_ = out_dim

        assert config.lora_dropout_ > 0.0
        self.dropout_ = nn.Dropout(p=config.lora_dropout_)

        self.lora_A = nn.Linear(self.in_features_, self.r_, bias=False, dtype=self.dtype_, device=self.device_)
        self.lora_B = nn.Linear(self.r_, self.out_features_, bias=False, dtype=self.dtype_, device=self.device_)

        self.use_dora_: bool = config.use_dora_
        self.magnitude_vector_: nn.Parameter = None

        self.reset_parameters(weight)

    def _get_weight_norm(self) -> torch.Tensor:
        # column-wise L2 norm of the merged weight (a plain Linear needs no dequantisation)
        weight = self.base_layer_.weight.to(self.dtype_)
        lora_weight = self.lora_B.weight @ self.lora_A.weight
        weight = weight + self.scaling_ * lora_weight
        return torch.linalg.norm(weight, dim=1).to(weight.dtype)

    def reset_parameters(self, weight=(None, None)) -> None:
        assert isinstance(weight, tuple) and len(weight) == 2
        if weight[0] is None and weight[1] is None:
            if self.initializer_ == "original":
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            elif self.initializer_ == "gaussian":
                nn.init.normal_(self.lora_A.weight, std=1 / self.r_)
            else:
                raise ValueError(f"Unknown initialization {self.initializer_}")
            nn.init.zeros_(self.lora_B.weight)
        else:
            with torch.no_grad():
                self.lora_A.weight.copy_(weight[0])
                self.lora_B.weight.copy_(weight[1])

        if self.use_dora_:
            self.magnitude_vector_ = nn.Parameter(self._get_weight_norm(), requires_grad=True)

    def apply_dora(self, residual: torch.Tensor, result_lora: torch.Tensor):
        weight_norm = self._get_weight_norm().detach()
        mag_norm_scale = (self.magnitude_vector_ / weight_norm).view(1, -1)
        return mag_norm_scale * residual + mag_norm_scale * result_lora

    def lora_forward(self, residual: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        result_lora = self.lora_B(self.lora_A(self.dropout_(hidden_states.to(self.dtype_)))) * self.scaling_
        if self.use_dora_:
            return self.apply_dora(residual, result_lora).to(hidden_states.dtype)
        else:
            return residual + result_lora.to(residual.dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = self.base_layer_(hidden_states)
        return self.lora_forward(residual, hidden_states)


def _slice_tensor(data: torch.Tensor, slice: torch.Tensor, dtype: torch.dtype,
                  last_value: torch.Tensor | None = None):
    if last_value is None:
        return data[None, slice].reshape(-1, data.shape[-1]).to(dtype)
    else:
        return last_value


# upstream also maps "phi" and "phi3" to `_phi_forward` / `_phi3_forward`, left out here
_compatible_model_types = {"llama": "_llama_forward", "gemma": "_llama_forward", "gemma2": "_llama_forward",
                           "qwen2": "_llama_forward", "mistral": "_llama_forward"}


class MixLoraSparseMoe(nn.Module):
    def __init__(self, base_layer: nn.Module, config: MixLoraConfig) -> None:
        super().__init__()
        self.dtype_: torch.dtype = config.dtype_
        self.gate_: torch.Tensor = None
        self.base_layer_: nn.Module = base_layer
        self.experts_: dict[str, LoraLinear] = {}
        self.act_fn_ = ACT2FN[config.act_fn_] if isinstance(config.act_fn_, str) else config.act_fn_
        self.num_experts_: int = config.num_experts_
        self.topk_: int = config.top_k_
        self.jitter_noise_: float = config.jitter_noise_
        if config.model_type_ not in _compatible_model_types:
            raise NotImplementedError()
        self.forward_fn_ = getattr(self, _compatible_model_types[config.model_type_])

    def _llama_forward(self, expert_mask: torch.Tensor, hidden_states: torch.Tensor, input_dtype: torch.dtype):
        # the frozen base projections, once for all tokens
        common_gate = self.base_layer_.gate_proj(hidden_states.to(input_dtype)).to(hidden_states.dtype)
        common_up = self.base_layer_.up_proj(hidden_states.to(input_dtype)).to(hidden_states.dtype)
        final_expert_states = []
        for expert_idx in range(self.num_experts_):
            _, top_x = torch.where(expert_mask[expert_idx])
            lora_gate: LoraLinear | None = self.experts_.get(f"experts.{expert_idx}.gate_proj", None)
            lora_down: LoraLinear | None = self.experts_.get(f"experts.{expert_idx}.down_proj", None)
            lora_up: LoraLinear | None = self.experts_.get(f"experts.{expert_idx}.up_proj", None)
            if lora_gate is not None:
                lora_data = _slice_tensor(hidden_states, top_x, input_dtype)
                gate_states = lora_gate.lora_forward(_slice_tensor(common_gate, top_x, input_dtype), lora_data)
            else:
                lora_data = None
                gate_states = _slice_tensor(common_gate, top_x, input_dtype)

            if lora_up is not None:
                lora_data = _slice_tensor(hidden_states, top_x, input_dtype)
                up_states = lora_up.lora_forward(_slice_tensor(common_up, top_x, input_dtype), lora_data)
            else:
                lora_data = None
                up_states = _slice_tensor(common_up, top_x, input_dtype)

            act_result = self.act_fn_(gate_states) * up_states

            if lora_down is not None:
                final_expert_states.append(lora_down.lora_forward(self.base_layer_.down_proj(act_result), act_result))
            else:
                final_expert_states.append(self.base_layer_.down_proj(act_result))

        return final_expert_states

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape

        if self.jitter_noise_ > 0:
            # scale the inputs by uniform noise in [1 - jitter, 1 + jitter]
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise_,
                                                                        1.0 + self.jitter_noise_)

        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.view(-1, hidden_dim).to(self.dtype_)
        router_logits = F.linear(hidden_states, self.gate_.to(hidden_states))

        routing_weights = F.softmax(router_logits, dim=1, dtype=self.dtype_)
        routing_weights, selected_experts = torch.topk(routing_weights, self.topk_, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)

        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=self.dtype_,
                                          device=hidden_states.device)

        # [E, k, T] mask of which token chose which expert in which slot
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts_).permute(2, 1, 0)

        expert_states = self.forward_fn_(expert_mask, hidden_states, input_dtype)

        for expert_idx in range(self.num_experts_):
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_hidden_states = expert_states[expert_idx] * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(self.dtype_))

        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim).to(input_dtype)
        return final_hidden_states


def _inject_mlp_module(layer_idx: int, mlp: nn.Module, config: MixLoraConfig, weights: dict[str, torch.Tensor]):
    moe_layer = MixLoraSparseMoe(mlp, config)
    moe_layer.gate_ = weights[f"mixlora.layers.{layer_idx}.mlp.moe_gate.weight"].to(config.dtype_)

    if not hasattr(mlp, "mixlora_moes"):
        mlp.mixlora_moes = {}

    mlp.mixlora_moes[config.adapter_name_] = moe_layer
    mlp.forward = moe_layer.forward

    for proj_name, inject in config.target_modules_.items():
        if not inject or not hasattr(mlp, proj_name):
            continue
        base_layer = getattr(mlp, proj_name)
        for expert_idx in range(config.num_experts_):
            layer_prefix_name = f"mixlora.layers.{layer_idx}.mlp.{proj_name}.experts.{expert_idx}"
            moe_layer.experts_[f"experts.{expert_idx}.{proj_name}"] = LoraLinear(
                base_layer,
                config,
                (weights[f"{layer_prefix_name}.lora_A.weight"], weights[f"{layer_prefix_name}.lora_B.weight"]),
            )


def _adapter_weights(layer_idx: int, config: MixLoraConfig, mlp: LlamaMLP) -> dict[str, torch.Tensor]:
    """Stands in for a loaded `adapter_model.bin`: router and LoRA A/B weights, drawn from a fixed generator and
    scaled by 1/sqrt(fan_in) like the shell's weights, LoRA B by a further 0.1 (a trained delta is small next to
    the base weight)."""
    generator = torch.Generator().manual_seed(1000 + layer_idx)

    def draw(*shape):
        return torch.randn(shape, generator=generator) / shape[-1] ** 0.5

    weights = {f"mixlora.layers.{layer_idx}.mlp.moe_gate.weight": draw(config.num_experts_, mlp.hidden_size)}
    for proj_name in config.target_modules_:
        out_dim, in_dim = getattr(mlp, proj_name).weight.shape
        for expert_idx in range(config.num_experts_):
            prefix = f"mixlora.layers.{layer_idx}.mlp.{proj_name}.experts.{expert_idx}"
            weights[f"{prefix}.lora_A.weight"] = draw(config.lora_r_, in_dim)
            weights[f"{prefix}.lora_B.weight"] = 0.1 * draw(out_dim, config.lora_r_)
    return weights


def make_layer(layer_idx: int = 0) -> LlamaMLP:
    """A dense LlamaMLP with a MixLoRA adapter injected the way `inject_adapter_in_model` does it."""
    config = MixLoraConfig()
    mlp = LlamaMLP(HIDDEN, INTER)
    _inject_mlp_module(layer_idx, mlp, config, _adapter_weights(layer_idx, config, mlp))
    # upstream leaves these unregistered LoRA modules in training mode (dropout on); see the docstring
    for lora in mlp.mixlora_moes[config.adapter_name_].experts_.values():
        lora.eval()
    return mlp


def build():
    return tiny(make_layer, HIDDEN)
