"""MiniMax-M2's remote-code `MiniMaxM2SparseMoeBlock` as GPTQModel ships it: sigmoid scores plus an in-place
routing bias, a config-valued grouped top-k, `expert_hit.tolist()` and a chunked per-expert loop.

Mirrors the MiniMax-M2 Hugging Face remote-code package that ModelCloud ships inside GPTQModel, GitHub
ModelCloud/GPTQModel at commit 0ba1419 (`gptqmodel/hf_minimax_m2/modeling_minimax_m2.py`: `MiniMaxM2MLP.__init__` /
`forward`, `MiniMaxM2SparseMoeBlock.__init__` / `forward`, and the MoE half of `MiniMaxM2DecoderLayer.forward`),
with `gptqmodel/hf_minimax_m2/configuration_minimax_m2.py` (commit 3d14511) for the defaults (256 experts,
`num_experts_per_tok` 8, `scoring_func` "sigmoid", `use_routing_bias` True, `use_grouped_topk` True with
`num_expert_group` / `topk_group` None, `routed_scaling_factor` 1.0, `router_jitter_noise` 0.0, `hidden_act`
"silu"). The package's `__init__` calls it "MiniMax M2 Hugging Face remote code support"; it is loaded with
`trust_remote_code` (its own `PreTrainedModel`, not transformers' `models/minimax_m2`). MiniMaxAI's own hub
`modeling_minimax_m2.py` is not stored verbatim in any GitHub repository the search reaches, so this is the
remote-code MoE block for MiniMax-M2 that could be read and cited.
`MiniMaxM2SparseMoeBlock.forward(hidden_states)` reads (batch, seq, hidden); `if self.training and
self.jitter_noise > 0` it multiplies the input in place by uniform noise (off: eval, and the noise is 0.0). It
views the tokens [T, H], casts them to the gate's dtype, runs the bias-free `gate` Linear and casts the logits to
float32. The `e_score_correction_bias` Parameter (present since `use_routing_bias`) is moved `.to(device, dtype)`;
a string-valued `scoring_func` chain picks `torch.sigmoid` (else softmax, else `raise ValueError`). With a bias,
`original_scores = scores` then `scores.add_(correction_bias)` in place, so both names alias the biased scores.
The grouped top-k branch (`use_grouped_topk and num_expert_group > 1`: group scores from top-2 sums, a group
`scatter_` mask, `masked_fill(-inf)`) is kept; with the defaults `__init__` resolves `num_expert_group` to 1,
so the plain `torch.topk(scores, top_k, sorted=True)` runs. With a bias the weights are
`original_scores.gather(1, selected_experts)`; `del` drops the score tensors; the weights are divided in place
by their sum `clamp(min=1e-12)`, scaled in place `if self.routed_scaling_factor != 1.0` (skipped), cast to the
token dtype, and the ids cast to long. The dispatch: `zeros_like` output, `one_hot(..., num_experts)
.permute(2, 1, 0)` mask, `expert_hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten()`, then
`for expert_idx in expert_hit.tolist()`: `torch.where(expert_mask[expert_idx].squeeze(0))`, and an inner
`for i in range(0, top_x_full.size(0), EXPERT_CHUNK_SIZE)` (1024) slicing token and slot ids, `index_select`
of the tokens, the expert (SwiGLU with an in-place `gate.mul_(up)` and `del up`), weights
`routing_weights[top_x, idx].unsqueeze(-1)`, in-place `expert_output.mul_(weights)`, and `index_add_` into the
output, with `del` of the temporaries. It returns `(final_hidden_states.view(B, S, H), router_logits)`; the
decoder layer unpacks the tuple and adds the residual (the shell takes element 0 and adds).
Left out: attention, `MiniMaxM2RMSNorm` (the shell supplies the post-attention norm and the residual),
`load_balancing_loss_func` (training only, on collected router logits), the `PretrainedConfig` base and the
quantization-config shim (a plain local class with the package defaults), `ACT2FN` (its "silu" entry is
`nn.SiLU()`), weight init and the state-dict remapping (the shell draws weights), caches. Nothing of the MoE
forward was left out.
Sizes: MiniMax-M2 has hidden 3072, expert intermediate 1536, 256 experts, top-8, 62 layers; here hidden 16,
intermediate 8, 16 experts (top-8 needs more than 8 to stay sparse), top-8.
Constructs: a `self.training and jitter_noise > 0` in-place noise branch, dtype round-trips through the gate's
dtype and float32, a `.to(device, dtype)` Parameter bias, a string-valued scoring chain with a `raise`, aliasing
in-place `add_` of the bias (the gathered weights include it), a config-valued grouped top-k branch with
`scatter_` / `masked_fill`, `topk(sorted=True)`, `gather`, in-place `div_` by a clamped sum, a config-valued
in-place `mul_`, `del` statements, one-hot `permute(2, 1, 0)` mask, `torch.nonzero(...).flatten().tolist()` host
read, a loop over the hit list with a nested `range(0, n, 1024)` chunk loop over a data-dependent size,
`torch.where`, `index_select`, in-place `mul_` of expert output, `index_add_`, an in-place `gate.mul_(up)` in the
expert, a `(output, router_logits)` tuple return.
"""

