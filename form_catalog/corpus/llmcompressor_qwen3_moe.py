"""llm-compressor's `CalibrationQwen3MoeSparseMoeBlock`: Qwen3-MoE's block as swapped in for quantisation
calibration, where every expert runs on every token and only the routed rows are kept.

Mirrors vllm-project/llm-compressor `src/llmcompressor/modeling/qwen3_moe.py` at commit 91d8d9d (the file's last
change, "Remove replace_module_for_calibration"; unchanged through 4818655, and deleted by a71ae23 "Transformers v5",
which moved MoE calibration to `modeling/moe/linearize.py`): `CalibrationQwen3MoeSparseMoeBlock.__init__` /
`forward` / `restore`, and its base `MoECalibrationModule` from `modeling/moe_context.py` at the same commit
(`ABC, torch.nn.Module, RegistryMixin`, `is_permanent`, `restore`). `moe_calibration_context(model,
calibrate_all_experts=True)` replaces every registered `Qwen3MoeSparseMoeBlock` with
`CalibrationQwen3MoeSparseMoeBlock(original=module, config=model.config, calibrate_all_experts=True)`, which
takes over the original's `gate` and `experts`. Those come from transformers' `Qwen3MoeSparseMoeBlock.__init__`
and `Qwen3MoeMLP` (read in transformers 4.55.4, inside the `>=4.54.0,<=4.57.3` pin of that commit's setup.py):
a bias-free Linear gate and a ModuleList of SwiGLU MLPs (gate_proj, up_proj, down_proj, `ACT2FN["silu"]`), sized
by `moe_intermediate_size`; both are mirrored here as local classes, with a plain config class.
`forward(hidden_states)` views tokens [T, H], takes `torch.nn.functional.softmax(router_logits, dim=1,
dtype=torch.float)`, `torch.topk(..., top_k)`, `if self.norm_topk_prob:` renormalises in place (`/=`), casts back
to the input dtype, one-hot encodes the choices to an [E, k, T] mask, then `for expert_idx, expert_layer in
enumerate(self.experts)`: `idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))`; `if
self.calibrate_all_experts:` the expert runs on ALL T tokens and its output is gathered `[top_x]` afterwards
(else it runs on `hidden_states[top_x]`); `if len(top_x) > 0:` the rows are scaled by
`routing_weights[top_x, idx, None]` and `index_add_`ed into a zeros buffer. It returns
`(final_hidden_states reshaped [B, S, H], router_logits)`; the decoder layer keeps the first.
Left out: the `@MoECalibrationModule.register("Qwen3MoeSparseMoeBlock")` registry decorator and `RegistryMixin`
(compressed-tensors), the context manager's module swapping and logging (the model here is built already
swapped), attention and the rest of the decoder. Nothing of the MoE forward was left out.
Sizes: Qwen3-30B-A3B has hidden 2048, moe_intermediate 768, 128 experts, top-8, norm_topk_prob true; here hidden
16, moe_intermediate 8, 8 experts, top-2, norm_topk_prob true, 7 tokens.
Constructs: an ABC + nn.Module base class with a class attribute, submodules shared from another module,
float32 softmax + `topk`, a config-valued `if norm_topk_prob` in-place `/=`, `one_hot(...).permute(2, 1, 0)`,
a loop over `enumerate(ModuleList)`, `torch.where` on a `squeeze(0)`'d mask row, a flag-selected dense
expert call on every token followed by an advanced-index row gather, a data-dependent `if len(top_x) > 0`
host check, `index_add_` into a zeros buffer, a tuple return.
"""

from __future__ import annotations

from abc import ABC

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("vllm-project/llm-compressor", "src/llmcompressor/modeling/qwen3_moe.py",
                "91d8d9d44f221037c1f1c60d5bf9b1ff42bf81ee", "CalibrationQwen3MoeSparseMoeBlock.forward")
HIDDEN, MOE_INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class Qwen3MoeConfig:
    """The MoE fields of transformers' `Qwen3MoeConfig` (sizes tiny, `norm_topk_prob` as Qwen3-30B-A3B)."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=32, moe_intermediate_size=MOE_INTER, hidden_act="silu",
                 num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.hidden_act = hidden_act
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob


ACT2FN = {"silu": nn.SiLU()}


class Qwen3MoeMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size if intermediate_size is not None else config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class OriginalQwen3MoeSparseMoeBlock(nn.Module):
    """transformers' `Qwen3MoeSparseMoeBlock.__init__` only: the calibration block takes its gate and experts."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

        # gating
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(self.num_experts)]
        )


class MoECalibrationModule(ABC, torch.nn.Module):
    is_permanent: bool = False

    def restore(self, original: torch.nn.Module) -> torch.nn.Module:
        if self.is_permanent:
            return self
        raise NotImplementedError(
            f"{self.__class__.__name__} has is_permanent=False but doesn't implement restore()"
        )


class CalibrationQwen3MoeSparseMoeBlock(MoECalibrationModule):
    is_permanent = False

    def __init__(self, original, config, calibrate_all_experts: bool = True):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

        self.calibrate_all_experts = calibrate_all_experts
        self.gate = original.gate
        self.experts = original.experts

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        # router_logits: (batch * sequence_length, n_experts)
        router_logits = self.gate(hidden_states)

        routing_weights = torch.nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        # cast back to the input dtype
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )

        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)

        for expert_idx, expert_layer in enumerate(self.experts):
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))

            if self.calibrate_all_experts:
                expert_out = expert_layer(hidden_states)[top_x]
            else:
                expert_out = expert_layer(hidden_states[top_x])

            if len(top_x) > 0:
                current_hidden_states = expert_out * routing_weights[top_x, idx, None]
                final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))

        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits

    def restore(self, original: torch.nn.Module) -> torch.nn.Module:
        return original


def _calibration_block():
    config = Qwen3MoeConfig()
    return CalibrationQwen3MoeSparseMoeBlock(OriginalQwen3MoeSparseMoeBlock(config), config, calibrate_all_experts=True)


def build():
    return tiny(_calibration_block, HIDDEN)
