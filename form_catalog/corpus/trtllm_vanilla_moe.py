"""TensorRT-LLM's VanillaMoE: the pure-PyTorch MoE backend, argsort dispatch and a boolean-mask expert loop.

Mirrors NVIDIA/TensorRT-LLM `tensorrt_llm/_torch/modules/fused_moe/fused_moe_vanilla.py` at commit 2a9abd9
(`VanillaMoE.__init__`, `create_experts`, `create_weights`, `reducescatter_or_allreduce`, `run_experts`,
`forward`), with the pieces it runs on: `RenormalizeMoeRoutingMethod` from `fused_moe/routing.py` (stored
copies 4bd549c and 0f3e29a, identical for this class), `GatedMLP` and `swiglu` from `modules/gated_mlp.py`
(stored copy 01503f5), and its caller `MixtralMoE` from `models/modeling_mixtral.py` (stored copy 000a01d),
which `create_moe` builds as a VanillaMoE when `model_config.moe_backend == "VANILLA"`. The newest snapshot
(2.5 GB) was too large to bring here, so these files were read from the search index's stored copies; newer
upstream code passes `layer_idx` and `activation_type` to VanillaMoE (its own tests' reference copy of the
forward is the same as the one mirrored here).
The Mixtral block scores the tokens with a bias-free gate Linear and calls the experts with
(tokens, router_logits). VanillaMoE is an `nn.ModuleList` subclass whose items are the experts, with the
routing method registered as an extra child ahead of them (so `self[i]` indexes string keys and every
`module_list[i] = ...` assignment passes ModuleList's bound check only because that child already counts).
Its forward asserts the hidden size, views the tokens flat, calls `routing_method.apply(router_logits)`
(Renormalize: the routing module checks `force_enable_pytorch_op or num_experts > 128 or top_k > 8` and takes
its PyTorch path, top-k of the raw logits, ids cast to int32, and a float32 softmax over the k values), skips
the attention-DP allgather (`use_dp and parallel_size > 1` is false), builds the boolean mask of slots whose
expert lies in this rank's range [expert_start, expert_end), boolean-gathers those expert ids, `argsort`s
them, reorders them, takes (token, slot) ids with `torch.where(mask)` and reorders both by the same sort,
gathers the token rows and the `[token, slot, None]` scales. `run_experts` allocates a zero buffer and loops
`for expert_idx in range(expert_start, expert_end)`: `sorted_experts == expert_idx` mask, skip when
`not torch.any(mask)` (a tensor truth test on the host), boolean-mask gathers of inputs, token ids and
scales, the expert (`self[expert_idx]`: a GatedMLP, fused gate_up Linear, `chunk(2)` SwiGLU, down Linear) and
an indexed in-place update `final[batch_idx] += output * scale`. The result goes through
`reducescatter_or_allreduce`, which returns it unchanged with one rank (`parallel_size == 1`).
TRT-LLM feeds its layers packed tokens [num_tokens, hidden]; the outer `PackedTokens` module views the
shell's [B, S, H] to that layout and the output back (with [B, S, H] the router logits would be 3-D and the
two-way `torch.where` unpacking would fail), passing a stand-in attention metadata with no per-rank counts.
Left out: tensor/expert/attention-DP parallelism (`Mapping` becomes a one-rank local class: tp 1, ep 1,
rank 0, no attention DP; the `AllReduce` child module is not built, and the `allgather`, `reducescatter` and
all-reduce calls sit behind conditions that are false with one rank, and here raise if reached); the
`trtllm.renorm_moe_routing_op` CUDA kernel that the routing takes for <= 128 experts and top_k <= 8 (the
mirror sets `force_enable_pytorch_op=True`, so the routing's own PyTorch path runs; Mixtral leaves it
False); the `pack_weights` / quantised weight creation and `load_weights` (used by the Flux subclass and
checkpoint loading only); GatedMLP's LoRA path and the flashinfer `silu_and_mul` branch of `swiglu` (same
math; `IS_FLASHINFER_AVAILABLE` is False here); the TRT-LLM `Linear` wrappers (plain `nn.Linear`, one rank).
The real Mixtral has 8 experts, top-2 (kept here).
Constructs: an `nn.ModuleList` subclass indexed by expert id with a non-expert child registered first,
`routing_method.apply` dispatch on config flags and `logits.shape[-1]`, int32 expert ids, boolean-mask
gathers, `argsort` and reorder, two-way `torch.where(mask)`, a `range(expert_start, expert_end)` loop with a
`not torch.any(mask)` skip, an activation-identity test (`self.activation == F.silu`), `chunk(2)` SwiGLU,
indexed in-place `+=` (index_put) combine, config-gated distributed branches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("NVIDIA/TensorRT-LLM", "tensorrt_llm/_torch/modules/fused_moe/fused_moe_vanilla.py",
                "2a9abd9536aa62ad3e4b9314be9286b1b1be523b", "VanillaMoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2

IS_FLASHINFER_AVAILABLE = False


class Mapping:
    """One rank: no tensor, expert or attention-data parallelism."""

    def __init__(self):
        self.rank, self.tp_size = 0, 1
        self.moe_tp_size, self.moe_tp_rank = 1, 0
        self.moe_ep_size, self.moe_ep_rank = 1, 0
        self.moe_cluster_size, self.moe_cluster_rank = 1, 0
        self.enable_attention_dp = False


class MixtralConfig:
    def __init__(self, hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                 num_experts_per_tok=TOP_K, torch_dtype=torch.float32):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_local_experts, self.num_experts_per_tok = num_local_experts, num_experts_per_tok
        self.torch_dtype = torch_dtype


class AttentionMetadata:
    """Stand-in: only the per-rank token counts the MoE block reads (none with one rank)."""

    def __init__(self):
        self.all_rank_num_tokens = None
        self.all_rank_max_num_tokens = None


class BaseMoeRoutingMethod(nn.Module):
    def apply(self, _router_logits):
        raise NotImplementedError

    def get_experts_per_token(self):
        return self.top_k

    @property
    def experts_per_token(self):
        return self.get_experts_per_token()


class RenormalizeMoeRoutingMethod(BaseMoeRoutingMethod):
    def __init__(self, top_k, output_dtype=torch.float32, force_enable_pytorch_op=False):
        super().__init__()
        self.top_k = top_k
        self.force_enable_pytorch_op = force_enable_pytorch_op
        self.output_dtype = output_dtype

    def apply_pytorch(self, router_logits):
        values, indices = torch.topk(router_logits, k=self.top_k, dim=-1)
        return indices.to(torch.int32), torch.nn.functional.softmax(values.to(self.output_dtype), dim=-1)

    def apply(self, router_logits):
        num_experts = router_logits.shape[-1]
        if self.force_enable_pytorch_op or num_experts > 128 or self.top_k > 8:
            return self.apply_pytorch(router_logits)
        raise NotImplementedError("trtllm.renorm_moe_routing_op is a TensorRT-LLM CUDA kernel")


def swiglu(x):
    if IS_FLASHINFER_AVAILABLE:
        raise NotImplementedError("flashinfer silu_and_mul")
    else:
        gate, x = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class GatedMLP(nn.Module):
    def __init__(self, *, hidden_size, intermediate_size, bias, activation=F.silu, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, intermediate_size * 2, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x):
        if self.activation == F.silu:
            h1 = self.gate_up_proj(x)
            h2 = swiglu(h1)
            return self.down_proj(h2)
        else:
            raise NotImplementedError(f"activation {self.activation} is not fused in GatedMLP")


class VanillaMoE(nn.ModuleList):
    def __init__(self, *, routing_method, num_experts, hidden_size, intermediate_size, dtype=None,
                 reduce_results=False, mapping=None, apply_router_weight_on_input=False):
        super().__init__()
        mapping = mapping or Mapping()
        self.routing_method = routing_method
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.dtype, self.reduce_results = dtype, reduce_results

        self.cluster_rank, self.cluster_size = mapping.moe_cluster_rank, mapping.moe_cluster_size
        self.smart_router = True if self.cluster_size > 1 else False
        assert not self.smart_router, "vanilla MoE runs with moe_cluster_size 1"
        self.rank = mapping.rank
        self.tp_rank, self.tp_size = mapping.moe_tp_rank, mapping.moe_tp_size
        self.ep_size, self.ep_rank = mapping.moe_ep_size, mapping.moe_ep_rank
        self.use_dp = mapping.enable_attention_dp
        self.mapping = mapping
        self.parallel_size = mapping.tp_size

        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        self.expert_size_per_partition = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.expert_size_per_partition
        self.expert_end = min(self.expert_start + self.expert_size_per_partition, self.num_experts)
        self.expert_size_per_partition = self.expert_end - self.expert_start

        self._weights_created = False
        self.create_weights()
        self.apply_router_weight_on_input = apply_router_weight_on_input

    def create_experts(self, module_list=None):
        if module_list is None:
            module_list = self
        for expert_idx in range(self.num_experts):
            if self.expert_start <= expert_idx < self.expert_end:
                module_list[expert_idx] = GatedMLP(hidden_size=self.hidden_size,
                                                   intermediate_size=self.intermediate_size,
                                                   bias=False, dtype=self.dtype)
            else:
                module_list[expert_idx] = nn.Identity()

    def create_weights(self):
        if self._weights_created:
            return
        self._weights_created = True
        self.create_experts()

    def reducescatter_or_allreduce(self, inputs, all_rank_num_tokens=None, use_dp_padding=None):
        outputs = inputs
        if self.parallel_size > 1:
            raise NotImplementedError("reducescatter / allreduce across ranks")
        return outputs

    def run_experts(self, input, expanded_inputs, expanded_scales, sorted_experts, batch_indices):
        final_hidden_states = torch.zeros(input.shape, dtype=input.dtype, device=input.device)
        for expert_idx in range(self.expert_start, self.expert_end):
            expert_mask = sorted_experts == expert_idx
            if not torch.any(expert_mask):
                continue
            expanded_input = expanded_inputs[expert_mask]
            batch_idx = batch_indices[expert_mask]
            expanded_scale = expanded_scales[expert_mask]

            output = self[expert_idx](expanded_input)
            final_hidden_states[batch_idx] += output * expanded_scale
        return final_hidden_states

    def forward(self, x, router_logits, all_rank_num_tokens=None, use_dp_padding=None, **kwargs):
        assert x.shape[-1] == self.hidden_size
        x = x.view(-1, self.hidden_size)

        token_selected_experts, token_final_scales = self.routing_method.apply(router_logits)

        if self.use_dp and self.parallel_size > 1:
            raise NotImplementedError("allgather across attention-DP ranks")

        expert_masks = ((token_selected_experts >= self.expert_start)
                        & (token_selected_experts < self.expert_end))
        local_selected_experts = token_selected_experts[expert_masks]
        sort_indices = torch.argsort(local_selected_experts)
        sorted_experts = local_selected_experts[sort_indices]

        batch_indices, nth_experts = torch.where(expert_masks)
        batch_indices = batch_indices[sort_indices]
        nth_experts = nth_experts[sort_indices]
        expanded_inputs = x[batch_indices]
        expanded_scales = token_final_scales[batch_indices, nth_experts, None]

        final_hidden_states = self.run_experts(x, expanded_inputs, expanded_scales, sorted_experts,
                                               batch_indices)
        final_hidden_states = self.reducescatter_or_allreduce(
            final_hidden_states, all_rank_num_tokens=all_rank_num_tokens, use_dp_padding=use_dp_padding)
        return final_hidden_states


class MixtralMoE(nn.Module):
    def __init__(self, config=None, mapping=None):
        super().__init__()
        config = config or MixtralConfig()
        mapping = mapping or Mapping()
        self.hidden_dim, self.ffn_dim = config.hidden_size, config.intermediate_size
        self.num_experts, self.top_k = config.num_local_experts, config.num_experts_per_tok
        self.enable_attention_dp = mapping.enable_attention_dp
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False, dtype=config.torch_dtype)
        reduce_results = True
        self.experts = VanillaMoE(
            routing_method=RenormalizeMoeRoutingMethod(top_k=self.top_k, force_enable_pytorch_op=True),
            num_experts=self.num_experts, hidden_size=self.hidden_dim, intermediate_size=self.ffn_dim,
            dtype=config.torch_dtype, reduce_results=reduce_results, mapping=mapping)

    def forward(self, hidden_states, attn_metadata):
        all_rank_num_tokens = attn_metadata.all_rank_num_tokens
        all_rank_max_num_tokens = attn_metadata.all_rank_max_num_tokens
        router_logits = self.gate(hidden_states)
        final_hidden_states = self.experts(hidden_states, router_logits,
                                           all_rank_num_tokens=all_rank_num_tokens,
                                           all_rank_max_num_tokens=all_rank_max_num_tokens,
                                           use_dp_padding=False)
        return final_hidden_states


class PackedTokens(nn.Module):
    """[B, S, H] -> TensorRT-LLM's packed [num_tokens, H] layout around the Mixtral MoE block, and back."""

    def __init__(self):
        super().__init__()
        self.block_sparse_moe = MixtralMoE()
        self.attn_metadata = AttentionMetadata()

    def forward(self, x):
        out = self.block_sparse_moe(x.view(-1, x.shape[-1]), self.attn_metadata)
        return out.view(x.shape)


def build():
    return tiny(PackedTokens, HIDDEN)
