"""Aria's language-model `MoELayer`: Megatron-style top-k router, argsort dispatcher, sequential grouped GEMM, shared experts.

Mirrors rhymes-ai/Aria `aria/model/moe_lm.py` at commit 9b25fec (`AriaMoELMConfig`, `MoEAuxLossAutoScaler`,
`z_loss_func`, `switch_load_balancing_loss_func`, `TopKRouter`, `TokenDispatcher`, `SharedExpertMLP`,
`sequential_gemm`, the `experts_gemm` import fallback, `GroupedGEMM`, `GroupedMLP`, `MoELayer.forward`), with
`LlamaMLP.forward` of transformers 4.46.3 (the version Aria's pyproject pins), which `SharedExpertMLP`
inherits: its `if self.config.pretraining_tp > 1` weight-slicing branch is kept (the tiny config has the
default pretraining_tp = 1, so the plain gate/up/down path runs).
The router applies F.linear with a bias-free [E, H] weight to the [B, S, H] input, views the logits
[-1, E], and in training wraps them in `MoEAuxLossAutoScaler.apply` with a z-loss (a custom
autograd.Function that returns its input and injects the loss gradient); `torch.topk(logits, k, dim=1)`
picks the experts, a float32 softmax over the k logits gives the scores (`.type_as(logits)`), and
`torch.histc` of the flat ids counts tokens per expert; in training the scores pass through
`MoEAuxLossAutoScaler.apply` again with the switch load-balancing loss. `TokenDispatcher` is a plain
Python object (not a module) that stores state on itself during forward: `token_permutation` records the
input shape, stable-`argsort`s the flat ids, `index_select`s the rows `sorted_indices // topk` and keeps
the permutation in `self.reversed_input_permutation_mapping`; `token_unpermutation` `index_copy_`s the expert
outputs back into a zero [T*k, H] buffer, reshapes to [T, k, H], multiplies by the scores, sums over k and
views the result to the stored shape. The routed experts are `GroupedMLP`: two `GroupedGEMM` weights
([E, H, 2I] and [E, I, H], used as `x @ w`) around a `glu` closure defined in `__init__` (`torch.chunk`
in two, silu(a) * b). `GroupedGEMM.forward` moves the counts to the host (`tokens_per_expert.cpu()`),
calls `torch.cuda.set_device(input.device)` and then `experts_gemm`, chosen at import: the `grouped_gemm`
package's `gmm` if it imports (and `USE_GROUPED_GEMM` is not "0"), otherwise `sequential_gemm`, which
allocates a zero output, takes the `torch.cumsum` of the counts, prepends a long zero with `torch.cat`,
and loops `for expert_num in range(weight.shape[0])` reading `start`/`end` as 0-d tensors from the
cumulative counts, slicing `input[start:end]` (no empty-expert skip), matmul-ing with `weight[expert_num]`
and writing `output[start:end] = out`. The shared experts are one SwiGLU MLP of width
moe_intermediate_size * moe_num_shared_experts run on every token, added in place (`output += ...`).
Left out: the `grouped_gemm` CUDA kernel (not installed here, so the original's own `sequential_gemm`
fallback is what runs; the import-time fallback warnings are logged at debug level to keep imports quiet).
Two CUDA-only calls are adapted so the layer runs on CPU: `torch.histc` rejects int64 on CPU, so the ids
are cast to float for it and the counts back to the ids' int64 dtype (what CUDA's int64 `histc` returns,
which `sequential_gemm` needs to slice with); `torch.cuda.set_device(input.device)` raises for a CPU
device, so it runs only `if input.is_cuda`. The z-loss and load-balancing loss are kept behind the
original's `if self.training` branches (the model runs in eval). The real Aria text model has 64 experts,
top-6, 2 shared experts (kept: top-6 and 2 shared experts, with 16 experts at the tiny size).
Constructs: an autograd.Function applied in training-only branches, `torch.histc` counts, a non-module
dispatcher object mutated in forward, stable `argsort` + `index_select` permutation and `index_copy_`
unpermutation, a closure activation stored on the module, a `.cpu()` host copy of the counts, a
`cumsum`/`cat` offset table read as 0-d tensor slice bounds in a `range(num_experts)` loop with sliced
in-place writes, an import-time `try/except ImportError` kernel fallback, a `pretraining_tp` config branch,
in-place `+=` of the shared-expert output.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("rhymes-ai/Aria", "aria/model/moe_lm.py", "9b25fecb02553a24832c26617d4e034517f71260",
                "MoELayer.forward")
HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 16, 8, 16, 6, 2

logger = logging.getLogger(__name__)


class AriaMoELMConfig:
    """The LlamaConfig fields the MoE layer reads (Llama defaults), plus Aria's MoE fields (Aria defaults)."""

    def __init__(self, hidden_size=HIDDEN, hidden_act="silu", mlp_bias=False, pretraining_tp=1,
                 moe_intermediate_size=INTER, moe_num_experts=EXPERTS, moe_topk=TOP_K, moe_z_loss_coeff=1e-5,
                 moe_aux_loss_coeff=1e-3, moe_num_shared_experts=SHARED):
        self.hidden_size = hidden_size
        self.hidden_act = hidden_act
        self.mlp_bias = mlp_bias
        self.pretraining_tp = pretraining_tp
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_num_experts = moe_num_experts
        self.moe_topk = moe_topk
        self.moe_z_loss_coeff = moe_z_loss_coeff
        self.moe_aux_loss_coeff = moe_aux_loss_coeff
        self.moe_num_shared_experts = moe_num_shared_experts


