"""Where the fused call goes: the Gaudi kernel when the bridge registered it, else the portable twin.

Both expose `mixture_of_experts` with the overloads `default`, `fused_weights` and
`bias_fused_weights` and the same schemas; the portable op adds `stacked` and `stacked_fused_weights`,
which take stacked weights instead of per-expert lists (weight_stacks.stacked_overload). Newer bridges add keyword-only arguments, so the call is
built from the installed overload's schema rather than from a hard-coded argument list.
"""

from __future__ import annotations

import torch

TARGETS = ("auto", "hpu", "portable")


def hpu_op_available() -> bool:
    """True when the Gaudi bridge (or a test double of it) registered `hpu::mixture_of_experts`."""
    try:
        return hasattr(torch.ops.hpu, "mixture_of_experts")
    except (AttributeError, RuntimeError):
        return False


def resolve_target(target: str) -> str:
    """Turn the `target` option into "hpu" or "portable"; "hpu" without the bridge is an error."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if target == "auto":
        return "hpu" if hpu_op_available() else "portable"
    if target == "hpu" and not hpu_op_available():
        raise RuntimeError(
            "target='hpu' needs torch.ops.hpu.mixture_of_experts, which is registered by the Gaudi "
            "bridge (import habana_frameworks.torch); use target='auto' or 'portable' off Gaudi"
        )
    return target


def hpu_op_differentiable(overload: str = "default") -> bool:
    """Whether the bridge gave `hpu::mixture_of_experts.<overload>` autograd, so that AOTAutograd can
    differentiate a fused call. Newer bridges do, for `.default` and `.fused_weights`: a C++ Autograd
    kernel that runs their recompute (or saving) forward/backward pair, and, under torch.compile, a Python
    Autograd kernel (`py_impl`) that redirects the op to their compile-mode twin."""
    try:
        op = getattr(torch.ops.hpu.mixture_of_experts, overload)
    except (AttributeError, RuntimeError):
        return False
    if torch._C.DispatchKey.Autograd in getattr(op, "py_kernels", {}):
        return True
    name = "hpu::mixture_of_experts" + ("" if overload == "default" else f".{overload}")
    for key in ("AutogradHPU", "Autograd", "CompositeImplicitAutograd"):
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
                return True
        except RuntimeError:  # a dispatch key this torch does not know
            continue
    return False


def why_not_trainable(target: str, overload: str) -> str | None:
    """Why a layer lowered to `overload` is left as written in a graph that needs gradients, or None."""
    if target == "hpu" and not hpu_op_differentiable(overload):
        return (
            f"training: the Gaudi bridge registers no autograd for hpu::mixture_of_experts.{overload} (a bridge "
            "without the MoE training ops, or an overload they do not cover); the layer trains as written"
        )
    return None


def fused_overload(target: str, overload: str):
    """The OpOverload the rewrite emits for a resolved target."""
    if target == "hpu":
        packet = torch.ops.hpu.mixture_of_experts
    else:
        from . import fused_op  # noqa: F401  (registers the portable twin)

        packet = torch.ops.moe_passes.mixture_of_experts
    return getattr(packet, overload)


def call_arguments(op, values: dict) -> tuple[tuple, dict]:
    """Split `values` into positional and keyword arguments following `op`'s schema.

    Arguments the schema does not know are dropped only when they are optional extras the caller
    marked as such; a required argument the caller did not supply is an error.
    """
    args, kwargs = [], {}
    for argument in op._schema.arguments:
        if argument.name in values:
            if argument.kwarg_only:
                kwargs[argument.name] = values[argument.name]
            else:
                args.append(values[argument.name])
        elif not argument.has_default_value():
            raise RuntimeError(f"{op} needs argument {argument.name!r}, which the rewrite does not supply")
    return tuple(args), kwargs
