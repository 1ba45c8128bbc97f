"""SmallDoge's DogeCDMoE: product-key routing over single-neuron experts stored as two nn.Embedding tables.

Stands in for openPangu's `modeling_openpangu_moe.py` (its home is GitCode, not among the stored copies;
the stored GitHub ports are vLLM / vLLM-Ascend layers or an unfinished transformers draft) and for the
Step-3 text MoE remote code (a copy is stored, but with no repository or path to cite). Mirrors
huggingface/transformers `src/transformers/models/doge/modeling_doge.py` at commit d8590b4 ("Add Doge model
(#35891)", the SmallDoge models' cross-domain MoE as first merged), read from a snapshot of the
AutumnAurelium/transformers fork whose history holds that upstream commit (the transformers snapshot itself
is over the size limit), next to `configuration_doge.py` at the same commit. Read: `DogeCDMoE` (`__init__`,
`forward`) and how `DogeDecoderLayer` calls it (`self.mlp(hidden_states)` after the post-attention RMSNorm
when `config.is_moe`, then a learned per-channel residual scale).
The E experts are single neurons: expert e is row e of `down_embed` (read against the token) and row e of
`up_embed` (written back), both [E, H] `nn.Embedding`s. Routing is product-key: `router_gate` (a bias-free
Linear to 2 * K, K = floor(sqrt(E))) scores the [B, S, H] input, the [B, S, 2K] logits are `view`ed as
[2, T, K] (as written: a view of the contiguous [B, S, 2K] buffer, which for more than one token pairs rows
of different tokens rather than splitting each token's 2K logits in halves), and one `topk(K)` over the last
dim gives two (scores, indices) pairs, unpacked as `(scores_x, scores_y), (indices_x, indices_y)`. All K x K
sums of an x score and a y score are formed by broadcasting, with expert ids `ix * K + iy`, flattened to
[T, K*K]; `topk(top_k)` of the sums picks the experts, their ids are `gather`ed, and the routing weights are
a softmax over the picked sums (divided in place, `/=`, by their sum when `norm_topk_prob`, off by default).
The chosen embedding rows are looked up ([T, k, H] each); `matmul(down_rows, x[T, H, 1])` gives one
activation per expert, `act(.) * weights` scales it, and `matmul(weights[T, 1, k], up_rows)` sums the k
up-rows into [B, S, H]. A dense SwiGLU "shared expert" (`gate_proj`, `up_proj`, `down_proj` on the layer
itself, `intermediate_size` wide) runs on the input and the routed states are added; the layer returns
`(hidden_states, router_logits)`. act is `ACT2FN["silu"]`, here `nn.SiLU`.
Tiny sizes: 16 experts (K = 4 keys a side), top-4, intermediate 8; the config's defaults are 16384 experts,
top-64, hidden 1024, intermediate 2048, `norm_topk_prob` False, `mlp_bias` False.
Left out: the decoder's dropout and learned residual scales, and the `PretrainedConfig` base (a plain local
class carries the fields the layer reads). Nothing in the layer is distributed or a custom kernel.
Constructs: product-key top-k over a `view(2, T, -1)` of the router logits with tuple-unpacked
`(values, indices)` pairs, broadcast sums of key scores and `ix * K + iy` ids, a second top-k with a
`gather` of ids, softmax over the picked scores, an optional in-place `/=`, `nn.Embedding` lookups as expert
weights, two batched `matmul`s as the expert computation, a shared SwiGLU on the same module's own
Linears, a tuple return with the router logits, `math.floor(math.sqrt(E))` computed in `__init__`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "huggingface/transformers",
    "src/transformers/models/doge/modeling_doge.py",
    "d8590b4b0c84094277c1a7ffc2e8a9f3baa7f3a1",
    "DogeCDMoE.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 16, 4


class DogeConfig:
    """The MoE fields of DogeConfig the layer reads."""

    def __init__(
        self,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        hidden_act="silu",
        mlp_bias=False,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
    ):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.hidden_act, self.mlp_bias = hidden_act, mlp_bias
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob


class DogeCDMoE(nn.Module):
    """A dense SwiGLU plus product-key-routed single-neuron experts."""

    def __init__(self, config: DogeConfig | None = None):
        super().__init__()
        config = config or DogeConfig()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.act_fn = nn.SiLU()  # ACT2FN[config.hidden_act]

        self.num_experts = config.num_experts
        self.num_keys = math.floor(math.sqrt(self.num_experts))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

        # the shared expert lives on the layer itself
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=config.mlp_bias)

        # two key sets of num_keys each
        self.router_gate = nn.Linear(self.hidden_size, self.num_keys * 2, bias=False)

        # expert e: row e of each table
        self.down_embed = nn.Embedding(self.num_experts, self.hidden_size)
        self.up_embed = nn.Embedding(self.num_experts, self.hidden_size)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, seq_len, _ = hidden_states.shape

        router_logits = self.router_gate(hidden_states).view(2, bsz * seq_len, -1)

        # best keys on each side, then the best of their K x K pairwise sums
        (scores_x, scores_y), (indices_x, indices_y) = router_logits.topk(self.num_keys, dim=-1)
        all_scores = scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)
        all_indices = indices_x.unsqueeze(-1) * self.num_keys + indices_y.unsqueeze(-2)
        all_scores = all_scores.view(*all_scores.shape[:-2], -1)
        all_indices = all_indices.view(*all_indices.shape[:-2], -1)
        scores, position_indices = all_scores.topk(self.top_k, dim=-1)
        indices = all_indices.gather(-1, position_indices)
        routing_weights = F.softmax(scores, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)

        # routed single-neuron experts, then the shared SwiGLU
        down_embed = self.down_embed(indices)
        up_embed = self.up_embed(indices)
        experts_weights = torch.matmul(down_embed, hidden_states.view(bsz * seq_len, -1, 1)).view(
            bsz * seq_len, -1
        )
        experts_weights = self.act_fn(experts_weights) * routing_weights
        experts_states = torch.matmul(experts_weights.view(bsz * seq_len, 1, -1), up_embed).view(
            bsz, seq_len, -1
        )
        hidden_states = self.down_proj(
            self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states)
        )
        hidden_states = hidden_states + experts_states
        return hidden_states, router_logits


def build():
    return tiny(DogeCDMoE, HIDDEN)
