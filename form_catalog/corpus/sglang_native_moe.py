"""SGLang's torch-native MoE (`moe_forward_native`) behind its Qwen2-MoE block, as SGLang runs it on a CPU without AMX.

Mirrors sgl-project/sglang `python/sglang/srt/layers/moe/fused_moe_native.py` at commit d16ff35
(`moe_forward_native`), with the code that leads to it at the same commit: `models/qwen2_moe.py`
(`Qwen2MoeSparseMoeBlock.__init__`, `forward`, `_forward_shared_experts`, `_forward_router_experts`,
`Qwen2MoeMLP`), `layers/moe/topk.py` (`TopKConfig`, `StandardTopKOutput`, `TopK.forward_native`,
`select_experts`, `fused_topk_torch_native`), `layers/moe/fused_moe_triton/layer.py` (`FusedMoE.__init__`,
`forward`, `run_moe_core`), `layers/moe/token_dispatcher/standard.py` (`StandardDispatcher.dispatch`,
`combine`, the two NamedTuples), `layers/quantization/unquant.py` (`UnquantizedFusedMoEMethod.create_weights`,
`apply`, `forward_cpu` = `forward_native`; `UnquantizedLinearMethod.apply`), `custom_op.py` (`CustomOp`
and its `dispatch_forward`), `layers/activation.py` (`SiluAndMul`), `layers/linear.py` (`ReplicatedLinear`,
`MergedColumnParallelLinear`, `RowParallelLinear` forwards), `eplb/expert_location_dispatch.py`
(`transform_select_experts_inputs`) and `distributed/.../pynccl_allocator.py` (`use_symmetric_memory`).
The upstream snapshot (1.2 GB) was too large to bring here; these files were read from a snapshot of the
fork DaizeDong/sglang whose HEAD is this upstream commit ("[CPU] Add Gemma3RMSNorm kernel ..." #9324,
2025-12-15); the stored upstream copy 163b798 of fused_moe_native.py has the same `moe_forward_native`.
The block views the tokens [T, H], runs the shared expert (a fused gate_up `MergedColumnParallelLinear`,
`SiluAndMul`, `RowParallelLinear`, each returning `(output, bias)`) and gates it with
`F.sigmoid(shared_expert_gate(x))`, then scores the tokens with a `ReplicatedLinear` gate and calls
`TopK`, a `CustomOp` whose `forward` calls the method `dispatch_forward` chose in `__init__` from platform
flags (a bound method stored on the module): on a CPU without AMX that is `forward_native`, which sets
`self.topk_config.torch_native = True` on its config dataclass and calls `select_experts`. That unpacks
the config, passes the logits through `transform_select_experts_inputs` (no dispatch info: unchanged),
branches on grouped / torch-native / custom routing and takes `fused_topk_torch_native` (bound at import
to `fused_topk_native` when not on AMX): `assert` the token counts match, allocate unused empty weight/id
buffers, softmax the float logits (a nested `scoring_func_impl` with a string switch), `torch.topk`, and
renormalise only `if renormalize` (Qwen2-MoE's `norm_topk_prob` is False); a no-op expert-distribution
recorder sees the ids and a `StandardTopKOutput` NamedTuple comes back. `FusedMoE.forward` calls the
`StandardDispatcher` (no fp4 all-gather, EP size 1, no local expert map: the NamedTuple passes through),
then `quant_method.apply`, which calls the `UnquantizedFusedMoEMethod` `CustomOp`'s own dispatched forward,
`forward_cpu` (asserting a silu activation; the AMX `sgl_kernel` branch is off) -> `moe_forward_native`:
it counts tokens per expert by `scatter_`ing ones into a [T, E] zero tensor and summing, `argsort`s the
flat ids, gathers `x[idxs // top_k]`, reads the counts to the host with `tokens_per_expert.cpu().numpy()`,
constructs a `SiluAndMul()` module inside the call (`if activation == "silu"`), and loops
`for i, num_tokens in enumerate(tokens_per_expert)` with numpy-int slice bounds and an
`if num_tokens == 0: continue` skip, computing F.linear(silu-and-mul(F.linear(x, w13[i])), w2[i]) and
appending to a list; it `torch.cat`s the list (or `new_empty(0)` if empty), scatters the rows back with
`new_x[idxs] = outs`, and reduces `view(T, k, H).type(fp32).mul_(weights).sum(1)`. The dispatcher's
`combine` unpacks the result, `FusedMoE` slices `[..., :hidden]` inside `use_symmetric_memory(...)` (a
`nullcontext()` with one rank), skips its all-reduce, and the block adds the shared output and views back.
SGLang feeds packed tokens [num_tokens, hidden]; the outer `PackedTokens` views the shell's [B, S, H] to
that layout and back.
Left out: tensor/expert parallelism (one rank: the all-reduce, the EP local-expert map, symmetric memory,
DeepEP/two-batch-overlap paths and the dual-stream shared expert sit behind conditions that are false
here, and raise if reached), the platform-selected CUDA/HIP/NPU/XPU forwards and the Intel-AMX `sgl_kernel`
ops (platform flags are fixed to a CPU without AMX, where SGLang itself uses these torch-native paths),
the Triton `MoeRunner` that `create_moe_runner` builds for the CUDA path (never run on this path), weight
loading (`weight_loader`, `set_weight_attrs`), quantisation configs (`quant_config=None`), the routing
functions of the branches not taken (grouped / biased-grouped top-k and the `topk_softmax` kernel are stubs
that raise; the linear layers' constructors are cut to one rank), and the
`enter_torch_compile` swap to `fused_moe_forward_native` (taken only for batch size 1 under SGLang's own
torch.compile mode). Server args, backend enums and the distributed getters are small local stand-ins
with SGLang's defaults (`moe_a2a_backend` none, `moe_runner_backend` auto, no redundant experts).
Qwen1.5-MoE-A2.7B has 60 experts, top-4, norm_topk_prob False, one shared expert 4x the expert width (kept
at the tiny size with 8 experts).
Constructs: `CustomOp` platform dispatch through a bound method stored in `__init__`, a config dataclass
mutated in forward, NamedTuple outputs with `_replace`/unpacking, `assert`s, an import-time function alias,
a nested scoring function with a string switch, `scatter_` count matrix, `argsort` dispatch, a
`.cpu().numpy()` host read iterated with `enumerate` and numpy-int slicing, an `if num_tokens == 0:
continue` skip, an nn.Module constructed inside forward, list append + conditional `torch.cat`,
index_put (`new_x[idxs] = outs`) combine, in-place `mul_`, a `nullcontext()` `with` block, config-gated
distributed branches, a sigmoid-gated shared expert.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from ._shell import Source, tiny

SOURCE = Source("sgl-project/sglang", "python/sglang/srt/layers/moe/fused_moe_native.py",
                "d16ff357db7b38a46b30f0ec9a5a86f73a898a57", "moe_forward_native")
HIDDEN, INTER, SHARED_INTER, EXPERTS, TOP_K = 16, 8, 32, 8, 4

# Platform flags SGLang computes at import: a CPU engine without Intel AMX (no sgl_kernel CPU ops).
_is_cuda = False
_is_hip = False
_is_cpu = True
_is_cpu_amx_available = False
_is_npu = False
_is_xpu = False
_use_aiter = False


# ---- one-rank stand-ins for SGLang's server args, backends and distributed state ----

@dataclass
class ServerArgs:
    ep_num_redundant_experts: int = 0
    rl_on_policy_target: str | None = None


_global_server_args = ServerArgs()


def get_global_server_args():
    return _global_server_args


class MoeA2ABackend(Enum):
    NONE = "none"
    DEEPEP = "deepep"
    MOONCAKE = "mooncake"
    ASCEND_FUSEEP = "ascend_fuseep"

    def is_none(self):
        return self == MoeA2ABackend.NONE

    def is_deepep(self):
        return self == MoeA2ABackend.DEEPEP

    def is_mooncake(self):
        return self == MoeA2ABackend.MOONCAKE


class MoeRunnerBackend(Enum):
    AUTO = "auto"
    TRITON = "triton"
    TRITON_KERNELS = "triton_kernel"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    FLASHINFER_CUTLASS = "flashinfer_cutlass"

    def is_triton_kernels(self):
        return self == MoeRunnerBackend.TRITON_KERNELS

    def is_flashinfer_trtllm(self):
        return self == MoeRunnerBackend.FLASHINFER_TRTLLM

    def is_flashinfer_cutlass(self):
        return self == MoeRunnerBackend.FLASHINFER_CUTLASS


def get_moe_a2a_backend():
    return MoeA2ABackend.NONE


def get_moe_runner_backend():
    return MoeRunnerBackend.AUTO


def get_tensor_model_parallel_world_size():
    return 1


def get_moe_expert_parallel_world_size():
    return 1


def get_moe_expert_parallel_rank():
    return 0


def get_moe_tensor_parallel_world_size():
    return 1


def get_moe_tensor_parallel_rank():
    return 0


def tensor_model_parallel_all_reduce(x):
    raise NotImplementedError("all-reduce across tensor-parallel ranks")


class GroupCoordinator:
    world_size = 1


def get_tp_group():
    return GroupCoordinator()


def is_allocation_symmetric():
    return False


def is_symmetric_memory_enabled():
    return False


def use_symmetric_memory(group_coordinator, disabled=False):
    disabled = not is_symmetric_memory_enabled() or disabled or group_coordinator.world_size == 1
    if not disabled:
        raise NotImplementedError("SymmetricMemoryContext (pynccl allocator)")
    return nullcontext()


def should_use_flashinfer_cutlass_moe_fp4_allgather():
    # the original also needs DP attention and modelopt_fp4; its first test already fails here
    return get_moe_runner_backend().is_flashinfer_cutlass()


def get_is_capture_mode():
    return False


def use_intel_amx_backend(layer):
    return getattr(layer, "use_intel_amx_backend", False)


class _ExpertDistributionRecorderNoop:
    def on_select_experts(self, topk_ids):
        pass


_global_expert_distribution_recorder = _ExpertDistributionRecorderNoop()


def get_global_expert_distribution_recorder():
    return _global_expert_distribution_recorder


def transform_select_experts_inputs(router_logits, correction_bias, info):
    if (info is not None) and (info.ep_dispatch_algorithm == "fake"):
        router_logits.uniform_(5, 10)
        if correction_bias is not None:
            correction_bias = torch.zeros_like(correction_bias)
    return router_logits, correction_bias


# ---- custom_op.py ----

class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self._forward_method = self.dispatch_forward()

        # States for torch.compile
        self._original_forward_method = None
        self.is_torch_compile = False

    # Please do not override this method, because `self._forward_method` can change when in torch compile mode
    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cuda(self, *args, **kwargs):
        raise NotImplementedError

    def forward_npu(self, *args, **kwargs):
        raise NotImplementedError

    def forward_hip(self, *args, **kwargs):
        return self.forward_cuda(*args, **kwargs)

    def forward_xpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self):
        if _is_cuda:
            return self.forward_cuda
        elif _is_hip:
            return self.forward_hip
        elif _is_cpu and _is_cpu_amx_available:
            return self.forward_cpu
        elif _is_npu:
            return self.forward_npu
        elif _is_xpu:
            return self.forward_xpu
        else:
            return self.forward_native


# ---- layers/activation.py ----

class SiluAndMul(CustomOp):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if get_global_server_args().rl_on_policy_target is not None:
            self._forward_method = self.forward_native

    def forward_native(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def forward_cpu(self, x):
        if _is_cpu_amx_available:
            raise NotImplementedError("torch.ops.sgl_kernel.silu_and_mul_cpu")
        else:
            return self.forward_native(x)


class GeluAndMul(CustomOp):
    def __init__(self, approximate="tanh"):
        super().__init__()
        self.approximate = approximate

    def forward_native(self, x):
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


# ---- layers/quantization/base_config.py, unquant.py (linear) and layers/linear.py ----

class QuantizeMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer, *weight_args, **extra_weight_attrs):
        raise NotImplementedError()

    @abstractmethod
    def apply(self, layer, *args, **kwargs):
        raise NotImplementedError()


class LinearMethodBase(QuantizeMethodBase):
    pass


class FusedMoEMethodBase(QuantizeMethodBase):
    @abstractmethod
    def create_moe_runner(self, layer, moe_runner_config):
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        weight = Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                           requires_grad=False)
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        if use_intel_amx_backend(layer):
            raise NotImplementedError("torch.ops.sgl_kernel.weight_packed_linear")

        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    def __init__(self, input_size, output_size, skip_bias_add=False, params_dtype=None, quant_config=None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        if params_dtype is None:
            params_dtype = torch.get_default_dtype()
        self.params_dtype = params_dtype
        self.quant_config = quant_config
        if quant_config is None:
            self.quant_method = UnquantizedLinearMethod()
        else:
            raise NotImplementedError("quantised linear methods")


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size, output_size, bias=True, skip_bias_add=False, params_dtype=None,
                 quant_config=None, prefix=""):
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config)
        assert self.quant_method is not None
        self.quant_method.create_weights(self, self.input_size, [self.output_size], self.input_size,
                                         self.output_size, self.params_dtype)
        if bias:
            self.bias = Parameter(torch.empty(self.output_size, dtype=self.params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        bias = self.bias if not self.skip_bias_add else None
        assert self.quant_method is not None
        output = self.quant_method.apply(self, x, bias)
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class MergedColumnParallelLinear(LinearBase):
    """One tensor-parallel rank: the merged [gate; up] weight, `gather_output=False`."""

    def __init__(self, input_size, output_sizes, bias=True, gather_output=False, skip_bias_add=False,
                 params_dtype=None, quant_config=None, prefix="", tp_rank=None, tp_size=None):
        super().__init__(input_size, sum(output_sizes), skip_bias_add, params_dtype, quant_config)
        self.gather_output = gather_output
        self.tp_rank = 0 if tp_rank is None else tp_rank
        self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        self.output_sizes = output_sizes
        self.output_size_per_partition = sum(output_sizes) // self.tp_size
        self.quant_method.create_weights(self, self.input_size, [x // self.tp_size for x in output_sizes],
                                         self.input_size, self.output_size, self.params_dtype)
        if bias:
            self.bias = Parameter(torch.empty(self.output_size_per_partition, dtype=self.params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        bias = self.bias if not self.skip_bias_add else None

        assert self.quant_method is not None
        output_parallel = self.quant_method.apply(self, input_, bias)
        if self.gather_output:
            raise NotImplementedError("tensor_model_parallel_all_gather")
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(LinearBase):
    """One tensor-parallel rank, `input_is_parallel=True`."""

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True, skip_bias_add=False,
                 params_dtype=None, reduce_results=True, quant_config=None, prefix="", tp_rank=None, tp_size=None):
        super().__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.tp_rank = 0 if tp_rank is None else tp_rank
        self.tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        self.input_size_per_partition = input_size // self.tp_size
        self.quant_method.create_weights(self, self.input_size_per_partition, [self.output_size], self.input_size,
                                         self.output_size, self.params_dtype)
        if bias:
            self.bias = Parameter(torch.empty(self.output_size, dtype=self.params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_, skip_all_reduce=False):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            raise NotImplementedError("split_tensor_along_last_dim across ranks")

        assert self.quant_method is not None
        # Only fuse bias add into GEMM for rank 0 (this ensures that
        # bias will not get added more than once in TP>1 case)
        bias_ = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        with use_symmetric_memory(get_tp_group(), disabled=not is_allocation_symmetric()):
            output_parallel = self.quant_method.apply(self, input_parallel, bias=bias_)

        if self.reduce_results and self.tp_size > 1 and not skip_all_reduce:
            output = tensor_model_parallel_all_reduce(output_parallel)
        else:
            output = output_parallel

        output_bias = self.bias if self.skip_bias_add else None

        return output, output_bias


# ---- layers/moe/topk.py ----

@dataclass
class TopKConfig:
    top_k: int
    use_grouped_topk: bool = False
    topk_group: int | None = None
    num_expert_group: int | None = None
    renormalize: bool = True
    num_fused_shared_experts: int = 0
    custom_routing_function: Callable | None = None
    correction_bias: torch.Tensor | None = None
    torch_native: bool = False
    routed_scaling_factor: float | None = None
    apply_routed_scaling_factor_on_output: bool = False
    fused_shared_experts_scaling_factor: float | None = None
    output_format: str | None = None
    scoring_func: str = "softmax"


class StandardTopKOutput(NamedTuple):
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor

    @property
    def format(self):
        return "standard"


class TopKOutputChecker:
    @staticmethod
    def format_is_standard(topk_output):
        return isinstance(topk_output, StandardTopKOutput)


class TopK(CustomOp):
    def __init__(self, top_k, *, use_grouped_topk=False, topk_group=None, num_expert_group=None, renormalize=True,
                 num_fused_shared_experts=0, custom_routing_function=None, scoring_func="softmax",
                 correction_bias=None, quant_config=None, routed_scaling_factor=None,
                 apply_routed_scaling_factor_on_output=False, output_format=None,
                 fused_shared_experts_scaling_factor=None):
        super().__init__()

        if use_grouped_topk:
            assert num_expert_group is not None and topk_group is not None

        self.topk_config = TopKConfig(
            top_k=top_k,
            use_grouped_topk=use_grouped_topk,
            renormalize=renormalize,
            topk_group=topk_group,
            num_expert_group=num_expert_group,
            num_fused_shared_experts=num_fused_shared_experts,
            custom_routing_function=custom_routing_function,
            correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor,
            apply_routed_scaling_factor_on_output=apply_routed_scaling_factor_on_output,
            fused_shared_experts_scaling_factor=fused_shared_experts_scaling_factor,
            output_format=output_format,
            scoring_func=scoring_func,
        )

    def forward_native(self, hidden_states, router_logits, *, num_token_non_padded=None,
                       expert_location_dispatch_info=None):
        self.topk_config.torch_native = True
        return select_experts(
            hidden_states=hidden_states,
            router_logits=router_logits,
            topk_config=self.topk_config,
            num_token_non_padded=num_token_non_padded,
            expert_location_dispatch_info=expert_location_dispatch_info,
        )

    def forward_cpu(self, hidden_states, router_logits, *, num_token_non_padded=None,
                    expert_location_dispatch_info=None):
        return select_experts(
            hidden_states=hidden_states,
            router_logits=router_logits,
            topk_config=self.topk_config,
            num_token_non_padded=num_token_non_padded,
            expert_location_dispatch_info=expert_location_dispatch_info,
        )


def fused_topk_torch_native(hidden_states, gating_output, topk, renormalize, correction_bias=None,
                            scoring_func="softmax"):
    def scoring_func_impl(gating_output):
        if scoring_func == "softmax":
            return gating_output.softmax(dim=-1)
        elif scoring_func == "sigmoid":
            return gating_output.sigmoid()
        else:
            raise ValueError(f"Invalid scoring function: {scoring_func}")

    if correction_bias is not None:
        n_routed_experts = gating_output.shape[-1]
        scores = scoring_func_impl(gating_output)
        scores_for_choice = scores.view(-1, n_routed_experts) + correction_bias.unsqueeze(0)
        topk_ids = torch.topk(scores_for_choice, k=topk, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
    else:
        assert (
            hidden_states.shape[0] == gating_output.shape[0]
        ), f"Number of tokens mismatch, {hidden_states.shape=} vs {gating_output.shape=}"
        M, _ = hidden_states.shape
        topk_weights = torch.empty(M, topk, dtype=torch.float32, device=hidden_states.device)
        topk_ids = torch.empty(M, topk, dtype=torch.int32, device=hidden_states.device)
        topk_weights = scoring_func_impl(gating_output.float())
        topk_weights, topk_ids = torch.topk(topk_weights, topk, dim=-1)

    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def _kernel_only(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"{name} is an sgl_kernel / CUDA routine")
    return kernel


grouped_topk_gpu = _kernel_only("grouped_topk_gpu")
biased_grouped_topk_gpu = _kernel_only("biased_grouped_topk_gpu")
grouped_topk_cpu = _kernel_only("grouped_topk_cpu")
biased_grouped_topk_cpu = _kernel_only("biased_grouped_topk_cpu")
fused_topk = _kernel_only("fused_topk (topk_softmax)")
fused_topk_cpu = _kernel_only("fused_topk_cpu (topk_softmax_cpu)")

if _is_cpu and _is_cpu_amx_available:
    biased_grouped_topk = biased_grouped_topk_cpu
    grouped_topk = grouped_topk_cpu
    fused_topk_native = fused_topk_cpu
    fused_topk = fused_topk_cpu
else:
    biased_grouped_topk = biased_grouped_topk_gpu
    grouped_topk = grouped_topk_gpu
    fused_topk_native = fused_topk_torch_native


def select_experts(hidden_states, router_logits, topk_config, *, num_token_non_padded=None,
                   expert_location_dispatch_info=None):
    top_k = topk_config.top_k
    use_grouped_topk = topk_config.use_grouped_topk
    topk_group = topk_config.topk_group
    num_expert_group = topk_config.num_expert_group
    renormalize = topk_config.renormalize
    num_fused_shared_experts = topk_config.num_fused_shared_experts
    custom_routing_function = topk_config.custom_routing_function
    correction_bias = topk_config.correction_bias
    torch_native = topk_config.torch_native
    apply_routed_scaling_factor_on_output = topk_config.apply_routed_scaling_factor_on_output
    scoring_func = topk_config.scoring_func

    router_logits, correction_bias = transform_select_experts_inputs(
        router_logits=router_logits,
        correction_bias=correction_bias,
        info=expert_location_dispatch_info,
    )

    num_routed_topk = top_k - num_fused_shared_experts
    if use_grouped_topk:
        assert topk_group is not None
        assert num_expert_group is not None
        if correction_bias is None:
            topk_weights, topk_ids = grouped_topk(hidden_states, router_logits, top_k, renormalize)
        else:
            topk_weights, topk_ids = biased_grouped_topk(hidden_states, router_logits, correction_bias, top_k)
    elif torch_native and custom_routing_function is None:
        assert num_token_non_padded is None, "num_token_non_padded is not yet supported in fused_topk_native"
        assert expert_location_dispatch_info is None
        assert not apply_routed_scaling_factor_on_output, "Not implemented"
        topk_weights, topk_ids = fused_topk_native(
            hidden_states=hidden_states,
            gating_output=router_logits,
            topk=num_routed_topk if _use_aiter else top_k,
            renormalize=renormalize,
            correction_bias=correction_bias,
            scoring_func=scoring_func,
        )
    elif custom_routing_function is None:
        assert not apply_routed_scaling_factor_on_output, "Not implemented"
        topk_weights, topk_ids = fused_topk(hidden_states, router_logits, top_k, renormalize)
    else:
        assert num_token_non_padded is None, "num_token_non_padded is not yet supported in custom_routing_function"
        assert expert_location_dispatch_info is None
        assert not apply_routed_scaling_factor_on_output, "Not implemented"
        topk_weights, topk_ids = custom_routing_function(
            hidden_states=hidden_states,
            gating_output=router_logits,
            topk=num_routed_topk if _use_aiter else top_k,
            renormalize=renormalize,
        )

    if num_fused_shared_experts > 0 and _use_aiter:
        raise NotImplementedError("fused_append_shared_experts (ROCm aiter)")

    get_global_expert_distribution_recorder().on_select_experts(topk_ids=topk_ids)

    return StandardTopKOutput(topk_weights, topk_ids, router_logits)


# ---- layers/moe/moe_runner/base.py, token_dispatcher/standard.py ----

@dataclass
class MoeRunnerConfig:
    num_experts: int | None = None
    num_local_experts: int | None = None
    hidden_size: int | None = None
    intermediate_size_per_partition: int | None = None
    layer_id: int | None = None
    top_k: int | None = None
    num_fused_shared_experts: int | None = None
    params_dtype: torch.dtype | None = None

    activation: str = "silu"
    is_gated: bool = True
    apply_router_weight_on_input: bool = False
    inplace: bool = True
    no_combine: bool = False
    routed_scaling_factor: float | None = None
    gemm1_alpha: float | None = None
    gemm1_clamp_limit: float | None = None


class StandardDispatchOutput(NamedTuple):
    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_output: StandardTopKOutput

    @property
    def format(self):
        return "standard"


class StandardCombineInput(NamedTuple):
    hidden_states: torch.Tensor

    @property
    def format(self):
        return "standard"


class BaseDispatcher(ABC):
    @abstractmethod
    def dispatch(self, hidden_states, topk_output):
        raise NotImplementedError

    @abstractmethod
    def combine(self, combine_input):
        raise NotImplementedError


class StandardDispatcher(BaseDispatcher):
    def __init__(self, moe_runner_config):
        super().__init__()
        self.moe_ep_size = get_moe_expert_parallel_world_size()
        self.enable_flashinfer_cutlass_moe = get_moe_runner_backend().is_flashinfer_cutlass()
        self.num_experts = moe_runner_config.num_experts
        self.num_local_shared_experts = moe_runner_config.num_fused_shared_experts
        self.num_local_routed_experts = moe_runner_config.num_local_experts - self.num_local_shared_experts
        self.moe_ep_rank = get_moe_expert_parallel_rank()
        self.local_expert_mapping = None

    def dispatch(self, hidden_states, topk_output):
        if should_use_flashinfer_cutlass_moe_fp4_allgather():
            raise NotImplementedError("fp4 quantise + all-gather of hidden states (flashinfer)")
        else:
            hidden_states = hidden_states
            hidden_states_scale = None

        if (
            self.moe_ep_size > 1
            and not self.enable_flashinfer_cutlass_moe
            and TopKOutputChecker.format_is_standard(topk_output)
        ):
            raise NotImplementedError("local expert mapping across expert-parallel ranks")

        if self.local_expert_mapping is not None and not _use_aiter:
            if TopKOutputChecker.format_is_standard(topk_output):
                topk_output = topk_output._replace(topk_ids=self.local_expert_mapping[topk_output.topk_ids])

        return StandardDispatchOutput(
            hidden_states=hidden_states,
            hidden_states_scale=hidden_states_scale,
            topk_output=topk_output,
        )

    def combine(self, combine_input):
        (hidden_states,) = combine_input
        if should_use_flashinfer_cutlass_moe_fp4_allgather():
            raise NotImplementedError("reduce-scatter across DP ranks")
        return hidden_states


# ---- layers/moe/fused_moe_native.py ----

def moe_forward_native(layer, x, topk_output, moe_runner_config):

    if moe_runner_config.apply_router_weight_on_input:
        raise NotImplementedError()

    topk_weights, topk_ids, _ = topk_output

    # Ref code from DeepSeek-V2's modeling_deepseek.py (MoE.moe_infer)
    len_experts = layer.num_experts

    cnts = topk_ids.new_zeros((topk_ids.shape[0], len_experts))
    cnts.scatter_(1, topk_ids.to(torch.int64), 1)
    tokens_per_expert = cnts.sum(dim=0)
    idxs = topk_ids.view(-1).argsort()

    sorted_tokens = x[idxs // topk_ids.shape[1]]
    tokens_per_expert = tokens_per_expert.cpu().numpy()

    if moe_runner_config.activation == "silu":
        act = SiluAndMul()
    elif moe_runner_config.activation == "gelu":
        act = GeluAndMul()
    else:
        raise ValueError(f"Unsupported activation: {moe_runner_config.activation=}")

    outputs = []
    start_idx = 0
    for i, num_tokens in enumerate(tokens_per_expert):
        end_idx = start_idx + num_tokens
        if num_tokens == 0:
            continue
        tokens_for_this_expert = sorted_tokens[start_idx:end_idx]

        layer_w13_weight = layer.w13_weight[i]
        layer_w2_weight = layer.w2_weight[i]

        gate_up = F.linear(tokens_for_this_expert, layer_w13_weight)
        gate_up = act(gate_up)
        expert_out = F.linear(gate_up, layer_w2_weight)
        outputs.append(expert_out)
        start_idx = end_idx

    outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
    new_x = torch.empty_like(outs)

    new_x[idxs] = outs
    final_out = (
        new_x.view(*topk_ids.shape, -1)
        .type(topk_weights.dtype)
        .mul_(topk_weights.unsqueeze(dim=-1))
        .sum(dim=1)
        .type(new_x.dtype)
    )
    return final_out


# ---- layers/quantization/unquant.py (MoE) and layers/moe/fused_moe_triton/layer.py ----

class UnquantizedFusedMoEMethod(FusedMoEMethodBase, CustomOp):
    def __init__(self, use_triton_kernels=False, use_flashinfer_trtllm_moe=False):
        super().__init__()
        self.use_flashinfer_cutlass = get_moe_runner_backend().is_flashinfer_cutlass()
        self.use_triton_kernels = use_triton_kernels
        self.with_bias = False
        self.use_flashinfer_trtllm_moe = use_flashinfer_trtllm_moe
        self._cache_permute_indices = dict({})

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       with_bias=False, **extra_weight_attrs):
        self.with_bias = with_bias

        w13_up_dim = 2 * intermediate_size_per_partition if layer.moe_runner_config.is_gated \
            else intermediate_size_per_partition
        w13_weight_n, w13_weight_k = (w13_up_dim, hidden_size)
        if self.use_triton_kernels:
            w13_weight_n, w13_weight_k = w13_weight_k, w13_weight_n
        w13_weight = torch.nn.Parameter(torch.empty(num_experts, w13_weight_n, w13_weight_k, dtype=params_dtype),
                                        requires_grad=False)
        layer.register_parameter("w13_weight", w13_weight)

        w2_weight_n, w2_weight_k = (hidden_size, intermediate_size_per_partition)
        if self.use_triton_kernels:
            w2_weight_n, w2_weight_k = w2_weight_k, w2_weight_n
        w2_weight = torch.nn.Parameter(torch.empty(num_experts, w2_weight_n, w2_weight_k, dtype=params_dtype),
                                       requires_grad=False)
        layer.register_parameter("w2_weight", w2_weight)

    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        self.runner = None  # the Triton MoeRunner of the CUDA path

    def apply(self, layer, dispatch_output):
        return self.forward(
            layer=layer,
            dispatch_output=dispatch_output,
        )

    def forward_cuda(self, layer, dispatch_output):
        raise NotImplementedError("Triton / flashinfer fused MoE kernels")

    def forward_cpu(self, layer, dispatch_output):
        x = dispatch_output.hidden_states
        topk_output = dispatch_output.topk_output

        moe_runner_config = self.moe_runner_config

        assert moe_runner_config.activation == "silu", f"activation = {moe_runner_config.activation} is not supported."

        if use_intel_amx_backend(layer):
            raise NotImplementedError("torch.ops.sgl_kernel.fused_experts_cpu")
        else:
            output = moe_forward_native(
                layer,
                x,
                topk_output,
                moe_runner_config,
            )
            return StandardCombineInput(hidden_states=output)

    forward_native = forward_cpu


def create_moe_dispatcher(moe_runner_config):
    a2a_backend = get_moe_a2a_backend()
    if a2a_backend.is_none():
        return StandardDispatcher(moe_runner_config)
    raise NotImplementedError(f"Unsupported a2a backend: {a2a_backend}")


class FusedMoE(nn.Module):
    def __init__(self, num_experts, hidden_size, intermediate_size, layer_id, top_k=None, num_fused_shared_experts=0,
                 params_dtype=None, reduce_results=False, quant_config=None, prefix="", activation="silu",
                 apply_router_weight_on_input=False, inplace=True, no_combine=False, routed_scaling_factor=None,
                 with_bias=False, routing_method_type=None, is_gated=True):
        super().__init__()
        if params_dtype is None:
            params_dtype = torch.get_default_dtype()

        self.layer_id = layer_id
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.num_fused_shared_experts = num_fused_shared_experts

        self.enable_flashinfer_cutlass_moe = get_moe_runner_backend().is_flashinfer_cutlass()
        self.moe_ep_size = get_moe_expert_parallel_world_size()
        self.moe_ep_rank = get_moe_expert_parallel_rank()
        self.moe_tp_size = get_moe_tensor_parallel_world_size()
        self.moe_tp_rank = get_moe_tensor_parallel_rank()
        assert (num_experts - num_fused_shared_experts) % self.moe_ep_size == 0
        self.num_local_experts = (num_experts - num_fused_shared_experts) // self.moe_ep_size \
            + num_fused_shared_experts

        self.expert_mask_gpu = None

        assert intermediate_size % self.moe_tp_size == 0
        self.intermediate_size_per_partition = intermediate_size // self.moe_tp_size
        self.reduce_results = reduce_results

        self.use_triton_kernels = get_moe_runner_backend().is_triton_kernels()
        self.use_flashinfer_trtllm_moe = get_moe_runner_backend().is_flashinfer_trtllm()
        self.quant_config = quant_config

        self.moe_runner_config = MoeRunnerConfig(
            num_experts=num_experts,
            num_local_experts=self.num_local_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            layer_id=layer_id,
            top_k=top_k,
            num_fused_shared_experts=num_fused_shared_experts,
            params_dtype=params_dtype,
            activation=activation,
            apply_router_weight_on_input=apply_router_weight_on_input,
            inplace=inplace,
            no_combine=no_combine,
            routed_scaling_factor=routed_scaling_factor,
            is_gated=is_gated,
        )

        self.quant_method = None
        if quant_config is not None:
            raise NotImplementedError("quantised MoE methods")
        if self.quant_method is None:
            self.quant_method = UnquantizedFusedMoEMethod(self.use_triton_kernels, self.use_flashinfer_trtllm_moe)

        self.quant_method.create_weights(
            layer=self,
            num_experts=self.num_local_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            params_dtype=params_dtype,
            with_bias=with_bias,
        )

        self.quant_method.create_moe_runner(self, self.moe_runner_config)
        self.dispatcher = create_moe_dispatcher(self.moe_runner_config)
        self.routing_method_type = routing_method_type

    def forward(self, hidden_states, topk_output):
        origin_hidden_states_dim = hidden_states.shape[-1]
        assert self.quant_method is not None

        dispatch_output = self.dispatcher.dispatch(hidden_states=hidden_states, topk_output=topk_output)
        if _use_aiter and self.dispatcher.local_expert_mapping is not None:
            raise NotImplementedError("aiter expert mask")

        combine_input = self.run_moe_core(
            dispatch_output=dispatch_output,
        )

        with use_symmetric_memory(get_tp_group(), disabled=not is_allocation_symmetric()):
            final_hidden_states = self.dispatcher.combine(combine_input=combine_input)

            final_hidden_states = final_hidden_states[..., :origin_hidden_states_dim].contiguous()

        if self.reduce_results and (self.moe_tp_size > 1 or self.moe_ep_size > 1):
            final_hidden_states = tensor_model_parallel_all_reduce(final_hidden_states)

        return final_hidden_states

    def run_moe_core(self, dispatch_output):
        return self.quant_method.apply(
            layer=self,
            dispatch_output=dispatch_output,
        )


def get_moe_impl_class(quant_config):
    if get_moe_a2a_backend().is_deepep() or get_moe_a2a_backend().is_mooncake():
        raise NotImplementedError("DeepEPMoE")
    if get_moe_runner_backend().is_flashinfer_trtllm():
        raise NotImplementedError("FlashInferFusedMoE")
    return FusedMoE


# ---- models/qwen2_moe.py ----

@dataclass
class Qwen2MoeConfig:
    hidden_size: int = HIDDEN
    num_experts: int = EXPERTS
    num_experts_per_tok: int = TOP_K
    norm_topk_prob: bool = False
    moe_intermediate_size: int = INTER
    shared_expert_intermediate_size: int = SHARED_INTER
    hidden_act: str = "silu"


class Qwen2MoeMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, hidden_act, quant_config=None, reduce_results=True,
                 prefix="", tp_rank=None, tp_size=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, quant_config=quant_config,
                                           reduce_results=reduce_results, tp_rank=tp_rank, tp_size=tp_size)
        if hidden_act != "silu":
            raise ValueError(f"Unsupported activation: {hidden_act}. Only silu is supported for now.")
        self.act_fn = SiluAndMul()

    def forward(self, x, should_allreduce_fusion=False, use_reduce_scatter=False):
        gate_up, _ = self.gate_up_proj(x)
        x = self.act_fn(gate_up)
        x, _ = self.down_proj(x, skip_all_reduce=should_allreduce_fusion or use_reduce_scatter)
        return x


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, layer_id=0, config=None, quant_config=None, alt_stream=None, prefix=""):
        super().__init__()
        config = config or Qwen2MoeConfig()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.layer_id = layer_id
        self.alt_stream = alt_stream
        if self.tp_size > config.num_experts:
            raise ValueError(
                f"Tensor parallel size {self.tp_size} is greater than the number of experts {config.num_experts}.")

        self.topk = TopK(
            top_k=config.num_experts_per_tok,
            renormalize=config.norm_topk_prob,
        )

        self.experts = get_moe_impl_class(quant_config)(
            layer_id=self.layer_id,
            top_k=config.num_experts_per_tok,
            num_experts=config.num_experts + get_global_server_args().ep_num_redundant_experts,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            quant_config=quant_config,
            routing_method_type="RenormalizeNaive",
        )

        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, quant_config=None)
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = Qwen2MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.shared_expert_intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                reduce_results=False,
                **(dict(tp_rank=0, tp_size=1) if get_moe_a2a_backend().is_deepep() else {}),
            )
        else:
            self.shared_expert = None
        if _is_cpu and _is_cpu_amx_available:
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False, quant_config=None)
        else:
            self.shared_expert_gate = torch.nn.Linear(config.hidden_size, 1, bias=False)

    def _forward_shared_experts(self, hidden_states):
        shared_output = None
        if self.shared_expert is not None:
            shared_output = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                if use_intel_amx_backend(self.shared_expert_gate):
                    raise NotImplementedError("torch.ops.sgl_kernel.fused_linear_sigmoid_mul")
                else:
                    shared_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_output

        return shared_output

    def _forward_router_experts(self, hidden_states):
        # router_logits: (num_tokens, n_experts)
        router_logits, _ = self.gate(hidden_states)
        topk_output = self.topk(hidden_states, router_logits)
        return self.experts(hidden_states, topk_output)

    def forward(self, hidden_states, forward_batch=None, use_reduce_scatter=False):
        num_tokens, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)

        if get_moe_a2a_backend().is_deepep():
            raise NotImplementedError("DeepEP all-to-all MoE forward")

        if self.alt_stream is not None and hidden_states.shape[0] > 0 and get_is_capture_mode():
            raise NotImplementedError("dual-stream shared expert under CUDA graph capture")
        else:
            shared_output = self._forward_shared_experts(hidden_states)
            final_hidden_states = self._forward_router_experts(hidden_states)

        if shared_output is not None:
            final_hidden_states = final_hidden_states + shared_output
        if self.tp_size > 1 and not use_reduce_scatter:
            final_hidden_states = tensor_model_parallel_all_reduce(final_hidden_states)

        return final_hidden_states.view(num_tokens, hidden_dim)


class PackedTokens(nn.Module):
    """[B, S, H] -> SGLang's packed [num_tokens, H] layout around the Qwen2-MoE block, and back."""

    def __init__(self):
        super().__init__()
        self.mlp = Qwen2MoeSparseMoeBlock()

    def forward(self, x):
        out = self.mlp(x.view(-1, x.shape[-1]))
        return out.view(x.shape)


def build():
    return tiny(PackedTokens, HIDDEN)
