"""Pieces every catalog form shares: override parsing, seeded weights, the router, the toy model shell."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = dict(
    dtype=torch.float32,
    num_experts=4,
    top_k=2,
    hidden=16,
    intermediate=8,
    tokens=6,
    layers=2,
    seed=0,
    routing="softmax_topk_renorm",
    router_fp32=True,
    activation="silu",
)
ROUTINGS = ("softmax_topk_renorm", "softmax_topk", "topk_softmax")
ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": lambda t: F.gelu(t, approximate="tanh"),  # the kernel's gelu
    "gelu_exact": F.gelu,
}


def settings(overrides: dict, exclude: tuple[str, ...] = ()) -> dict:
    """Defaults updated with `overrides`; unknown keys and bad values are errors, not silent no-ops.

    `exclude` names defaults a form cannot honour (e.g. `activation` where the source hard-codes SiLU):
    passing one is an error rather than an override that silently does nothing.
    """
    allowed = [key for key in DEFAULTS if key not in exclude]
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise TypeError(f"build() got unknown override(s) {unknown}; allowed: {sorted(allowed)}")
    out = {key: DEFAULTS[key] for key in allowed}
    out.update(overrides)
    for size in ("num_experts", "top_k", "hidden", "intermediate", "tokens", "layers"):
        if not isinstance(out[size], int) or out[size] < 1:
            raise ValueError(f"{size} must be a positive int, got {out[size]!r}")
    if not isinstance(out["dtype"], torch.dtype) or not out["dtype"].is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {out['dtype']!r}")
    if out.get("routing", ROUTINGS[0]) not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {out['routing']!r}")
    if out.get("activation", "silu") not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {out['activation']!r}")
    if not 1 <= out["top_k"] <= out["num_experts"]:
        raise ValueError("top_k must be between 1 and num_experts")
    return out


def init_weights(module: nn.Module, seed: int) -> None:
    """Deterministic weights scaled by 1/sqrt(fan-in), so activations stay O(1) at any size."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            fan_in = parameter.shape[-1] if parameter.dim() >= 2 else 1
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * fan_in**-0.5)


def route(logits: torch.Tensor, top_k: int, routing: str, router_fp32: bool, dtype: torch.dtype):
    """(weights [T, k] in `dtype`, ids [T, k]) for the three routing orders the catalog covers.

    softmax_topk_renorm: softmax -> top-k -> w / w.sum()   (Mixtral, Qwen3-MoE, vllm-hpu-extension)
    softmax_topk:        softmax -> top-k                  (Qwen2-MoE norm_topk_prob=False, OLMoE)
    topk_softmax:        top-k on logits -> softmax        (GPT-OSS, GraniteMoE)
    """
    if routing == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        weights = F.softmax(values.float() if router_fp32 else values, dim=-1)
        return weights.to(dtype), ids
    probs = F.softmax(logits, dim=-1, dtype=torch.float32) if router_fp32 else F.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if routing == "softmax_topk_renorm":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class Router(nn.Module):
    """A bias-free linear gate followed by `route`."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.gate = nn.Linear(cfg["hidden"], cfg["num_experts"], bias=False)
        self.top_k, self.routing, self.router_fp32 = cfg["top_k"], cfg["routing"], cfg["router_fp32"]

    def forward(self, x: torch.Tensor):
        return route(self.gate(x), self.top_k, self.routing, self.router_fp32, x.dtype)


class SourceRouter(Router):
    """The same bias-free gate, with the routing its source writes in the subclass's `forward` (the
    catalog's routing options do not apply)."""

    def __init__(self, cfg: dict):
        nn.Module.__init__(self)
        self.gate = nn.Linear(cfg["hidden"], cfg["num_experts"], bias=False)
        self.top_k = cfg["top_k"]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with nn.Linear projections (gate_proj / up_proj / down_proj names).

    `activation` is a name from ACTIVATIONS or the function itself (for activations the catalog lacks).
    """

    def __init__(self, hidden: int, intermediate: int, activation="silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACTIVATIONS[activation] if isinstance(activation, str) else activation

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TinyDecoder(nn.Module):
    """`layers` residual blocks x = x + moe(norm(x)): one MoE layer per block, as in a decoder stack."""

    def __init__(self, make_moe, cfg: dict):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(cfg["hidden"]) for _ in range(cfg["layers"]))
        self.moes = nn.ModuleList(make_moe(cfg) for _ in range(cfg["layers"]))

    def forward(self, x):
        for norm, moe in zip(self.norms, self.moes, strict=True):
            x = x + moe(norm(x))
        return x


def finish(model: nn.Module, cfg: dict):
    """Seed, cast, eval, and make example inputs [1, tokens, hidden]."""
    init_weights(model, cfg["seed"])
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
    model = model.to(cfg["dtype"]).eval()
    generator = torch.Generator().manual_seed(cfg["seed"] + 1)
    x = torch.randn(1, cfg["tokens"], cfg["hidden"], generator=generator).to(cfg["dtype"])
    return model, (x,)
