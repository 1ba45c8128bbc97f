"""NVIDIA NeMo Automodel's `MoE` layer as its Kimi-VL (and DeepSeek-V3) text decoder runs it: a sigmoid `Gate` with
a score-correction bias, plus `GroupedExperts` whose CPU path loops over experts with `torch.where`, gathers,
applies the routing weight inside a weighted-SwiGLU autograd Function, and `scatter_add_`s in float32.

Stands in for moonshotai's Kimi-VL remote code (`modeling_kimi_vl.py`), which is not stored as PyTorch source in
any repository reachable here (only a MindSpore port in mindone, a ByteDance/VeOmni variant that imports its own
DeepSeek-V3 classes, and vLLM/SGLang rewrites). Those copies show that the hub file's MoE is DeepSeek-V2's
`DeepseekV2MoE.forward` (a training branch with `repeat_interleave` and an aux-loss autograd Function, `moe_infer`
in eval) around DeepSeek-V3's `noaux_tc` sigmoid gate: in eval it runs the same code as DeepSeek-V3's hub
`DeepseekV3MoE` (the `deepseek_v3_hub_moe_infer` entry), so a mirror would add nothing. This entry is instead
the MoE layer NeMo Automodel trains and runs Kimi-VL with (`KimiVLForConditionalGeneration` there builds its
text model as `DeepseekV3Model`, whose MoE blocks are this `MoE`), with Kimi-VL-A3B's text-config values.
Mirrors NVIDIA-NeMo/Automodel at commit 36044ad (36044ad3d139363fb6c73c24af2e7c6b65ec52f6):
`nemo_automodel/components/moe/layers.py` (`MLP`, `_GateRoutingCore`, `Gate.__init__` / `_local_score_correction_bias`
/ `_route_scores` / `forward` / `_compute_expert_load` / `_compute_aux_loss`, `MoE.__init__` / `forward`),
`nemo_automodel/components/moe/experts.py` (`is_gated_activation`, `GroupedExperts.__init__` / `forward` /
`_forward_loop`, `get_expert_activation_for_deepep`'s "swiglu" case), `.../moe/megatron/moe_utils.py` (`swiglu`,
`weighted_swiglu`, their backward helpers, `WeightedSwiGLUFunction`, `weighted_bias_swiglu_impl`,
`MoEAuxLossAutoScaler`), `.../moe/router_replay.py` (`replay_selection`), `.../moe/config.py` (`MoEConfig`),
and `.../models/deepseek_v3/model.py` (the `MoEConfig` that `DeepseekV3Model` builds: `score_func="sigmoid"`,
`train_gate=True`, `gate_bias_update_factor=1e-3`, `aux_loss_coeff=0`; and `Block._mlp`, `self.mlp(x,
padding_mask)`), `.../models/kimivl/model.py` (which wraps that `DeepseekV3Model`).
`MoE.forward` views x as [T, dim], builds an all-true `token_mask` when no padding mask is given, calls the gate,
runs the shared experts (`n_shared_experts * moe_inter_dim` SwiGLU `MLP`; an optional sigmoid shared-expert gate,
off here), the routed experts, adds, and views back. `Gate.forward` computes `F.linear(x, weight.to(x.dtype))`,
then `_route_scores`: for "sigmoid" it takes `sigmoid`, adds `e_score_correction_bias` to the selection scores
(a float32 buffer, present because `gate_bias_update_factor > 0`), `if self.n_groups > 1` masks groups (Kimi-VL:
one group, so skipped), `torch.topk`, gathers the unbiased scores, divides weights by their sum + 1e-20
(`norm_topk_prob`), and multiplies by `route_scale`. Because the bias update is on, the gate always computes a
per-expert load (`scatter_` of the token mask into [T, E], summed); in training it accumulates that load and, with
`aux_loss_coeff > 0`, attaches an aux loss through `MoEAuxLossAutoScaler` (both training-only, kept as
branches). `GroupedExperts.forward` checks for DTensor parameters (plain tensors here, so ep_size 1), casts the
stacked expert weights `gate_and_up_projs` [E, dim, 2*inter] and `down_projs` [E, inter, dim] to the activation
dtype, and on CPU (`BackendConfig.experts` defaults to "torch" without CUDA) takes `_forward_loop`: a float32
`zeros` output, `for i in range(start, end)`: `torch.where(torch.logical_and(indices == i, token_mask[:, None]))`,
`if idx.numel() == 0: continue`, a `gather` of the rows, `x_idx @ gate_and_up_proj`, the routing weight
`weights[idx, top, None]` applied inside `WeightedSwiGLUFunction` (chunk, `silu(gate) * up * w`), `@ down_proj`,
`scatter_add_` into the float32 output; a dummy expert-0 computation runs when no expert received tokens.
The output is cast back to the input dtype.
Left out: attention (MLA), RoPE, RMSNorms (the shell supplies the pre-MoE norm, a LayerNorm, and adds the
residual), the vision tower; expert parallelism (the `ep_size > 1` variable-length all-gather / all-reduce, left
out as distributed code; one process), the DeepEP / HybridEP / UCCL-EP / TE / MoK / `torch_mm` grouped-GEMM expert
backends and `FakeBalancedGate` (other `BackendConfig` choices), the CUDA-graph routing core path (off unless
configured; `_GateRoutingCore` kept), routing replay (off: `replay_selection(None, ...)` is kept), the latent
projections and `apply_router_weight_after_down` variants (off in this config; their branches are kept),
`update_bias` (called by the trainer between steps, not in forward), state-dict hooks, weight init (the shell draws
parameters; the correction bias is set to a small fixed ramp in `build()`, as a loaded checkpoint would have it).
The `@torch.compile` decorators on `swiglu` / `weighted_swiglu` and their backward helpers are left off, so that
`build()` runs eagerly; the functions themselves are unchanged.
Sizes: Kimi-VL-A3B's text model has hidden 2048, moe_intermediate 1408, 64 routed experts, top-6, 2 shared experts,
one expert group, routed_scaling_factor 2.446, norm_topk_prob true; here hidden 16, moe_intermediate 8, 8 experts,
top-2, 2 shared experts, one group, route_scale 2.446, float32.
Constructs: dataclass configs, `isinstance(..., DTensor)` checks, `F.linear` gate, a five-way string branch on the
score function (sigmoid path taken), correction-bias add for selection only, a group-mask branch, `topk` + `gather`
+ epsilon renormalisation + scale, an expert-load `scatter_` with an expanded mask, training-only branches (load
accumulation, aux-loss autograd Function), a float32 `zeros` accumulator, a loop over a range of experts with
`torch.where` on a combined boolean mask, `if idx.numel() == 0: continue`, `gather` with an expanded index,
`@` matmuls on indexed stacked weights, a custom `torch.autograd.Function` (weighted SwiGLU with hand-written
backward), `scatter_add_`, a counter-driven dummy computation, shared experts added, dtype casts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from ._shell import Source, tiny

SOURCE = Source("NVIDIA-NeMo/Automodel", "nemo_automodel/components/moe/layers.py",
                "36044ad3d139363fb6c73c24af2e7c6b65ec52f6", "MoE.forward")
HIDDEN, MOE_INTER, EXPERTS, TOP_K, SHARED = 16, 8, 8, 2, 2


# --- moe/config.py and models/common BackendConfig (the fields the layer reads) ---

@dataclass(kw_only=True)
class MoEConfig:
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    n_expert_groups: int
    n_limited_groups: int
    train_gate: bool
    gate_bias_update_factor: float
    aux_loss_coeff: float
    score_func: str
    route_scale: float
    dim: int
    inter_dim: int
    moe_inter_dim: int
    norm_topk_prob: bool
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "swiglu"
    apply_router_weight_after_down: bool = False
    swiglu_limit: float = 0.0
    softmax_before_topk: bool = False
    router_weights_fp32: bool = False
    router_weight_uses_score_correction_bias: bool = False
    dtype: torch.dtype = torch.bfloat16
    shared_expert_gate: bool = False
    shared_expert_inter_dim: int | None = None
    shared_expert_activation: str = "swiglu"
    force_e_score_correction_bias: bool = False
    moe_latent_size: int | None = None
    enable_routing_replay: bool = False

    @property
    def expert_dim(self) -> int:
        return self.moe_latent_size if self.moe_latent_size is not None else self.dim


@dataclass
class CudaGraphConfig:
    modules: tuple = ()


@dataclass
class BackendConfig:
    """CPU defaults of NeMo Automodel's `BackendConfig` (no TE, no CUDA, no DeepEP)."""

    linear: str = "torch"
    experts: str = "torch"
    dispatcher: str = "torch"
    fake_balanced_gate: bool = False
    gate_precision: torch.dtype | None = None
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)


