"""The options `torch.compile(..., backend="hpu_moe", options={...})` accepts, checked up front."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from .backend_passes import DEFAULT_PASSES
from .lowering import TARGETS
from .pass_manager import check_skip
from .passes.pipeline import FORMS


@dataclass(frozen=True)
class Options:
    """inner:   the backend that compiles the rewritten graph: a registered name or a callable
             (default: "hpu_backend" when registered, else "inductor").
    target:  "auto" (hpu when torch.ops.hpu.mixture_of_experts exists, else portable), "hpu", "portable".
    verify:  run the graph before and after the rewrite on the example inputs and keep the rewrite only
             when the outputs agree within the dtype's tolerance.
    enabled: False leaves every graph as it is (the inner backend still compiles it).
    adapters: False traces framework MoE layers (vLLM-style FusedMoE) as they are written, instead of
             through the adapters that make them traceable (moe_passes/adapters).
    strict:  decline (with the reason) every match whose fused call could give another result than the
             layer as written: a rewrite that rounds a value the model keeps wider than the hidden dtype
             (float32 router weights, or a float32 combine, under bfloat16 experts), and a layer that runs
             every expert on every token (a NaN or inf in an unrouted expert reaches its output, never
             the fused call's): for users who need eager's results rather than agreement within tolerance.
    forms:   the expert forms to look for, by name (default: all of `moe_passes.FORMS`); naming a
             subset turns the others off, to bisect which finder made a rewrite.
    recompute: training graphs: True (default) lets each fused call's backward recompute the expert
             projections (it saves only its inputs: least memory); False writes calls over stacked
             weights as grouped matmuls whose activations are saved for the backward (faster; as much
             memory as the layer as written). The Gaudi bridge makes this choice itself (`recomp`).
    skip_passes: names of the backend's passes to leave out (`moe_passes.backend.DEFAULT_PASSES`; e.g.
             ["fuse routing"], ["stack weights"]).
    custom_passes: the user's own `moe_passes.BackendPass` objects, run after the rewrite (they read
             `state.graph`) and before the rewritten graph is lowered.
    fuse_routing: the softmax → top-k → renormalise chain feeding a portable fused call becomes one
             `moe_passes.softmax_topk` call (passes/routing_fusion.py): None (default) where its logits
             are on CUDA and the op's Triton kernel covers them, True wherever the chain is found (the
             op's torch implementation elsewhere), False never.
    """

    inner: str | Callable | None = None
    target: str = "auto"
    verify: bool = False
    enabled: bool = True
    adapters: bool = True
    strict: bool = False
    forms: tuple[str, ...] | None = None
    fuse_routing: bool | None = None
    recompute: bool = True
    skip_passes: tuple[str, ...] = ()
    custom_passes: tuple = ()

    @classmethod
    def parse(cls, options: dict | None) -> Options:
        if options is None:
            return cls()
        if isinstance(options, Options):
            return options
        if not isinstance(options, dict):
            raise TypeError(f"hpu_moe options must be a dict, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown hpu_moe option(s) {unknown}; known options: {sorted(known)}")
        if options.get("forms") is not None:
            options = {**options, "forms": _form_names(options["forms"])}
        for key in ("skip_passes", "custom_passes"):
            if key in options:
                options = {**options, key: _sequence(key, options[key])}
        parsed = cls(**options)
        if parsed.target not in TARGETS:
            raise ValueError(f"hpu_moe option target must be one of {TARGETS}, got {parsed.target!r}")
        if parsed.inner is not None and not (isinstance(parsed.inner, str) or callable(parsed.inner)):
            raise TypeError("hpu_moe option inner must be a backend name or a callable")
        if isinstance(parsed.inner, str):
            _check_backend_name(parsed.inner)
        for flag in ("verify", "enabled", "adapters", "strict", "recompute"):
            if not isinstance(getattr(parsed, flag), bool):
                raise TypeError(f"hpu_moe option {flag} must be a bool")
        if parsed.fuse_routing is not None and not isinstance(parsed.fuse_routing, bool):
            raise TypeError("hpu_moe option fuse_routing must be None (where the kernel applies), True or False")
        check_skip(DEFAULT_PASSES, parsed.skip_passes)
        for custom in parsed.custom_passes:
            if not (isinstance(getattr(custom, "name", None), str) and callable(getattr(custom, "run", None))):
                raise TypeError(f"hpu_moe option custom_passes: {custom!r} is not a pass (subclass "
                                "moe_passes.BackendPass: a `name` and a `run(state)` method)")
        return parsed


def _sequence(key: str, value) -> tuple:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise TypeError(f"hpu_moe option {key} must be a list, got {type(value).__name__}")
    return tuple(value)


def _form_names(forms) -> tuple[str, ...]:
    if isinstance(forms, str) or not all(isinstance(f, str) for f in forms):
        raise TypeError("hpu_moe option forms must be a list of form names, e.g. ['grouped_mm']")
    if not forms:
        raise ValueError(
            f"hpu_moe option forms must name at least one form of {list(FORMS)} (to leave every graph as "
            "captured, pass enabled=False)"
        )
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        raise ValueError(f"hpu_moe option forms: unknown form(s) {unknown}; known forms: {list(FORMS)}")
    return tuple(forms)


def _check_backend_name(name: str) -> None:
    """`inner` names a registered torch.compile backend other than hpu_moe itself."""
    from torch._dynamo.backends.registry import list_backends

    if name == "hpu_moe":
        raise ValueError("hpu_moe option inner names the backend that compiles the rewritten graph; it cannot be "
                         "hpu_moe itself (use 'inductor', 'eager', 'aot_eager', ...)")
    registered = list_backends(exclude_tags=())
    if name not in registered:
        raise ValueError(f"hpu_moe option inner: no backend named {name!r} is registered; registered backends: "
                         f"{registered}")
