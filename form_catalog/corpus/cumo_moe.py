"""CuMo's co-upcycled MoE projector `MLPMoE`: float32 softmax top-2 renormalised, then a Python loop over the batch
and the experts that adds into a view of the output with `results[b][token_idx] +=`.

Mirrors SHI-Labs/CuMo `cumo/model/multimodal_projector/builder.py` at commit d1afd4a (`MLPMoE.__init__` /
`forward`, and `build_vision_projector`'s `smoe_mlp` branch), the sparse MLP projector between CuMo's CLIP
vision tower and its LLM (the scripts pass `--mm_projector_type smoe_mlp --num_experts 4 --num_selected 2`).
The same routing and the same batch/expert loop also sit in the MoE half of `CLIPEncoderMoELayer.forward`
(`cumo/model/multimodal_encoder/clip_smoe.py`, same commit, with CLIP MLP experts fc1 / quick_gelu / fc2);
CuMo's language-model MoE (`smoe_mixtral_helper.py`) is HF Mixtral's block plus the same two losses, so the
projector is the entry.
`MLPMoE.forward(x_img)` scores [B, N, C] tokens with a bias-free `gate` Linear, computes a router z-loss
(`logsumexp` over experts, squared, mean), a softmax in float32 cast back to the input dtype, the
importance proxy (mean over tokens of the probabilities, einops `reduce('... n e -> ... e', 'mean')`),
`torch.topk(gate_softmax, num_selected)`, a top-1 one-hot density (`one_hot(rearrange(selected,
'... k -> k ...'), E).float()[0]`, token mean) and a balance loss `(proxy * density).mean() * E**2`, then
renormalises the top-k weights by their sum (cast to the input dtype). The output is
`torch.zeros((B, N, channels)).to(device, dtype)`, filled by `for b in range(x_img.shape[0])` and
`for i, expert in enumerate(self.experts)`: `token_idx, nth_expert = torch.where(selected_experts[b] == i)`,
and `results[b][token_idx] += weights[b][token_idx, nth_expert, None] * expert(x_img[b][token_idx])`
(a getitem / iadd / setitem through the `results[b]` view; no empty-expert skip, so an unchosen expert runs on
zero rows). Each expert is `nn.Sequential(Linear(mm_channels, channels), nn.GELU(), Linear(channels,
channels))` with biases. It returns `(results, balance_loss, router_z_loss)`; the shell keeps `results`.
einops `rearrange` / `reduce` are written as `movedim(-1, 0)` / `mean(dim=-2)`.
Left out: the `config` property, `IdentityMap` and the other projector types, the unused `num_layers` /
`dropout` arguments (kept in the signature, unused as upstream), the caller's loss weighting
(`balance_loss_coef`, `router_z_loss_coef`). Nothing of the MoE forward was left out. Upstream the projector
maps mm_channels (CLIP 1024 x 2 scales) to the LLM width (4096) with no residual; here mm_channels == channels
so the shell can add its residual.
Sizes: CuMo-Mistral-7B uses 4 experts, top-2, 2048 -> 4096; here 16 -> 16, 4 experts, top-2, batch 2 (so the
batch loop runs twice), 7 tokens.
Constructs: router z-loss and balance-loss side computations returned as extra outputs, float32 softmax cast
back, `topk` without `dim`, `one_hot(...).float()[0]`, renormalisation by a divide, nested Python loops over
`range(batch)` and `enumerate(ModuleList)`, `torch.where(selected[b] == i)` with two outputs, advanced-index
gathers `x[b][idx]` and `weights[b][idx, nth, None]`, in-place `+=` through an index on a select view,
experts run on possibly empty row sets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._shell import Source, tiny

SOURCE = Source("SHI-Labs/CuMo", "cumo/model/multimodal_projector/builder.py",
                "d1afd4ae71f56b826e82ae0c217a0743716f8da6", "MLPMoE.forward")
MM_CHANNELS, CHANNELS, EXPERTS, TOP_K, BATCH = 16, 16, 4, 2, 2


class MLPMoE(nn.Module):
    def __init__(self, num_experts, num_selected, mm_channels, channels, num_layers, dropout=False):
        super().__init__()
        self.num_experts = num_experts
        self.num_selected = num_selected
        self.mm_channels = mm_channels
        self.channels = channels

        self.gate = nn.Linear(mm_channels, num_experts, bias=False)
        self.num_selected = num_selected
        self.num_experts = num_experts
        self.experts = nn.ModuleList([
            nn.Sequential(nn.Linear(mm_channels, channels), nn.GELU(), nn.Linear(channels, channels))
            for _ in range(num_experts)
        ])

    def forward(self, x_img):
        gate_logits = self.gate(x_img)

        router_z_loss = torch.logsumexp(gate_logits, dim=-1)
        router_z_loss = torch.square(router_z_loss)
        router_z_loss = router_z_loss.mean()

        gate_softmax = F.softmax(gate_logits, dim=-1, dtype=torch.float).to(x_img.dtype)

        density_1_proxy = gate_softmax.mean(dim=-2)  # reduce(gate_softmax, '... n e -> ... e', 'mean')

        weights, selected_experts = torch.topk(gate_softmax, self.num_selected)

        # one_hot(rearrange(selected_experts, '... k -> k ...'), E).float()[0]
        one_hot_gate_indices = F.one_hot(selected_experts.movedim(-1, 0), self.num_experts).float()[0]
        density_1 = one_hot_gate_indices.mean(dim=-2)  # reduce(..., '... n e -> ... e', 'mean')
        balance_loss = (density_1_proxy * density_1).mean() * float(self.num_experts ** 2)

        weights = weights / torch.sum(weights, dim=-1, keepdim=True).to(x_img.dtype)

        results = torch.zeros((x_img.shape[0], x_img.shape[1], self.channels)).to(x_img.device, x_img.dtype)

        for b in range(x_img.shape[0]):
            for i, expert in enumerate(self.experts):
                token_idx, nth_expert = torch.where(selected_experts[b] == i)
                results[b][token_idx] += weights[b][token_idx, nth_expert, None] * expert(x_img[b][token_idx])
        return results, balance_loss, router_z_loss


def build():
    return tiny(lambda: MLPMoE(num_experts=EXPERTS, num_selected=TOP_K, mm_channels=MM_CHANNELS, channels=CHANNELS,
                               num_layers=2, dropout=False), MM_CHANNELS, batch=BATCH)