def initialize_linear_module(linear_impl, in_features, out_features, bias=False, dtype=torch.bfloat16):
    assert linear_impl == "torch"  # "te" / "quack" need CUDA
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def replay_selection(router_replay, indices):
    if router_replay is None:
        return indices
    return router_replay.apply(indices)


# --- moe/megatron/moe_utils.py (the @torch.compile decorators left off) ---

def swiglu(y):
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


def weighted_swiglu(y, weights):
    dtype = y.dtype
    res = swiglu(y) * weights
    return res.to(dtype)


def swiglu_back(g, y):
    y_1, y_2 = torch.chunk(y, 2, -1)
    return torch.cat(
        (
            g * torch.sigmoid(y_1) * (1 + y_1 * (1 - torch.sigmoid(y_1))) * y_2,
            g * F.silu(y_1),
        ),
        -1,
    )


def weighted_swiglu_back(g, y, weights):
    input_dtype = y.dtype
    w_dtype = weights.dtype
    input_grad = swiglu_back(g * weights, y)
    weights_grad = swiglu(y) * g.to(w_dtype)
    weights_grad = torch.sum(weights_grad, dim=-1, keepdim=True)
    return input_grad.to(input_dtype), weights_grad.to(w_dtype)


class WeightedSwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weights, fp8_input_store):  # noqa: A002 - the original's name
        input_for_backward = input.to(torch.float8_e4m3fn) if fp8_input_store else input
        ctx.save_for_backward(input_for_backward, weights)
        ctx.ori_input_dtype = input.dtype
        ctx.fp8_input_store = fp8_input_store
        return weighted_swiglu(input, weights)

    @staticmethod
    def backward(ctx, grad_output):
        input, weights = ctx.saved_tensors  # noqa: A001 - the original's name
        input = input.to(ctx.ori_input_dtype) if ctx.fp8_input_store else input  # noqa: A001
        tmp, wgrad = weighted_swiglu_back(grad_output, input, weights)
        return tmp, wgrad, None


