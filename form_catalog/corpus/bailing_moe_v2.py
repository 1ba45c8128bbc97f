"""Ling 2.0's remote-code `BailingMoeV2SparseMoeBlock`: float32 sigmoid gate with an expert-bias buffer and
group-limited top-k, `moe_infer` over counts read to numpy, a shared expert, and a dense first layer.

Stands in for StepFun Step-3's text MoE (`Step3vMoEMLP` in the hub's `modeling_step3.py`), which the search index
holds only in a GitHub copy whose repository it does not name (stepfun-ai/Step3 stores only its README and docs),
so no repository and commit could be cited. Instead this mirrors the `modeling_bailing_moe_v2.py` that inclusionAI
ships with Ling-mini-2.0 / Ring-mini-2.0 (the Ling 2.0 family) for `trust_remote_code=True`, as vendored by the
GitHub repository pillumina/verl at commit b38cee2 (`modeling_bailing_moe_v2.py`: `BailingMoeV2MLP`,
`BailingMoeV2Gate.__init__` / `group_limited_topk` / `forward`, `BailingMoeV2SparseMoeBlock.__init__` /
`_setup_experts` / `forward` / `moe_infer`, the MLP choice in `BailingMoeV2DecoderLayer.__init__` and the MLP half
of its `forward`), with that repository's `config.json` (Ling-mini-2.0: 256 experts, top-8, `n_group` 8,
`topk_group` 4, `routed_scaling_factor` 2.5, one shared expert, `first_k_dense_replace` 1, "silu") for the values;
the repository holds no `configuration_bailing_moe_v2.py`. It is the successor of the Ling 1.0 code in the
`bailing_moe` entry: the dispatch (`moe_infer`) is the same, the gate is new.
`BailingMoeV2Gate.forward` flattens the tokens, computes float32 logits with `F.linear` on float32 copies of input
and weight, takes `sigmoid` (cast back to the logits' dtype), adds the `expert_bias` buffer for ROUTING only, and
calls `group_limited_topk`: per group of `E / n_group` experts the sum of its top-2 scores, `topk_group` groups by
`torch.topk(sorted=False)`, a `zeros_like` + `scatter_` group mask expanded to the experts, `masked_fill` of the
rest with -inf, and `torch.topk(k=8)`; only the indices are kept. The WEIGHTS are the unbiased sigmoid scores
gathered at those indices, divided by their sum + 1e-20 (`if self.top_k > 1`), times `routed_scaling_factor`.
`BailingMoeV2SparseMoeBlock.forward` keeps `identity`, routes, views the tokens [T, H]; `if self.training` it
repeats tokens k times and fills `y[flat_topk_idx == i]` expert by expert through boolean-mask gathers and
index-puts; otherwise `moe_infer` (`@torch.no_grad()`): a `new_zeros` [T, E] count matrix `scatter_`ed with 1s,
`sum(dim=0)`, `argsort` of the flat ids, `x[idxs // k]` sorted tokens, counts read with `.cpu().numpy()`, a loop
`for i, num_tokens in enumerate(...)` with `if num_tokens == 0: continue` over slices (note: `start_idx` advances
only after a non-empty expert, as written), `torch.cat` of the outputs (or `new_empty(0)`), an index-put
`new_x[idxs] = outs`, and a weighted sum via `.type(...).mul_(...).sum(dim=1).type(...)`. The shared SwiGLU
expert runs on `identity` and is added; the block returns `(y, (router_logits, topk_idx))`, which the decoder
layer unpacks with `isinstance(hidden_states, tuple)` before adding the residual with `.to(residual.device)`.
Layers with `layer_idx < first_k_dense_replace` get a dense `BailingMoeV2MLP` instead (`BailingMoeV2LayerSchedule`
reproduces that choice for the shell, one call per layer: layer 0 dense, layer 1 MoE).
Left out: attention, rotary embedding, the MTP layers (`num_nextn_predict_layers`), `BailingMoeV2RMSNorm` (the
shell supplies the pre-MoE norm and the residual), the `PretrainedConfig` base (a plain local class with the
config.json values), `ACT2FN` (its "silu" entry is `nn.SiLU()`), `reset_parameters`' kaiming init (the shell draws
weights), caches. The `expert_bias` buffer, zero at construction and set by a trained checkpoint, is filled by the
schedule with a fixed `linspace(-0.1, 0.1)` to stand in for a loaded checkpoint. Nothing of the MoE forward was
left out.
Sizes: Ling-mini-2.0 has hidden 2048, expert FFN 512, 256 experts in 8 groups, top-8 within 4 groups; here hidden
16, expert FFN 8 (shared expert 8), dense FFN 32, 16 experts in 8 groups, top-8 within 4 groups (16, not 4-8,
experts: `group_limited_topk` takes the top-2 of each group, so a group needs 2 experts, and top-8 must fit in the
4 chosen groups), two layers.
Constructs: float32 `F.linear` on cast weights, sigmoid + bias buffer used for selection only, grouped top-2 sum,
`topk(sorted=False)`, `scatter_` mask + `expand` + `masked_fill(-inf)`, `gather` of unbiased scores,
epsilon renormalisation behind a Python `if top_k > 1`, a scaling factor, an `if self.training` branch with
boolean-mask gathers / index-puts, `@torch.no_grad()` on a helper method, `new_zeros` + `scatter_` counts read to
the host with `.cpu().numpy()`, `argsort`, a loop over a numpy array with `if num_tokens == 0: continue`,
`torch.cat` of a Python list with an empty fallback, index-put `new_x[idxs] = outs`, in-place `mul_`, dtype
round-trips, a shared expert on the saved input, a nested tuple return unpacked by `isinstance`, a stateful
per-layer factory (dense first layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("pillumina/verl", "modeling_bailing_moe_v2.py", "b38cee2393170e5b4c6906226071fe7ed2c970aa",
                "BailingMoeV2SparseMoeBlock.forward")
HIDDEN, INTER, MOE_INTER, EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, LAYERS = 16, 32, 8, 16, 8, 8, 4, 2


class BailingMoeV2Config:
    """The MoE fields of Ling-mini-2.0's `BailingMoeV2Config` (config.json values, sizes tiny)."""

    def __init__(self, hidden_size=HIDDEN, intermediate_size=INTER, moe_intermediate_size=MOE_INTER,
                 num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_shared_experts=1, n_group=N_GROUP,
                 topk_group=TOPK_GROUP, routed_scaling_factor=2.5, first_k_dense_replace=1, hidden_act="silu"):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.moe_intermediate_size = moe_intermediate_size
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.num_shared_experts = num_shared_experts
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.first_k_dense_replace = first_k_dense_replace
        self.hidden_act = hidden_act


