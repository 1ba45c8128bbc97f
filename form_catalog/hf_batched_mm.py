"""transformers 5.x batched-GEMM experts (`experts_implementation="batched_mm"`; used for decode on GPU).

Mirrors transformers 5.23.0 (release wheel) `src/transformers/integrations/moe.py`:
`batched_mm_experts_forward` with `_batched_linear` (not expert-parallel; this form's build has no bias
and is not transposed, the GPT-OSS and transposed forms reuse the forward with those flags):
`x.repeat_interleave(k, 0)`, per-slot weight copies `gate_up_proj[ids]`, `bmm(W, x[..., None])` →
`act(gate) * up` → `bmm(down_proj[ids], .)` → `* w[:, None]` → `.view(T, k, H).sum(1).to(dtype)`;
block shell from `_stacked_experts.py`.

The rewrite must turn each layer into ONE `fused_weights` call; it also removes the [T*k, 2I, H]
gathered weight copies this form makes.
"""

from __future__ import annotations

import torch

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock

EXPECTED = Expected(fused=2, overload="fused_weights")


def batched_linear(x, weight, bias=None, is_transposed: bool = False) -> torch.Tensor:
    """`_batched_linear`: [S, in] rows against [S, out, in] (or transposed [S, in, out]) weight copies."""
    if is_transposed:
        out = torch.bmm(x.unsqueeze(1), weight).squeeze(1)
    else:
        out = torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)
    if bias is not None:
        out.add_(bias)
    return out


def batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """[T, H] -> [T, H]: one matrix-vector product per (token, slot) against a gathered weight copy."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    selected = hidden_states.repeat_interleave(num_top_k, dim=0)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    gate_up_bias = self.gate_up_proj_bias[expert_ids] if self.has_bias else None
    out = batched_linear(selected, self.gate_up_proj[expert_ids], gate_up_bias, self.is_transposed)
    out = self.apply_gate(out)
    down_bias = self.down_proj_bias[expert_ids] if self.has_bias else None
    out = batched_linear(out, self.down_proj[expert_ids], down_bias, self.is_transposed)
    weighted = out * sample_weights.unsqueeze(-1)
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def build(**overrides):
    """(TinyDecoder of batched-GEMM SparseMoeBlocks, (x [1, T, H],)); every `_common.DEFAULTS` key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(lambda c: SparseMoeBlock(c, batched_mm_experts_forward), cfg), cfg)
