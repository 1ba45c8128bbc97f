"""nanotron's pure-PyTorch Qwen2MoELayer: top-k of raw logits, per-expert mask loops that scale the INPUTS.

Mirrors huggingface/nanotron `src/nanotron/models/qwen.py` at commit 37cc8b0 (`Qwen2MoELayer`: `__init__`,
`_compute_router_probabilities`, `_dispatch_tokens`, `_combine_expert_outputs`, `_core_forward`,
`_checkpointed_forward`, `forward`; `Qwen2MLP`; the call in `Qwen2DecoderLayer._core_forward`; the
`MoEConfig` defaults of `src/nanotron/config/models_config.py`), the last commit at which this layer is
the one `Qwen2DecoderLayer` builds for its MoE layers. Why this one: nanotron's other MoE code has no
pure-PyTorch path. `examples/moe/moe.py` (`dMoE`, `LearnedRouter`, `ParallelDroplessMLP`, `SparseMLP`) is
MegaBlocks' dropless MoE and runs entirely on `megablocks.ops` (radix sort, histogram, padded gather /
scatter, block-sparse topology) and `stk` block-sparse matmuls with 128-blocks; the later
`src/nanotron/nn/moe.py` (which replaced this class in 7bc9923, leaving it dead and unimportable in
qwen.py) runs on `grouped_gemm.ops.permute` / `gmm` / `unpermute`. This class is the repo's own
reference loop. The layer is fed [b*s, H] by the decoder (nanotron keeps the sequence flattened), so a
wrapper flattens [B, S, H], calls `mlp(hidden_states=...)["hidden_states"]` as the decoder does, and
restores the shape.
The forward: unless `recompute_layer and self.training` (then the core runs through
`torch.utils.checkpoint.CheckpointFunction`), the core computes router logits with a bias-free linear, takes
`torch.topk` of the raw logits and softmaxes only the k picked values (no renormalisation step). Dispatch:
a bare `hidden_states.shape[0]` expression, then for every local expert (`range(num_local_experts)`) a
token mask `(routing_indices == e).any(dim=-1)` gathers the tokens by boolean indexing, `nonzero(as_tuple=
True)` on the same comparison gives (token, slot) ids that pick the weights, and the gathered tokens are
multiplied by their weights BEFORE the expert (so the expert sees w * x, not x); each expert's input and
its host-side count `len(tokens)` are appended to Python lists. The experts loop `enumerate(zip(...))`:
a zero count appends an empty `torch.tensor([])` and skips, otherwise the expert (a Qwen2MLP: merged
gate_up projection `torch.split` in half, SiLU(gate) * up, down projection, returned in a dict) runs.
Combine: a float32 `torch.zeros(shape, device=outputs[0].device)` (no dtype argument), and per expert
`if out.shape[0] == 0: continue`, then the token mask is recomputed and `combined[mask] += out` (an
index_put through a boolean mask). With the shared expert on, a Qwen2MLP on all tokens is added, gated by
`sigmoid` of a [H, 1] linear. Returns `{"hidden_states": output}`.
Tiny sizes: hidden 16, intermediate 8, 8 experts, top-2 (the `MoEConfig` defaults for experts and k),
`enable_shared_expert=True` (as the repo's later `examples/config_qwen_with_moe.yaml` sets it; the
default is False); the shared expert has the routed experts' width, as `Qwen2MLP` reads
`config.intermediate_size` at this commit.
Left out: tensor parallelism reduces to its one-process form: `TensorParallelColumnLinear` /
`TensorParallelRowLinear` (ALL_REDUCE mode, tp = 1: identity communication around `F.linear`) become
bias-free `nn.Linear`s, `contiguous_chunks` and async flags drop; `expert_parallel_size` is 1, so all
experts are local. `ACT2FN[config.hidden_act]` with the default "silu" becomes `nn.SiLU()`. The
`Qwen2Config` / `MoEConfig` / `ParallelismArgs` objects become a tiny local config class carrying the
fields the layer reads. `token_dispatcher_type` is stored and never used, as in the original.
Constructs: a `recompute_layer and self.training` branch to `CheckpointFunction.apply`, a Python loop over
`range(num_local_experts)` with boolean-mask gathers and `nonzero(as_tuple=True)` weight picks, host
counts via `len(tensor)` driving `if count == 0` skips with `torch.tensor([])` placeholders, an
`enumerate(zip(...))` expert loop, an `if out.shape[0] == 0: continue` skip, `combined[mask] += out`
masked in-place accumulation, dict-returning submodules indexed by key, a bare shape expression.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointFunction

from ._shell import Source, tiny

SOURCE = Source(
    "huggingface/nanotron",
    "src/nanotron/models/qwen.py",
    "37cc8b0cd4795d6b458f609f9671c5c465e09333",
    "Qwen2MoELayer.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class TinyQwen2MoEConfig:
    """The fields of Qwen2Config, its MoEConfig and ParallelismArgs that the layer reads."""

    def __init__(
        self,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        hidden_act="silu",
        num_experts=EXPERTS,
        top_k=TOP_K,
        enable_shared_expert=True,
        token_dispatcher_type="alltoall",
        expert_parallel_size=1,
        recompute_layer=False,
    ):
        self.hidden_size, self.intermediate_size, self.hidden_act = hidden_size, intermediate_size, hidden_act
        self.num_experts, self.top_k = num_experts, top_k
        self.enable_shared_expert, self.token_dispatcher_type = enable_shared_expert, token_dispatcher_type
        self.expert_parallel_size, self.recompute_layer = expert_parallel_size, recompute_layer


class Qwen2MLP(nn.Module):
    def __init__(self, config: TinyQwen2MoEConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = nn.SiLU()  # ACT2FN["silu"]

    def forward(self, hidden_states):
        merged_states = self.gate_up_proj(hidden_states)
        gate_states, up_states = torch.split(merged_states, merged_states.shape[-1] // 2, dim=-1)
        hidden_states = self.act(gate_states) * up_states
        hidden_states = self.down_proj(hidden_states)
        return {"hidden_states": hidden_states}


class Qwen2MoELayer(nn.Module):
    def __init__(self, config: TinyQwen2MoEConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.num_experts = config.num_experts
        self.num_experts_per_token = config.top_k
        self.expert_parallel_size = config.expert_parallel_size
        self.num_local_experts = self.num_experts // self.expert_parallel_size

        self.router = nn.Linear(self.hidden_size, self.num_experts, bias=False)

        self.enable_shared_expert = config.enable_shared_expert
        if self.enable_shared_expert:
            self.shared_expert = Qwen2MLP(config)
            self.shared_expert_gate = nn.Linear(self.hidden_size, 1, bias=False)

        self.experts = nn.ModuleList([Qwen2MLP(config) for _ in range(self.num_local_experts)])
        self.recompute_layer = config.recompute_layer
        self.token_dispatcher_type = config.token_dispatcher_type

    def _compute_router_probabilities(self, hidden_states):
        router_logits = self.router(hidden_states)
        routing_weights, routing_indices = torch.topk(router_logits, k=self.num_experts_per_token, dim=-1)
        routing_weights = F.softmax(routing_weights, dim=-1)
        return routing_weights, routing_indices

    def _dispatch_tokens(self, hidden_states, routing_weights, routing_indices):
        hidden_states.shape[0]
        dispatched_inputs = []
        expert_counts = []
        for expert_idx in range(self.num_local_experts):
            expert_mask = (routing_indices == expert_idx).any(dim=-1)
            tokens_for_expert = hidden_states[expert_mask]

            token_positions, k_positions = (routing_indices == expert_idx).nonzero(as_tuple=True)
            expert_weights = routing_weights[token_positions, k_positions].unsqueeze(-1)

            scaled_inputs = tokens_for_expert * expert_weights
            dispatched_inputs.append(scaled_inputs)
            expert_counts.append(len(tokens_for_expert))
        return dispatched_inputs, expert_counts

    def _combine_expert_outputs(self, expert_outputs, routing_indices, original_shape):
        combined_output = torch.zeros(original_shape, device=expert_outputs[0].device)
        for expert_idx, expert_output in enumerate(expert_outputs):
            if expert_output.shape[0] == 0:
                continue
            expert_mask = (routing_indices == expert_idx).any(dim=-1)
            combined_output[expert_mask] += expert_output
        return combined_output

    def _core_forward(self, hidden_states):
        routing_weights, routing_indices = self._compute_router_probabilities(hidden_states)
        dispatched_inputs, expert_counts = self._dispatch_tokens(hidden_states, routing_weights, routing_indices)

        expert_outputs = []
        for expert_idx, (inputs, count) in enumerate(zip(dispatched_inputs, expert_counts)):  # noqa: B905
            if count == 0:
                expert_outputs.append(torch.tensor([], device=hidden_states.device))
                continue
            output = self.experts[expert_idx](hidden_states=inputs)["hidden_states"]
            expert_outputs.append(output)

        output = self._combine_expert_outputs(expert_outputs, routing_indices, hidden_states.shape)

        if self.enable_shared_expert:
            shared_expert_output = self.shared_expert(hidden_states=hidden_states)["hidden_states"]
            shared_gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
            output = output + shared_gate * shared_expert_output
        return output

    def _checkpointed_forward(self, hidden_states):
        return CheckpointFunction.apply(self._core_forward, True, hidden_states)

    def forward(self, hidden_states):
        if self.recompute_layer and self.training:
            hidden_states = self._checkpointed_forward(hidden_states)
        else:
            hidden_states = self._core_forward(hidden_states)
        return {"hidden_states": hidden_states}


class FlatCaller(nn.Module):
    """Feeds the layer [b*s, H] and takes its dict output, as Qwen2DecoderLayer does, then restores [B, S, H]."""

    def __init__(self):
        super().__init__()
        self.mlp = Qwen2MoELayer(TinyQwen2MoEConfig())

    def forward(self, x):
        hidden_states = self.mlp(hidden_states=x.reshape(-1, x.shape[-1]))["hidden_states"]
        return hidden_states.view(x.shape)


def build():
    return tiny(FlatCaller, HIDDEN)
