"""Finding the classes to adapt: by convention among loaded nn.Module classes, and by name for vLLM."""

from __future__ import annotations

import logging
import sys
import types
import weakref

import torch

from . import device_moves, function_swaps, hit_expert_loops, vllm_style
from .base import (
    BEFORE_TRACE,
    compiling_for_hpu_moe,
    env_enabled,
    install,
    modules_of_the_frame_being_compiled,
    retrace,
)

log = logging.getLogger(__name__)

_seen_subclass_count = -1
# Classes already looked at with adapters enabled, with the methods they had then. Adapting installs on
# the class itself, so a class needs one look while its methods stay: tests and generated models define
# classes at every compile, and looking at every loaded class again each time cost about 0.6 s per
# compile with ~500 classes loaded. A class whose methods were replaced since (LongCat-Next patches its
# MoE forward at run time) is looked at again.
_examined: weakref.WeakKeyDictionary[type, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _methods_of(cls: type) -> tuple[int, ...]:
    """The identities of the functions `cls` and its bases define, nn.Module's and object's aside (ids, not
    the functions: a function using super() refers to its class, and would keep a deleted class alive)."""
    return tuple(
        id(value)
        for base in cls.__mro__
        if base is not torch.nn.Module and base is not object
        for value in vars(base).values()
        if isinstance(value, (types.FunctionType, staticmethod, classmethod))
    )


# Classes whose installed expert-loop copies rest on helpers read by name ({class: {method: copy}}): a
# helper replaced since (a pool patched in) voids the proof, so those methods are looked at again
_READS_HELPERS: weakref.WeakKeyDictionary[type, dict[str, types.FunctionType]] = weakref.WeakKeyDictionary()


def _note_helper_reads(cls: type, loops: dict[str, types.FunctionType]) -> None:
    reading = {method: traced for method, traced in loops.items() if hit_expert_loops.reads_helpers(traced)}
    if reading:
        _READS_HELPERS[cls] = reading


def _look_again_where_helpers_changed() -> None:
    """Decide again the installed copies that rest on a helper replaced since, and have hpu_moe trace the
    new decision (the copy, or the method as written)."""
    for cls, reading in list(_READS_HELPERS.items()):
        stale = [method for method, traced in reading.items() if not hit_expert_loops.still_holds(traced)]
        if not stale:
            continue
        del _READS_HELPERS[cls]
        loops = hit_expert_loops.adaptations_of(cls)
        _note_helper_reads(cls, loops)
        for method in stale:
            retrace(cls, method, loops.get(method))
            log.info("%s.%s.%s: a helper its expert-loop proof read was replaced; decided again",
                     cls.__module__, cls.__qualname__, method)


BEFORE_TRACE.append(_look_again_where_helpers_changed)


def _module_classes() -> list[type]:
    classes, stack, seen = [], [torch.nn.Module], set()
    while stack:
        cls = stack.pop()
        for sub in type.__subclasses__(cls):
            if sub not in seen:
                seen.add(sub)
                classes.append(sub)
                stack.append(sub)
    return classes


def adapt(model: torch.nn.Module | None = None) -> list[str]:
    """Install adapters on the classes of `model`'s modules (or every loaded nn.Module class).

    Returns "module.Class" for each class adapted by this call. Honours MOE_PASSES_ADAPTERS=0.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"adapt() needs an nn.Module or None, got {type(model).__name__}")
    if not env_enabled():
        return []
    classes = {type(m) for m in model.modules()} if model is not None else _module_classes()
    adapted = []
    for cls in classes:
        if _examined.get(cls) == _methods_of(cls):
            continue  # looked at before, methods unchanged: adapted then, or nothing to adapt
        if _install_adapters(cls):
            adapted.append(f"{cls.__module__}.{cls.__qualname__}")
        adapted.extend(function_swaps.look_at_callees(cls))
        _examined[cls] = _methods_of(cls)  # after installing: the adapted methods are the ones to keep
        for helper in _helper_classes_beside(cls):
            if _install_loop_adapters(helper):
                adapted.append(f"{helper.__module__}.{helper.__qualname__}")
            _examined[helper] = _methods_of(helper)
    from . import vllm

    adapted.extend(vllm.install_if_loaded())
    return adapted


def _helper_classes_beside(cls: type) -> list[type]:
    """The plain classes (not nn.Module) defined in `cls`'s module and not looked at yet: MoE code often
    runs its expert loop in a helper object the layer holds (ktransformers' `KExpertsTorch`)."""
    module = sys.modules.get(cls.__module__)
    found = []
    for value in list(vars(module).values()) if module is not None else ():
        if (isinstance(value, type) and value.__module__ == cls.__module__ and not issubclass(value, torch.nn.Module)
                and _examined.get(value) != _methods_of(value)):
            found.append(value)
    return found


def _install_loop_adapters(cls: type) -> bool:
    """Install the expert-loop adapter on a plain helper class; False where it takes nothing (or the class
    cannot be read: a helper is looked at on the side, and never stops a compile)."""
    try:
        loops = hit_expert_loops.adaptations_of(cls)
    except Exception as error:  # noqa: BLE001 - an unreadable helper class is left as written
        log.debug("helper class %s.%s not read: %s", cls.__module__, cls.__qualname__, error)
        return False
    _note_helper_reads(cls, loops)
    return any([install(cls, traced, hit_expert_loops.NAME, method) for method, traced in loops.items()])


def _install_adapters(cls: type) -> bool:
    """Install every adapter that takes `cls`; True if any was installed now."""
    if vllm_style.follows_convention(cls) and install(cls, vllm_style.traceable_forward, vllm_style.NAME):
        return True
    loops = hit_expert_loops.adaptations_of(cls)
    _note_helper_reads(cls, loops)
    installed = [install(cls, traced, hit_expert_loops.NAME, method, exact=True) for method, traced in loops.items()]
    installed += [
        install(cls, traced, device_moves.NAME, method)
        for method, traced in device_moves.adaptations_of(cls, taken=set(loops)).items()
    ]
    return any(installed)


def adapt_new_classes() -> None:
    """Adapt the nn.Module classes defined since the last look (cheap when there are none). A class made
    as another was freed leaves the count as it was: one not looked at yet is found by membership."""
    global _seen_subclass_count
    classes = _module_classes()
    if len(classes) != _seen_subclass_count or any(cls not in _examined for cls in classes):
        _seen_subclass_count = len(classes)
        adapt()


def _adapt_new_classes_for_hpu_moe(*_args) -> None:
    """Dynamo start-of-compile callback: for a compile whose backend is hpu_moe, adapt the classes
    defined since the last look, and re-bind forwards bound onto instances; for any other backend, nothing."""
    if compiling_for_hpu_moe():
        adapt_new_classes()
        for root in modules_of_the_frame_being_compiled():
            rebind_instance_forwards(root)


def rebind_instance_forwards(root: torch.nn.Module) -> list[str]:
    """Instance attributes holding a method of an adapted class bound to its instance get that class's
    adapted method bound to the same instance: the method as written outside hpu_moe's traces, its
    traceable copy inside. MixLoRA injects its MoE so (`mlp.forward = moe_layer.forward`, and
    `self.forward_fn_ = getattr(self, "_llama_forward")` in the layer), bound before any adapter was
    installed, so they hold the methods as written. Looked for in `root`'s modules and in the instances
    such methods are bound to. Returns "module.Class.method" for each re-bound."""
    rebound, seen = [], set()
    stack: list[object] = list(root.modules())
    while stack:
        holder = stack.pop()
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        for attribute, bound in list(getattr(holder, "__dict__", {}).items()):
            if not isinstance(bound, types.MethodType):
                continue
            owner, name = type(bound.__self__), bound.__func__.__name__
            installed = owner.__dict__.get(name)
            if getattr(installed, "__moe_passes_original__", None) is bound.__func__:
                holder.__dict__[attribute] = types.MethodType(installed, bound.__self__)
                rebound.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
                log.info("%s of a %s instance re-bound to the adapted %s.%s", attribute, type(holder).__name__,
                         owner.__qualname__, name)
            stack.append(bound.__self__)
    return rebound


def install_discovery_hook() -> None:
    """Look for new classes before dynamo compiles a frame for hpu_moe (dynamo's reset() clears the
    callback: the backend and `explain` install it again)."""
    handler = getattr(torch._dynamo, "callback_handler", None)
    register = getattr(handler, "register_start_callback", None)
    if register is None:
        log.debug("this torch has no dynamo start callbacks; adapters install when hpu_moe is looked up or runs")
        return
    callbacks = getattr(handler, "start_callbacks", [])
    if _adapt_new_classes_for_hpu_moe not in callbacks:
        register(_adapt_new_classes_for_hpu_moe)


def prepare() -> None:
    """What the hpu_moe backend needs before dynamo traces for it: the loaded classes adapted, and new
    ones looked for before each hpu_moe compile. Runs when the backend is looked up by name, when it
    compiles a graph, and in `explain`; never at `import moe_passes`."""
    install_discovery_hook()
    hit_expert_loops.run_switches_as_plain_python()
    adapt_new_classes()
