"""Megatron-Core's `MoELayer`: TopKRouter, all-gather token dispatcher (one rank) and a `SequentialMLP` loop.

Mirrors NVIDIA/Megatron-LM `megatron/core/transformer/moe/moe_layer.py` at commit d98e8a6 (`BaseMoELayer`,
`MoELayer.__init__`, `route`, `preprocess`, `dispatch`, `shared_experts_compute`, `routed_experts_compute`,
`combine`, `postprocess`, `forward`), with `moe/router.py` (`Router`, `TopKRouter`: `gating`, `routing`,
`forward`, `apply_input_jitter`, `apply_z_loss`, `_apply_expert_bias`, `get_aux_loss_coeff`),
`moe/token_dispatcher.py` (`MoETokenDispatcher`, `MoEAllGatherTokenDispatcher`), `moe/experts.py`
(`SequentialMLP`), `moe/moe_utils.py` (`permute`, `unpermute`, `topk_routing_with_score_function`,
`group_limited_topk`, `RouterGatingLinearFunction`, `router_gating_linear`, `MoECudaGraphTensorStore`,
`maybe_skip_or_early_return_by_cudagraph`), `transformer/mlp.py` (`MLP`), `core/jit.py` (`jit_fuser`),
`core/utils.py` (`get_pg_size`, `get_pg_rank`, `internal_api`, `nvtx_range_push/pop`) and
`core/typed_torch.py` (`apply_module`, `not_none`). The layer is built the way the local spec
(`LocalSpecProvider.grouped_mlp_modules`, `moe_grouped_gemm=False`) builds it: `MoESubmodules(
experts=partial(SequentialMLP, submodules=MLPSubmodules(ColumnParallelLinear, RowParallelLinear)),
router=TopKRouter)`.
The config holds `TransformerConfig`'s defaults: `moe_token_dispatcher_type="allgather"` (the default, so
`MoEAllGatherTokenDispatcher`), `moe_router_load_balancing_type="aux_loss"`, `moe_router_score_function=
"softmax"` without pre-softmax, no groups, no scaling factor, no expert bias, no router fusion, no capacity
factor (dropless), `moe_permute_fusion=False`, `bias_activation_fusion=False`, `cuda_graph_impl="none"`; and
the Mixtral settings from `examples/mixtral/train_mixtral_8x7b_distributed.sh`: 8 experts, top-2,
`--swiglu` (`gated_linear_unit=True`, `activation_func=F.silu`), `--disable-bias-linear`, aux-loss coeff 1e-2
(that script itself picks the alltoall dispatcher with grouped GEMM, which need Transformer Engine, and
the training CLI turns `bias_activation_fusion` on with `--swiglu`, which would take the `@jit_fuser`
`weighted_bias_swiglu_impl` path instead of the unfused GLU mirrored here).
`MoELayer.forward` (eval) checks training/TP, `hasattr(self, "_inference_token_dispatcher")`, and runs a
nested `custom_forward` inside try/except `MoECudaGraphPartialCaptureSignal`, gated by the step names in
`self.fwd_execution_map`. `route` / `preprocess` / `shared_experts_compute` are wrapped by
`maybe_skip_or_early_return_by_cudagraph` (which calls through when `cuda_graph_impl !=
"transformer_engine"`); there is no shared expert (None). The router checks its float32 expert bias, skips input jitter
(`moe_input_jitter_eps` None), computes the logits with the `RouterGatingLinearFunction` autograd Function
(`torch.mm` in the input dtype, TE's GEMM absent), views them to [S*B, E], skips the z-loss (eval), and
`topk_routing_with_score_function` takes `torch.topk` of the raw logits (through nested closures,
`sorted=torch.is_grad_enabled() or batch-invariant mode`), a float32 softmax over the k values, and scatters
probs and a bool routing map back to [tokens, E] (or `index_put_` when deterministic algorithms are on). No
capacity dropping; the aux-loss branch needs `self.training`; `_apply_expert_bias` is a `@jit_fuser`
(`torch.compile`d) method that does nothing without expert bias. The dispatcher views tokens to [S*B, H]
and caches the routing map on itself; `token_dispatch` skips the all-gather (`tp_size > 1 or ep_size > 1` is
false); `dispatch_postprocess` slices the local experts' columns of map and probs, counts tokens per expert
and copies them to the host (`.long().cpu()`), and `permute`s with `num_out_tokens=tokens_per_expert.sum()
.item()` (argsort of the transposed flat map, descending and stable, cut to `num_out_tokens`, `% num_tokens`,
`index_select`), with the probs taken by `masked_select` of the transposed map. `SequentialMLP` (more than one
local expert) reads `tokens_per_expert.tolist()`, `torch.split`s tokens and probs by it and loops `zip(
self.local_experts, tokens_list, probs_list)`, each `MLP` doing fc1 (to 2 * ffn), the GLU closure (`chunk`,
silu(gate) * (up + glu_linear_offset)), the per-token prob scale, and fc2; the outputs are `cat`ed.
`unpermute` `scatter_add_`s the rows back into a zero [S*B, H] (or `index_add_` when deterministic), the reduce-scatter is
skipped, and the output is viewed back to [S, B, H]; `forward` returns (output, None).
Megatron layers take [seq, batch, hidden]; the outer `SeqFirst` module transposes the shell's [B, S, H] to
that layout (`.contiguous()`, as a decoder's layernorm hands it over) and back.
Left out: `parallel_state` and process groups (one-rank stand-ins: `ProcessGroupCollection` of groups with
size 1 and rank 0; `torch.distributed` is not initialised, so `get_pg_size` gives 1 anyway); the all-gather
and reduce-scatter of the dispatcher and the alltoall/flex dispatchers (not built; the collectives raise if
reached); the tensor-parallel linears become one-rank `ColumnParallelLinear` / `RowParallelLinear` that keep
the (output, bias) return and `skip_bias_add`, with the identity copy/reduce regions and the
grad-accumulation autograd Function written as `torch.matmul(input, weight.t())`; Transformer Engine fused
permute/unpermute/top-k and `te_general_gemm` (absent, so the PyTorch paths run, as without TE); the
batch-invariant kernels (mode off); the router's move of CPU weights to `torch.cuda.current_device()` (guarded
here by the input being on CUDA, so a run on CPU tensors keeps them in place, on a machine with a GPU too); training-only pieces (aux, sequence
and global aux losses, z-loss, input jitter, expert-bias updates, recompute/checkpointing, delayed wgrad
streams, `backward_dw`; the aux-loss methods raise if reached); the fused bias-activation kernels, fp8/fp4
padding, latent projections, shared experts, inference-optimized dispatchers and CUDA-graph partial capture
(off in this config; their branches raise); metrics logging and sharded state dicts.
Constructs: nested closures with try/except and step-name membership tests, decorator-wrapped methods
(`functools.wraps`), a `torch.compile`d method, an autograd Function for the router linear, `topk` with a
grad-mode `sorted`, scatter-built routing map, module state written in forward (routing map, shapes,
permutation), a host copy `.cpu()` plus `.item()` sizing the permutation, argsort permute with `%` and
`index_select`, `masked_select` probs, `.tolist()` split sizes, `torch.split` + `zip` expert loop (empty
experts run on zero rows), a GLU closure with a walrus clamp check, `scatter_add_` unpermute, deterministic-
mode branches, `del` of intermediates, and (output, bias) tuples throughout.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from copy import deepcopy
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("NVIDIA/Megatron-LM", "megatron/core/transformer/moe/moe_layer.py",
                "d98e8a64ddf34856e74b24714e3bedb2f5a39553", "MoELayer.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2

HAVE_TE = False
te_general_gemm = None
_nvtx_enabled = False
_batch_invariant_MODE = False
_IS_GRAPH_CAPTURING = False


# --- megatron.core.utils / typed_torch / jit / inference.utils -------------------------------------------

def nvtx_range_push(msg=None, suffix=None) -> None:
    if not _nvtx_enabled:
        return
    raise NotImplementedError("NVTX ranges")


def nvtx_range_pop(msg=None, suffix=None) -> None:
    if not _nvtx_enabled:
        return
    raise NotImplementedError("NVTX ranges")


def internal_api(func):
    func._internal_api = True
    return func


def apply_module(m, *, check_subclass: bool = True):
    if check_subclass and not issubclass(type(m), torch.nn.Module):
        raise TypeError(f"{type(m)} is not a subclass of torch.nn.Module")
    return m


def not_none(value):
    if value is None:
        raise ValueError("Expected value to be not None")
    return value


def is_torch_min_version(version):
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    want_major, want_minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (want_major, want_minor)


jit_fuser = torch.jit.script


def enable_jit_fuser():
    global jit_fuser
    if is_torch_min_version("2.2.0a0"):
        jit_fuser = torch.compile


enable_jit_fuser()


def is_batch_invariant_mode_enabled():
    return _batch_invariant_MODE


def is_graph_capturing():
    return _IS_GRAPH_CAPTURING


class InferenceMode:
    _is_active: bool = False

    @classmethod
    def is_active(cls) -> bool:
        return cls._is_active


def get_pg_size(group=None):
    if not torch.distributed.is_initialized() or group is None:
        return 1
    return group.size()


def get_pg_rank(group=None):
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return group.rank()


# --- one-rank stand-ins for parallel_state and the process groups ----------------------------------------

class _OneRankGroup:
    def size(self):
        return 1

    def rank(self):
        return 0


class ProcessGroupCollection:
    def __init__(self):
        for name in ("ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp"):
            setattr(self, name, None)


def get_default_pg_collection() -> ProcessGroupCollection:
    pg_collection = ProcessGroupCollection()
    for name in ("ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp"):
        setattr(pg_collection, name, _OneRankGroup())
    return pg_collection


def gather_from_sequence_parallel_region(input_, group=None, use_global_buffer=False):
    raise NotImplementedError("all-gather across TP*EP ranks")


def reduce_scatter_to_sequence_parallel_region(input_, group=None):
    raise NotImplementedError("reduce-scatter across TP*EP ranks")


# --- config ------------------------------------------------------------------------------------------------

@dataclass
class TransformerConfig:
    """The fields the MoE layer reads, with TransformerConfig's defaults unless noted."""

    hidden_size: int = HIDDEN
    ffn_hidden_size: int | None = INTER
    num_layers: int = 1
    params_dtype: torch.dtype = torch.float32
    init_method_std: float = 0.02
    perform_initialization: bool = True
    add_bias_linear: bool = False  # Mixtral: --disable-bias-linear (default True)
    gated_linear_unit: bool = True  # Mixtral: --swiglu (default False)
    activation_func: object = F.silu  # Mixtral: --swiglu (default F.gelu)
    activation_func_fp8_input_store: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    use_te_activation_func: bool = False
    bias_activation_fusion: bool = False
    use_kitchen: bool = False
    sequence_parallel: bool = False
    calculate_per_token_loss: bool = False
    recompute_granularity: str | None = None
    recompute_modules: list = field(default_factory=lambda: ["core_attn"])
    cuda_graph_impl: str = "none"
    fp8: str | None = None
    fp4: str | None = None
    transformer_impl: str = "local"
    mtp_num_layers: int | None = None
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    num_moe_experts: int | None = EXPERTS  # Mixtral: 8
    moe_ffn_hidden_size: int | None = INTER
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    moe_latent_size: int | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_router_topk: int = TOP_K
    moe_enable_routing_replay: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_score_function: str = "softmax"
    moe_router_dtype: str | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_force_load_balancing: bool = False
    moe_router_force_biased: float | None = None
    moe_router_fusion: bool = False
    moe_aux_loss_coeff: float = 1e-2  # Mixtral: --moe-aux-loss-coeff 1e-2 (default 0.0)
    moe_z_loss_coeff: float | None = None
    moe_input_jitter_eps: float | None = None
    moe_token_dispatcher_type: str = "allgather"
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_permute_fusion: bool = False
    moe_apply_probs_on_input: bool = False

    def init_method(self, tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=self.init_method_std)


