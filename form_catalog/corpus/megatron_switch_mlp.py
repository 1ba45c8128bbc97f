"""Megatron-LM's legacy `SwitchMLP`: top-1 sigmoid router (sinkhorn in training), a loop over experts with `nonzero`.

Mirrors NVIDIA/Megatron-LM `megatron/model/transformer.py` at commit bdabab0 (2023-10-26, "get rid of bias in
router"; the last change to `SwitchMLP` before the file moved to `megatron/legacy/` in 2024): `sinkhorn`,
`get_router_linear_layer`, `SwitchMLP.__init__` / `gather_indices` / `forward`, `ParallelMLP.__init__` /
`forward`, and the MLP part of `ParallelTransformerLayer.forward`; with `megatron/model/fused_bias_gelu.py`
(`bias_gelu`, `GeLUFunction`, `bias_gelu_impl`), `megatron/model/module.py` (`MegatronModule.__init__`),
`megatron/model/utils.py` (`init_method_normal`, `scaled_init_method_normal`),
`megatron/core/tensor_parallel/layers.py` (`LinearWithFrozenWeight`, `linear_with_frozen_weight`,
`LinearWithGradAccumulationAndAsyncCommunication.forward`, `linear_with_grad_accumulation_and_async_allreduce`,
`ColumnParallelLinear`, `RowParallelLinear`) and `megatron/core/tensor_parallel/mappings.py` (`_reduce`,
`_CopyToModelParallelRegion`, `_ReduceFromModelParallelRegion` and their wrappers), all at the same commit.
This is the Megatron (not NeMo) copy of the layer, in its final form: sinkhorn was added on the MoE branch
(1ecbebe, 2022-06-20) and merged into main in August 2023 together with expert parallelism.
The layer takes Megatron's sequence-first [s, b, h] activations. `forward` runs the bias-free router Linear and
views the logits [s*b, E]; in training it picks each token's expert as the argmax of `sinkhorn` of the
detached float32 logits (under `no_grad`; `sinkhorn` exponentiates and alternately rescales rows and columns in
a `while error > tol` loop whose condition reads a tensor) and takes the sigmoid probability of that expert by
`route[torch.arange(T), max_ind]`; in eval it takes `torch.max(torch.sigmoid(route), dim=1)` (top-1, no
renormalisation). It views the tokens [s*b, h], skips the sequence/expert-parallel all-gather (one rank),
allocates `torch.zeros_like` outputs for the result and (with `add_bias_linear`) the bias, and loops
`for expert_num, expert in enumerate(self.local_experts)`: `local_indices = (global_indices ==
local_expert_index).nonzero()` (an [n, 1] index, so the gathered `hidden` is [n, 1, h]), runs the expert,
`output_total[local_indices, :] = output` and, for the bias, `output_bias.expand_as(output)` stored the same
way; there is no empty-expert skip. It then multiplies both by the router probability and views them back to
[s, b, h], returning `(output_total, output_bias_total)`. Each expert is a `ParallelMLP` with Megatron's default
activation: `ColumnParallelLinear` h->ffn with `skip_bias_add=True` (returns `(output, bias)`), the fused
bias-GeLU (`GeLUFunction.apply`, an autograd Function around a `@torch.jit.script` tanh-GeLU of bias + y), and
`RowParallelLinear` ffn->h, also returning its bias separately. Both parallel linears go through Megatron's
autograd Functions: `copy_to_tensor_model_parallel_region` (identity forward), then (weights require grad)
`LinearWithGradAccumulationAndAsyncCommunication.apply` (`torch.matmul(input, weight.t())`), and for the
row-parallel layer `reduce_from_tensor_model_parallel_region` (`_reduce`: identity with one rank); each
`forward` also re-binds `self._forward_impl` according to `weight.requires_grad`.
The outer `SequenceFirst` module stands in for the model around the layer: it transposes the shell's [B, S, H]
to [S, B, H] (`.transpose(0, 1).contiguous()`, as Megatron's embedding does), calls the MLP as
`ParallelTransformerLayer.forward` does (`mlp_output, mlp_bias = self.mlp(norm_output)`), adds the expanded
bias and applies dropout (`bias_dropout_add` without the residual, which the shell adds; dropout is off in
eval) and transposes back.
Left out: tensor / sequence / expert parallelism (one rank: `gather_from_sequence_parallel_region_to_moe`,
`reduce_scatter_to_sequence_parallel_region_from_moe` and the all-gather in `gather_indices` sit behind
conditions that are false here and raise if reached; the parallel linears are their one-rank forms, the
weight split and the `allreduce` / `sequence_parallel` attributes dropped), the backward passes of the
autograd Functions (with APEX's fused gradient accumulation: `gradient_accumulation_fusion` is off here since
the extension is absent, where Megatron's CLI default is on), weight initialisation details (the CPU master-
weight split of `_initialize_affine_weight_cpu` becomes a direct `init_method(weight)`; the CUDA RNG tracker
fork around the router init is a no-op context), `torch.cuda.amp.custom_fwd` written as its non-deprecated
equivalent `torch.amp.custom_fwd(device_type="cuda")`, the attention half of `ParallelTransformerLayer`, its
jit-scripted fused bias-dropout-add (the unfused `bias_dropout_add` is used, without the residual) and
`make_viewless_tensor`, and the global `get_args()` namespace (a small local dataclass with Megatron's CLI
defaults: gelu activation, `bias_gelu_fusion` and `add_bias_linear` on, hidden dropout 0.1).
Sizes: Megatron's switch-transformer runs pass `--num-experts` (e.g. 8) with ffn_hidden_size 4h; kept tiny
(hidden 16, ffn 32, 8 experts, top-1 as upstream).
Constructs: `self.training` branch between a sinkhorn path (`no_grad`, a data-dependent `while` loop on a
tensor-valued error, advanced-index gather of the chosen probability) and a sigmoid + `torch.max` top-1 path,
views between [s, b, h] and [s*b, h], config-gated distributed branches, an `enumerate` loop over the experts
with no skip, `(ids == e).nonzero()` giving an [n, 1] index, 3-D gathered expert inputs, index_put of outputs
and of `expand_as`'d biases, `(out, bias)` tuples from every linear, three `torch.autograd.Function`s in the
forward (identity copy/reduce, matmul linear under `custom_fwd`), a `@torch.jit.script` function inside an
autograd Function, a module attribute re-bound in forward, a function attribute read and `os.environ.get` in
the linear wrapper, post-hoc scaling by the top-1 probability.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from ._shell import Source, tiny

SOURCE = Source("NVIDIA/Megatron-LM", "megatron/model/transformer.py",
                "bdabab0ea1457e58ff22f8f881170755f0fde8b4", "SwitchMLP.forward")
HIDDEN, FFN, EXPERTS = 16, 32, 8


# ---- megatron/model/utils.py ----

def init_method_normal(sigma):
    """Init method based on N(0, sigma)."""
    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma, num_layers):
    """Init method based on N(0, sigma/sqrt(2*num_layers)."""
    std = sigma / math.sqrt(2.0 * num_layers)

    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


# ---- one-rank stand-ins for get_args(), TransformerConfig and megatron.core.parallel_state ----

@dataclass
class Args:
    """The `get_args()` fields the MoE path reads, with Megatron's CLI defaults."""

    hidden_size: int = HIDDEN
    ffn_hidden_size: int = FFN
    num_experts: int | None = EXPERTS
    swiglu: bool = False
    openai_gelu: bool = False
    onnx_safe: bool | None = None
    squared_relu: bool = False
    bias_gelu_fusion: bool = True
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    init_method_std: float = 0.02
    num_layers: int = 1


_GLOBAL_ARGS = Args()


def get_args():
    return _GLOBAL_ARGS


@dataclass
class TransformerConfig:
    """The `TransformerConfig` (and `ModelParallelConfig`) fields the MoE path reads."""

    hidden_size: int = HIDDEN
    ffn_hidden_size: int = FFN
    num_layers: int = 1
    add_bias_linear: bool = True
    gated_linear_unit: bool = False
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = True
    params_dtype: torch.dtype = torch.float32
    use_cpu_initialization: bool = True
    perform_initialization: bool = True
    init_method_std: float = 0.02
    init_method: Callable | None = None
    output_layer_init_method: Callable | None = None
    hidden_dropout: float = 0.1

    def __post_init__(self):
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)


