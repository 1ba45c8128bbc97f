"""Numerical verification of a rewrite: the captured graph and the rewritten one on the same inputs.

Parameters and buffers keep their real values (the experts must be the real experts); other
floating-point inputs are replaced by random values of the same shape, and every input that is not a
parameter is cloned so that a graph that updates its inputs in place cannot change the user's state.
"""

from __future__ import annotations

import torch

from .fx_utils import const_int

# Absolute and relative tolerance per output dtype: the fused kernel rounds router weights to the
# hidden dtype and sums experts in another order, so low-precision outputs differ in the last bits.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-8, 1e-8),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}


def _verification_inputs(example_inputs, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for value in example_inputs:
        if isinstance(value, torch.nn.Parameter) or not isinstance(value, torch.Tensor):
            inputs.append(value)
        elif value.is_floating_point() and not value.requires_grad and value.dim() >= 2:
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
            inputs.append(noise.to(device=value.device, dtype=value.dtype))
        else:
            inputs.append(value.clone())
    return inputs


def _flat_outputs(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def max_error(before, after) -> tuple[float, bool]:
    """(largest absolute difference, whether every output is within its dtype's tolerance)."""
    worst, ok = 0.0, True
    for a, b in zip(_flat_outputs(before), _flat_outputs(after), strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf"), False
        if not a.is_floating_point():
            ok = ok and torch.equal(a, b)
            continue
        atol, rtol = TOLERANCE.get(a.dtype, (1e-4, 1e-4))
        diff = (a.float() - b.float()).abs()
        if diff.numel():
            worst = max(worst, float(diff.max()))
        ok = ok and bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol, equal_nan=True))
    return worst, ok


def compare_rewrite(captured, rewritten, example_inputs) -> tuple[float, bool]:
    """(largest absolute output difference, within tolerance) of both graphs on the example inputs."""
    # Sizes are read through their hints: int() on a SymInt would specialise the compile.
    example_inputs = [const_int(v) if isinstance(v, torch.SymInt) else v for v in example_inputs]
    with torch.no_grad():
        # Each graph gets its own copies of the non-parameter inputs, drawn from the same seed.
        expected = captured(*_verification_inputs(example_inputs))
        actual = rewritten(*_verification_inputs(example_inputs))
    return max_error(expected, actual)
