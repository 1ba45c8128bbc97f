"""transformers 5.17 batched-GEMM experts, which clamp the expert ids before gathering weights.

Mirrors transformers 5.17.0 (release wheel) `src/transformers/integrations/moe.py`:
`batched_mm_experts_forward` as `hf_batched_mm.py` (`repeat_interleave` the tokens, gather `W[ids]`, two
`bmm`s, weight, sum over k), except that the flat ids are first `clamp(0, num_experts - 1)`-ed, so that
expert-parallel sentinels index a real expert. With a router over exactly E experts the clamp changes
nothing.

The rewrite must turn each layer into ONE `fused_weights` call, as for `hf_batched_mm`; it may look
through the clamp only where the routing proves the ids lie in [0, E-1] (top-k over E router columns).
"""

from __future__ import annotations

from ._common import TinyDecoder, finish, settings
from ._expected import Expected
from ._stacked_experts import SparseMoeBlock
from .hf_batched_mm import batched_linear

EXPECTED = Expected(fused=2, overload="fused_weights")


def batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """[T, H] -> [T, H]: one matrix-vector product per (token, slot), ids clamped to the experts held."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    selected = hidden_states.repeat_interleave(num_top_k, dim=0)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1).clamp(0, self.num_experts - 1)
    out = batched_linear(selected, self.gate_up_proj[expert_ids], None, self.is_transposed)
    out = self.apply_gate(out)
    out = batched_linear(out, self.down_proj[expert_ids], None, self.is_transposed)
    weighted = out * sample_weights.unsqueeze(-1)
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def build(**overrides):
    """(TinyDecoder of transformers-5.17 batched-GEMM blocks, (x [1, T, H],)); every DEFAULTS key applies."""
    cfg = settings(overrides)
    return finish(TinyDecoder(lambda c: SparseMoeBlock(c, batched_mm_experts_forward), cfg), cfg)