def get_tensor_model_parallel_world_size():
    return 1


def get_expert_model_parallel_world_size():
    return 1


def get_expert_model_parallel_rank():
    return 0


def get_tensor_and_expert_parallel_group():
    return None


def get_tensor_model_parallel_group():
    return None


def _distributed_get_world_size(group=None):
    # torch.distributed.get_world_size(group=...) with one process
    return 1


class _CudaRNGStatesTracker:
    def fork(self, name="model-parallel-rng"):
        return nullcontext()


def get_cuda_rng_tracker():
    return _CudaRNGStatesTracker()


def get_data_parallel_rng_tracker_name():
    return "data-parallel-rng"


def gather_from_sequence_parallel_region_to_moe(input_):
    raise NotImplementedError("all-gather across tensor/expert-parallel ranks")


def reduce_scatter_to_sequence_parallel_region_from_moe(input_):
    raise NotImplementedError("reduce-scatter across tensor/expert-parallel ranks")


def divide(numerator, denominator):
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


# ---- megatron/core/tensor_parallel/mappings.py ----

def _reduce(input_):
    """All-reduce the input tensor across model parallel group."""

    # Bypass the function if we are using only 1 GPU.
    if get_tensor_model_parallel_world_size() == 1:
        return input_

    raise NotImplementedError("torch.distributed.all_reduce across tensor-parallel ranks")


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Pass the input to the model parallel region."""

    @staticmethod
    def symbolic(graph, input_):
        return input_

    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce the input from the model parallel region."""

    @staticmethod
    def symbolic(graph, input_):
        return _reduce(input_)

    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


