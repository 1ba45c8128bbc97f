"""transformers 5.x grouped-GEMM experts (`experts_implementation="grouped_mm"`, the v5 default).

Mirrors transformers 5.23.0 (release wheel) `src/transformers/integrations/moe.py`:
`grouped_mm_experts_forward` with `_grouped_linear` / `_grouped_mm` (no bias, not transposed, not
expert-parallel): `sort` the flat ids, gather `x[perm // k]`, offsets
`cumsum(histc(sorted ids, E, 0, E-1), int32)`, `grouped_mm(x, gate_up_proj.transpose(-2, -1), offs)` →
`act(gate) * up` (chunk halves) → `grouped_mm(., down_proj.transpose(-2, -1), offs)` → `* w[perm]` →
inverse permutation → `.view(T, k, H).sum(1).to(dtype)`; block shell from `_stacked_experts.py`.

Defaults to bfloat16 and refuses other dtypes: under torch.compile `aten._grouped_mm`'s fake kernel
accepts bfloat16 only (torch 2.13 `_meta_grouped_mm_common`), which is why `_can_use_grouped_mm` sends
other dtypes to the opaque `transformers::grouped_mm_fallback` op (the real-model tests cover that
path). On CPU the kernel also needs 16-byte aligned strides: hidden and intermediate must be
multiples of 8.

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

ALIGNMENT_BYTES = 16  # CPU grouped_mm kernel: every stride a multiple of 16 bytes


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`_grouped_mm` on its fast path: the public op where torch has it, else the private one."""
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x.to(weight.dtype), weight, offs=offs)
    return torch._grouped_mm(x.to(weight.dtype), weight, offs=offs)


def _tokens_per_expert(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """histc, not bincount (CUDA graphs); CPU/MPS histc needs float input, CUDA int."""
    on_cpu = sorted_ids.device.type in ("cpu", "mps")
    histc_input = sorted_ids.float() if on_cpu else sorted_ids.int()
    return torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)


def grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """[T, H] -> [T, H]: sort the (token, slot) pairs by expert, two grouped GEMMs, weight, unsort, sum."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    counts = _tokens_per_expert(expert_ids_g, self.num_experts)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    out = _grouped_mm(selected, self.gate_up_proj.transpose(-2, -1), offsets)
    out = self.apply_gate(out)
    out = _grouped_mm(out, self.down_proj.transpose(-2, -1), offsets)
    weighted = out * sample_weights_g.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    weighted = weighted[inverse]
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def _check_grouped_mm_can_compile(cfg: dict) -> None:
    """Refuse, with the reason, builds whose grouped_mm torch.compile cannot trace."""
    if cfg["dtype"] != torch.bfloat16:
        raise ValueError("hf_grouped_mm: torch._grouped_mm compiles for bfloat16 only")
    per_row = ALIGNMENT_BYTES // cfg["dtype"].itemsize
    for size in ("hidden", "intermediate"):
        if cfg[size] % per_row:
            raise ValueError(f"hf_grouped_mm: {size} must be a multiple of {per_row} (16-byte strides)")


def build(**overrides):
    """(TinyDecoder of grouped-GEMM SparseMoeBlocks, (x [1, T, H],)); bfloat16 by default."""
    cfg = settings({"dtype": torch.bfloat16, **overrides})
    _check_grouped_mm_can_compile(cfg)
    return finish(TinyDecoder(lambda c: SparseMoeBlock(c, grouped_mm_experts_forward), cfg), cfg)
