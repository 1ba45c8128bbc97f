"""transformers 5.x grouped-GEMM experts (`experts_implementation="grouped_mm"`, the v5 default).

Mirrors `grouped_mm_experts_forward` in transformers 5.23 `src/transformers/integrations/moe.py`:
`sort` the flat ids, gather `x[perm // k]`, offsets `cumsum(histc(sorted ids, E, 0, E-1), int32)`,
`grouped_mm(x, gate_up_proj.transpose(-2, -1), offs)` → `act(gate) * up` (chunk halves) →
`grouped_mm(., down_proj.transpose(-2, -1), offs)` → `* w[perm]` → inverse permutation →
`.view(T, k, H).sum(1).to(dtype)`; block shell from `_stacked_experts.py`.

`torch._grouped_mm` compiles for bfloat16 only (its fake kernel rejects other dtypes; transformers
switches to its own `transformers::grouped_mm_fallback` op then, which the real-model tests cover), so
this form defaults to bfloat16 and refuses other dtypes.

The rewrite must turn each layer into ONE `fused_weights` call with w12 = gate_up_proj[e] and
w3 = down_proj[e] (both already [out, in], so permuted_weights=True).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock

EXPECTED = Expected(fused=2, overload="fused_weights")


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x.to(weight.dtype), weight, offs=offs)
    return torch._grouped_mm(x.to(weight.dtype), weight, offs=offs)


def grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    counts = torch.histc(expert_ids_g.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    out = _grouped_mm(selected, self.gate_up_proj.transpose(-2, -1), offsets)
    out = self.apply_gate(out)
    out = _grouped_mm(out, self.down_proj.transpose(-2, -1), offsets)
    weighted = out * sample_weights_g.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted = weighted[inverse]
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def build(**overrides):
    cfg = settings({"dtype": torch.bfloat16, **overrides})
    if cfg["dtype"] != torch.bfloat16:
        raise ValueError("hf_grouped_mm: torch._grouped_mm compiles for bfloat16 only")
    return finish(TinyDecoder(lambda c: SparseMoeBlock(c, grouped_mm_experts_forward), cfg), cfg)