def copy_to_tensor_model_parallel_region(input_):
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_):
    return _ReduceFromModelParallelRegion.apply(input_)


# ---- megatron/core/tensor_parallel/layers.py ----

class LinearWithFrozenWeight(torch.autograd.Function):
    """Linear operator that does not calculate gradient for weight."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(weight)
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        return grad_input, None, None


def linear_with_frozen_weight(input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce,
                              sequence_parallel):
    if sequence_parallel:
        raise NotImplementedError("sequence-parallel all-gather of the input")
    else:
        input = input

    args = [
        input,
        weight,
        bias,
    ]

    return LinearWithFrozenWeight.apply(*args)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """See linear_with_grad_accumulation_and_async_allreduce"""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce, sequence_parallel):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.async_grad_allreduce = async_grad_allreduce
        ctx.sequence_parallel = sequence_parallel

        if sequence_parallel:
            raise NotImplementedError("sequence-parallel all-gather into the global memory buffer")
        else:
            total_input = input

        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        # One rank, no sequence parallelism, no gradient-accumulation fusion: the upstream's remaining path.
        input, weight = ctx.saved_tensors
        use_bias = ctx.use_bias
        total_input = input
        grad_input = grad_output.matmul(weight)
        grad_output = grad_output.contiguous()
        # Convert the tensor shapes to 2D for execution compatibility
        grad_output = grad_output.view(grad_output.shape[0] * grad_output.shape[1], grad_output.shape[2])
        total_input = total_input.view(total_input.shape[0] * total_input.shape[1], total_input.shape[2])
        grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                      async_grad_allreduce, sequence_parallel):
    args = [
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        async_grad_allreduce,
        sequence_parallel,
    ]

    if not linear_with_grad_accumulation_and_async_allreduce.warned:
        if os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1":
            if sequence_parallel:
                warnings.warn(
                    "When using sequence parallelism it is recommended to set the "
                    "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for "
                    "maximum speedup", stacklevel=2
                )
                linear_with_grad_accumulation_and_async_allreduce.warned = True

            if async_grad_allreduce:
                warnings.warn(
                    "When using async grad allreduce it is recommended to set the "
                    "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for "
                    "maximum speedup", stacklevel=2
                )
                linear_with_grad_accumulation_and_async_allreduce.warned = True

    return LinearWithGradAccumulationAndAsyncCommunication.apply(*args)


linear_with_grad_accumulation_and_async_allreduce.warned = False


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b with A split along its columns (one rank here: the whole A)."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False, stride=1,
                 keep_master_weight_for_test=False, skip_bias_add=False, skip_weight_param_allocation=False,
                 is_expert=False):
        super().__init__()

        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        world_size = get_tensor_model_parallel_world_size()
        self.output_size_per_partition = divide(output_size, world_size)
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.config = config

        if not skip_weight_param_allocation:
            self.weight = Parameter(torch.empty(self.output_size_per_partition, self.input_size,
                                                dtype=config.params_dtype))
            if config.perform_initialization:
                init_method(self.weight)
        else:
            self.weight = None

        if bias:
            self.bias = Parameter(torch.empty(self.output_size_per_partition, dtype=config.params_dtype))
            if config.perform_initialization:
                # Always initialize bias to zero.
                with torch.no_grad():
                    self.bias.zero_()
        else:
            self.register_parameter('bias', None)

        self.async_tensor_model_parallel_allreduce = config.async_tensor_model_parallel_allreduce and world_size > 1

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and world_size <= 1:
            warnings.warn("`sequence_parallel` is set to `True`, but tensor model parallel size is "
                          f"{world_size}. Disabling sequence parallel.", stacklevel=2)
            self.sequence_parallel = False

        if config.gradient_accumulation_fusion:
            raise RuntimeError("gradient_accumulation_fusion needs APEX's fused_weight_gradient_mlp_cuda")
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion

        if self.async_tensor_model_parallel_allreduce and self.sequence_parallel:
            raise RuntimeError("`async_tensor_model_parallel_allreduce` and `sequence_parallel` "
                               "cannot be enabled at the same time.")

        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce
        self.explicit_expert_comm = self.is_expert and (self.sequence_parallel or self.expert_parallel)

    def forward(self, input_, weight=None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("weight was not supplied to ColumnParallelLinear forward pass "
                                   "and skip_weight_param_allocation is True.")
            weight = self.weight
        else:
            expected_shape = (self.output_size_per_partition, self.input_size)
            if weight.shape != expected_shape:
                raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, "
                                   f"not {expected_shape} as expected")

        bias = self.bias if not self.skip_bias_add else None

        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel or self.explicit_expert_comm:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_)

        # Matrix multiply.
        if not weight.requires_grad:
            self._forward_impl = linear_with_frozen_weight
        else:
            self._forward_impl = linear_with_grad_accumulation_and_async_allreduce
        output_parallel = self._forward_impl(
            input=input_parallel,
            weight=weight,
            bias=bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            async_grad_allreduce=False if self.explicit_expert_comm else self.async_tensor_model_parallel_allreduce,
            sequence_parallel=False if self.explicit_expert_comm else self.sequence_parallel,
        )
        if self.gather_output:
            raise NotImplementedError("all-gather of the output across tensor-parallel ranks")
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(torch.nn.Module):
    """Y = XA + b with A split along its rows (one rank here: the whole A)."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, input_is_parallel=False,
                 stride=1, keep_master_weight_for_test=False, skip_bias_add=False, is_expert=False):
        super().__init__()

        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        world_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, world_size)
        self.skip_bias_add = skip_bias_add
        self.config = config
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and not self.input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")

        self.weight = Parameter(torch.empty(self.output_size, self.input_size_per_partition,
                                            dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)

        if bias:
            self.bias = Parameter(torch.empty(self.output_size, dtype=config.params_dtype))
            if config.perform_initialization:
                # Always initialize bias to zero.
                with torch.no_grad():
                    self.bias.zero_()
        else:
            self.register_parameter('bias', None)

        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce
        self.explicit_expert_comm = self.is_expert and (self.sequence_parallel or self.expert_parallel)

    def forward(self, input_):
        # Set up backprop all-reduce.
        if self.input_is_parallel:
            input_parallel = input_
        else:
            raise NotImplementedError("scatter of the input across tensor-parallel ranks")
        # Matrix multiply.
        if not self.weight.requires_grad:
            self._forward_impl = linear_with_frozen_weight
        else:
            self._forward_impl = linear_with_grad_accumulation_and_async_allreduce
        output_parallel = self._forward_impl(
            input=input_parallel,
            weight=self.weight,
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            async_grad_allreduce=False,
            sequence_parallel=False,
        )

        # All-reduce across all the partitions.
        if self.explicit_expert_comm:
            assert self.skip_bias_add
            output_ = output_parallel
        elif self.sequence_parallel:
            raise NotImplementedError("reduce-scatter to the sequence-parallel region")
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel)
        if not self.skip_bias_add:
            output = (output_ + self.bias) if self.bias is not None else output_
            output_bias = None
        else:
            output = output_
            output_bias = self.bias
        return output, output_bias