ACT2FN = {"silu": nn.SiLU()}


class BailingMoeV2MLP(nn.Module):
    def __init__(self, config: BailingMoeV2Config, intermediate_size: int):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size

        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class BailingMoeV2Gate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts

        self.n_group = config.n_group
        self.topk_group = config.topk_group

        # top-k selection
        self.gating_dim = config.hidden_size
        self.weight = nn.Parameter(torch.empty((self.num_experts, self.gating_dim)))
        self.routed_scaling_factor = config.routed_scaling_factor

        self.register_buffer("expert_bias", torch.zeros(self.num_experts))

    def group_limited_topk(
        self,
        scores: torch.Tensor,
    ):
        num_tokens, _ = scores.size()
        # experts in groups: a group's score is the sum of its top-2
        group_scores = scores.view(num_tokens, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)

        # mask the experts of the groups not chosen
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(num_tokens, self.n_group, self.num_experts // self.n_group)
            .reshape(num_tokens, -1)
        )

        masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
        probs, top_indices = torch.topk(masked_scores, k=self.top_k, dim=-1)

        return probs, top_indices

    def forward(self, hidden_states):
        # gating scores
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))

        scores = torch.sigmoid(logits.float()).type_as(logits)

        scores_for_routing = scores + self.expert_bias
        _, topk_idx = self.group_limited_topk(scores_for_routing)

        scores = torch.gather(scores, dim=1, index=topk_idx).type_as(logits)

        topk_weight = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if self.top_k > 1 else scores
        topk_weight = topk_weight * self.routed_scaling_factor

        return topk_idx, topk_weight, logits


