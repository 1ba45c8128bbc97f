"""mixtral-offloading's SparseMoeWrapper: Mixtral top-2 routing over the unique active experts, fetched by uid.

Mirrors dvmazur/mixtral-offloading `src/custom_layers.py` at commit ce54518 (`SparseMoeWrapper`,
`MixtralBLockSparseTop2MLP_HQQ`), with the iteration protocol of `ExpertCache.load_experts` in
`src/expert_cache.py` from the same commit. The wrapper holds the layer's gate (a bias-free nn.Linear), its
`layer_id` and a shared expert cache in place of an experts list. Forward flattens [B, S, H] to tokens,
computes the router logits, a float32 softmax, the top-k, renormalises the top-k weights in place (`/=`, no
epsilon) and casts them back to the input dtype, allocates a zero output, and builds a [E, k, T] one-hot
mask. The ids of the experts used by any token are read to the host
(`selected_experts.flatten().unique().tolist()`, ascending), and the loop runs over the generator
`self.experts.load_experts(*((layer_id, e) for e in active), unordered=True)`, which yields
`((layer, expert), module)` pairs; the loop target unpacks the nested tuple. For each yielded expert,
`torch.where(mask[e])` gives (slot, token) ids, `assert top_x.shape[0] > 0` checks the expert has tokens,
both id tensors become Python lists (`.tolist()`) that gather the tokens (`x[None, top_x_list]`, reshaped to
[-1, H]) and their weights (`w[top_x_list, idx_list, None]`), and the expert output times its weight is
cast to the input dtype and `index_add_`-ed into the output by the `top_x` tensor. The layer returns
(output reshaped to [B, S, H], router_logits). Experts are SwiGLU MLPs w2(act(w1 x) * w3 x) with
`ACT2FN["silu"]` (here `nn.SiLU`).
Left out: the offloading itself. `ExpertCache` (main/offloaded/pinned storages, LRU eviction groups,
non-blocking swaps through device buffers) is replaced by `ExpertStore`, an nn.Module holding the experts in
a ModuleList whose `load_experts` generator keeps the original's uniqueness assert and its `unordered`
reordering (`sorted` by a per-uid "offloaded" flag, resident first: every expert is resident here, so the
stable sort keeps the ascending order) and yields `((layer_id, expert_idx), expert)` for each uid in that
order; the cache's LRU bookkeeping, `active` flag and try/finally are not mirrored. `MixtralExpertWrapper`
(which flattens an expert's tensors into one UntypedStorage and calls it through a lambda) is dropped, so the
store returns the expert MLP itself. The HQQ-quantized `HQQLinearTritonSavable` projections with their
Triton matmuls become bias-free nn.Linear; the fp16 dtypes become float32. The transformers `MixtralConfig`
is a tiny local config class. One store per layer here (the original shares one cache across all layers,
keyed by layer id).
Constructs: a host read of the active expert ids (`unique().tolist()`), a `for` loop over a generator method
of another module called with a starred generator expression of (layer, expert) tuples, nested tuple
unpacking in the loop target, an `assert` on a data-dependent shape, `torch.where(mask[e])` with `.tolist()`
of token and slot ids used as Python-list indices, an in-place `/=` on the routing weights, `index_add_`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source(
    "dvmazur/mixtral-offloading",
    "src/custom_layers.py",
    "ce545188b804238f0b23a59fc45e6a8f8b390c40",
    "SparseMoeWrapper.forward",
)
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2


class MixtralConfig:
    def __init__(self, hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                 num_experts_per_tok=TOP_K, hidden_act="silu"):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_local_experts, self.num_experts_per_tok = num_local_experts, num_experts_per_tok
        self.hidden_act = hidden_act


class MixtralBLockSparseTop2MLP(nn.Module):
    def __init__(self, config: MixtralConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.act_fn = nn.SiLU()  # ACT2FN[config.hidden_act], hidden_act == "silu"

    def forward(self, hidden_states):
        h = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        h = self.w2(h)
        return h


class ExpertStore(nn.Module):
    """In-memory stand-in for ExpertCache: every expert resident, looked up by its (layer, expert) uid."""

    def __init__(self, config: MixtralConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.experts = nn.ModuleList(MixtralBLockSparseTop2MLP(config) for _ in range(config.num_local_experts))
        self.offloaded = {(layer_id, e): False for e in range(config.num_local_experts)}

    def load_experts(self, *uids, unordered: bool = False):
        assert len(set(uids)) == len(uids)
        if unordered:
            uids = sorted(uids, key=lambda uid: self.offloaded[uid])
        for uid in uids:
            _layer_id, expert_idx = uid
            yield (uid, self.experts[expert_idx])


class SparseMoeWrapper(nn.Module):
    def __init__(self, config: MixtralConfig, layer_id: int, gate: nn.Module, expert_cache: ExpertStore):
        super().__init__()
        self.hidden_dim = config.hidden_size
        self.ffn_dim = config.intermediate_size
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.layer_id = layer_id
        self.gate = gate
        self.experts = expert_cache

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)

        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)

        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)

        active_experts = selected_experts.flatten().unique().tolist()

        for (_layer_index, expert_idx), expert_layer in self.experts.load_experts(
            *((self.layer_id, expert_idx) for expert_idx in active_experts), unordered=True
        ):
            idx, top_x = torch.where(expert_mask[expert_idx])
            assert top_x.shape[0] > 0

            top_x_list = top_x.tolist()
            idx_list = idx.tolist()

            current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x_list, idx_list, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


def _layer(layer_id: int = 0) -> SparseMoeWrapper:
    config = MixtralConfig()
    gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
    return SparseMoeWrapper(config, layer_id, gate, ExpertStore(config, layer_id))


def build():
    return tiny(_layer, HIDDEN)