# ---- megatron/model/fused_bias_gelu.py ----

# this function is tanh approximation of gelu
@torch.jit.script
def bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


# gradient of tanh approximation of gelu
@torch.jit.script
def bias_gelu_back(g, bias, y):
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    # sqrt(2/pi) * 3 * 0.044715 -> 0.1070322243
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    # bias is an optional argument
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return bias_gelu(bias, input)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        tmp = bias_gelu_back(grad_output, bias, input)
        return tmp, tmp


bias_gelu_impl = GeLUFunction.apply


def openai_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def erf_gelu(x):
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


# ---- megatron/model/module.py ----

class MegatronModule(torch.nn.Module):
    """Megatron specific extensions of torch Module with support for pipelining."""

    def __init__(self, config=None, share_embeddings_and_output_weights=True):
        super().__init__()
        self.config = config
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights


# ---- megatron/model/transformer.py ----

class ParallelMLP(MegatronModule):
    """h -> 4h -> h MLP; each linear returns its bias separately (skip_bias_add)."""

    def __init__(self, config, is_expert=False):
        super().__init__()
        args = get_args()

        self.add_bias = config.add_bias_linear

        ffn_hidden_size = config.ffn_hidden_size
        if config.gated_linear_unit:
            ffn_hidden_size *= 2

        # Project to 4h. If using swiglu double the output width.
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size,
            ffn_hidden_size,
            config=config,
            init_method=config.init_method,
            bias=self.add_bias,
            gather_output=False,
            skip_bias_add=True,
            is_expert=is_expert,
        )

        self.bias_gelu_fusion = False
        self.activation_func = None
        self.swiglu = args.swiglu

        if args.openai_gelu:
            self.activation_func = openai_gelu
        elif args.onnx_safe:
            self.activation_func = erf_gelu
        elif args.swiglu:
            def swiglu(x):
                x = torch.chunk(x, 2, dim=-1)
                return F.silu(x[0]) * x[1]
            self.activation_func = swiglu
        elif args.squared_relu:
            def squared_relu(x):
                return torch.pow(F.relu(x), 2)
            self.activation_func = squared_relu
        else:
            self.bias_gelu_fusion = args.bias_gelu_fusion
            self.activation_func = F.gelu

        # Project back to h.
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=self.add_bias,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
        )

    def forward(self, hidden_states):

        # [s, b, 4hp]
        intermediate_parallel, bias_parallel = self.dense_h_to_4h(hidden_states)

        if self.bias_gelu_fusion:
            assert self.add_bias is True
            assert self.activation_func == F.gelu
            intermediate_parallel = bias_gelu_impl(intermediate_parallel, bias_parallel)
        else:
            if bias_parallel is not None:
                intermediate_parallel = intermediate_parallel + bias_parallel
            intermediate_parallel = self.activation_func(intermediate_parallel)

        # [s, b, h]
        output, output_bias = self.dense_4h_to_h(intermediate_parallel)
        return output, output_bias


