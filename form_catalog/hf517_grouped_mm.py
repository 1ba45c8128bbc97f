"""transformers 5.17 grouped-GEMM experts, with the expert-parallel sentinel masks of that release.

Mirrors transformers 5.17.0 (release wheel) `src/transformers/integrations/moe.py`:
`grouped_mm_experts_forward` as `hf_grouped_mm.py` (sort, gather `x[perm // k]`, `histc` offsets, two
grouped GEMMs, weight, unsort, sum over k), plus the sentinel handling that release added for expert
parallelism: `sentinel_mask = (sorted_ids >= num_experts).unsqueeze(-1)`, `sorted_ids.clamp_(max=E-1)`,
`selected.masked_fill_(sentinel_mask, 0)` before the first GEMM and `masked_fill(sentinel_mask, 0)` after
each GEMM. With a router over exactly E experts no id reaches E, so every mask is all false.

The rewrite must turn each layer into ONE `fused_weights` call, as for `hf_grouped_mm`; it may look
through the masks only where the routing proves the ids lie in [0, E-1] (top-k over E router columns).
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock
from .hf_grouped_mm import _check_grouped_mm_can_compile, _grouped_mm, _tokens_per_expert

EXPECTED = Expected(fused=2, overload="fused_weights")


def grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """[T, H] -> [T, H]: grouped GEMMs over sorted (token, slot) pairs, sentinel rows zeroed."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    counts = _tokens_per_expert(expert_ids_g, self.num_experts)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    sentinel_mask = (expert_ids_g >= self.num_experts).unsqueeze(-1)
    expert_ids_g.clamp_(max=self.num_experts - 1)
    selected.masked_fill_(sentinel_mask, 0.0)
    out = _grouped_mm(selected, self.gate_up_proj.transpose(-2, -1), offsets)
    out = out.masked_fill(sentinel_mask, 0.0)
    out = self.apply_gate(out)
    out = _grouped_mm(out, self.down_proj.transpose(-2, -1), offsets)
    out = out.masked_fill(sentinel_mask, 0.0)
    weighted = out * sample_weights_g.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted = weighted[inverse]
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def build(**overrides):
    """(TinyDecoder of transformers-5.17 grouped-GEMM blocks, (x [1, T, H],)); bfloat16 by default."""
    cfg = settings({"dtype": torch.bfloat16, **overrides})
    _check_grouped_mm_can_compile(cfg)
    return finish(TinyDecoder(lambda c: SparseMoeBlock(c, grouped_mm_experts_forward), cfg), cfg)