class MegatronModule(torch.nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config


# --- moe_utils ---------------------------------------------------------------------------------------------

def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
            tokens_per_expert=None, align_size=0, return_batch_invariant_inverse_map=False):
    """Group the tokens by expert following the [tokens, experts] map."""
    if return_batch_invariant_inverse_map:
        assert not fused, "batch-invariant MoE permute requires the unfused path"
        assert not drop_and_pad, "batch-invariant MoE supports dynamic dropless routing only"

    if fused:
        raise ValueError("fused_permute is not available. Please install TE >= 2.1.0.")

    num_tokens, hidden = tokens.shape
    num_experts = routing_map.shape[1]  # noqa: F841 - read by the drop-and-pad branch
    permuted_probs = None
    batch_invariant_inverse_map = None
    if drop_and_pad and not (num_out_tokens is None):  # noqa: E714 - as written
        raise NotImplementedError("drop-and-pad permute (no capacity factor in this config)")
    else:
        assert num_out_tokens is not None, "num_out_tokens is required for the argsort-based permute"

        # mask [num_tokens, num_experts] -> [num_experts, num_tokens]
        routing_map = routing_map.bool().T.contiguous()

        # argsort puts the non-zeros first, in row-major order, with a fixed-size output
        flat_sorted = routing_map.reshape(-1).argsort(descending=True, stable=True)
        flat_sorted = flat_sorted[:num_out_tokens]
        sorted_indices = flat_sorted % num_tokens

        if probs is not None:
            permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]

        if return_batch_invariant_inverse_map:
            raise NotImplementedError("batch-invariant inverse map (mode off)")

    permuted_input = tokens.index_select(0, sorted_indices)
    return permuted_input, permuted_probs, sorted_indices, batch_invariant_inverse_map, tokens_per_expert


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
              drop_and_pad=False, pad_offsets=None, batch_invariant_inverse_map=None):
    """Restore the original token order, optionally weighting by probs."""
    batch_invariant_mode = is_batch_invariant_mode_enabled()
    if batch_invariant_mode:
        assert not fused, "batch-invariant MoE unpermute requires the unfused path"
        assert not drop_and_pad, "batch-invariant MoE supports dynamic dropless routing only"

    if fused:
        raise ValueError("fused_unpermute is not available. Please install TE >= 2.1.0.")

    if batch_invariant_mode:
        raise NotImplementedError("batch-invariant unpermute (mode off)")

    _, hidden = restore_shape
    input_dtype = permuted_tokens.dtype

    if probs is not None:
        assert routing_map is not None, "Mask must be provided to permute the probs."
        if drop_and_pad:
            raise NotImplementedError("drop-and-pad unpermute (no capacity factor in this config)")
        else:
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)

    output_tokens = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    if torch.are_deterministic_algorithms_enabled():
        output_tokens = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
        output_tokens.index_add_(0, sorted_indices, permuted_tokens)
    else:
        output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    out = output_tokens.to(dtype=input_dtype)
    del output_tokens, permuted_tokens, sorted_indices
    return out