def sinkhorn(cost, tol=0.0001):
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)

    eps = 0.00000001
    error = 1e9
    d1_old = d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def get_router_linear_layer(config):
    args = get_args()
    router = torch.nn.Linear(args.hidden_size, args.num_experts, bias=False)
    with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
        config.init_method(router.weight)
    setattr(router.weight, 'sequence_parallel', config.sequence_parallel)  # noqa: B010
    return router


class SwitchMLP(MegatronModule):
    """
    Routes input to one of N MLP "experts"
    """

    def __init__(self, config):
        super().__init__()
        args = get_args()
        self.router = get_router_linear_layer(config)
        self.expert_parallel_size = get_expert_model_parallel_world_size()
        self.sequence_parallel = config.sequence_parallel
        self.add_bias = config.add_bias_linear

        assert args.num_experts % self.expert_parallel_size == 0
        self.num_local_experts = args.num_experts // self.expert_parallel_size
        local_expert_indices_offset = get_expert_model_parallel_rank() * self.num_local_experts
        self.local_expert_indices = [local_expert_indices_offset + i for i in range(self.num_local_experts)]

        self.local_experts = torch.nn.ModuleList()
        for _ in range(self.num_local_experts):
            self.local_experts.append(ParallelMLP(config, is_expert=True))

    def gather_indices(self, local_indices):
        """ Gather tensors and concatinate along the first dimension."""
        group = get_tensor_and_expert_parallel_group()
        world_size = _distributed_get_world_size(group=group)
        # Bypass the function if we are using only 1 GPU.
        if world_size == 1:
            return local_indices

        raise NotImplementedError("torch.distributed._all_gather_base of the expert indices")

    def forward(self, hidden_states):
        # hidden_states: [b, s, h]
        args = get_args()
        s = hidden_states.size(0)
        b = hidden_states.size(1)
        h = hidden_states.size(2)
        route = self.router(hidden_states).view(-1, args.num_experts)

        # sinkhorn load balancing in training, plain top-1 of the sigmoid in eval
        if self.training:
            with torch.no_grad():
                sinkroute = sinkhorn(route.detach().to(dtype=torch.float32))
                _, max_ind = torch.max(sinkroute, dim=1)
            route = torch.sigmoid(route)
            max_prob = route[torch.arange(route.size(0)), max_ind]
        else:
            route = torch.sigmoid(route)
            max_prob, max_ind = torch.max(route, dim=1)

        max_prob = torch.unsqueeze(max_prob, 1)
        hidden_states = hidden_states.view(-1, hidden_states.size(2))

        # Converting [s, b, h] to [s*b, h].
        # Each vector could be routed differently
        if self.sequence_parallel or (self.expert_parallel_size > 1):
            global_hidden_states = gather_from_sequence_parallel_region_to_moe(hidden_states)
            global_indices = self.gather_indices(max_ind)
        else:
            global_hidden_states = hidden_states
            global_indices = max_ind

        output_total = torch.zeros_like(global_hidden_states)
        if self.add_bias:
            output_bias_total = torch.zeros_like(global_hidden_states)

        for expert_num, expert in enumerate(self.local_experts):
            local_expert_index = self.local_expert_indices[expert_num]
            local_indices = (global_indices == local_expert_index).nonzero()
            hidden = global_hidden_states[local_indices, :]
            output, output_bias = expert(hidden)
            output_total[local_indices, :] = output
            if self.add_bias:
                output_bias = output_bias.expand_as(output)
                output_bias_total[local_indices, :] = output_bias

        if self.sequence_parallel or (self.expert_parallel_size > 1):
            output_total = reduce_scatter_to_sequence_parallel_region_from_moe(output_total)
            if self.add_bias:
                output_bias_total = reduce_scatter_to_sequence_parallel_region_from_moe(output_bias_total)

                # bias is duplicated across tensor parallelism ranks;
                # reduce scatter reduces bias across tensor parallel_ranks
                output_bias_total = output_bias_total / get_tensor_model_parallel_world_size()

        output_total = output_total * max_prob
        output_total = output_total.view(s, b, h)
        if self.add_bias:
            output_bias_total = output_bias_total * max_prob
            output_bias_total = output_bias_total.view(s, b, h)
        else:
            output_bias_total = None

        return output_total, output_bias_total


class SequenceFirst(torch.nn.Module):
    """[B, S, H] -> Megatron's [S, B, H] around `SwitchMLP`, with the MLP half of `ParallelTransformerLayer`
    (bias add + dropout; the shell adds the residual), and back."""

    def __init__(self):
        super().__init__()
        args = get_args()
        config = TransformerConfig(hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                                   add_bias_linear=args.add_bias_linear, gated_linear_unit=args.swiglu,
                                   hidden_dropout=args.hidden_dropout, init_method_std=args.init_method_std,
                                   num_layers=args.num_layers)
        self.hidden_dropout = config.hidden_dropout
        if args.num_experts is not None:
            self.mlp = SwitchMLP(config)
        else:
            self.mlp = ParallelMLP(config)

    def forward(self, x):
        norm_output = x.transpose(0, 1).contiguous()  # [s, b, h]
        mlp_output, mlp_bias = self.mlp(norm_output)
        if mlp_bias is not None:
            mlp_bias = mlp_bias.expand_as(mlp_output)
            mlp_output = mlp_output + mlp_bias
        out = torch.nn.functional.dropout(mlp_output, p=self.hidden_dropout, training=self.training)
        return out.transpose(0, 1)


def build():
    return tiny(SequenceFirst, HIDDEN)
