"""LongCat-Next SFT's `_deterministic_moe`: stable-argsort dispatch cut at the routed count, split loop.

Mirrors ShinnChow/LongCat-Next `sft/model/fsdp_utils.py` at commit 49dc718 (`_patch_moe_for_checkpoint`,
the `_deterministic_moe` it defines and assigns over `LongcatFlashMoE.moe`, found by class name in the
loaded model), on its default path (`use_grouped_gemm=False`). The module it patches is LongCat-Flash's
`LongcatFlashMoE` as the Hugging Face modular code first wrote it (huggingface/transformers
`models/longcat_flash/modular_longcat_flash.py`, read from a stored copy; LongCat-Next's own remote code is
not on GitHub): `LongcatFlashTopkRouter` scores the flattened tokens with a float32 linear and a softmax
over the routed and the zero (identity) experts, picks the unsorted top-k of the scores plus the
`e_score_correction_bias` buffer under `@torch.no_grad()`, gathers the unbiased scores and multiplies them
by `routed_scaling_factor` (no renormalisation); `experts` is a ModuleList of SwiGLU MLPs followed by
`zero_expert_num` `nn.Identity()`; the forward views the tokens flat and calls `self.moe(...)`. The patched
`moe` casts the weights to the input dtype, stable-argsorts the flat ids, counts the routed pairs on the
host (`num_out_tokens = (flat_indices < n_routed).sum().item()`) and keeps only that many sorted positions
(identity ids sort last), computes token ids (`// topk`) and expert ids, counts tokens per routed expert
with `zeros(n_routed).scatter_add_(..., ones_like(...))` under `if sorted_expert_ids.numel() > 0:`,
gathers with `index_select`, `torch.split`s by `tokens_per_expert.tolist()` and loops over every routed
expert (no empty skip) with three `torch.matmul`s against the experts' transposed Linear weights,
`torch.cat`s the pieces (under `if len(expert_outputs) > 0:`), `index_copy_`s them into a zero
[N*topk, H] buffer at the sorted positions, views it [N, topk, H], multiplies by the weights and sums the
slots; the identity experts add `hidden * (weights * identity_mask).sum(-1)` since `n_routed < n_total`.
Tiny sizes: 4 routed experts plus 2 identity experts, top-2 (LongCat-Flash: 512 + 256, top-12, routed
scaling 6.0, which is kept). The router's bias buffer is zeros as constructed.
The original `moe` (one-hot `torch.where` loop with `if token_indices.numel() > 0`) is kept on the class,
as the patch finds it there, and is never called once patched.
Left out: the `use_grouped_gemm=True` path (the `grouped_gemm` library's gmm in an autograd Function),
the activation-checkpoint wrapper around the decoder layer (it calls the plain forward when grad is off),
FSDP2 sharding, and the rest of the decoder layer (MLA attention, dense MLPs, shortcut connection).
Constructs: a method patched onto a class found by name, a closure flag, `hasattr(self.config, ...)`,
stable `argsort`, `.sum().item()` cut of the sorted positions, a guarded in-place `scatter_add_` count,
`index_select`, `.tolist()` counts fed to `torch.split`, a loop over all routed experts with no empty skip,
`index_copy_` unpermute, `view`/mul/sum combine, identity experts added by mask.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("ShinnChow/LongCat-Next", "sft/model/fsdp_utils.py", "49dc718151f9943a9dca2c1169541934bb85d83e",
                "_patch_moe_for_checkpoint._deterministic_moe")
HIDDEN, INTER, EXPERTS, ZERO_EXPERTS, TOP_K = 16, 8, 4, 2, 2

CONFIG = SimpleNamespace(hidden_size=HIDDEN, expert_ffn_hidden_size=INTER, n_routed_experts=EXPERTS,
                         zero_expert_num=ZERO_EXPERTS, zero_expert_type="identity", moe_topk=TOP_K,
                         routed_scaling_factor=6.0, router_bias=False)


class LongcatFlashMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LongcatFlashTopkRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.moe_topk
        self.n_routed_experts = config.n_routed_experts + (config.zero_expert_num or 0)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_routed_experts))
        self.router_bias = getattr(config, "router_bias", False)
        self.classifier = nn.Linear(config.hidden_size, self.n_routed_experts, bias=self.router_bias)

    @torch.no_grad()
    def get_topk_indices(self, scores):
        scores_for_choice = scores.view(-1, self.n_routed_experts) + self.e_score_correction_bias.unsqueeze(0)
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        return topk_indices

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, self.config.hidden_size)
        router_logits = F.linear(hidden_states.type(torch.float32), self.classifier.weight.type(torch.float32))
        scores = router_logits.softmax(dim=-1)
        topk_indices = self.get_topk_indices(scores)
        topk_weights = scores.gather(1, topk_indices)
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_indices, topk_weights


class LongcatFlashMoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.intermediate_size = config.expert_ffn_hidden_size
        self.experts = nn.ModuleList(
            [LongcatFlashMLP(config, intermediate_size=self.intermediate_size) for _ in range(config.n_routed_experts)]
            + [nn.Identity() for _ in range(config.zero_expert_num)]
        )
        self.router = LongcatFlashTopkRouter(config)

    def moe(self, hidden_states, topk_indices, topk_weights):
        """The original (DeepseekV3MoE.moe); `_patch_moe_for_checkpoint` replaces it on the class."""
        final_hidden_states = torch.zeros_like(hidden_states, dtype=topk_weights.dtype)
        expert_mask = F.one_hot(topk_indices, num_classes=len(self.experts)).permute(2, 0, 1)
        for expert_idx in range(len(self.experts)):
            expert = self.experts[expert_idx]
            token_indices, weight_indices = torch.where(expert_mask[expert_idx])
            if token_indices.numel() > 0:
                expert_weights = topk_weights[token_indices, weight_indices]
                expert_output = expert(hidden_states[token_indices])
                final_hidden_states.index_add_(0, token_indices, expert_output * expert_weights.unsqueeze(-1))
        return final_hidden_states.type(hidden_states.dtype)

    def forward(self, hidden_states):
        orig_shape = hidden_states.shape
        topk_indices, topk_weights = self.router(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.moe(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        return hidden_states


_moe_patched = False


def _find_moe_class(model=None):
    if model is not None:
        for _name, module in model.named_modules():
            if type(module).__name__ == "LongcatFlashMoE":
                return type(module)
    return None


def _patch_moe_for_checkpoint(model=None, use_grouped_gemm=False):
    global _moe_patched
    if _moe_patched:
        return
    _moe_patched = True

    moe_class = _find_moe_class(model)
    if moe_class is None:
        return

    def _deterministic_moe(self, hidden_states, topk_indices, topk_weights):
        topk_weights = topk_weights.to(hidden_states.dtype)
        orig_shape = hidden_states.shape
        hidden_states_for_dispatch = hidden_states.view(-1, hidden_states.shape[-1])
        _hs_orig_for_identity = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = hidden_states_for_dispatch
        num_tokens, hidden_size = hidden_states.shape
        topk = topk_indices.shape[1]

        n_total = len(self.experts)
        n_routed = 256
        if hasattr(self, "config") and hasattr(self.config, "n_routed_experts"):
            n_routed = self.config.n_routed_experts

        flat_indices = topk_indices.view(-1)
        sorted_indices_full = torch.argsort(flat_indices, stable=True)
        num_out_tokens = (flat_indices < n_routed).sum().item()
        sorted_indices = sorted_indices_full[:num_out_tokens]

        sorted_token_ids = sorted_indices // topk
        sorted_expert_ids = flat_indices[sorted_indices]

        tokens_per_expert = torch.zeros(n_routed, dtype=torch.long, device=hidden_states.device)
        if sorted_expert_ids.numel() > 0:
            tokens_per_expert.scatter_add_(0, sorted_expert_ids.long(),
                                           torch.ones_like(sorted_expert_ids, dtype=torch.long))

        permuted_input = hidden_states.index_select(0, sorted_token_ids)

        # use_grouped_gemm=False: per-expert matmuls on the experts' own weights, then unpermute
        input_splits = list(torch.split(permuted_input, tokens_per_expert.tolist(), dim=0))

        expert_outputs = []
        for e in range(n_routed):
            expert_input = input_splits[e]
            gate_out = torch.matmul(expert_input, self.experts[e].gate_proj.weight.t())
            up_out = torch.matmul(expert_input, self.experts[e].up_proj.weight.t())
            act_out = torch.nn.functional.silu(gate_out) * up_out
            expert_output = torch.matmul(act_out, self.experts[e].down_proj.weight.t())
            expert_outputs.append(expert_output)

        if len(expert_outputs) > 0:
            permuted_output = torch.cat(expert_outputs, dim=0)

        flat_output = torch.zeros(num_tokens * topk, hidden_size,
                                  device=hidden_states.device, dtype=hidden_states.dtype)
        flat_output.index_copy_(0, sorted_indices, permuted_output)
        flat_output = flat_output.view(num_tokens, topk, hidden_size)
        flat_output = flat_output * topk_weights.unsqueeze(-1)
        final_hidden_states = flat_output.sum(dim=1)

        if n_routed < n_total:
            identity_mask = (topk_indices >= n_routed) & (topk_indices < n_total)
            iw_sum = (topk_weights * identity_mask.to(topk_weights.dtype)).sum(dim=-1, keepdim=True)
            final_hidden_states = final_hidden_states + _hs_orig_for_identity * iw_sum

        return final_hidden_states.view(orig_shape)

    moe_class.moe = _deterministic_moe


def patched_longcat_flash_moe():
    moe = LongcatFlashMoE(CONFIG)
    _patch_moe_for_checkpoint(model=moe)
    return moe


def build():
    return tiny(patched_longcat_flash_moe, HIDDEN)
