"""Gradients of the portable op: every overload against finite differences (float64 gradcheck), the
grouped and loop backward paths against autograd through the reference, and a compiled training step."""

from __future__ import annotations

import pytest
import torch

from moe_passes import fused_op, op_groups, reference

OP = fused_op.OP
T, H, INTER, E, K = 6, 8, 4, 4, 2


def _table(experts_seen: int, generator) -> torch.Tensor:
    """[T, K] distinct ids per token out of 0..experts_seen-1 (ids >= E fall outside the range)."""
    return torch.stack([torch.randperm(experts_seen, generator=generator)[:K] for _ in range(T)])


def _weights(count: int, shape, dtype, generator, scale=0.5) -> list[torch.Tensor]:
    return [(torch.randn(*shape, generator=generator) * scale).to(dtype).requires_grad_() for _ in range(count)]


def _shapes(permuted: bool, parts: int) -> tuple[tuple[int, int], tuple[int, int]]:
    gate_up = (parts * INTER, H) if permuted else (H, parts * INTER)
    down = (H, INTER) if permuted else (INTER, H)
    return gate_up, down


def _inputs(dtype, seed, experts_seen=E + 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    router = torch.rand(T, K, generator=g).to(dtype).requires_grad_()
    return g, x, _table(experts_seen, g), router


@pytest.mark.parametrize("permuted", [True, False])
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_default_overload_gradcheck(permuted, activation):
    g, x, table, router = _inputs(torch.float64, 1)
    gate_up, down = _shapes(permuted, 1)
    w1, w2, w3 = (_weights(E, s, torch.float64, g) for s in (gate_up, gate_up, down))

    def op(x, router, *w):
        return OP.default(x, table, router, list(w[:E]), list(w[E : 2 * E]), list(w[2 * E :]), permuted,
                          activation, 0, E - 1)

    assert torch.autograd.gradcheck(op, (x, router, *w1, *w2, *w3))


@pytest.mark.parametrize("permuted", [True, False])
def test_fused_weights_overload_gradcheck(permuted):
    g, x, table, router = _inputs(torch.float64, 2)
    gate_up, down = _shapes(permuted, 2)
    w12, w3 = _weights(E, gate_up, torch.float64, g), _weights(E, down, torch.float64, g)

    def op(x, router, *w):
        return OP.fused_weights(x, table, router, list(w[:E]), list(w[E:]), permuted, "silu", 0, E - 1)

    assert torch.autograd.gradcheck(op, (x, router, *w12, *w3))


@pytest.mark.parametrize("permuted", [True, False])
@pytest.mark.parametrize("experts", [(0, E - 1), (1, 2)], ids=["all", "expert-parallel-range"])
def test_stacked_overloads_gradcheck(permuted, experts):
    g, x, table, router = _inputs(torch.float64, 3)
    count = experts[1] - experts[0] + 1
    gate_up, down = _shapes(permuted, 1)
    w1, w2, w3 = (torch.stack(_weights(count, s, torch.float64, g)).detach().requires_grad_()
                  for s in (gate_up, gate_up, down))
    fused_gate_up = torch.cat([w1, w2], dim=1 if permuted else 2).detach().requires_grad_()

    def stacked(x, router, w1, w2, w3):
        return OP.stacked(x, table, router, w1, w2, w3, permuted, "gelu", *experts)

    def stacked_fused(x, router, w12, w3):
        return OP.stacked_fused_weights(x, table, router, w12, w3, permuted, "silu", *experts)

    assert torch.autograd.gradcheck(stacked, (x, router, w1, w2, w3))
    assert torch.autograd.gradcheck(stacked_fused, (x, router, fused_gate_up, w3))


@pytest.mark.parametrize("permuted", [True, False])
def test_bias_fused_weights_overload_gradcheck(permuted):
    g, x, table, router = _inputs(torch.float64, 4)
    gate_up, down = _shapes(permuted, 2)
    w12, w3 = _weights(E, gate_up, torch.float64, g), _weights(E, down, torch.float64, g)
    b12, b3 = _weights(E, (2 * INTER,), torch.float64, g), _weights(E, (H,), torch.float64, g)
    options = dict(permuted_weights=permuted, experts_min=0, experts_max=E - 1, alpha=1.702, limit=0.7)

    def op(x, router, *w):
        return OP.bias_fused_weights(x, table, router, *(list(w[i * E : (i + 1) * E]) for i in range(4)), **options)

    assert torch.autograd.gradcheck(op, (x, router, *w12, *w3, *b12, *b3))


def _autograd_of(fn, args, grad):
    return torch.autograd.grad(fn(*args), args, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_backward_paths_match_autograd_through_the_reference(monkeypatch, dtype, path):
    if path == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not available")
    monkeypatch.setattr(op_groups, "GROUPED_DEVICES", {"cpu"} if path == "grouped" else set())
    g, x, table, router = _inputs(dtype, 5)
    gate_up, down = _shapes(True, 2)
    w12 = torch.stack(_weights(E, gate_up, dtype, g)).detach().requires_grad_()
    w3 = torch.stack(_weights(E, down, dtype, g)).detach().requires_grad_()
    upstream = torch.randn(T, H, generator=g).to(dtype)

    def fused(x, router, w12, w3):
        return OP.stacked_fused_weights(x, table, router, w12, w3, True, "silu", 0, E - 1)

    def oracle(x, router, w12, w3):
        return reference.mixture_of_experts_fused_weights_reference(
            x, table, router, list(w12), list(w3), True, "silu", 0, E - 1
        )

    got = _autograd_of(fused, (x, router, w12, w3), upstream)
    want = _autograd_of(oracle, (x, router, w12, w3), upstream)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, a, b in zip(("hidden", "router", "w12", "w3"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_an_expert_without_rows_gets_zero_gradients(monkeypatch, path):
    if path == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not available")
    monkeypatch.setattr(op_groups, "GROUPED_DEVICES", {"cpu"} if path == "grouped" else set())
    g, x, _, router = _inputs(torch.float32, 6)
    table = torch.zeros(T, K, dtype=torch.long)
    table[:, 1] = 1  # experts 2 and 3 receive nothing
    gate_up, down = _shapes(True, 2)
    w12 = torch.stack(_weights(E, gate_up, torch.float32, g)).detach().requires_grad_()
    w3 = torch.stack(_weights(E, down, torch.float32, g)).detach().requires_grad_()
    OP.stacked_fused_weights(x, table, router, w12, w3, True, "silu", 0, E - 1).sum().backward()
    for grad in (w12.grad[2:], w3.grad[2:]):
        assert not grad.any()
    assert w12.grad[0].any() and w3.grad[1].any()


@pytest.mark.parametrize("listed", [False, True], ids=["stacked", "per-expert lists"])
def test_a_compiled_training_step_matches_eager(listed):
    """AOTAutograd and inductor take the autograd formula and the backward op (fake kernels included)."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(7)
            self.router = torch.nn.Linear(H, E, bias=False)
            self.w12 = torch.nn.Parameter(torch.randn(E, 2 * INTER, H, generator=g) / 4)
            self.w3 = torch.nn.Parameter(torch.randn(E, H, INTER, generator=g) / 4)

        def forward(self, x):
            weights, ids = self.router(x).softmax(-1).topk(K, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            if listed:
                return OP.fused_weights(x, ids, weights, list(self.w12.unbind(0)), list(self.w3.unbind(0)), True,
                                        "silu", 0, E - 1)
            return OP.stacked_fused_weights(x, ids, weights, self.w12, self.w3, True, "silu", 0, E - 1)

    torch.manual_seed(0)
    layer, x = Layer(), torch.randn(T, H)
    layer(x).square().sum().backward()
    eager = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    torch.compile(layer, backend="inductor", fullgraph=True)(x).square().sum().backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], atol=1e-5, rtol=1e-5, msg=name)
