"""A test double of the Gaudi bridge's `hpu::mixture_of_experts`, for machines without Gaudi.

It registers the op under the real `hpu` namespace with the bridge's v1.19 schemas for `.default` and
`.fused_weights` and the GPT-OSS `.bias_fused_weights` schema, computes the bridge's reference
semantics (moe_passes/reference.py) on CPU, and records every real call in `CALLS`, so tests can check
which overload the Gaudi lowering emitted, with which roles, dtypes, layouts and expert range. It
belongs to the tests, never to the package.
"""

from __future__ import annotations

import torch

from moe_passes import reference

# The bridge's schemas (v1.19 eager_custom_op_register.cpp; bias_fused_weights as the op contract quotes it).
BRIDGE_SCHEMAS = {
    "default": "mixture_of_experts(Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights, "
    "Tensor[] w1, Tensor[] w2, Tensor[] w3, bool permuted_weights, str activation, int experts_min, "
    "int experts_max) -> Tensor",
    "fused_weights": "mixture_of_experts.fused_weights(Tensor hidden_states, Tensor expert_routing_table, "
    "Tensor router_weights, Tensor[] w12, Tensor[] w3, bool permuted_weights, str activation, "
    "int experts_min, int experts_max) -> Tensor",
    "bias_fused_weights": "mixture_of_experts.bias_fused_weights(Tensor hidden_states, "
    "Tensor expert_routing_table, Tensor router_weights, Tensor[] w12, Tensor[] w3, Tensor[] w12_bias, "
    "Tensor[] w3_bias, *, bool permuted_weights, int experts_min, int experts_max, int chunk_size=0, "
    "int total_experts=0, float alpha=1.702, float limit=7.0) -> Tensor",
}

# The newest bridge's keyword-only extras on `.default` and `.fused_weights` (../shared/research/hpu_fp8.md):
# vllm-gaudi passes total_experts = the global expert count under expert parallelism.
NEWEST_EXTRAS = ", *, bool? recomp=True, int chunk_size=0, int total_experts=0) -> Tensor"
NEWEST_SCHEMAS = {
    **BRIDGE_SCHEMAS,
    "default": BRIDGE_SCHEMAS["default"].replace(") -> Tensor", NEWEST_EXTRAS),
    "fused_weights": BRIDGE_SCHEMAS["fused_weights"].replace(") -> Tensor", NEWEST_EXTRAS),
}

# One dict per real (not fake) call, in call order.
CALLS: list[dict] = []

_LIBRARY: torch.library.Library | None = None


def _record(overload, hidden_states, table, router_weights, lists, permuted, activation, lo, hi, **extra):
    CALLS.append(
        {
            "overload": overload,
            "hidden_dtype": str(hidden_states.dtype),
            "hidden_shape": list(hidden_states.shape),
            "routing_dtype": str(table.dtype),
            "router_weights_dtype": str(router_weights.dtype),
            "num_weights": len(lists[0]),
            "weight_shapes": [list(weights[0].shape) if len(weights) else None for weights in lists],
            "permuted_weights": bool(permuted),
            "activation": activation,
            "experts_min": int(lo),
            "experts_max": int(hi),
            **extra,
        }
    )


def _default(hidden_states, table, router_weights, w1, w2, w3, permuted_weights, activation, lo, hi, **extras):
    _record(
        "default", hidden_states, table, router_weights, (w1, w2, w3), permuted_weights, activation, lo, hi,
        **extras,
    )
    return reference.mixture_of_experts_reference(
        hidden_states, table, router_weights, w1, w2, w3, permuted_weights, activation, lo, hi
    )


def _fused_weights(hidden_states, table, router_weights, w12, w3, permuted_weights, activation, lo, hi, **extras):
    _record(
        "fused_weights", hidden_states, table, router_weights, (w12, w3), permuted_weights, activation, lo, hi,
        **extras,
    )
    return reference.mixture_of_experts_fused_weights_reference(
        hidden_states, table, router_weights, w12, w3, permuted_weights, activation, lo, hi
    )