ACT2FN = {"silu": nn.SiLU()}


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Returns `output` unchanged; in backward, hands `aux_loss` a gradient of `main_loss_backward_scale`."""

    main_loss_backward_scale: torch.Tensor = torch.tensor(1.0)

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        aux_loss_backward_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        scaled_aux_loss_grad = torch.ones_like(aux_loss) * aux_loss_backward_scale
        return grad_output, scaled_aux_loss_grad

    @staticmethod
    def set_loss_scale(scale):
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


def z_loss_func(logits, z_loss_coeff):
    z_loss = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff
    return z_loss


def switch_load_balancing_loss_func(probs, tokens_per_expert, topk, moe_aux_loss_coeff):
    num_tokens = probs.shape[0] * topk
    num_experts = probs.shape[1]

    probs_mean_per_expert = probs.mean(dim=0)
    aux_loss = torch.sum(probs_mean_per_expert * tokens_per_expert) * (
        num_experts / num_tokens * moe_aux_loss_coeff
    )
    return aux_loss


class TopKRouter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty((self.config.moe_num_experts, self.config.hidden_size)))

    def gating(self, input):
        logits = torch.nn.functional.linear(input, self.weight)
        return logits

    def apply_z_loss(self, logits):
        z_loss = z_loss_func(logits, self.config.moe_z_loss_coeff)
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        return logits

    def apply_aux_loss(self, logits, tokens_per_expert, activation):
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        aux_loss = switch_load_balancing_loss_func(
            probs, tokens_per_expert, self.config.moe_topk, self.config.moe_aux_loss_coeff)
        return MoEAuxLossAutoScaler.apply(activation, aux_loss)

    def routing(self, logits):
        if self.training:
            logits = self.apply_z_loss(logits)

        top_logits, top_indices = torch.topk(logits, k=self.config.moe_topk, dim=1)
        scores = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)

        # CPU histc has no int64 kernel: count a float copy, return CUDA's int64 result dtype.
        tokens_per_expert = torch.histc(
            top_indices.flatten().float(),
            bins=self.config.moe_num_experts,
            min=0,
            max=self.config.moe_num_experts - 1,
        ).to(top_indices.dtype)

        if self.training:
            scores = self.apply_aux_loss(logits, tokens_per_expert, scores)
        return scores, top_indices, tokens_per_expert

    def forward(self, input):
        logits = self.gating(input)
        logits = logits.view(-1, self.config.moe_num_experts)
        scores, top_indices, tokens_per_expert = self.routing(logits)
        return scores, top_indices, tokens_per_expert


class TokenDispatcher:
    """Not a module: it keeps the input shape and the permutation on itself between the two calls."""

    def __init__(self, config):
        self.config = config
        self.hidden_states_shape = None
        self.reversed_input_permutation_mapping = None

    def token_permutation(self, hidden_states, indices):
        self.hidden_states_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_states.size(-1))
        flatten_indices = indices.flatten()
        sorted_indices = torch.argsort(flatten_indices, stable=True)
        permuted_tokens = hidden_states.index_select(0, sorted_indices // self.config.moe_topk)
        self.reversed_input_permutation_mapping = sorted_indices
        return permuted_tokens

    def token_unpermutation(self, permuted_tokens, scores):
        num_unpermuted_tokens = scores.numel()
        unpermuted_tokens = torch.zeros(
            (num_unpermuted_tokens, permuted_tokens.size(1)),
            dtype=permuted_tokens.dtype,
            device=permuted_tokens.device,
        )
        unpermuted_tokens.index_copy_(0, self.reversed_input_permutation_mapping, permuted_tokens)
        unpermuted_tokens = unpermuted_tokens.reshape(-1, self.config.moe_topk, permuted_tokens.size(1))

        unpermuted_tokens = unpermuted_tokens * scores.unsqueeze(-1)
        unpermuted_tokens = unpermuted_tokens.sum(dim=1).type_as(permuted_tokens)
        output = unpermuted_tokens.view(self.hidden_states_shape)
        return output


class LlamaMLP(nn.Module):
    """transformers 4.46 `LlamaMLP` (only its forward is inherited by `SharedExpertMLP`)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        if self.config.pretraining_tp > 1:
            slice = self.intermediate_size // self.config.pretraining_tp  # noqa: A001 - the original's name
            gate_proj_slices = self.gate_proj.weight.split(slice, dim=0)
            up_proj_slices = self.up_proj.weight.split(slice, dim=0)
            down_proj_slices = self.down_proj.weight.split(slice, dim=1)

            gate_proj = torch.cat(
                [F.linear(x, gate_proj_slices[i]) for i in range(self.config.pretraining_tp)], dim=-1)
            up_proj = torch.cat([F.linear(x, up_proj_slices[i]) for i in range(self.config.pretraining_tp)], dim=-1)

            intermediate_states = (self.act_fn(gate_proj) * up_proj).split(slice, dim=2)
            down_proj = [
                F.linear(intermediate_states[i], down_proj_slices[i]) for i in range(self.config.pretraining_tp)
            ]
            down_proj = sum(down_proj)
        else:
            down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return down_proj