def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
                  .reshape(num_tokens, -1))
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    probs, top_indices = torch.topk(masked_scores, k=topk, dim=-1)
    return probs, top_indices


def topk_routing_with_score_function(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                                     scaling_factor=None, score_function="softmax", expert_bias=None,
                                     fused=False, router_replay=None, dense_output=False,
                                     precomputed_indices=None):
    assert logits.dim() == 2, f"Expected 2D logits [num_tokens, num_experts], got {logits.dim()}."
    num_tokens, num_experts = logits.shape
    assert not (fused and precomputed_indices is not None), \
        "precomputed_indices is not supported with the fused top-k score function."
    if fused:
        raise ValueError("fused_topk_with_score_function is not available. Please install TE >= 2.6.0.")

    def _compute_topk(scores, topk, num_groups=None, group_topk=None):
        if group_topk:
            return group_limited_topk(scores=scores, topk=topk, num_tokens=num_tokens, num_experts=num_experts,
                                      num_groups=num_groups, group_topk=group_topk)
        else:
            # sorting is turned off during inference
            return torch.topk(scores, k=topk, dim=1,
                              sorted=torch.is_grad_enabled() or is_batch_invariant_mode_enabled())

    def compute_topk(scores, topk, num_groups=None, group_topk=None):
        if router_replay is None:
            return _compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        else:
            return router_replay.get_replay_topk(scores, topk, num_groups, group_topk, _compute_topk)

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            if precomputed_indices is not None:
                top_indices = precomputed_indices
                probs = torch.gather(scores, dim=1, index=top_indices)
            else:
                probs, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        else:
            if precomputed_indices is not None:
                top_indices = precomputed_indices
                scores = torch.gather(logits, dim=1, index=top_indices)
            else:
                scores, top_indices = compute_topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        if score_function == "sigmoid":
            scores = torch.sigmoid(logits.float())
        else:
            scores = torch.nn.functional.softplus(logits.float()).sqrt()
        if precomputed_indices is not None:
            top_indices = precomputed_indices
            scores = torch.gather(scores, dim=1, index=top_indices)
        elif expert_bias is not None:
            scores_for_routing = scores + expert_bias.float()
            _, top_indices = compute_topk(scores_for_routing, topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"Invalid score_function: {score_function}")

    if scaling_factor:
        probs = probs * scaling_factor

    probs = probs.type_as(logits)

    if dense_output:
        return probs, top_indices

    if torch.are_deterministic_algorithms_enabled():
        routing_probs = torch.zeros_like(logits)
        rows = torch.arange(num_tokens, device=logits.device).unsqueeze(1)
        routing_probs.index_put_((rows, top_indices), probs, accumulate=False)
        routing_map = torch.zeros_like(logits, dtype=logits.dtype)
        routing_map.index_put_((rows, top_indices), torch.ones_like(probs, dtype=routing_map.dtype),
                               accumulate=False)
        routing_map = routing_map.bool()
    else:
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()

    return routing_probs, routing_map


class RouterGatingLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, router_dtype):
        ctx.save_for_backward(inp, weight, bias)
        ctx.router_dtype = router_dtype
        ctx.input_dtype = inp.dtype
        ctx.weight_dtype = weight.dtype
        inp_shape = inp.shape
        inp = inp.view(-1, inp_shape[-1])

        if te_general_gemm is not None and router_dtype != torch.float64:
            raise NotImplementedError("te_general_gemm (Transformer Engine)")
        elif bias is None:
            output = torch.mm(inp.to(router_dtype), weight.to(router_dtype).t())
        else:
            output = torch.addmm(bias.to(router_dtype), inp.to(router_dtype), weight.to(router_dtype).t())

        output = output.view(*inp_shape[:-1], -1)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight, bias = ctx.saved_tensors
        inp_shape = inp.shape
        grad_shape = grad_output.shape
        inp = inp.view(-1, inp_shape[-1])
        grad_output = grad_output.view(-1, grad_shape[-1])
        grad_input = torch.mm(grad_output, weight.to(ctx.router_dtype)).to(ctx.input_dtype)
        grad_weight = torch.mm(grad_output.t(), inp.to(ctx.router_dtype)).to(ctx.weight_dtype)
        grad_bias = grad_output.sum(dim=0).to(ctx.weight_dtype) if bias is not None else None
        grad_input = grad_input.view(*inp_shape)
        return grad_input, grad_weight, grad_bias, None


def router_gating_linear(inp, weight, bias, router_dtype):
    return RouterGatingLinearFunction.apply(inp, weight, bias, router_dtype)


class MoECudaGraphPartialCaptureSignal(Exception):
    def __init__(self, moe_layer, return_step: str, **kwargs):
        self.moe_layer = moe_layer
        self.return_step = return_step
        self.kwargs = kwargs

    def get_early_return_outputs(self, hidden_states, shared_expert_output):
        raise NotImplementedError("CUDA-graph partial capture (cuda_graph_impl is 'none')")


@internal_api
@dataclass
class MoECudaGraphTensorStore:
    hidden_states: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    routing_map: torch.Tensor | None = None
    shared_expert_output: torch.Tensor | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, field_name) is None
                   for field_name in ["hidden_states", "probs", "routing_map", "shared_expert_output"])


def maybe_skip_or_early_return_by_cudagraph(step_condition):
    def decorator(func):
        @functools.wraps(func)
        def wrapped_func(moe_layer, *args, **kwargs):
            if moe_layer.config.cuda_graph_impl != "transformer_engine":
                return func(moe_layer, *args, **kwargs)

            if not is_graph_capturing() and moe_layer.cudagraph_tensor_store.is_empty():
                return func(moe_layer, *args, **kwargs)

            raise NotImplementedError(f"CUDA-graph replay/capture of step {step_condition!r}")

        return wrapped_func

    return decorator


# --- router ------------------------------------------------------------------------------------------------

class Router(ABC, MegatronModule):
    def __init__(self, config, pg_collection=None, is_mtp_layer=False):
        super().__init__(config)
        self.config = config
        self.num_experts = self.config.num_moe_experts
        self.moe_aux_loss_func = None
        self.layer_number = None
        self.is_mtp_layer = is_mtp_layer
        self.tp_group = pg_collection.tp
        self.cp_group = pg_collection.cp
        self.tp_cp_group = pg_collection.tp_cp
        self.tp_dp_cp_group = pg_collection.tp_dp_cp

        self.weight = torch.nn.Parameter(
            torch.empty((self.config.num_moe_experts, self.config.hidden_size), dtype=torch.float32))
        if self.config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.empty((self.config.num_moe_experts), dtype=torch.float32))
        else:
            self.bias = None
        self.calculate_per_token_loss = self.config.calculate_per_token_loss
        self.reset_parameters()

    def reset_parameters(self):
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
            if self.bias is not None:
                self.config.init_method(self.bias)
        self.weight.data = self.weight.data.to(dtype=self.config.params_dtype)
        self.weight.sequence_parallel = self.config.sequence_parallel
        if self.bias is not None:
            self.bias.data = self.bias.data.to(dtype=self.config.params_dtype)
            self.bias.sequence_parallel = self.config.sequence_parallel

    def gating(self, input):
        # the original moves CPU weights to the current CUDA device; guarded so a run on CPU tensors keeps them
        if self.weight.device.type == "cpu" and input.is_cuda:
            self.weight.data = self.weight.data.to(device=torch.cuda.current_device())
        if self.bias is not None and self.bias.device.type == "cpu" and input.is_cuda:
            self.bias.data = self.bias.data.to(device=torch.cuda.current_device())

        router_dtype = input.dtype
        if self.config.moe_router_dtype == "fp32":
            router_dtype = torch.float32
        elif self.config.moe_router_dtype == "fp64":
            router_dtype = torch.float64
        logits = router_gating_linear(input, self.weight, self.bias, router_dtype)
        return logits

    @abstractmethod
    def routing(self, logits):
        raise NotImplementedError("Routing function not implemented.")

    @abstractmethod
    def forward(self, input):
        raise NotImplementedError("Forward function not implemented.")

    def set_layer_number(self, layer_number):
        self.layer_number = layer_number
        if getattr(self, "router_replay", None) is not None:
            self.router_replay.layer_number = layer_number