def _bias_fused_weights(hidden_states, table, router_weights, w12, w3, w12_bias, w3_bias, **options):
    range_and_layout = ("permuted_weights", "experts_min", "experts_max")
    _record(
        "bias_fused_weights",
        hidden_states,
        table,
        router_weights,
        (w12, w3, w12_bias, w3_bias),
        options["permuted_weights"],
        None,
        options["experts_min"],
        options["experts_max"],
        options={k: v for k, v in options.items() if k not in range_and_layout},
    )
    return reference.mixture_of_experts_bias_fused_weights_reference(
        hidden_states, table, router_weights, w12, w3, w12_bias, w3_bias, **options
    )


_KERNELS = {"default": _default, "fused_weights": _fused_weights, "bias_fused_weights": _bias_fused_weights}


def _fake(hidden_states, *args, **kwargs):
    return hidden_states.new_empty(hidden_states.shape)


def _hpu_op_registered(name: str = "mixture_of_experts") -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(f"hpu::{name}", "")
    except RuntimeError:
        return False
    return True


def register_newest_fake_gaudi_bridge() -> torch.library.Library | None:
    """`register_fake_gaudi_bridge` with the newest bridge's schemas (keyword-only total_experts...)."""
    return register_fake_gaudi_bridge(NEWEST_SCHEMAS)


def register_fake_gaudi_bridge(schemas: dict[str, str] = BRIDGE_SCHEMAS) -> torch.library.Library | None:
    """Register `hpu::mixture_of_experts` unless it exists; returns the library that owns it.

    Safe to call any number of times. Returns None when something other than this module (the real
    bridge) registered the op first.
    """
    global _LIBRARY
    if _LIBRARY is not None or _hpu_op_registered():
        return _LIBRARY
    try:
        library = torch.library.Library("hpu", "DEF")
    except RuntimeError:  # another library already owns the namespace: add to it
        library = torch.library.Library("hpu", "FRAGMENT")
    for overload, schema in schemas.items():
        library.define(schema)
        name = "mixture_of_experts" + ("" if overload == "default" else f".{overload}")
        library.impl(name, _KERNELS[overload], "CPU")
        torch.library.register_fake(f"hpu::{name}", _fake, lib=library)
    _LIBRARY = library
    return library


# ---------------------------------------------------------------------------------------------------
# The training ops of newer bridges (HabanaAI/gaudi-pytorch-bridge at eea6c59f: `scripts/hpu_op.yaml`
# for the schemas; `hpu_ops/common/mixture_of_experts.cpp` and `habana_kernels/kernels_register.cpp`
# for the Autograd kernel of the inference op, which runs the recompute pair unless `recomp=False`;
# `MixtureOfExpertsRecompFwdFunction::backward` for the gradients' order). Only the recompute pair is
# doubled: the saving pair's intermediates (chunked inputs, GEMM outputs) are the kernel's own layout.

_ROUTED = "Tensor hidden_states, Tensor expert_routing_table, Tensor router_weights"
_TAIL = "bool permuted_weights, str activation, int experts_min, int experts_max"
TRAINING_SCHEMAS = {
    "default": BRIDGE_SCHEMAS["default"].replace(") -> Tensor", ", *, bool? recomp=True) -> Tensor"),
    "fused_weights": BRIDGE_SCHEMAS["fused_weights"].replace(") -> Tensor", ", *, bool? recomp=True) -> Tensor"),
    "bias_fused_weights": BRIDGE_SCHEMAS["bias_fused_weights"],
}
RECOMP_SCHEMAS = {
    "mixture_of_experts_recomp_fwd": f"mixture_of_experts_recomp_fwd({_ROUTED}, Tensor[] w1, Tensor[] w2, "
    f"Tensor[] w3, {_TAIL}) -> Tensor",
    "mixture_of_experts_recomp_fwd.fused_weights": f"mixture_of_experts_recomp_fwd.fused_weights({_ROUTED}, "
    f"Tensor[] w12, Tensor[] w3, {_TAIL}) -> Tensor",
    "mixture_of_experts_recomp_bwd": f"mixture_of_experts_recomp_bwd(Tensor grad_tokens_in, {_ROUTED}, "
    f"Tensor[] w1, Tensor[] w2, Tensor[] w3, {_TAIL}) -> Tensor[]",
    "mixture_of_experts_recomp_bwd.fused_weights": f"mixture_of_experts_recomp_bwd.fused_weights("
    f"Tensor grad_tokens_in, {_ROUTED}, Tensor[] w12, Tensor[] w3, {_TAIL}) -> Tensor[]",
}
_REFERENCES = {
    "default": reference.mixture_of_experts_reference,
    "fused_weights": reference.mixture_of_experts_fused_weights_reference,
}