from __future__ import annotations

import torch
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("ModelCloud/GPTQModel", "gptqmodel/hf_minimax_m2/modeling_minimax_m2.py",
                "0ba1419d0c6bb45b567b39847eb4972c0993376b", "MiniMaxM2SparseMoeBlock.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 16, 8


class MiniMaxM2Config:
    """The MoE fields of GPTQModel's `MiniMaxM2Config` (defaults as there, sizes tiny)."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                 num_experts_per_tok=TOP_K, hidden_act="silu", use_routing_bias=True, scoring_func="sigmoid",
                 router_jitter_noise=0.0, use_grouped_topk=True, num_expert_group=None, topk_group=None,
                 routed_scaling_factor=1.0):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_local_experts = num_local_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.hidden_act = hidden_act
        self.use_routing_bias = use_routing_bias
        self.scoring_func = scoring_func
        self.router_jitter_noise = router_jitter_noise
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor


ACT2FN = {"silu": nn.SiLU()}


class MiniMaxM2MLP(nn.Module):
    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size

        self.w1 = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.w2 = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.w3 = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate = self.act_fn(self.w1(hidden_states))
        up = self.w3(hidden_states)
        gate.mul_(up)
        del up
        return self.w2(gate)


class MiniMaxM2SparseMoeBlock(nn.Module):
    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.experts = nn.ModuleList([MiniMaxM2MLP(config) for _ in range(config.num_local_experts)])
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.jitter_noise = config.router_jitter_noise
        self.use_routing_bias = config.use_routing_bias
        self.scoring_func = getattr(config, "scoring_func", "softmax")
        self.use_grouped_topk = getattr(config, "use_grouped_topk", False)
        self.num_expert_group = getattr(config, "num_expert_group", None)
        self.topk_group = getattr(config, "topk_group", None)
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)

        if self.use_grouped_topk:
            if self.num_expert_group is None or self.num_expert_group <= 0:
                self.num_expert_group = 1
            if self.topk_group is None or self.topk_group <= 0:
                self.topk_group = min(self.num_expert_group, self.top_k)
        else:
            self.num_expert_group = 1
            self.topk_group = 1

        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        if self.use_routing_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, seq_len, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise,
                1.0 + self.jitter_noise,
            )
            hidden_states.mul_(noise)
            del noise

        hidden_states = hidden_states.view(-1, hidden_dim)
        gate_dtype = self.gate.weight.dtype
        router_logits = self.gate(hidden_states.to(gate_dtype)).to(torch.float32)
        if self.e_score_correction_bias is not None:
            # Bias is applied after scoring (see vLLM/SGLang implementations).
            correction_bias = self.e_score_correction_bias.to(router_logits.device, router_logits.dtype)
        else:
            correction_bias = None

        if self.scoring_func == "sigmoid":
            scores = torch.sigmoid(router_logits)
        elif self.scoring_func == "softmax":
            scores = torch.softmax(router_logits, dim=-1)
        else:
            raise ValueError(f"Unsupported scoring function: {self.scoring_func}")

        if correction_bias is not None:
            original_scores = scores
            scores.add_(correction_bias)
        else:
            original_scores = scores
        topk_scores: torch.Tensor
        if self.use_grouped_topk and self.num_expert_group > 1:
            experts_per_group = scores.size(-1) // self.num_expert_group
            scores_grouped = scores.view(scores.size(0), self.num_expert_group, experts_per_group)
            if correction_bias is not None:
                topk_in_group = min(2, experts_per_group)
                if topk_in_group > 0:
                    group_scores = scores_grouped.topk(topk_in_group, dim=-1)[0].sum(dim=-1)
                else:
                    group_scores = torch.zeros_like(scores_grouped[..., 0])
            else:
                group_scores = scores_grouped.max(dim=-1).values
            group_mask = torch.zeros_like(group_scores)
            selected_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=True).indices
            group_mask.scatter_(1, selected_groups, 1.0)
            mask = group_mask.unsqueeze(-1).expand(-1, -1, experts_per_group).reshape(scores.size())
            masked_scores = scores.masked_fill(mask == 0, float("-inf"))
            topk_scores, selected_experts = torch.topk(masked_scores, self.top_k, dim=-1, sorted=True)
        else:
            topk_scores, selected_experts = torch.topk(scores, self.top_k, dim=-1, sorted=True)

        if correction_bias is not None:
            routing_weights = original_scores.gather(1, selected_experts)
        else:
            routing_weights = topk_scores
        del scores, original_scores, topk_scores

        routing_weights.div_(routing_weights.sum(dim=-1, keepdim=True).clamp(min=1e-12))
        if self.routed_scaling_factor != 1.0:
            routing_weights.mul_(self.routed_scaling_factor)
        routing_weights = routing_weights.to(hidden_states.dtype)
        selected_experts = selected_experts.to(torch.long)

        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        del selected_experts
        expert_hit = torch.nonzero(expert_mask.sum(dim=(-1, -2)) > 0, as_tuple=False).flatten()

        # To further reduce memory, process tokens routed to each expert in chunks
        # instead of all at once. A chunk size of 1024 is a reasonable default.
        EXPERT_CHUNK_SIZE = 1024  # noqa: N806 - the original's name

        for expert_idx in expert_hit.tolist():
            expert_layer = self.experts[expert_idx]
            idx_full, top_x_full = torch.where(expert_mask[expert_idx].squeeze(0))

            for i in range(0, top_x_full.size(0), EXPERT_CHUNK_SIZE):
                top_x = top_x_full[i : i + EXPERT_CHUNK_SIZE]
                idx = idx_full[i : i + EXPERT_CHUNK_SIZE]

                token_states = hidden_states.index_select(0, top_x)
                expert_output = expert_layer(token_states)

                weights = routing_weights[top_x, idx].unsqueeze(-1)
                expert_output.mul_(weights)

                final_hidden_states.index_add_(0, top_x, expert_output.to(final_hidden_states.dtype))
                del expert_output, token_states, idx, top_x, weights

            del idx_full, top_x_full
        del hidden_states, routing_weights, expert_mask, expert_hit
        final_hidden_states = final_hidden_states.view(batch_size, seq_len, hidden_dim)
        return final_hidden_states, router_logits


def build():
    return tiny(lambda: MiniMaxM2SparseMoeBlock(MiniMaxM2Config()), HIDDEN)