class TopKRouter(Router):
    def __init__(self, config, pg_collection=None, is_mtp_layer=False):
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.topk = self.config.moe_router_topk
        self.routing_type = self.config.moe_router_load_balancing_type
        self.score_function = self.config.moe_router_score_function
        self.input_jitter = None
        self.frozen_expert_bias = False

        self.enable_expert_bias = self.config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            raise NotImplementedError("expert bias (off in this config)")
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None

        if self.get_aux_loss_coeff("global_aux_loss") > 0:
            raise NotImplementedError("global aux loss buffers (not configured)")
        else:
            self.global_tokens_per_expert = None
            self.ga_steps = None

        if self.routing_type == "quantile_balancing":
            raise NotImplementedError("quantile balancing (not configured)")
        else:
            self.qb_beta = None
            self.qb_beta_accum = None
            self.qb_beta_count = None

        self.router_replay = None
        if self.config.moe_enable_routing_replay:
            raise NotImplementedError("routing replay (off)")

    def _maintain_float32_expert_bias(self):
        if hasattr(self, "expert_bias") and self.expert_bias is not None:
            if self.expert_bias.dtype != torch.float32:
                self.expert_bias.data = self.expert_bias.data.to(torch.float32)
        if hasattr(self, "qb_beta") and self.qb_beta is not None:
            if self.qb_beta.dtype != torch.float32:
                self.qb_beta.data = self.qb_beta.data.to(torch.float32)
        if hasattr(self, "qb_beta_accum") and self.qb_beta_accum is not None:
            if self.qb_beta_accum.dtype != torch.float32:
                self.qb_beta_accum.data = self.qb_beta_accum.data.to(torch.float32)

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        if isinstance(self.routing_type, str):
            if self.routing_type == aux_loss_type:
                return self.config.moe_aux_loss_coeff
        if isinstance(self.routing_type, list):
            try:
                idx = self.routing_type.index(aux_loss_type)
                return self.config.moe_aux_loss_coeff[idx]
            except ValueError:
                return 0.0
        return 0.0

    def is_aux_loss_enabled(self) -> bool:
        for aux_loss_type in ["aux_loss", "seq_aux_loss", "global_aux_loss"]:
            if self.get_aux_loss_coeff(aux_loss_type) > 0:
                return True
        return False

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        raise NotImplementedError("switch load-balancing loss (training only)")

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                            with_padding_mask=False):
        raise NotImplementedError("sequence aux loss (training only)")

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        raise NotImplementedError("global aux loss (training only)")

    def sinkhorn_load_balancing(self, logits):
        raise NotImplementedError("sinkhorn routing (not configured)")

    def quantile_balancing(self, logits):
        raise NotImplementedError("quantile balancing (not configured)")

    def apply_z_loss(self, logits, padding_mask=None):
        if self.config.moe_z_loss_coeff is not None and self.training and torch.is_grad_enabled():
            raise NotImplementedError("z-loss (training only)")
        return logits

    def apply_input_jitter(self, input):
        if self.config.moe_input_jitter_eps is not None:
            eps = self.config.moe_input_jitter_eps
            if self.input_jitter is None:
                self.input_jitter = torch.distributions.uniform.Uniform(
                    torch.tensor(1.0 - eps, dtype=input.dtype, device=input.device),
                    torch.tensor(1.0 + eps, dtype=input.dtype, device=input.device),
                ).rsample
            return input * self.input_jitter(input.shape)
        else:
            return input

    @jit_fuser
    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & (~padding_mask).unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def routing(self, logits, padding_mask=None):
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)

        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)

        logits = self.apply_z_loss(logits, padding_mask=padding_mask)

        if self.routing_type == "sinkhorn":
            probs, routing_map = self.sinkhorn_load_balancing(logits)
        elif self.routing_type == "quantile_balancing":
            assert padding_mask is None, "Quantile balancing routing does not support padding masks yet."
            probs, routing_map = self.quantile_balancing(logits)
        else:
            probs, routing_map = topk_routing_with_score_function(
                logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax,
                num_groups=self.config.moe_router_num_groups, group_topk=self.config.moe_router_group_topk,
                scaling_factor=self.config.moe_router_topk_scaling_factor, score_function=self.score_function,
                expert_bias=self.expert_bias, fused=self.config.moe_router_fusion,
                router_replay=self.router_replay)

        if self.config.moe_expert_capacity_factor is not None:
            raise NotImplementedError("router token dropping (dropless in this config)")

        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            raise NotImplementedError("aux-loss scores (training only)")

        self._apply_expert_bias(routing_map, padding_mask=padding_mask)

        return probs, routing_map

    def forward(self, input, padding_mask=None):
        self._maintain_float32_expert_bias()

        input = self.apply_input_jitter(input)
        logits = self.gating(input)

        if self.config.moe_router_force_load_balancing:
            raise NotImplementedError("random logits for benchmarking (off)")

        if self.config.moe_router_force_biased is not None:
            raise NotImplementedError("biased logits for benchmarking (off)")

        probs, routing_map = self.routing(logits, padding_mask=padding_mask)

        return probs, routing_map


# --- token dispatcher ----------------------------------------------------------------------------------------

