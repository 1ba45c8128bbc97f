"""Megatron-core's `SequentialMLP`: tokens permuted by expert, split by host-side counts, one MLP each.

Mirrors NVIDIA/Megatron-LM at commit d98e8a6, single rank (tensor and expert parallel size 1):
`megatron/core/transformer/moe/router.py` (`TopKRouter` with the default `topk_routing_with_score_function`:
top-k on the logits, softmax over the k in float32 cast back; dense `routing_probs` and `routing_map`
[T, E] by scatter), `token_dispatcher.py` (`MoEAllGatherTokenDispatcher`: counts `routing_map.sum(0)`
read on the host, `num_out_tokens` by `.item()`), `moe_utils.py` (`permute`: `routing_map.T` flattened,
stable descending argsort, `% T`, `index_select`; probs gathered from the flattened transposed table by
the same sorted cells; `unpermute`: `scatter_add_` into zeros), `experts.py` (`SequentialMLP.forward`: `tokens_per_expert.tolist()`, `torch.split` of rows
and probs, each expert's `MLP` with the prob applied after the gated activation and before fc2, `cat`),
with `gated_linear_unit=True`, no bias (`--disable-bias-linear`).

What dynamo does with it: in a plain `torch.compile`, `.item()` on the token count breaks the graph,
and `.tolist()` of the split sizes (in the experts module, on the counts the dispatcher hands it) would
break it again. Under `hpu_moe`, the adapter of methods that read per-expert counts as numbers (here:
hand them to a submodule) switches on dynamo's `capture_scalar_outputs` for the compile, so the layer
is one graph whose counts and token total are unbacked SymInts. The segments finder
reads it through the slot algebra (`moe_passes/passes/slots.py`): the stable descending sort of the
expert-major one-hot table, cut to its true cells, orders the rows by expert; `% T` is each row's token;
the dense weight table read at the same cells gives each row's weight; each expert's weight,
applied before its bias-free fc2, scales fc2's output the same; the segments are checked on probe
routings. One `fused_weights` call per layer (fc1's gate rows first are the kernel's w12).
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import ACTIVATIONS, Router, TinyDecoder, finish, settings
from ._expected import Expected

EXPECTED = Expected(fused=2, overload="fused_weights")
# Keeps its source's own forward: tests/test_mutations.py's per-family mutated forwards do not apply.
MUTATED = False
ADAPTER = "hit_expert_loops"


class TopKRouter(Router):
    """top-k on the logits, softmax over the k in float32, cast back to the logits' dtype."""

    def __init__(self, cfg: dict):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.empty(cfg["num_experts"], cfg["hidden"]))
        self.top_k = cfg["top_k"]

    def forward(self, x: torch.Tensor):
        logits = torch.mm(x, self.weight.t())
        scores, ids = torch.topk(logits, self.top_k, dim=1)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits), ids


class ExpertMLP(nn.Module):
    """Megatron's `MLP` with `gated_linear_unit=True`: fc1 [2I, H] (gate rows first), fc2 [H, I]."""

    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        h = self.act(gate) * up
        return self.linear_fc2((h * probs.unsqueeze(-1)).to(h.dtype))


class SequentialMLP(nn.Module):
    """Megatron's `SequentialMLP`: the counts arrive as a tensor and are read on the host here."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.local_experts = nn.ModuleList(
            ExpertMLP(cfg["hidden"], cfg["intermediate"], cfg["activation"]) for _ in range(cfg["num_experts"])
        )

    def forward(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        sizes = tokens_per_expert.tolist()
        rows, row_probs = torch.split(permuted, sizes), torch.split(permuted_probs, sizes)
        outputs = [expert(r, p) for expert, r, p in zip(self.local_experts, rows, row_probs, strict=True)]
        return torch.cat(outputs, dim=0)


class SequentialMoE(nn.Module):
    """Router, dispatcher (`permute` / `unpermute`) and experts, each as Megatron writes it."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.router = TopKRouter(cfg)
        self.mlp = SequentialMLP(cfg)

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.mlp.local_experts

    @property
    def experts(self) -> nn.ModuleList:
        return self.mlp.local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden = x.view(-1, shape[-1])
        probs, ids = self.router(hidden)
        logits_like = torch.zeros(hidden.shape[0], len(self.local_experts), dtype=probs.dtype)
        routing_probs = logits_like.scatter(1, ids, probs)
        routing_map = logits_like.int().scatter(1, ids, 1).bool()
        tokens_per_expert = routing_map.sum(dim=0).long().cpu()
        num_out_tokens = int(tokens_per_expert.sum().item())
        flat = routing_map.T.contiguous().reshape(-1)
        sorted_flat = flat.argsort(descending=True, stable=True)[:num_out_tokens]
        sorted_indices = sorted_flat % hidden.shape[0]
        permuted = hidden.index_select(0, sorted_indices)
        permuted_probs = routing_probs.T.contiguous().reshape(-1)[sorted_flat]
        expert_output = self.mlp(permuted, tokens_per_expert, permuted_probs)
        out = torch.zeros_like(hidden)
        index = sorted_indices.unsqueeze(1).expand(-1, hidden.shape[-1])
        return out.scatter_add_(0, index, expert_output).view(shape)


def build(**overrides):
    """(TinyDecoder of SequentialMoE layers, (x [1, T, H],)); Megatron's own routing."""
    cfg = settings(overrides, exclude=("routing", "router_fp32"))
    return finish(TinyDecoder(SequentialMoE, cfg), cfg)
