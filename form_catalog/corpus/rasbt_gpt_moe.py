"""LLMs-from-scratch's `MoEFeedForward`: top-k logits then softmax, a loop over `torch.unique` experts with
`.item()`, host-side `mask.any()` / `numel() == 0` skips, and an `argmax` slot lookup.

Mirrors Sebastian Raschka's "Build a Large Language Model From Scratch" bonus material, GitHub
rasbt/LLMs-from-scratch at commit 218221a (`ch04/07_moe/gpt_with_kv_moe.py`: `MoEFeedForward.__init__` /
`forward`, and the feed-forward half of `TransformerBlock.forward`), with the settings of the folder's README
(`--num_experts 32 --num_experts_per_tok 2`, argparse default top-k 2). The config is a plain dict (`cfg`), as
in the script. `MoEFeedForward.forward(x)` scores (batch, seq, emb) with the bias-free `gate` Linear,
`torch.topk(scores, k)` on the raw logits, then a softmax over the k chosen logits only. It flattens the tokens
[T, emb] and the ids / probs to [T, k], allocates `torch.zeros(T, emb)`, and loops `for expert_id_tensor in
torch.unique(topk_indices_flat)`: `expert_id = int(expert_id_tensor.item())` (a host read used to index the
ModuleLists), `mask = topk_indices_flat == expert_id`, `if not mask.any(): continue` (a host-side bool),
`token_mask = mask.any(dim=-1)`, `selected_idx = token_mask.nonzero(as_tuple=False).squeeze(-1)`,
`if selected_idx.numel() == 0: continue`, `index_select` of the tokens, the expert as three parallel
ModuleLists (`fc1` gate, `fc2` up, `fc3` down; `silu(fc1(x)) * fc2(x)`), the slot each token chose the expert in
by `mask[selected_idx].int().argmax(dim=-1, keepdim=True)`, `torch.gather` of that slot's probability from the
`index_select`-ed probs, and `out_flat.index_add_(0, selected_idx, expert_out * probs.unsqueeze(-1))`. It
reshapes back to (batch, seq, emb). `TransformerBlock.forward` applies `norm2`, calls `self.ff`, applies
`drop_shortcut` (Dropout, identity in eval) and adds the shortcut (the shell supplies the norm and the residual).
The block picks `MoEFeedForward(cfg) if cfg["num_experts"] > 0 else FeedForward(cfg)` (the dense GELU FFN, kept,
not taken). The script's config has `drop_rate` 0.0 and calls `model.eval()`.
Left out: attention and its KV cache, the custom `LayerNorm` (the shell's norm stands in), and the benchmarking
wrapped around `self.ff(x)` in `TransformerBlock.forward` (`torch.cuda.is_available()` memory stats and
`time.perf_counter()` timings appended to module-level lists): it measures the call rather than computing
anything, and its CUDA half is off on CPU.
Nothing of the MoE forward was left out.
Sizes: the README runs emb 4096, hidden 1024 per expert, 32 experts, top-2; here emb 16, hidden 8, 8 experts,
top-2.
Constructs: topk-then-softmax over the chosen logits, a loop over `torch.unique(...)` tensor elements with
`int(t.item())` host reads used as ModuleList indices, a host-side `if not mask.any(): continue`, `nonzero`
+ `squeeze`, `if numel() == 0: continue`, `index_select` gathers, experts as three parallel ModuleLists,
`bool.int().argmax` slot recovery, `torch.gather`, `index_add_`, a constructor-time MoE-or-dense choice and a
Dropout on the output in the block half.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._shell import Source, tiny

SOURCE = Source("rasbt/LLMs-from-scratch", "ch04/07_moe/gpt_with_kv_moe.py",
                "218221ab62f0f502ca0bbf1620fe1c53ee1aba03", "MoEFeedForward.forward")
HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 8, 2

CFG = {
    "emb_dim": HIDDEN,
    "hidden_dim": INTER,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "drop_rate": 0.0,
}


class GELU(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(
            torch.sqrt(torch.tensor(2.0 / torch.pi)) *
            (x + 0.044715 * torch.pow(x, 3))
        ))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(cfg["emb_dim"], cfg["hidden_dim"]),
            GELU(),
            nn.Linear(cfg["hidden_dim"], cfg["emb_dim"]),
        )

    def forward(self, x):
        return self.layers(x)


class MoEFeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_experts_per_tok = cfg["num_experts_per_tok"]
        self.num_experts = cfg["num_experts"]
        self.emb_dim = cfg["emb_dim"]

        self.gate = nn.Linear(cfg["emb_dim"], cfg["num_experts"], bias=False)
        self.fc1 = nn.ModuleList(
            [
                nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False)
                for _ in range(self.num_experts)
            ]
        )
        self.fc2 = nn.ModuleList(
            [
                nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], bias=False)
                for _ in range(self.num_experts)
            ]
        )
        self.fc3 = nn.ModuleList(
            [
                nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], bias=False)
                for _ in range(self.num_experts)
            ]
        )

    def forward(self, x):
        # x: (batch, seq_len, emb_dim)
        scores = self.gate(x)  # (b, seq_len, num_experts)
        topk_scores, topk_indices = torch.topk(scores, self.num_experts_per_tok, dim=-1)
        topk_probs = torch.softmax(topk_scores, dim=-1)

        batch, seq_len, _ = x.shape
        x_flat = x.reshape(batch * seq_len, -1)
        out_flat = torch.zeros(batch * seq_len, self.emb_dim, device=x.device, dtype=x.dtype)

        topk_indices_flat = topk_indices.reshape(-1, self.num_experts_per_tok)
        topk_probs_flat = topk_probs.reshape(-1, self.num_experts_per_tok)

        unique_experts = torch.unique(topk_indices_flat)

        for expert_id_tensor in unique_experts:
            expert_id = int(expert_id_tensor.item())

            mask = topk_indices_flat == expert_id
            if not mask.any():
                continue

            token_mask = mask.any(dim=-1)
            selected_idx = token_mask.nonzero(as_tuple=False).squeeze(-1)
            if selected_idx.numel() == 0:
                continue

            expert_input = x_flat.index_select(0, selected_idx)
            hidden = torch.nn.functional.silu(self.fc1[expert_id](expert_input)) * self.fc2[
                expert_id
            ](expert_input)
            expert_out = self.fc3[expert_id](hidden)

            mask_selected = mask[selected_idx]
            slot_indices = mask_selected.int().argmax(dim=-1, keepdim=True)
            selected_probs = torch.gather(
                topk_probs_flat.index_select(0, selected_idx), dim=-1, index=slot_indices
            ).squeeze(-1)

            out_flat.index_add_(0, selected_idx, expert_out * selected_probs.unsqueeze(-1))

        return out_flat.reshape(batch, seq_len, self.emb_dim)


class TransformerBlockFF(nn.Module):
    """The feed-forward half of `TransformerBlock.forward` after `norm2`: the MoE, then `drop_shortcut` (the
    shell adds the shortcut)."""

    def __init__(self, cfg):
        super().__init__()
        self.ff = MoEFeedForward(cfg) if cfg["num_experts"] > 0 else FeedForward(cfg)
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        x = self.ff(x)
        x = self.drop_shortcut(x)
        return x


def build():
    return tiny(lambda: TransformerBlockFF(CFG), HIDDEN)