class SharedExpertMLP(LlamaMLP):
    def __init__(self, config):
        nn.Module.__init__(self)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_intermediate_size * config.moe_num_shared_experts
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]


def sequential_gemm(input, weight, tokens_per_expert):
    num_tokens = input.shape[0]
    out_features = weight.shape[-1]
    output = torch.zeros(num_tokens, out_features, dtype=input.dtype, device=input.device)

    cumsum_num_tokens = torch.cumsum(tokens_per_expert, dim=0)
    # a leading zero so that expert i's rows are [cumsum[i], cumsum[i + 1])
    zero_tensor = torch.zeros(1, dtype=torch.long, device=cumsum_num_tokens.device)
    cumsum_num_tokens = torch.cat((zero_tensor, cumsum_num_tokens))

    for expert_num in range(weight.shape[0]):
        start = cumsum_num_tokens[expert_num]
        end = cumsum_num_tokens[expert_num + 1]
        tokens = input[start:end]

        out = torch.matmul(tokens, weight[expert_num])
        output[start:end] = out
    return output


try:
    from grouped_gemm.ops import gmm as experts_gemm

    if os.environ.get("USE_GROUPED_GEMM", "1") == "0":
        logger.debug("environment variable USE_GROUPED_GEMM is set to 0, using sequential GEMM instead.")
        experts_gemm = sequential_gemm
except ImportError:
    logger.debug("`grouped_gemm` is not installed, using sequential GEMM, which is slower.")
    experts_gemm = sequential_gemm


class GroupedGEMM(nn.Module):
    def __init__(self, in_features, out_features, groups):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups, in_features, out_features))

    def forward(self, input, tokens_per_expert):
        tokens_per_expert = tokens_per_expert.cpu()

        # torch.cuda.set_device raises for a CPU device; the original calls it unconditionally on GPU.
        if input.is_cuda:
            torch.cuda.set_device(input.device)
        return experts_gemm(input, self.weight, tokens_per_expert)


class GroupedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.fc1 = GroupedGEMM(config.hidden_size, config.moe_intermediate_size * 2, config.moe_num_experts)
        self.fc2 = GroupedGEMM(config.moe_intermediate_size, config.hidden_size, config.moe_num_experts)

        def glu(x):
            x = torch.chunk(x, 2, dim=-1)
            return F.silu(x[0]) * x[1]

        self.activation_func = glu

    def forward(self, permuted_tokens, tokens_per_expert):
        fc1_output = self.fc1(permuted_tokens, tokens_per_expert)
        fc1_output = self.activation_func(fc1_output)
        fc2_output = self.fc2(fc1_output, tokens_per_expert)
        return fc2_output


class MoELayer(nn.Module):
    def __init__(self, config):
        super().__init__()

        self.router = TopKRouter(config)
        self.token_dispatcher = TokenDispatcher(config)
        self.experts = GroupedMLP(config)
        self.shared_experts = SharedExpertMLP(config)

    def forward(self, hidden_states):
        scores, indices, tokens_per_expert = self.router(hidden_states)

        permuted_tokens = self.token_dispatcher.token_permutation(hidden_states, indices)

        expert_output = self.experts(permuted_tokens, tokens_per_expert)

        output = self.token_dispatcher.token_unpermutation(expert_output, scores)

        shared_expert_output = self.shared_experts(hidden_states)
        output += shared_expert_output
        return output


def make_layer():
    return MoELayer(AriaMoELMConfig())


def build():
    return tiny(make_layer, HIDDEN)
