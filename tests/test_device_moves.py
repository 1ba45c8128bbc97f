"""Experts moved to a device in the forward (offloading, st-moe): skipped under hpu_moe where they already
are, so that torch 2.9's dynamo, which cannot trace `nn.Module.to`, keeps the layer in one graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_passes.adapters import adapted_classes, device_moves, hit_expert_loops
from tests.helpers import assert_close_for_dtype, eager_output, run_hpu_moe


class SwiGLU(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class OffloadedMoE(nn.Module):
    """Experts outside `keep` wait on the CPU, the others are brought to the layer's device, every forward."""

    def __init__(self, hidden=16, inter=8, experts=4, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(experts))
        self.register_buffer("anchor", torch.zeros(()), persistent=False)

    def offload_besides(self, keep):
        for expert in self.experts[: len(self.experts)]:
            expert.to(self.anchor.device if expert in keep else "cpu")

    def forward(self, x):
        self.offload_besides(set(self.experts))
        weights, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            tokens, slots = torch.where(ids == e)
            out.index_add_(0, tokens, self.experts[e](x[tokens]) * weights[tokens, slots, None])
        return out


def test_an_offloading_layer_is_one_graph_and_fused():
    torch.manual_seed(0)
    model, x = OffloadedMoE(), torch.randn(7, 16)
    report, output, _ = run_hpu_moe(model, (x,))
    assert len(report.fused) == 1 and report.graph_break_count == 0, str(report)
    assert_close_for_dtype(output, eager_output(model, (x,)))
    assert adapted_classes()[f"{__name__}.OffloadedMoE"] == f"{hit_expert_loops.NAME} + {device_moves.NAME}"


def test_only_a_call_that_would_move_nothing_is_skipped(monkeypatch):
    calls = []
    module_to = nn.Module.to

    def recording_to(self, *args, **kwargs):
        calls.append(args)
        return module_to(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", recording_to)
    module = nn.Linear(2, 2)
    assert device_moves.moved(module, "cpu") is module
    assert device_moves.moved(module, device=torch.device("cpu")) is module
    assert calls == []
    device_moves.moved(module, "cpu", non_blocking=True)
    device_moves.moved(module, torch.float64)
    assert calls == [("cpu",), (torch.float64,)]
    assert module.weight.dtype == torch.float64  # the cast was made, as written
    meta = nn.Linear(2, 2).to("meta")
    calls.clear()
    device_moves.moved(meta, "meta")
    assert calls == []
    tensor = torch.ones(2)
    assert device_moves.moved(tensor, torch.float64).dtype == torch.float64  # not a module: as written


class KeepsTrack(nn.Linear):
    """A module of its own `to` (residency bookkeeping, a review's case)."""

    def __init__(self):
        super().__init__(2, 2)
        self.moves = 0

    def to(self, *args, **kwargs):
        self.moves += 1
        return super().to(*args, **kwargs)


def test_a_module_of_its_own_to_is_moved_as_written():
    module = KeepsTrack()
    device_moves.moved(module, "cpu")
    assert module.moves == 1


class Moves(nn.Module):
    """Moves the construct does not cover: none of its methods is adapted."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2, 2)])
        for block in self.blocks:
            block.to("cpu")  # __init__: never traced

    def unreached(self):
        for block in self.blocks:
            block.to("cpu")  # not called from forward

    def forward(self, x):
        self.blocks[0].to("cpu")  # one module, not a container's modules in turn
        for block in [self.blocks[0]]:
            block.to("cpu")  # not a container of the instance
        return self.blocks[0](x)


def test_only_container_moves_reached_from_forward_are_adapted():
    assert device_moves.adaptations_of(Moves) == {}
    assert list(device_moves.adaptations_of(OffloadedMoE)) == ["offload_besides"]
    assert device_moves.adaptations_of(OffloadedMoE, taken={"offload_besides"}) == {}
