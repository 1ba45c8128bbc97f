"""ReMoE's ReLU-routed Megatron `MoELayer`: `relu(logits)` as the routing weights and `> 0` as the routing map (a
variable number of experts per token, zero for some), the alltoall dispatcher on one rank, and `SequentialMLP`.

Mirrors thu-ml/ReMoE (Megatron-LM with ReLU routing added) at commit 463c6af: `megatron/core/transformer/moe/
moe_layer.py` (`BaseMoELayer`, `MoELayer.__init__` / `forward`), `moe/router.py` (`Router.__init__` / `gating`,
`ReLURouter`: `apply_input_jitter`, `l1_reg_load_balancing`, `routing`, `forward`), `moe/token_dispatcher.py`
(`MoETokenDispatcher`, `MoEAlltoAllTokenDispatcher`: `__init__`, `preprocess`, `token_permutation`,
`token_unpermutation`), `moe/moe_utils.py` (`get_capacity`, `permute`, `unpermute`, `sort_chunks_by_idxs`),
`moe/experts.py` (`SequentialMLP`), `transformer/mlp.py` (`MLP`), `fusions/fused_bias_swiglu.py` (`swiglu`,
`SwiGLUFunction`, `bias_swiglu_impl`), `core/jit.py` (`jit_fuser`), `tensor_parallel/layers.py`
(`LinearWithFrozenWeight`, `LinearWithGradAccumulationAndAsyncCommunication`, `linear_with_frozen_weight`,
`linear_with_grad_accumulation_and_async_allreduce`, `ColumnParallelLinear.forward`, `RowParallelLinear.forward`)
and `tensor_parallel/mappings.py` (`_AllToAll`, `all_to_all`, the copy/reduce regions). Settings from
`scripts/train_llama_182m_remoe.sh`: `--moe-relu-routing`, `--moe-router-topk 1`, `--moe-token-dispatcher-type
alltoall`, `--swiglu` (GLU, SiLU, and `bias_activation_fusion` on, as `--bias-swiglu-fusion` defaults on),
`--disable-bias-linear`, EP = TP = 1 (Megatron turns `--sequence-parallel` off at TP 1), no capacity factor.
The forward (eval): `MoELayer.forward` checks training/TP and runs its nested `custom_forward`. The router stores
`self.hidden`, skips input jitter (eps None), computes logits with `F.linear` of its [E, H] weight (moving the
weight to CUDA first when it is on the CPU), views them to [S*B, E]; `routing` (no `alltoall_seq` gather) calls
`l1_reg_load_balancing`: `probs = relu(logits)`, `routing_map = probs > 0`, and only with `self.training and
torch.is_grad_enabled()` the L1 regulariser (skipped here). So each token goes to every expert with a positive
logit, weighted by the logit itself, unnormalised; the top-k setting is not used for routing. The dispatcher
asserts on the probs/map ranks and dtype, views tokens to [S*B, H], and `preprocess` counts tokens per expert
(`routing_map.sum(0)`), takes the dropless branch (`num_out_tokens = tokens * topk`, which `permute` ignores), and,
with more than one local expert, sets the sync point "before_ep_alltoall" and keeps the counts as "CPU" copies
(`.to("cpu", non_blocking=True)`). `permute` `masked_select`s token ids from the transposed map (expert-major)
and `index_select`s the rows; the (one-rank) all-to-all returns its input; `sort_chunks_by_idxs` splits the rows
by the host counts (`.tolist()`) and concatenates them in the local-expert order (the identity on one rank).
`SequentialMLP` reads `tokens_per_expert.tolist()`, `torch.split`s, loops `zip(local_experts, chunks)` (an expert
with no tokens runs on an empty chunk) and concatenates. Each `MLP`: `ColumnParallelLinear` fc1 (H -> 2 * ffn,
through the grad-accumulation autograd Function, or the frozen-weight one when the weight needs no grad; the
choice is stored on the module in forward), `bias_swiglu_impl` with no bias (the `SwiGLUFunction` autograd Function
around `swiglu`, which `jit_fuser` = `torch.compile` compiles), `RowParallelLinear` fc2. The unpermutation
re-sorts the chunks back, all-to-alls (identity) and `unpermute`s: the rows times `probs.T.masked_select(map.T)`,
`scatter_add_` into zeros; the output is viewed back to [S, B, H] and returned with a None bias.
Megatron layers take [seq, batch, hidden]; the outer `SeqFirst` transposes the shell's [B, S, H] to that layout
(`.contiguous()`) and back.
Left out: process groups and `torch.distributed` (one-rank stand-ins with size 1; the branches for EP or TP > 1
raise); the CUDA stream synchronisations at the dispatcher's sync points and the router's move of a CPU weight
to `torch.cuda.current_device()` (both done here only when the tokens are on CUDA);
`--moe-grouped-gemm` (`GroupedMLP` needs the grouped_gemm CUDA kernels; the local spec's `SequentialMLP` is what
Megatron builds without it); `--moe-layer-recompute` (`tensor_parallel.checkpoint` saves CUDA RNG states, which
cannot run on CPU; off here); the training-only L1 regulariser and its aux-loss autograd scaler, the TopKRouter
of the non-ReLU branch, shared experts (none configured) and the alltoall_seq / allgather dispatchers.
Sizes: the 182M script runs hidden 768, ffn 3072, 8 experts, bf16; here hidden 16, ffn 8, 4 experts, float32.
Constructs: ReLU routing with a boolean `> 0` routing map (a data-dependent number of experts per token), a
`masked_select` permutation, host `.tolist()` counts used twice (`split` + `cat` by a precomputed order list, then
the expert split), a `zip` loop over experts and chunks, `torch.compile`-decorated helpers inside an autograd
Function, autograd Functions for the linears chosen per call by `weight.requires_grad` and stored on the module, a
function attribute (`.warned`) read and an environment variable checked in forward, (output, bias) tuple returns,
a nested closure forward and module attributes (`self.hidden`, the dispatcher's cached map/probs) written in forward.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from ._shell import Source, tiny

SOURCE = Source(
    "thu-ml/ReMoE",
    "megatron/core/transformer/moe/moe_layer.py",
    "463c6af38ffaa841941ea834470ee09f8d515652",
    "MoELayer.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 4, 1

custom_fwd = partial(torch.amp.custom_fwd, device_type="cuda")
custom_bwd = partial(torch.amp.custom_bwd, device_type="cuda")


def _init_normal(weight, std=0.01):
    torch.nn.init.normal_(weight, mean=0.0, std=std)


@dataclass
class TransformerConfig:
    hidden_size: int = HIDDEN
    ffn_hidden_size: int = INTER
    moe_ffn_hidden_size: int = INTER
    num_moe_experts: int = EXPERTS
    moe_router_topk: int = TOP_K
    moe_relu_routing: bool = True
    moe_token_dispatcher_type: str = "alltoall"
    moe_input_jitter_eps: float | None = None
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    moe_layer_recompute: bool = False
    gated_linear_unit: bool = True
    activation_func: object = F.silu
    bias_activation_fusion: bool = True
    activation_func_fp8_input_store: bool = False
    add_bias_linear: bool = False
    gradient_accumulation_fusion: bool = False
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    perform_initialization: bool = True
    params_dtype: torch.dtype = torch.float32
    fp8: str | None = None
    init_method: object = field(default=_init_normal)
    output_layer_init_method: object = field(default=_init_normal)


class MegatronModule(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config


# --- one-rank stand-ins for parallel_state and the process groups ------------------------------------------


class _OneRankGroup:
    def size(self):
        return 1


def get_tensor_model_parallel_world_size():
    return 1


def get_expert_model_parallel_world_size():
    return 1


def get_expert_model_parallel_rank():
    return 0


def _group_world_size(group):
    return group.size()  # torch.distributed.get_world_size(group=group) on a real group


# --- core/jit.py and fusions/fused_bias_swiglu.py ----------------------------------------------------------

jit_fuser = torch.jit.script
if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 2):  # is_torch_min_version("2.2.0a0")
    jit_fuser = torch.compile


@jit_fuser
def swiglu(y):
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


@jit_fuser
def bias_swiglu(y, bias):
    y = y + bias
    return swiglu(y)


class BiasSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, bias, fp8_input_store):
        input_for_backward = input.to(torch.float8_e4m3fn) if fp8_input_store else input
        ctx.save_for_backward(input_for_backward, bias)
        ctx.ori_input_dtype = input.dtype
        ctx.fp8_input_store = fp8_input_store
        return bias_swiglu(input, bias)

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError("backward not mirrored")


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, fp8_input_store):
        input_for_backward = input.to(torch.float8_e4m3fn) if fp8_input_store else input
        ctx.save_for_backward(input_for_backward)
        ctx.ori_input_dtype = input.dtype
        ctx.fp8_input_store = fp8_input_store
        return swiglu(input)

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError("backward not mirrored")


def bias_swiglu_impl(input, bias, fp8_input_store=False):
    ori_shape = input.shape
    assert len(ori_shape) in [2, 3]
    input = input.view(-1, ori_shape[-1])
    if bias is not None:
        output = BiasSwiGLUFunction.apply(input, bias, fp8_input_store)
    else:
        output = SwiGLUFunction.apply(input, fp8_input_store)
    return output if len(ori_shape) == 2 else output.view(ori_shape[0], ori_shape[1], -1)


# --- tensor_parallel/mappings.py (one rank) ----------------------------------------------------------------


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_):
        if get_tensor_model_parallel_world_size() == 1:
            return input_
        raise NotImplementedError("all-reduce: collectives are left out")

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def copy_to_tensor_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        world_size = _group_world_size(group)
        if world_size == 1:  # bypass on one GPU
            return input
        raise NotImplementedError("all_to_all_single: collectives are left out")

    @staticmethod
    def backward(ctx, *grad_output):
        return (
            None,
            _AllToAll.apply(ctx.group, *grad_output, ctx.input_split_sizes, ctx.output_split_sizes),
            None,
            None,
        )


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


# --- tensor_parallel/layers.py (one rank) ------------------------------------------------------------------


class LinearWithFrozenWeight(torch.autograd.Function):
    @staticmethod
    @custom_fwd
    def forward(ctx, input, weight, bias, allreduce_dgrad):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        return grad_output.matmul(weight), None, None, None


def linear_with_frozen_weight(
    input,
    weight,
    bias,
    gradient_accumulation_fusion,
    allreduce_dgrad,
    sequence_parallel,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
):
    assert grad_output_buffer is None, "grad_output_buffer is not supported with frozen weights"
    assert not sequence_parallel, "sequence parallel is left out"
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    @staticmethod
    @custom_fwd
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
    ):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.grad_output_buffer = grad_output_buffer
        if sequence_parallel:
            raise NotImplementedError("sequence-parallel all-gather: collectives are left out")
        total_input = input
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_weight = (
            grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
        )
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input,
    weight,
    bias,
    gradient_accumulation_fusion,
    allreduce_dgrad,
    sequence_parallel,
    grad_output_buffer=None,
    wgrad_deferral_limit=0,
):
    args = [
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
    ]
    if not linear_with_grad_accumulation_and_async_allreduce.warned:
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            if sequence_parallel:
                warnings.warn("set CUDA_DEVICE_MAX_CONNECTIONS=1 with sequence parallelism", stacklevel=2)
                linear_with_grad_accumulation_and_async_allreduce.warned = True
            if allreduce_dgrad:
                warnings.warn("set CUDA_DEVICE_MAX_CONNECTIONS=1 with async grad allreduce", stacklevel=2)
                linear_with_grad_accumulation_and_async_allreduce.warned = True
    return LinearWithGradAccumulationAndAsyncCommunication.apply(*args)


linear_with_grad_accumulation_and_async_allreduce.warned = False


class ColumnParallelLinear(torch.nn.Module):
    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias=True,
        gather_output=False,
        skip_bias_add=False,
        is_expert=False,
        tp_comm_buffer_name=None,
    ):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.config = config
        world_size = get_tensor_model_parallel_world_size()
        self.explicit_expert_comm = self.is_expert and (world_size > 1 or self.expert_parallel)
        self.output_size_per_partition = output_size // world_size
        self.weight = Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            init_method(self.weight)
        self.bias = (
            Parameter(torch.zeros(self.output_size_per_partition, dtype=config.params_dtype))
            if bias
            else None
        )
        self.sequence_parallel = config.sequence_parallel
        self.allreduce_dgrad = world_size > 1 and not self.sequence_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is None:
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}")
        bias = self.bias if not self.skip_bias_add else None

        if self.allreduce_dgrad or self.sequence_parallel or self.explicit_expert_comm:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_)

        if not weight.requires_grad:
            self._forward_impl = linear_with_frozen_weight
        else:
            self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

        allreduce_dgrad = False if self.explicit_expert_comm else self.allreduce_dgrad
        output_parallel = self._forward_impl(
            input=input_parallel,
            weight=weight,
            bias=bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=allreduce_dgrad,
            sequence_parallel=False if self.explicit_expert_comm else self.sequence_parallel,
            grad_output_buffer=None,
            wgrad_deferral_limit=None,
        )
        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output:
            raise NotImplementedError("tensor-parallel all-gather: collectives are left out")
        output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(torch.nn.Module):
    def __init__(
        self,
        input_size,
        output_size,
        *,
        config,
        init_method,
        bias=True,
        input_is_parallel=False,
        skip_bias_add=False,
        is_expert=False,
        tp_comm_buffer_name=None,
    ):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.config = config
        world_size = get_tensor_model_parallel_world_size()
        self.explicit_expert_comm = self.is_expert and (world_size > 1 or self.expert_parallel)
        self.input_size_per_partition = input_size // world_size
        self.weight = Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=config.params_dtype)
        )
        if config.perform_initialization:
            init_method(self.weight)
        self.bias = Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        self.sequence_parallel = config.sequence_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            raise NotImplementedError("tensor-parallel scatter: collectives are left out")
        if not self.weight.requires_grad:
            self._forward_impl = linear_with_frozen_weight
        else:
            self._forward_impl = linear_with_grad_accumulation_and_async_allreduce
        output_parallel = self._forward_impl(
            input=input_parallel,
            weight=self.weight,
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            grad_output_buffer=None,
        )
        if self.explicit_expert_comm:
            assert self.skip_bias_add
            output_ = output_parallel
        elif self.sequence_parallel:
            raise NotImplementedError("reduce-scatter: collectives are left out")
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel)
        if not self.skip_bias_add:
            output = (output_ + self.bias) if self.bias is not None else output_
            output_bias = None
        else:
            output = output_
            output_bias = self.bias
        return output, output_bias


# --- transformer/mlp.py and moe/experts.py -----------------------------------------------------------------


class MLP(MegatronModule):
    def __init__(self, config, is_expert=False, input_size=None):
        super().__init__(config=config)
        self.input_size = input_size if input_size is not None else self.config.hidden_size
        ffn_hidden_size = self.config.ffn_hidden_size
        if self.config.gated_linear_unit:
            ffn_hidden_size *= 2
        self.linear_fc1 = ColumnParallelLinear(
            self.input_size,
            ffn_hidden_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc1",
        )
        self.activation_func = self.config.activation_func
        self.linear_fc2 = RowParallelLinear(
            self.config.ffn_hidden_size,
            self.config.hidden_size,
            config=self.config,
            init_method=self.config.output_layer_init_method,
            bias=self.config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc2",
        )

    def forward(self, hidden_states):
        intermediate_parallel, bias_parallel = self.linear_fc1(hidden_states)

        if self.config.bias_activation_fusion:
            if self.activation_func == F.gelu:
                raise NotImplementedError("the fused GeLU paths are not mirrored (SwiGLU is configured)")
            elif self.activation_func == F.silu and self.config.gated_linear_unit:
                intermediate_parallel = bias_swiglu_impl(
                    intermediate_parallel, bias_parallel, self.config.activation_func_fp8_input_store
                )
            else:
                raise ValueError("Only support fusion of gelu and swiglu")
        else:
            if bias_parallel is not None:
                intermediate_parallel = intermediate_parallel + bias_parallel
            if self.config.gated_linear_unit:

                def glu(x):
                    x = torch.chunk(x, 2, dim=-1)
                    return self.config.activation_func(x[0]) * x[1]

                intermediate_parallel = glu(intermediate_parallel)
            else:
                intermediate_parallel = self.activation_func(intermediate_parallel)

        output, output_bias = self.linear_fc2(intermediate_parallel)
        return output, output_bias


class SequentialMLP(MegatronModule):
    def __init__(self, num_local_experts, config):
        super().__init__(config=config)
        self.add_bias = config.add_bias_linear
        self.num_local_experts = num_local_experts
        self.local_experts = torch.nn.ModuleList()
        assert self.config.moe_ffn_hidden_size == self.config.ffn_hidden_size, (
            "use GroupedMLP for other widths"
        )
        for _ in range(self.num_local_experts):
            self.local_experts.append(MLP(self.config, is_expert=True))

    def _pad_tensor_for_fp8(self, hidden):
        actual_num_tokens = hidden.shape[0]
        padded_num_tokens = math.ceil(actual_num_tokens / 16) * 16 - actual_num_tokens
        if padded_num_tokens > 0:
            pad_tensor = torch.zeros(
                padded_num_tokens, hidden.shape[1], dtype=hidden.dtype, device=hidden.device
            )
            hidden = torch.cat((hidden, pad_tensor), dim=0)
        return hidden

    def forward(self, permuted_local_hidden_states, tokens_per_expert):
        if self.num_local_experts == 1:
            if self.config.fp8:
                hidden = self._pad_tensor_for_fp8(permuted_local_hidden_states)
                output, output_bias = self.local_experts[0](hidden)
                output = output[: permuted_local_hidden_states.shape[0]]
            else:
                output, output_bias = self.local_experts[0](permuted_local_hidden_states)
            return output, output_bias

        tokens_per_expert = tokens_per_expert.tolist()
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)

        output_local_list = []
        output_bias_list = []
        for expert, tokens in zip(self.local_experts, tokens_list, strict=False):
            if self.config.fp8:
                hidden = self._pad_tensor_for_fp8(tokens)
                output, output_bias = expert(hidden)
                output = output[: tokens.shape[0]]
            else:
                output, output_bias = expert(tokens)
            output_local_list.append(output)
            if self.add_bias:
                output_bias_list.append(output_bias.expand_as(output))

        output_local = torch.cat(output_local_list, dim=0)
        output_bias_local = torch.cat(output_bias_list, dim=0) if self.add_bias else None
        return output_local, output_bias_local


# --- moe/moe_utils.py ------------------------------------------------------------------------------------


def get_capacity(num_tokens, num_experts, capacity_factor, min_capacity=None):
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def permute(tokens, routing_map, num_out_tokens=None):
    num_tokens, hidden = tokens.shape
    num_experts = routing_map.shape[1]
    routing_map = routing_map.bool().T.contiguous()  # [E, T]
    token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map)  # expert-major token ids
    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, sorted_indices


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None):
    _, hidden = restore_shape
    if probs is not None:
        assert routing_map is not None, "Mask must be provided to permute the probs."
        permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens


def sort_chunks_by_idxs(input, split_sizes, sorted_idxs):
    input = torch.split(input, split_sizes.tolist(), dim=0)
    return torch.cat([input[i] for i in sorted_idxs], dim=0)


# --- moe/router.py -----------------------------------------------------------------------------------------


class Router(MegatronModule):
    def __init__(self, config):
        super().__init__(config)
        self.config = config
        self.num_experts = self.config.num_moe_experts
        self.moe_aux_loss_func = None
        self.layer_number = None
        self.weight = Parameter(
            torch.empty((self.config.num_moe_experts, self.config.hidden_size), dtype=torch.float32)
        )
        if config.perform_initialization:
            config.init_method(self.weight)
        self.weight.data = self.weight.data.to(dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel

    def gating(self, input):
        if (
            self.weight.device.type == "cpu" and input.is_cuda
        ):  # the source moves it whenever it is on the CPU
            self.weight.data = self.weight.data.to(device=torch.cuda.current_device())
        logits = torch.nn.functional.linear(input, self.weight)
        return logits

    def set_layer_number(self, layer_number):
        self.layer_number = layer_number


class ReLURouter(Router):
    def __init__(self, config):
        super().__init__(config=config)
        self.topk = self.config.moe_router_topk
        self.input_jitter = None

    def apply_input_jitter(self, input):
        if self.config.moe_input_jitter_eps is not None:
            eps = self.config.moe_input_jitter_eps
            if self.input_jitter is None:
                self.input_jitter = torch.distributions.uniform.Uniform(
                    torch.tensor(1.0 - eps, device=input.device), torch.tensor(1.0 + eps, device=input.device)
                ).rsample
            return input * self.input_jitter(input.shape)
        return input

    def l1_reg_load_balancing(self, logits):
        probs = torch.relu(logits)
        routing_map = probs > 0
        if self.training and torch.is_grad_enabled():
            raise NotImplementedError("the adaptive L1 regulariser is training-only, not mirrored")
        return probs, routing_map

    def routing(self, logits):
        logits = logits.view(-1, self.config.num_moe_experts)
        if self.config.moe_token_dispatcher_type == "alltoall_seq":
            raise NotImplementedError("sequence-parallel logits gather: collectives are left out")
        scores, routing_map = self.l1_reg_load_balancing(logits)
        return scores, routing_map

    def forward(self, input):
        self.hidden = input.shape[-1]
        input = self.apply_input_jitter(input)
        logits = self.gating(input)
        logits = logits.view(-1, self.config.num_moe_experts)
        scores, routing_map = self.routing(logits)
        return scores, routing_map


# --- moe/token_dispatcher.py -------------------------------------------------------------------------------


def _cuda_stream_sync(tensor):
    if tensor.is_cuda:  # the source synchronises the current CUDA stream unconditionally
        torch.cuda.current_stream().synchronize()


class MoETokenDispatcher:
    def __init__(self, config):
        self.config = config
        self.shared_experts = None
        self.tp_size = config.expert_tensor_parallel_size
        self.ep_size = config.expert_model_parallel_size

    @property
    def ep_group(self):
        return _OneRankGroup()

    @property
    def tp_group(self):
        return _OneRankGroup()


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    def __init__(self, num_local_experts, local_expert_indices, config):
        super().__init__(config=config)
        self.hidden_shape = None
        self.num_local_experts = num_local_experts
        self.num_experts = config.num_moe_experts
        assert self.num_local_experts > 0, "Expected at least one expert"
        self.local_expert_indices = local_expert_indices
        assert len(self.local_expert_indices) == self.num_local_experts, "Invalid local expert indices"
        for i in range(len(self.local_expert_indices) - 1):
            assert self.local_expert_indices[i] == self.local_expert_indices[i + 1] - 1, "must be continuous"
        self.probs = None
        self.input_splits = None
        self.output_splits = None
        self.output_splits_tp = None
        self.num_global_tokens_per_local_expert_cpu = None
        input_chunk_idxs = torch.arange(self.num_experts * self.tp_size)
        self.sort_input_by_local_experts = (
            input_chunk_idxs.reshape(-1, self.num_local_experts).T.ravel().tolist()
        )
        self.restore_output_by_local_experts = (
            input_chunk_idxs.reshape(self.num_local_experts, -1).T.ravel().tolist()
        )
        self.num_out_tokens = None
        self.drop_and_pad = self.config.moe_pad_expert_input_to_capacity
        if self.drop_and_pad:
            assert self.config.moe_expert_capacity_factor is not None
        self.capacity = None
        self.cuda_sync_point = "no_sync"
        self.shared_experts = None

    def preprocess(self, routing_map):
        num_local_tokens_per_expert = routing_map.sum(dim=0).long()  # [E]

        if self.drop_and_pad:
            num_tokens = routing_map.size(0) * self.config.moe_router_topk
            self.capacity = get_capacity(
                num_tokens=num_tokens,
                num_experts=self.num_experts,
                capacity_factor=self.config.moe_expert_capacity_factor,
            )
            self.num_out_tokens = self.capacity * self.num_experts
            num_tokens_per_local_expert = torch.full(
                (self.num_local_experts,), self.capacity * self.tp_size * self.ep_size, dtype=torch.long
            )
            self.num_global_tokens_per_local_expert_cpu = torch.full(
                (self.num_experts * self.tp_size,), self.capacity, dtype=torch.long
            )
            return num_tokens_per_local_expert
        elif self.config.moe_expert_capacity_factor is not None:
            self.num_out_tokens = num_local_tokens_per_expert.sum().to(torch.device("cpu"), non_blocking=True)
            self.cuda_sync_point = "before_permutation_1"
        else:
            # dropless
            self.num_out_tokens = routing_map.size(0) * self.config.moe_router_topk
            if self.ep_size > 1 or self.num_local_experts > 1:
                self.cuda_sync_point = "before_ep_alltoall"
            else:
                self.cuda_sync_point = "before_finish"

        if self.ep_size > 1 or self.tp_size > 1:
            raise NotImplementedError(
                "the cross-rank split sizes need an all-gather: collectives are left out"
            )
        num_global_tokens_per_local_expert = num_local_tokens_per_expert.reshape(self.num_experts)
        num_tokens_per_local_expert = num_local_tokens_per_expert.to(torch.device("cpu"), non_blocking=True)

        if self.num_local_experts > 1:
            self.num_global_tokens_per_local_expert_cpu = num_global_tokens_per_local_expert.view(
                -1, self.num_local_experts
            ).to(torch.device("cpu"), non_blocking=True)

        return num_tokens_per_local_expert

    def token_permutation(self, hidden_states, probs, routing_map):
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        assert probs.dim() == 2, "Expected 2D tensor for probs"
        assert routing_map.dim() == 2, "Expected 2D tensor for token2expert mask"
        assert routing_map.dtype == torch.bool, "Expected bool tensor for mask"
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        tokens_per_expert = self.preprocess(self.routing_map)

        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))

        # permutation 1: tokens grouped by expert
        self.hidden_shape_before_permute = hidden_states.shape
        if self.cuda_sync_point == "before_permutation_1":
            _cuda_stream_sync(hidden_states)
        permutated_local_input_tokens, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, routing_map, num_out_tokens=self.num_out_tokens
        )

        if self.cuda_sync_point == "before_ep_alltoall":
            _cuda_stream_sync(hidden_states)
        global_input_tokens = all_to_all(
            self.ep_group, permutated_local_input_tokens, self.output_splits, self.input_splits
        )
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)

        if self.tp_size > 1:
            raise NotImplementedError("tensor-parallel all-gather: collectives are left out")

        # permutation 2: sort the chunks by local expert
        if self.num_local_experts > 1:
            global_input_tokens = sort_chunks_by_idxs(
                global_input_tokens,
                self.num_global_tokens_per_local_expert_cpu.ravel(),
                self.sort_input_by_local_experts,
            )

        if self.cuda_sync_point == "before_finish":
            _cuda_stream_sync(hidden_states)

        return global_input_tokens, tokens_per_expert

    def token_unpermutation(self, hidden_states, bias=None):
        assert bias is None, "Bias is not supported in MoEAlltoAllTokenDispatcher"

        if self.num_local_experts > 1:
            hidden_states = sort_chunks_by_idxs(
                hidden_states,
                self.num_global_tokens_per_local_expert_cpu.T.ravel(),
                self.restore_output_by_local_experts,
            )

        if self.tp_size > 1:
            raise NotImplementedError("tensor-parallel reduce-scatter: collectives are left out")

        permutated_local_input_tokens = all_to_all(
            self.ep_group, hidden_states, self.input_splits, self.output_splits
        )
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()

        output = unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute,
            probs=self.probs,
            routing_map=self.routing_map,
        )
        output = output.view(self.hidden_shape)

        if self.shared_experts is not None:
            output += self.shared_experts.get_output()
        return output, None


# --- moe/moe_layer.py --------------------------------------------------------------------------------------


class BaseMoELayer(MegatronModule):
    def __init__(self, config, layer_number=None):
        super().__init__(config)
        self.config = config
        self.expert_parallel_size = get_expert_model_parallel_world_size()
        assert self.expert_parallel_size > 0, "Expected non-negative expert parallel size"
        assert self.config.num_moe_experts % self.expert_parallel_size == 0
        self.num_local_experts = self.config.num_moe_experts // self.expert_parallel_size
        local_expert_indices_offset = get_expert_model_parallel_rank() * self.num_local_experts
        self.use_shared_expert = self.config.moe_shared_expert_intermediate_size is not None
        self.shared_expert_overlap = self.config.moe_shared_expert_overlap
        self.local_expert_indices = [local_expert_indices_offset + i for i in range(self.num_local_experts)]
        assert all(x < self.config.num_moe_experts for x in self.local_expert_indices)
        self.router = None
        self.experts = None
        self.shared_experts = None
        self.token_dispatcher = None
        self.layer_number = layer_number


class MoELayer(BaseMoELayer):
    def __init__(self, config, layer_number=None):
        super().__init__(config=config, layer_number=layer_number)
        self.moe_layer_recompute = config.moe_layer_recompute
        if config.moe_relu_routing:
            self.router = ReLURouter(config=self.config)
        else:
            raise NotImplementedError("TopKRouter: not the ReMoE configuration, not mirrored")
        if config.moe_token_dispatcher_type == "alltoall":
            self.token_dispatcher = MoEAlltoAllTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config
            )
        else:
            raise ValueError(f"dispatcher {config.moe_token_dispatcher_type} is not mirrored")
        self.experts = SequentialMLP(self.num_local_experts, self.config)
        if self.use_shared_expert:
            raise NotImplementedError("shared experts are not configured in ReMoE's scripts")

    def forward(self, hidden_states):
        if self.training and self.config.tensor_model_parallel_size > 1 and not self.config.sequence_parallel:
            raise ValueError("MoE with tensor parallelism needs sequence parallelism in training")

        def custom_forward(hidden_states):
            probs, routing_map = self.router(hidden_states)
            dispatched_input, tokens_per_expert = self.token_dispatcher.token_permutation(
                hidden_states, probs, routing_map
            )
            expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert)
            output, mlp_bias = self.token_dispatcher.token_unpermutation(expert_output, mlp_bias)
            if self.use_shared_expert and not self.shared_expert_overlap:
                output += self.shared_experts(hidden_states)
            return output, mlp_bias

        if self.moe_layer_recompute:
            raise NotImplementedError("tensor_parallel.checkpoint captures CUDA RNG states; left out")
        output, mlp_bias = custom_forward(hidden_states)
        return output, mlp_bias


class SeqFirst(torch.nn.Module):
    """[B, S, H] -> Megatron's [S, B, H] and back; the layer's (output, bias) bias is None here."""

    def __init__(self, config):
        super().__init__()
        self.mlp = MoELayer(config, layer_number=1)

    def forward(self, x):
        output, _ = self.mlp(x.transpose(0, 1).contiguous())
        return output.transpose(0, 1)


def build():
    return tiny(lambda: SeqFirst(TransformerConfig()), HIDDEN)