def weighted_bias_swiglu_impl(input, weights, fp8_input_store=False):  # noqa: A002 - the original's name
    ori_shape = input.shape
    if len(ori_shape) > 1:
        input = input.view(-1, ori_shape[-1])  # noqa: A001

    output = WeightedSwiGLUFunction.apply(input, weights, fp8_input_store)

    return output if len(ori_shape) <= 2 else output.view(ori_shape[0], ori_shape[1], -1)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Training only: returns `output`, and gives the saved aux loss a gradient in backward."""

    main_loss_backward_scale: torch.Tensor = None

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.save_for_backward(aux_loss.float())
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        if MoEAuxLossAutoScaler.main_loss_backward_scale is None:
            MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0, device=aux_loss.device)
        aux_loss_backward_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        scaled_aux_loss_grad = torch.ones_like(aux_loss) * aux_loss_backward_scale
        return grad_output, scaled_aux_loss_grad


# --- moe/experts.py ---

def is_gated_activation(activation: str) -> bool:
    return activation in ("swiglu", "swigluoai", "quick_geglu", "geglu")


def get_expert_activation_for_deepep(config: MoEConfig):
    if config.expert_activation == "swiglu":
        if getattr(config, "swiglu_limit", 0.0) > 0.0:
            raise NotImplementedError("clamped SwiGLU (DeepSeek V4) not mirrored")
        return weighted_bias_swiglu_impl
    raise NotImplementedError(f"expert activation {config.expert_activation} not mirrored")


class GroupedExperts(nn.Module):

    def __init__(self, config: MoEConfig, backend: BackendConfig | None = None):
        super().__init__()
        self.config = config
        self.n_routed_experts = config.n_routed_experts
        self.expert_bias = config.expert_bias
        self.is_gated = is_gated_activation(config.expert_activation)
        self.use_torch_mm = backend is not None and backend.experts in ("torch_mm", "torch_mm_mxfp8")
        self.use_mxfp8 = backend is not None and backend.experts == "torch_mm_mxfp8"

        up_proj_dim = config.moe_inter_dim * 2 if self.is_gated else config.moe_inter_dim
        self.gate_and_up_projs = nn.Parameter(
            torch.empty(config.n_routed_experts, config.expert_dim, up_proj_dim, dtype=config.dtype)
        )
        self.down_projs = nn.Parameter(
            torch.empty(config.n_routed_experts, config.moe_inter_dim, config.expert_dim, dtype=config.dtype)
        )

        if self.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(config.n_routed_experts, up_proj_dim, dtype=config.dtype))
            self.down_proj_bias = nn.Parameter(
                torch.empty(config.n_routed_experts, config.expert_dim, dtype=config.dtype)
            )
        else:
            self.gate_up_proj_bias = None
            self.down_proj_bias = None

        self.expert_activation_grouped = get_expert_activation_for_deepep(config)

    def forward(self, x, token_mask, weights, indices):
        assert not isinstance(x, DTensor)
        input_dtype = x.dtype

        if isinstance(self.gate_and_up_projs, DTensor):
            ep_mesh = self.gate_and_up_projs.device_mesh
            assert ep_mesh is not None
            assert ep_mesh.ndim == 1, "We only support 1D mesh for MoE"
            ep_size = ep_mesh.size()
            ep_rank = ep_mesh.get_local_rank()
        else:
            ep_mesh = None
            ep_size = 1
            ep_rank = 0

        assert self.n_routed_experts % ep_size == 0, (
            f"Number of experts must be divisible by ep_size (ep_size={ep_size})"
        )

        compute_dtype = x.dtype
        gate_and_up_projs = (
            self.gate_and_up_projs.to_local() if isinstance(self.gate_and_up_projs, DTensor) else self.gate_and_up_projs
        ).to(compute_dtype)
        down_projs = (self.down_projs.to_local() if isinstance(self.down_projs, DTensor) else self.down_projs).to(
            compute_dtype
        )
        gate_up_proj_bias = (
            (
                self.gate_up_proj_bias.to_local()
                if isinstance(self.gate_up_proj_bias, DTensor)
                else self.gate_up_proj_bias
            ).to(compute_dtype)
            if self.expert_bias
            else None
        )
        down_proj_bias = (
            (self.down_proj_bias.to_local() if isinstance(self.down_proj_bias, DTensor) else self.down_proj_bias).to(
                compute_dtype
            )
            if self.expert_bias
            else None
        )

        if ep_size > 1:
            raise NotImplementedError("expert-parallel all-gather left out (one process)")

        n_local_experts = self.n_routed_experts // ep_size
        experts_start_idx = ep_rank * n_local_experts
        experts_end_idx = experts_start_idx + n_local_experts

        if self.use_torch_mm:
            raise NotImplementedError("torch._grouped_mm backend left out (CUDA default)")
        else:
            y = self._forward_loop(
                x,
                weights,
                indices,
                token_mask,
                gate_and_up_projs,
                down_projs,
                gate_up_proj_bias,
                down_proj_bias,
                n_local_experts,
                experts_start_idx,
                experts_end_idx,
            )

        if self.config.apply_router_weight_after_down:
            y = y.sum(dim=1)
        return y.to(input_dtype)

    def _forward_loop(self, x, weights, indices, token_mask, gate_and_up_projs, down_projs, gate_up_proj_bias,
                      down_proj_bias, n_local_experts, experts_start_idx, experts_end_idx):
        output_shape = (
            (x.shape[0], weights.shape[1], x.shape[1]) if self.config.apply_router_weight_after_down else x.shape
        )
        y = torch.zeros(output_shape, dtype=torch.float32, device=x.device)

        active_local_experts = 0
        for i in range(experts_start_idx, experts_end_idx):
            indices_mask = torch.logical_and(indices == i, token_mask.unsqueeze(-1))
            idx, top = torch.where(indices_mask)

            if idx.numel() == 0:
                continue
            active_local_experts += 1

            local_idx = i - experts_start_idx
            down_proj = down_projs[local_idx]
            expert_down_proj_bias = down_proj_bias[local_idx] if down_proj_bias is not None else None

            idx_b = idx[:, None].expand(-1, x.size(1))
            x_idx = x.gather(dim=0, index=idx_b)

            gate_and_up_proj = gate_and_up_projs[local_idx]
            expert_gate_up_proj_bias = gate_up_proj_bias[local_idx] if gate_up_proj_bias is not None else None

            # up projection, then the routing weight applied between up and down projections
            gate_and_up_out = x_idx @ gate_and_up_proj
            if expert_gate_up_proj_bias is not None:
                gate_and_up_out = gate_and_up_out + expert_gate_up_proj_bias

            w = weights[idx, top, None]
            activation_weight = torch.ones_like(w) if self.config.apply_router_weight_after_down else w
            activated = self.expert_activation_grouped(gate_and_up_out, activation_weight)

            expert_out = activated @ down_proj
            if expert_down_proj_bias is not None:
                expert_out = expert_out + (
                    expert_down_proj_bias if self.config.apply_router_weight_after_down else expert_down_proj_bias * w
                )

            if self.config.apply_router_weight_after_down:
                expert_out = expert_out.float() * w.float()
                slot_ids = idx * weights.shape[1] + top
                slot_ids_b = slot_ids[:, None].expand(-1, x.size(1))
                y.view(-1, x.size(1)).scatter_add_(dim=0, index=slot_ids_b, src=expert_out.float())
            else:
                y.scatter_add_(dim=0, index=idx_b, src=expert_out.float())

        # dummy computation for gradient flow when no tokens were routed locally
        if active_local_experts == 0:
            dummy_x = torch.zeros_like(x[0]).unsqueeze(0)
            gate_and_up_out = dummy_x @ gate_and_up_projs[0]
            activated = self.expert_activation_grouped(gate_and_up_out, weights[0, 0, None].unsqueeze(0))
            expert_out = activated @ down_projs[0]
            if self.config.apply_router_weight_after_down:
                y[0, 0] += expert_out[0]
            else:
                y[0] += expert_out[0]

        return y


# --- moe/layers.py ---

class MLP(nn.Module):

    def __init__(self, dim, inter_dim, backend, dtype=torch.bfloat16, activation="swiglu", bias=False,
                 swiglu_limit=0.0):
        super().__init__()
        if activation not in ("swiglu", "relu2"):
            raise ValueError(f"Unsupported activation: {activation}. Choose 'swiglu' or 'relu2'.")

        self.activation = activation
        self.is_gated = is_gated_activation(activation)
        self.swiglu_limit = float(swiglu_limit)

        self.up_proj = initialize_linear_module(
            linear_impl=backend, in_features=dim, out_features=inter_dim, bias=bias, dtype=dtype
        )
        if self.is_gated:
            self.gate_proj = initialize_linear_module(
                linear_impl=backend, in_features=dim, out_features=inter_dim, bias=bias, dtype=dtype
            )
        else:
            self.gate_proj = None

        self.down_proj = initialize_linear_module(
            linear_impl=backend, in_features=inter_dim, out_features=dim, bias=bias, dtype=dtype
        )

    def forward(self, x):
        if not self.is_gated:
            return self.down_proj(F.relu(self.up_proj(x)).pow(2))
        if self.swiglu_limit > 0.0:
            dtype = x.dtype
            gate = self.gate_proj(x).float().clamp(max=self.swiglu_limit)
            up = self.up_proj(x).float().clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            return self.down_proj((F.silu(gate) * up).to(dtype))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _GateRoutingCore(nn.Module):
    """Parameterless routing part of the gate (a CUDA-graph boundary when enabled)."""

    def forward(self, scores, gate):
        return gate._route_scores(scores)


class Gate(nn.Module):

    def __init__(self, config: MoEConfig, gate_precision: torch.dtype | None = None):
        super().__init__()
        self.dim = config.dim
        self.n_experts = config.n_routed_experts
        self.topk = config.n_activated_experts
        self.softmax_before_topk = config.softmax_before_topk
        self.router_weights_fp32 = config.router_weights_fp32
        self.router_weight_uses_score_correction_bias = config.router_weight_uses_score_correction_bias
        self.n_groups = config.n_expert_groups
        self.topk_groups = config.n_limited_groups
        self.score_func = config.score_func
        self.route_scale = config.route_scale
        self.train_gate = config.train_gate
        self.bias_update_factor = config.gate_bias_update_factor
        self.aux_loss_coeff = config.aux_loss_coeff
        self.norm_topk_prob = config.norm_topk_prob
        self.gate_precision = gate_precision

        if self.bias_update_factor > 0:
            assert self.train_gate, "Require train_gate to be set to True to apply the bias update"

        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.dim, dtype=config.dtype), requires_grad=self.train_gate
        )
        if config.router_bias:
            self.bias = nn.Parameter(
                torch.empty(config.n_routed_experts, dtype=config.dtype), requires_grad=self.train_gate
            )
        else:
            self.bias = None

        if self.bias_update_factor > 0 or config.force_e_score_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros((self.n_experts), dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

        self.e_score_correction_bias_master = None
        self._cumulative_expert_load = None
        self._track_load_balance = False
        self._last_expert_load = None
        self._last_aux_loss = None
        self.router_replay = None  # RouterReplay() only when config.enable_routing_replay
        self.routing_core = _GateRoutingCore()
        self.use_routing_core = False

    def _local_score_correction_bias(self):
        if isinstance(self.e_score_correction_bias, DTensor):
            return self.e_score_correction_bias.to_local()
        return self.e_score_correction_bias

    def _route_scores(self, scores):
        num_tokens = scores.size(0)
        correction_bias = self._local_score_correction_bias()

        if self.score_func == "softmax":
            if self.softmax_before_topk:
                scores = scores.softmax(dim=-1, dtype=self.gate_precision or torch.float32)
                original_scores = scores
                indices = torch.topk(scores, k=self.topk, dim=-1)[1]
                indices = replay_selection(self.router_replay, indices)
                weights = scores.gather(1, indices)
            else:
                values, indices = torch.topk(scores, k=self.topk, dim=-1)
                replayed = replay_selection(self.router_replay, indices)
                if replayed is not indices:
                    values = scores.gather(1, replayed)
                    indices = replayed
                weights = values.softmax(dim=1, dtype=self.gate_precision or torch.float32)
                original_scores = scores.softmax(dim=-1, dtype=self.gate_precision or torch.float32)
        elif self.score_func == "softmax_with_bias":
            scores = scores.softmax(dim=-1, dtype=self.gate_precision or torch.float32)
            original_scores = scores

            if correction_bias is not None:
                scores_for_choice = scores + correction_bias
            else:
                scores_for_choice = scores

            if self.n_groups > 1:
                scores_for_choice = scores_for_choice.view(num_tokens, self.n_groups, -1)
                group_scores = scores_for_choice.topk(2, dim=-1)[0].sum(dim=-1)

                group_idx = group_scores.topk(self.topk_groups, dim=-1)[1]
                mask = torch.zeros_like(scores_for_choice[..., 0]).scatter_(1, group_idx, True)
                scores_for_choice = (scores_for_choice * mask.unsqueeze(-1)).flatten(1)

            indices = torch.topk(scores_for_choice, self.topk, dim=-1)[1]
            indices = replay_selection(self.router_replay, indices)
            weights = original_scores.gather(1, indices)
        elif self.score_func == "sqrtsoftplus":
            scores = torch.sqrt(F.softplus(scores.float()))
            original_scores = scores

            if correction_bias is not None:
                scores = scores + correction_bias

            indices = torch.topk(scores, self.topk, dim=-1)[1]
            indices = replay_selection(self.router_replay, indices)
            weights = original_scores.gather(1, indices)
        elif self.score_func == "sigmoid_with_bias":
            scores = scores.sigmoid()
            original_scores = scores
            scores_for_choice = scores

            if correction_bias is not None:
                scores_for_choice = scores_for_choice + correction_bias

            if self.n_groups > 1:
                scores_for_choice = scores_for_choice.view(num_tokens, self.n_groups, -1)
                group_scores = scores_for_choice.topk(2, dim=-1)[0].sum(dim=-1)
                group_idx = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
                score_mask = group_mask.unsqueeze(-1).expand_as(scores_for_choice).reshape(num_tokens, -1)
                scores_for_choice = scores_for_choice.reshape(num_tokens, -1).masked_fill(
                    ~score_mask.bool(), float("-inf")
                )

            indices = torch.topk(scores_for_choice, k=self.topk, dim=-1, sorted=False)[1]
            indices = replay_selection(self.router_replay, indices)
            weights = original_scores.gather(1, indices)
        else:
            scores = scores.sigmoid()
            original_scores = scores

            # correction bias balances tokens across experts (selection only, unless configured)
            if correction_bias is not None:
                scores = scores + correction_bias
                if self.router_weight_uses_score_correction_bias:
                    original_scores = scores

            if self.n_groups > 1:
                scores = scores.view(num_tokens, self.n_groups, -1)
                if correction_bias is None:
                    group_scores = scores.amax(dim=-1)
                else:
                    group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)

                indices = group_scores.topk(self.topk_groups, dim=-1)[1]
                mask = torch.zeros_like(scores[..., 0]).scatter_(1, indices, True)
                scores = (scores * mask.unsqueeze(-1)).flatten(1)

            indices = torch.topk(scores, self.topk, dim=-1)[1]
            indices = replay_selection(self.router_replay, indices)
            weights = original_scores.gather(1, indices)

        if self.norm_topk_prob and self.topk > 1:
            denom_w = weights.sum(dim=-1, keepdim=True) + 1e-20
            denom_s = original_scores.sum(dim=-1, keepdim=True) + 1e-20
            weights = weights / denom_w
            original_scores = original_scores / denom_s

        weights = weights * self.route_scale
        return weights, indices, original_scores

    def forward(self, x, token_mask, cp_mesh):
        original_dtype = x.dtype

        if self.gate_precision is not None:
            x_compute = x.to(dtype=self.gate_precision)
            weight = self.weight.to(dtype=self.gate_precision)
            bias = self.bias.to(dtype=self.gate_precision) if self.bias is not None else None
        else:
            x_compute = x
            weight = self.weight.to(dtype=x.dtype)
            bias = self.bias.to(dtype=x.dtype) if self.bias is not None else None

        scores = F.linear(x_compute, weight, bias=bias)
        if self.use_routing_core:
            weights, indices, original_scores = self.routing_core(scores, self)
        else:
            weights, indices, original_scores = self._route_scores(scores)

        if self.gate_precision is not None and not self.router_weights_fp32:
            weights = weights.to(dtype=original_dtype)
            original_scores = original_scores.to(dtype=original_dtype)

        if self.bias_update_factor > 0 or self.aux_loss_coeff > 0 or self._track_load_balance:
            expert_load = self._compute_expert_load(indices, token_mask)

        if self._track_load_balance:
            self._last_expert_load = expert_load.detach()

        if self.bias_update_factor > 0 and self.training:
            if self._cumulative_expert_load is None:
                self._cumulative_expert_load = expert_load.detach()
            else:
                self._cumulative_expert_load = self._cumulative_expert_load + expert_load.detach()

        aux_loss = None
        if self.aux_loss_coeff > 0 and self.training:
            aux_loss = self._compute_aux_loss(original_scores, expert_load, token_mask, cp_mesh)
            weights = MoEAuxLossAutoScaler.apply(weights, self.aux_loss_coeff * aux_loss)

        if self._track_load_balance and aux_loss is not None:
            self._last_aux_loss = aux_loss.detach()

        if self.router_weights_fp32:
            return weights.float(), indices, aux_loss
        return weights.type_as(x), indices, aux_loss

    def _compute_expert_load(self, indices, token_mask):
        expert_mask = indices.new_zeros((indices.shape[0], self.n_experts))
        contribution = token_mask.to(dtype=expert_mask.dtype).unsqueeze(-1).expand(-1, indices.shape[1])
        expert_mask.scatter_(dim=1, index=indices, src=contribution)
        return expert_mask.sum(dim=0)

    def _compute_aux_loss(self, original_scores, expert_load, token_mask, cp_mesh):
        original_scores = original_scores.float()
        expert_load = expert_load.float()

        context_length = token_mask.sum()
        expert_scores = (original_scores * token_mask.unsqueeze(-1)).sum(dim=0)

        if cp_mesh is not None:
            context_length = DTensor.from_local(
                context_length, device_mesh=cp_mesh, placements=[Partial()]
            ).full_tensor()
            expert_load = DTensor.from_local(expert_load, device_mesh=cp_mesh, placements=[Partial()]).full_tensor()
            expert_scores = DTensor.from_local(expert_scores, device_mesh=cp_mesh, placements=[Partial()]).full_tensor()

        context_length = torch.clamp(context_length, min=1)
        f_i = expert_load * self.n_experts / (self.topk * context_length)
        P_i = expert_scores / context_length  # noqa: N806 - the original's name
        loss = torch.sum(f_i * P_i)
        return loss


class MoE(nn.Module):

    def __init__(self, config: MoEConfig, backend: BackendConfig):
        super().__init__()
        self.backend = backend
        self.dim = config.dim
        self.n_routed_experts = config.n_routed_experts
        self.n_activated_experts = config.n_activated_experts

        if backend.fake_balanced_gate:
            raise NotImplementedError("FakeBalancedGate (a benchmarking gate) not mirrored")
        else:
            self.gate = Gate(config, gate_precision=backend.gate_precision)
            self.gate.use_routing_core = "moe_router" in backend.cuda_graph.modules
        if backend.dispatcher != "torch":
            raise NotImplementedError("DeepEP / HybridEP / UCCL-EP / MoK dispatchers left out")
        else:
            self.experts = GroupedExperts(config, backend=backend)

        if config.n_shared_experts > 0:
            self.shared_experts = MLP(
                config.dim,
                config.n_shared_experts * (config.shared_expert_inter_dim or config.moe_inter_dim),
                backend.linear,
                dtype=config.dtype,
                activation=config.shared_expert_activation,
                bias=config.expert_bias,
                swiglu_limit=config.swiglu_limit,
            )
            if config.shared_expert_gate:
                self.shared_expert_gate = initialize_linear_module(
                    backend.linear, config.dim, 1, False, dtype=config.dtype
                )
            else:
                self.shared_expert_gate = None
        else:
            self.shared_experts = None
            self.shared_expert_gate = None

        if config.moe_latent_size is not None:
            self.fc1_latent_proj = initialize_linear_module(
                backend.linear, config.dim, config.moe_latent_size, bias=config.expert_bias, dtype=config.dtype
            )
            self.fc2_latent_proj = initialize_linear_module(
                backend.linear, config.moe_latent_size, config.dim, bias=config.expert_bias, dtype=config.dtype
            )
        else:
            self.fc1_latent_proj = None
            self.fc2_latent_proj = None

        self.cp_mesh = None

    def forward(self, x, padding_mask=None, cp_mesh=None):
        if cp_mesh is None:
            cp_mesh = self.cp_mesh

        shape = x.size()
        x = x.view(-1, self.dim)
        if padding_mask is not None:
            token_mask = (~padding_mask).flatten()
        else:
            token_mask = torch.ones(x.size(0), dtype=torch.bool, device=x.device)

        if self.fc1_latent_proj is not None:
            x_latent = self.fc1_latent_proj(x)
        else:
            x_latent = x

        weights, indices, aux_loss = self.gate(x, token_mask, cp_mesh)
        z = None
        if self.shared_experts is not None:
            z = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                z = torch.nn.functional.sigmoid(self.shared_expert_gate(x)) * z

        y = self.experts(x_latent, token_mask, weights, indices)

        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
        if z is not None:
            y = y + z
        return y.view(shape)


class KimiVLTextMoEBlock(nn.Module):
    """The MoE call of `deepseek_v3.model.Block._mlp` (`self.mlp(x, padding_mask)`, no padding mask here), with the
    `MoEConfig` that `DeepseekV3Model` derives from Kimi-VL-A3B's text config (sizes tiny, float32)."""

    def __init__(self):
        super().__init__()
        moe_config = MoEConfig(
            dim=HIDDEN,
            inter_dim=4 * HIDDEN,
            moe_inter_dim=MOE_INTER,
            n_routed_experts=EXPERTS,
            n_shared_experts=SHARED,
            n_activated_experts=TOP_K,
            n_expert_groups=1,
            n_limited_groups=1,
            train_gate=True,
            gate_bias_update_factor=1e-3,
            score_func="sigmoid",
            route_scale=2.446,
            aux_loss_coeff=0,
            norm_topk_prob=True,
            dtype=torch.float32,
        )
        self.mlp = MoE(moe_config, BackendConfig())

    def forward(self, x, padding_mask=None):
        return self.mlp(x, padding_mask)


def build():
    model, inputs = tiny(KimiVLTextMoEBlock, HIDDEN)
    with torch.no_grad():
        for moe in model.moes:
            bias = moe.mlp.gate.e_score_correction_bias
            bias.copy_(torch.linspace(-0.05, 0.05, bias.numel()))
    return model, inputs