def _recomp_bwd(overload: str):
    """The gradients of the reference forward, in the bridge's order: [d hidden_states, d router_weights,
    then one per tensor of each weight list]. torch.func.vjp, which works below the autograd key."""
    roles = 3 if overload == "default" else 2

    def kernel(grad, hidden_states, table, router_weights, *rest):
        lists, options = [list(r) for r in rest[:roles]], rest[roles:]
        CALLS.append({"overload": f"recomp_bwd.{overload}", "num_weights": len(lists[0])})

        def forward(hidden_states, router_weights, *lists):
            return _REFERENCES[overload](hidden_states, table, router_weights, *lists, *options)

        _, vjp = torch.func.vjp(forward, hidden_states, router_weights, *lists)
        d_hidden, d_router, *d_lists = vjp(grad)
        return [d_hidden, d_router, *(g for grads in d_lists for g in grads)]

    return kernel


def _recomp_bwd_fake(grad, hidden_states, table, router_weights, *rest):
    lists = [r for r in rest if isinstance(r, (list, tuple))]
    return [hidden_states.new_empty(hidden_states.shape), router_weights.new_empty(router_weights.shape),
            *(w.new_empty(w.shape) for weights in lists for w in weights)]


def _bridge_autograd(overload: str):
    """(setup_context, backward) of the inference op, as the bridge's recompute Function does it."""
    roles = 3 if overload == "default" else 2

    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        hidden_states, table, router_weights, *rest = inputs
        lists, options = rest[:roles], rest[roles:]
        ctx.lengths, ctx.options = [len(w) for w in lists], options
        ctx.save_for_backward(hidden_states, table, router_weights, *(w for weights in lists for w in weights))

    def backward(ctx, grad):
        hidden_states, table, router_weights, *flat = ctx.saved_tensors
        lists, start = [], 0
        for length in ctx.lengths:
            lists.append(list(flat[start : start + length]))
            start += length
        packet = torch.ops.hpu.mixture_of_experts_recomp_bwd
        op = packet.default if overload == "default" else packet.fused_weights
        result = op(grad, hidden_states, table, router_weights, *lists, *ctx.options)
        grads, start = [], 2
        for length in ctx.lengths:
            grads.append(list(result[start : start + length]))
            start += length
        return (result[0], None, result[1], *grads, *(None for _ in ctx.options))

    return setup_context, backward


def register_training_gaudi_bridge() -> torch.library.Library | None:
    """`register_fake_gaudi_bridge` as a bridge with the MoE training ops: the inference op with `recomp`
    and an Autograd kernel on `.default` and `.fused_weights` (not `.bias_fused_weights`), whose backward
    calls `mixture_of_experts_recomp_bwd`."""
    library = register_fake_gaudi_bridge(TRAINING_SCHEMAS)
    if library is None or _hpu_op_registered("mixture_of_experts_recomp_bwd"):
        return library
    for name, schema in RECOMP_SCHEMAS.items():
        library.define(schema)
        base, _, overload = name.partition(".")
        overload = overload or "default"
        if base.endswith("_bwd"):
            library.impl(name, _recomp_bwd(overload), "CPU")
            torch.library.register_fake(f"hpu::{name}", _recomp_bwd_fake, lib=library)
        else:
            library.impl(name, lambda *args, overload=overload: _KERNELS[overload](*args), "CPU")
            torch.library.register_fake(f"hpu::{name}", _fake, lib=library)
    for overload in ("default", "fused_weights"):
        setup_context, backward = _bridge_autograd(overload)
        name = "hpu::mixture_of_experts" + ("" if overload == "default" else f".{overload}")
        torch.library.register_autograd(name, backward, setup_context=setup_context, lib=library)
    return library
