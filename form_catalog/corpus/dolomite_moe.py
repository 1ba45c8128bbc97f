"""IBM dolomite-engine's `MoE` in its pure-torch path (scattermoe kernel not allowed): top-k of raw router
logits then softmax over the kept k, a sort-based token regrouping, and stacked expert weights run as a
`split(counts.tolist())` list of per-expert `F.linear`s concatenated back, combined with `index_add`.

Mirrors IBM/dolomite-engine `dolomite_engine/hf_models/modeling_utils/mlp_blocks/moe/base.py` at commit
00e2e871c02ae029ad31e917b6e02ed8a5677b18: `ParameterizedExperts` (`__init__` / `forward`, its `else` branch) and
`MoE` (`__init__`, `forward`, `_compute_routing_weights`, `_compute_experts` (its `else` branch),
`_compute_expert_assignment` (its CPU `bincount` branch), `_get_topk`). The GLU activation is
`GLUActivation.forward`'s non-kernel branch from `.../modeling_utils/activations/glu.py` (read at commit
3ac8f74f473bc7a195c5b003783ed9ae3b7f1e8a; "swiglu" maps to a SiLU base), and `add_aux_loss` (a module global
`_AUX_LOSS = _AUX_LOSS + aux_loss`) comes from `dolomite_engine/hf_models/loss.py` at commit
016db4a74e8397d3dcf18a6c4dfdb6768ff3d860.
`MoE.forward` reads `batch_size, sequence_length` when not padding-free, views the input as [T, H], scores it
with a bias-free Linear gate, takes `topk` of the LOGITS (`max(keepdim=True)` when top_k == 1) and `F.softmax`
over the kept k in float32, cast back with `type_as`. `_compute_expert_assignment` flattens the [T, k] ids,
counts them with `bincount(minlength=E)`, `sort`s them and divides the sort permutation by top_k (`//`) to get
each slot's token, and gathers the flattened gates by that permutation. `_compute_experts` gathers
`hidden_states[batch_index]`, runs `c_fc` (stacked [E, 2I, H] weights), the GLU (`chunk(2)`,
`x[0] * silu(x[1])`), and `c_proj` ([E, H, I]); each `ParameterizedExperts.forward` `split`s its input by
`num_experts_per_token.tolist()` (a host read of the counts) and loops `for i in range(self.num_experts)` over
`F.linear(input[i], self.weight[i], bias)`, empty chunks included, then `torch.cat`s. The rows are scaled by
`batch_gates.unsqueeze(-1)` and `zeros(...).index_add(0, batch_index, ...)` scatters them back; the layer
reshapes to [B, S, H], applies dropout (Identity at 0), computes the switch / z loss only `if self.training`
(else 0) and adds it to the global aux loss.
Left out: the scattermoe / cute-kernel branches (Triton), the switch-loss body (training only; the eval path
passes 0), the optional shared expert (`shared_intermediate_size` None here, the default), tensor / data
parallel reductions, `ParameterizedLinear`'s std init and `reset_parameters` (the shell draws the weights), the
hopper-GPU capability probe (a CUDA query; False on CPU), and the rest of the model (attention, norms: the shell
supplies the pre-MoE norm and the residual add).
Sizes: Granite-3.0-1B-A400M (a dolomite-engine MoE) has hidden 1024, intermediate 512, 32 experts, top-8; here
hidden 16, intermediate 8 (c_fc out 16, GLU), 8 experts, top-2, one layer, no bias.
Constructs: shape unpacking behind a config `if`, `view(-1, H)`, top-k of logits then softmax over k with
float/`type_as` casts, `bincount(minlength)`, `sort` + floor-division to token ids, flattened-gate gather,
advanced-index row gather, `split(tensor.tolist())` with a Python loop of per-expert `F.linear` on indexed 3-D
parameters and `cat`, `chunk`-based SwiGLU, `unsqueeze(-1)` scaling, out-of-place `zeros(...).index_add`, `del`,
`reshape` back to 3-D, `if self.training` loss, a module-global accumulator mutated in forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("IBM/dolomite-engine", "dolomite_engine/hf_models/modeling_utils/mlp_blocks/moe/base.py",
                "00e2e871c02ae029ad31e917b6e02ed8a5677b18", "MoE.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2

_AUX_LOSS: torch.Tensor | float = 0


def add_aux_loss(aux_loss: torch.Tensor) -> None:
    global _AUX_LOSS
    _AUX_LOSS = _AUX_LOSS + aux_loss


class GLUActivation(nn.Module):
    def __init__(self, base_activation: nn.Module) -> None:
        super().__init__()
        self.base_activation = base_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.chunk(2, dim=-1)
        x = x[0] * self.base_activation(x[1])
        return x


def is_glu(name: str) -> bool:
    return name.endswith("glu")


class ParameterizedExperts(nn.Module):
    def __init__(self, num_experts: int, in_features: int, out_features: int, add_bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.bias = None
        if add_bias:
            self.bias = nn.Parameter(torch.empty(num_experts, out_features))
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, input: torch.Tensor, num_experts_per_token: torch.Tensor | None = None) -> torch.Tensor:
        input = input.split(num_experts_per_token.tolist(), dim=0)
        input = [
            F.linear(input[i], self.weight[i], None if self.bias is None else self.bias[i])
            for i in range(self.num_experts)
        ]
        input = torch.cat(input, dim=0)
        return input


class MoE(nn.Module):
    linear_class = ParameterizedExperts

    def __init__(self, hidden_size: int, intermediate_size: int, shared_intermediate_size: int | None,
                 num_experts: int, num_experts_per_tok: int, activation_function: str, add_bias: bool,
                 dropout: float, use_padding_free_transformer: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = num_experts_per_tok
        self.use_padding_free_transformer = use_padding_free_transformer
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.shared_intermediate_size = shared_intermediate_size

        self.gate = nn.Linear(in_features=self.hidden_size, out_features=num_experts, bias=False)
        self.c_fc = self.linear_class(
            num_experts=num_experts,
            in_features=self.hidden_size,
            out_features=2 * self.intermediate_size if is_glu(activation_function) else self.intermediate_size,
            add_bias=add_bias,
        )
        self.act = GLUActivation(nn.SiLU())  # get_activation_function("swiglu")
        self.c_proj = self.linear_class(
            num_experts=num_experts, in_features=self.intermediate_size, out_features=self.hidden_size,
            add_bias=add_bias,
        )
        self.dropout = nn.Identity() if dropout == 0 else nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.use_padding_free_transformer:
            batch_size, sequence_length, _ = hidden_states.shape

        hidden_states = hidden_states.view(-1, self.hidden_size)

        router_logits, router_weights, selected_experts = self._compute_routing_weights(hidden_states)

        moe_output = self._compute_experts(hidden_states, router_weights, selected_experts)

        if self.shared_intermediate_size is None:
            hidden_states = moe_output
        else:
            raise NotImplementedError("shared experts are left out of this mirror")

        del moe_output

        if not self.use_padding_free_transformer:
            hidden_states = hidden_states.reshape(batch_size, sequence_length, self.hidden_size)

        hidden_states = self.dropout(hidden_states)

        aux_loss = self._compute_switch_loss(router_logits) if self.training else 0

        add_aux_loss(aux_loss)

        return hidden_states

    def _compute_routing_weights(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        router_logits = self.gate(hidden_states)
        router_weights, selected_experts = self._get_topk(router_logits)
        router_weights = F.softmax(router_weights.float(), dim=-1)
        router_weights = router_weights.type_as(hidden_states)
        return router_logits, router_weights, selected_experts

    def _compute_experts(self, hidden_states: torch.Tensor, router_weights: torch.Tensor,
                         selected_experts: torch.Tensor) -> torch.Tensor:
        total_q = hidden_states.shape[0]

        batch_index, batch_gates, num_experts_per_token = self._compute_expert_assignment(
            router_weights, selected_experts
        )

        hidden_states = hidden_states[batch_index]

        hidden_states = self.c_fc(hidden_states, num_experts_per_token)
        hidden_states = self.act(hidden_states)
        hidden_states = self.c_proj(hidden_states, num_experts_per_token)

        hidden_states = hidden_states * batch_gates.unsqueeze(-1)
        zeros = torch.zeros((total_q, self.hidden_size), dtype=hidden_states.dtype, device=hidden_states.device)
        hidden_states = zeros.index_add(0, batch_index, hidden_states)
        return hidden_states

    def _compute_expert_assignment(self, router_weights: torch.Tensor,
                                   selected_experts: torch.Tensor) -> tuple[torch.Tensor]:
        selected_experts = selected_experts.flatten()
        num_experts_per_token = selected_experts.bincount(minlength=self.num_experts)

        # sort and group input tokens according to expert assignment
        _, index_sorted_experts = selected_experts.sort(0)  # [num_tokens * top_k]
        batch_index = index_sorted_experts // self.top_k  # [num_tokens * top_k]

        # gather the gate values for grouped input tokens
        router_weights = router_weights.flatten()  # [num_tokens * top_k]
        batch_gates = router_weights[index_sorted_experts]  # [num_tokens * top_k]
        return batch_index, batch_gates, num_experts_per_token

    def _get_topk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.top_k == 1:
            x, indices = x.max(dim=-1, keepdim=True)
        else:
            x, indices = x.topk(self.top_k, dim=-1)
        return x, indices

    def _compute_switch_loss(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("training-only switch loss is left out of this mirror")


def build():
    return tiny(lambda: MoE(HIDDEN, INTER, None, EXPERTS, TOP_K, "swiglu", add_bias=False, dropout=0.0,
                            use_padding_free_transformer=False), HIDDEN)