class BailingMoeV2SparseMoeBlock(nn.Module):
    """Routed experts plus a shared expert."""

    def __init__(self, config: BailingMoeV2Config):
        super().__init__()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self._setup_experts()
        self.gate = BailingMoeV2Gate(config)
        if config.num_shared_experts is not None:
            self.shared_experts = BailingMoeV2MLP(
                config=config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts
            )

    def _setup_experts(self):
        self.experts = nn.ModuleList(
            [
                BailingMoeV2MLP(config=self.config, intermediate_size=self.config.moe_intermediate_size)
                for _ in range(self.config.num_experts)
            ]
        )

    def forward(self, hidden_states):
        identity = hidden_states
        bsz, seq_len, h = hidden_states.shape
        topk_idx, topk_weight, router_logits = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        flat_topk_idx = topk_idx.view(-1)
        if self.training:
            hidden_states = hidden_states.repeat_interleave(self.num_experts_per_tok, dim=0)
            y = torch.empty_like(hidden_states)
            for i, expert in enumerate(self.experts):
                y[flat_topk_idx == i] = expert(hidden_states[flat_topk_idx == i])
            y = (y.view(*topk_weight.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)
            y = y.to(hidden_states.dtype).view(bsz, seq_len, h)
        else:
            y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(bsz, seq_len, h)
        if self.config.num_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y, (router_logits.view(bsz, seq_len, -1), topk_idx.view(bsz, seq_len, -1))

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i]
            tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
            expert_out = expert(tokens_for_this_expert)
            outputs.append(expert_out.to(x.device))
            start_idx = end_idx

        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        final_out = (
            new_x.view(*topk_ids.shape, -1)
            .type(topk_weight.dtype)
            .mul_(topk_weight.unsqueeze(dim=-1))
            .sum(dim=1)
            .type(new_x.dtype)
        )
        return final_out


class BailingMoeV2DecoderMLP(nn.Module):
    """The MLP of `BailingMoeV2DecoderLayer`: chosen by `layer_idx` in `__init__`, its output unpacked in `forward`
    as the decoder layer does (the shell supplies the post-attention norm and adds the residual)."""

    def __init__(self, config: BailingMoeV2Config, layer_idx: int):
        super().__init__()
        self.mlp = (
            BailingMoeV2SparseMoeBlock(config)
            if (config.num_experts is not None and layer_idx >= config.first_k_dense_replace)
            else BailingMoeV2MLP(config=config, intermediate_size=config.intermediate_size)
        )

    def forward(self, hidden_states):
        hidden_states = self.mlp(hidden_states)
        if isinstance(hidden_states, tuple):
            hidden_states, router_logits = hidden_states
        else:
            router_logits = None  # noqa: F841 - the decoder layer keeps it for output_router_logits
        return hidden_states


class BailingMoeV2LayerSchedule:
    """`BailingMoeV2Model.__init__`'s layers, one call per layer in order (dense below `first_k_dense_replace`);
    each gate's `expert_bias` is set as a trained checkpoint would set it (a fixed ramp here)."""

    def __init__(self, config: BailingMoeV2Config):
        self.config = config
        self.layer_idx = 0

    def __call__(self) -> BailingMoeV2DecoderMLP:
        layer = BailingMoeV2DecoderMLP(self.config, self.layer_idx)
        self.layer_idx += 1
        if isinstance(layer.mlp, BailingMoeV2SparseMoeBlock):
            with torch.no_grad():
                layer.mlp.gate.expert_bias.copy_(torch.linspace(-0.1, 0.1, self.config.num_experts))
        return layer


def build():
    return tiny(BailingMoeV2LayerSchedule(BailingMoeV2Config()), HIDDEN, layers=LAYERS)