class MoETokenDispatcher:
    def __init__(self, config, pg_collection=None):
        self.config = config
        self.shared_experts = None
        self.use_nccl_stream = False

        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.tp_ep_group = pg_collection.tp_ep

        self.tp_size = get_pg_size(self.tp_group)
        self.tp_rank = get_pg_rank(self.tp_group)
        self.ep_size = get_pg_size(self.ep_group)
        self.ep_rank = get_pg_rank(self.ep_group)

        self.cudagraph_attrs = []
        self.valid_cudagraph_attrs = None

    def set_shared_experts(self, shared_experts):
        assert self.config.moe_shared_expert_overlap
        self.shared_experts = shared_experts
        self.use_nccl_stream = True

    def get_expert_zero_copy_buffers(self):
        return None, None


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        assert self.num_local_experts > 0, "Expected at least one expert"
        self.local_expert_indices = local_expert_indices
        assert len(self.local_expert_indices) > 0, "Expected at least one local expert index"
        self.router_topk = config.moe_router_topk
        self.add_bias = config.add_bias_linear
        self.global_local_map = None
        self.cudagraph_attrs = ["routing_map"]

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        # [S/TP, B, H] -> [S*B/TP, H]
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.routing_map = routing_map
        return hidden_states, probs

    def token_dispatch(self, hidden_states, probs):
        if self.tp_size > 1 or self.ep_size > 1:
            with torch.no_grad():
                self.routing_map = gather_from_sequence_parallel_region(self.routing_map, group=self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_ep_group,
                                                                 use_global_buffer=True)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        self.hidden_shape_before_permute = hidden_states.shape

        self.local_map = self.routing_map[
            :, self.local_expert_indices[0]: self.local_expert_indices[-1] + 1].contiguous()
        self.local_probs = probs[:, self.local_expert_indices[0]: self.local_expert_indices[-1] + 1].contiguous()

        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()

        permuted_local_hidden_states, _, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden_states, self.local_map, num_out_tokens=tokens_per_expert.sum().item(),
            fused=self.config.moe_permute_fusion)

        self.local_probs = self.local_probs.T.contiguous().masked_select(self.local_map.T.contiguous())
        self.routing_map = None
        return permuted_local_hidden_states, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states):
        unpermuted_local_hidden = unpermute(
            hidden_states, self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute, routing_map=self.local_map,
            fused=self.config.moe_permute_fusion)
        return unpermuted_local_hidden

    def token_combine(self, hidden_states):
        if self.tp_size > 1 or self.ep_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.local_probs.dtype), group=self.tp_ep_group).to(hidden_states.dtype)
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


# --- experts -----------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """One rank: the output is not split, the copy-to-TP region is the identity."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, gather_output=False,
                 stride=1, skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=None,
                 pg_collection=None, name=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.config = config
        world_size = get_pg_size(tp_group)
        self.output_size_per_partition = output_size // world_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, self.input_size,
                                               dtype=config.params_dtype))
        init_method(self.weight)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is None:
            weight = self.weight
        bias = self.bias if not self.skip_bias_add else None
        output_parallel = torch.matmul(input_, weight.t())
        if bias is not None:
            output_parallel = output_parallel + bias
        gather_output = self.gather_output
        if runtime_gather_output is not None:
            gather_output = runtime_gather_output
        if gather_output:
            raise NotImplementedError("all-gather across tensor-parallel ranks")
        output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias


class RowParallelLinear(nn.Module):
    """One rank: the input is not split, the reduce-from-TP region is the identity."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=True, input_is_parallel=False,
                 skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=None,
                 pg_collection=None, name=None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        world_size = get_pg_size(tp_group)
        self.input_size_per_partition = input_size // world_size
        self.weight = nn.Parameter(torch.empty(self.output_size, self.input_size_per_partition,
                                               dtype=config.params_dtype))
        init_method(self.weight)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size, dtype=config.params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            raise NotImplementedError("scatter to tensor-parallel ranks")
        output_ = torch.matmul(input_parallel, self.weight.t())
        if not self.skip_bias_add:
            output = (output_ + self.bias) if self.bias is not None else output_
            output_bias = None
        else:
            output = output_
            output_bias = self.bias
        return output, output_bias


@dataclass
class MLPSubmodules:
    linear_fc1: type
    linear_fc2: type
    activation_func: object = None


class MLP(MegatronModule):
    def __init__(self, config, submodules, is_expert=False, input_size=None, ffn_hidden_size=None,
                 tp_group=None, name=None, pg_collection=None):
        super().__init__(config=config)
        self.config = config
        self.input_size = input_size if input_size is not None else self.config.hidden_size
        self.tp_group = tp_group
        if ffn_hidden_size is None:
            if is_expert:
                raise ValueError("MoE MLP requires `ffn_hidden_size`, but it was not provided.")
            ffn_hidden_size = not_none(self.config.ffn_hidden_size)

        if self.config.gated_linear_unit:
            ffn_hidden_size *= 2
            fc1_stride = 2
            if self.config.use_kitchen:
                fc1_stride = 1
        else:
            fc1_stride = 1

        use_latent_size = (self.config.moe_latent_size is not None) and is_expert

        self.linear_fc1 = submodules.linear_fc1(
            self.input_size if not use_latent_size else not_none(self.config.moe_latent_size), ffn_hidden_size,
            config=self.config, init_method=self.config.init_method, gather_output=False,
            bias=self.config.add_bias_linear, skip_bias_add=True, is_expert=is_expert, tp_comm_buffer_name="fc1",
            tp_group=tp_group, pg_collection=pg_collection, stride=fc1_stride)

        if self.config.use_te_activation_func and submodules.activation_func is not None:
            raise NotImplementedError("TE activation modules")
        else:
            self.activation_func = self.config.activation_func

        self.linear_fc2 = submodules.linear_fc2(
            not_none(self.config.ffn_hidden_size),
            not_none(self.config.hidden_size if not use_latent_size else self.config.moe_latent_size),
            config=self.config, init_method=self.config.init_method, bias=self.config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=is_expert, tp_comm_buffer_name="fc2",
            tp_group=tp_group, pg_collection=pg_collection)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        nvtx_range_push(suffix="linear_fc1")
        intermediate_parallel, bias_parallel = apply_module(self.linear_fc1)(hidden_states)
        nvtx_range_pop(suffix="linear_fc1")

        nvtx_range_push(suffix="activation")
        if self.config.use_te_activation_func:
            raise NotImplementedError("TE activation modules")
        elif self.config.bias_activation_fusion:
            raise NotImplementedError("fused bias-activation kernels (bias_activation_fusion is False)")
        else:
            if bias_parallel is not None:
                intermediate_parallel = intermediate_parallel + bias_parallel
            if self.config.gated_linear_unit:

                def glu(x):
                    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
                    if (val := self.config.activation_func_clamp_value) is not None:
                        x_glu = x_glu.clamp(min=None, max=val)
                        x_linear = x_linear.clamp(min=-val, max=val)
                    return self.config.activation_func(x_glu) * (x_linear + self.config.glu_linear_offset)

                intermediate_parallel = glu(intermediate_parallel)
            else:
                intermediate_parallel = self.activation_func(intermediate_parallel)

            if per_token_scale is not None:
                original_dtype = intermediate_parallel.dtype
                intermediate_parallel = intermediate_parallel * per_token_scale.unsqueeze(-1)
                intermediate_parallel = intermediate_parallel.to(original_dtype)
        nvtx_range_pop(suffix="activation")

        nvtx_range_push(suffix="linear_fc2")
        output, output_bias = apply_module(self.linear_fc2)(intermediate_parallel)
        nvtx_range_pop(suffix="linear_fc2")

        if per_token_scale is not None and output_bias is not None:
            output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
            output_bias = None

        return output, output_bias


class SequentialMLP(MegatronModule):
    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        if config.moe_ffn_hidden_size == config.ffn_hidden_size:
            super().__init__(config=config)
        else:
            sequential_mlp_config = deepcopy(config)
            sequential_mlp_config.ffn_hidden_size = config.moe_ffn_hidden_size
            super().__init__(config=sequential_mlp_config)

        self.num_local_experts = num_local_experts
        self.local_experts = torch.nn.ModuleList()
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp

        for _ in range(self.num_local_experts):
            expert = MLP(self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size, is_expert=True,
                         tp_group=pg_collection.expt_tp)
            self.local_experts.append(expert)

    def _pad_tensor_for_quantization(self, hidden, probs):
        raise NotImplementedError("fp8/fp4 padding (off)")

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.config.moe_apply_probs_on_input:
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            original_dtype = permuted_local_hidden_states.dtype
            permuted_local_hidden_states = permuted_probs.unsqueeze(-1) * permuted_local_hidden_states
            permuted_local_hidden_states = permuted_local_hidden_states.to(original_dtype)
            permuted_probs = torch.ones_like(permuted_probs)

        if self.num_local_experts == 1:
            if self.config.fp8 or self.config.fp4:
                hidden, probs = self._pad_tensor_for_quantization(permuted_local_hidden_states, permuted_probs)
                output, output_bias = self.local_experts[0](hidden, probs)
                output = output[: permuted_local_hidden_states.shape[0]]
            else:
                output, output_bias = self.local_experts[0](permuted_local_hidden_states, permuted_probs)
            return output, output_bias
        else:
            tokens_per_expert = tokens_per_expert.tolist()
            tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert)
            probs_list = torch.split(permuted_probs, tokens_per_expert)

            output_local_list = []

            for expert, tokens, probs in zip(self.local_experts, tokens_list, probs_list):  # noqa: B905 - as written
                if self.config.fp8 or self.config.fp4:
                    hidden, probs = self._pad_tensor_for_quantization(tokens, probs)
                    output, output_bias = expert(hidden, probs)
                    output = output[: tokens.shape[0]]
                else:
                    output, output_bias = expert(tokens, probs)
                output_local_list.append(output)

            output_local = torch.cat(output_local_list, dim=0)
            output_bias_local = None
            return output_local, output_bias_local


# --- the MoE layer -------------------------------------------------------------------------------------------

@dataclass
class MoESubmodules:
    experts: object
    shared_experts: object = None
    router: object = TopKRouter


class BaseMoELayer(MegatronModule, ABC):
    def __init__(self, config, layer_number=None, pg_collection=None, is_mtp_layer=False):
        super().__init__(config)
        self.config = config
        self.layer_number = layer_number
        self.is_mtp_layer = is_mtp_layer
        self.ep_group = pg_collection.ep
        self.attn_tp_group = pg_collection.tp
        ep_size = get_pg_size(self.ep_group)
        ep_rank = get_pg_rank(self.ep_group)
        assert ep_size > 0, "Expected non-negative expert parallel size"

        assert self.config.num_moe_experts % ep_size == 0
        self.num_local_experts = self.config.num_moe_experts // ep_size
        local_expert_indices_offset = ep_rank * self.num_local_experts

        self.use_shared_expert = self.config.moe_shared_expert_intermediate_size is not None
        self.shared_expert_overlap = self.config.moe_shared_expert_overlap

        self.local_expert_indices = [local_expert_indices_offset + i for i in range(self.num_local_experts)]
        assert all(map(lambda x: x < self.config.num_moe_experts, self.local_expert_indices))
        self.router = None
        self.experts = None
        self.shared_experts = None
        self.token_dispatcher = None
        self.layer_number = layer_number

    @abstractmethod
    def forward(self, hidden_states):
        pass

    def set_layer_number(self, layer_number: int):
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)


class MoELayer(BaseMoELayer):
    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None):
        self.submodules = not_none(submodules)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer)
        self.moe_layer_recompute = (config.recompute_granularity == "selective"
                                    and "moe" in config.recompute_modules and config.cuda_graph_impl != "local")
        self.shared_experts_recompute = (config.recompute_granularity == "selective"
                                         and "shared_experts" in config.recompute_modules)
        self.tp_group = pg_collection.tp

        self.router = self.submodules.router(config=self.config, pg_collection=pg_collection,
                                             is_mtp_layer=is_mtp_layer)

        if self.config.moe_latent_size:
            raise NotImplementedError("latent projections need Transformer Engine")

        if config.moe_token_dispatcher_type == "allgather":
            self.token_dispatcher = MoEAllGatherTokenDispatcher(self.num_local_experts, self.local_expert_indices,
                                                                config=self.config, pg_collection=pg_collection)
        elif config.moe_token_dispatcher_type in ("alltoall", "flex"):
            raise NotImplementedError(f"{config.moe_token_dispatcher_type} dispatcher (not mirrored)")
        else:
            raise ValueError(f"Unsupported token dispatcher type: {config.moe_token_dispatcher_type}")

        self.experts = self.submodules.experts(self.num_local_experts, self.config, pg_collection=pg_collection)

        if self.use_shared_expert:
            raise NotImplementedError("shared experts (Mixtral has none)")

        if config.transformer_impl == "inference_optimized":
            raise NotImplementedError("inference-optimized dispatchers")

        self.cudagraph_tensor_store = MoECudaGraphTensorStore()
        self.fwd_execution_map = ["route", "expert_compute", "postprocess"]

        self.setup_delayed_wgrad_for_dispatch_backward_overlap()

    def setup_delayed_wgrad_for_dispatch_backward_overlap(self):
        self._delayed_wgrad_event = None
        self._delayed_wgrad_stream = None
        if self.config.overlap_dispatch_backward_with_experts_wgrad:
            raise NotImplementedError("delayed wgrad CUDA streams (training only)")

    @maybe_skip_or_early_return_by_cudagraph("route")
    def route(self, hidden_states, padding_mask=None):
        probs, routing_map = apply_module(self.router)(hidden_states, padding_mask)
        return probs, routing_map

    @maybe_skip_or_early_return_by_cudagraph("preprocess")
    def preprocess(self, hidden_states, probs, routing_map):
        if self.config.moe_latent_size:
            raise NotImplementedError("latent projections need Transformer Engine")
        hidden_states, probs = self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
        return hidden_states, probs

    def dispatch(self, hidden_states, probs):
        if self.config.overlap_dispatch_backward_with_experts_wgrad:
            raise NotImplementedError("delayed wgrad registration (training only)")
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    @maybe_skip_or_early_return_by_cudagraph("shared_experts_compute")
    def shared_experts_compute(self, hidden_states):
        shared_expert_output = None
        if self.use_shared_expert and not self.shared_expert_overlap:
            if self.shared_experts_recompute:
                raise NotImplementedError("shared-expert recompute (training only)")
            else:
                shared_expert_output = apply_module(self.shared_experts)(hidden_states)
        return shared_expert_output

    @internal_api
    def routed_experts_compute(self, hidden_states, probs):
        if self.config.overlap_dispatch_backward_with_experts_wgrad:
            raise NotImplementedError("delayed wgrad event (training only)")
        dispatched_input, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs)
        if hasattr(self, "_inference_token_dispatcher") and InferenceMode.is_active():
            raise NotImplementedError("inference dispatcher")
        else:
            output_buffer, grad_input_buffer = self.token_dispatcher.get_expert_zero_copy_buffers()
            expert_kwargs = {}
            if output_buffer is not None:
                expert_kwargs["output_buffer"] = output_buffer
            if grad_input_buffer is not None:
                expert_kwargs["grad_input_buffer"] = grad_input_buffer
            expert_output, mlp_bias = apply_module(self.experts)(dispatched_input, tokens_per_expert,
                                                                 permuted_probs, **expert_kwargs)
        assert mlp_bias is None, f"mlp_bias is not supported for {type(self.token_dispatcher)}"
        output = self.token_dispatcher.combine_preprocess(expert_output)
        return output, mlp_bias

    def combine(self, output):
        output = self.token_dispatcher.token_combine(output)
        return output

    def postprocess(self, output, shared_expert_output):
        output = self.token_dispatcher.combine_postprocess(output)
        if self.config.moe_latent_size:
            raise NotImplementedError("latent projections need Transformer Engine")
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError("During training, performance may degrade if MoE and tensor parallelism"
                             "are enabled without also enabling sequence parallelism.")
        if hasattr(self, "_inference_token_dispatcher"):
            raise NotImplementedError("inference dispatcher switch")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def custom_forward(hidden_states, intermediate_tensors=None, padding_mask=None):
            try:
                if "route" in self.fwd_execution_map:
                    shared_expert_output = self.shared_experts_compute(hidden_states)
                    probs, routing_map = self.route(hidden_states, padding_mask)
                    hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)

                    if intermediate_tensors is not None:
                        return hidden_states, probs, shared_expert_output

            except MoECudaGraphPartialCaptureSignal as e:
                return e.get_early_return_outputs(hidden_states, shared_expert_output)

            if "expert_compute" in self.fwd_execution_map:
                if intermediate_tensors is not None:
                    hidden_states, probs = intermediate_tensors

                dispatched_input, probs = self.dispatch(hidden_states, probs)
                output, mlp_bias = self.routed_experts_compute(dispatched_input, probs)
                assert mlp_bias is None, f"mlp_bias is not supported for {type(self.token_dispatcher)}"
                output = self.combine(output)

                if intermediate_tensors is not None:
                    return output, mlp_bias

            if "postprocess" in self.fwd_execution_map:
                if intermediate_tensors is not None:
                    output, shared_expert_output = intermediate_tensors

                output = self.postprocess(output, shared_expert_output)

                if intermediate_tensors is not None:
                    return output

            return output, mlp_bias

        if self.moe_layer_recompute and self.training:
            raise NotImplementedError("activation recompute (training only)")
        else:
            outputs = custom_forward(hidden_states, intermediate_tensors, padding_mask)

        return outputs


class SeqFirst(nn.Module):
    """[B, S, H] -> Megatron's [S, B, H] around the MoE layer, and back."""

    def __init__(self):
        super().__init__()
        config = TransformerConfig()
        submodules = MoESubmodules(
            experts=partial(SequentialMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                    linear_fc2=RowParallelLinear)))
        self.mlp = MoELayer(config, submodules=submodules, layer_number=1)

    def forward(self, x):
        output, mlp_bias = self.mlp(x.transpose(0, 1).contiguous())
        return output.transpose(0, 1)


def build():
    return tiny(SeqFirst, HIDDEN)
