"""transformers 4.x GPT-OSS MoE block, shared by `gpt_oss4_hit_loop` and `gpt_oss4_dense_bmm`.

Mirrors transformers 4.57.6 and 4.55.4 (release wheels) `src/transformers/models/gpt_oss/modeling_gpt_oss.py`:
`GptOssTopKRouter` (biased linear gate, top-k on the logits, softmax over the k values, scattered into a
[T, E] table of router scores) and the two inference paths of `GptOssExperts.forward` over stacked
weights `gate_up_proj [E, H, 2I]` (gate in the even, up in the odd columns), `gate_up_proj_bias [E, 2I]`,
`down_proj [E, I, H]`, `down_proj_bias [E, H]`, with GPT-OSS's clamped swiglu (alpha 1.702, limit 7):
- 4.57 on CPU: a loop over the experts that were hit, over a one-hot mask with one extra class
  (`num_classes=E + 1`), `expert_idx = expert_idx[0]`, `if expert_idx == num_experts: continue`, the
  weight read from the table (`routing_weights[token_idx, expert_idx, None]`), `index_add_`;
- 4.55 in eval mode (and 4.57 off CPU): every token through every expert with `repeat` + `bmm`, each
  expert's output scaled by its column of the table, summed over the experts.
Written as plain PyTorch: the same constructs, in this project's words.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ALPHA, LIMIT = 1.702, 7.0


class GptOss4Router(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.top_k = cfg["top_k"]
        self.weight = nn.Parameter(torch.empty(cfg["num_experts"], cfg["hidden"]))
        self.bias = nn.Parameter(torch.empty(cfg["num_experts"]))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight, self.bias)
        top_values, top_ids = torch.topk(logits, self.top_k, dim=-1)
        top_values = F.softmax(top_values, dim=1, dtype=top_values.dtype)
        scores = torch.zeros_like(logits).scatter_(1, top_ids, top_values)
        return scores, top_ids


class GptOss4Experts(nn.Module):
    """Stacked biased experts; `forward` is set by each catalog form to the path it mirrors."""

    def __init__(self, cfg: dict):
        super().__init__()
        experts, hidden, inter = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
        self.hidden_size = hidden
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.alpha, self.limit = ALPHA, LIMIT


class GptOss4Block(nn.Module):
    def __init__(self, cfg: dict, experts_class: type[GptOss4Experts]):
        super().__init__()
        self.router = GptOss4Router(cfg)
        self.experts = experts_class(cfg)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores, ids = self.router(flat)
        return self.experts(x, router_indices=ids, routing_weights=scores).view(x.shape)
