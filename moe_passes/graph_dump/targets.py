"""What `moe-graph-dump TARGET` compiles: a catalog form, a tiny transformers model, or a user callable.

    catalog:<name>            a module of the catalog (`form_catalog/`, in the repository checkout)
    hf:<model_type>            a tiny random transformers model of that family (moe_passes.tiny_models)
    package.module:callable    a callable returning (model, example_inputs) or (model, args, kwargs)

Modules are imported with the current directory on sys.path, as `python -m` would, so the catalog and
the user's own modules are found when the tool runs from their checkout.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from dataclasses import dataclass, field

import torch


class TargetError(Exception):
    """A target that cannot be built; the message is the one line the user sees."""


@dataclass
class Target:
    """A model to compile and what to run it on, with the settings its source asks for."""

    name: str
    model: torch.nn.Module | object
    args: tuple
    kwargs: dict = field(default_factory=dict)
    # entered around the compiled run: dynamo settings and run contexts the source needs
    contexts: list = field(default_factory=list)

    @contextlib.contextmanager
    def running(self):
        with contextlib.ExitStack() as stack:
            for make_context in self.contexts:
                stack.enter_context(make_context())
            yield


def load(spec: str, *, layers: int | None = None, experts_implementation: str | None = None) -> Target:
    """Build the target `spec` names; TargetError (one clear line) when it cannot be built."""
    kind, sep, name = spec.partition(":")
    if not sep or not kind or not name:
        raise TargetError(
            f"target {spec!r} is not catalog:<name>, hf:<model_type> or package.module:callable"
        )
    if experts_implementation is not None and kind != "hf":
        raise TargetError("--experts-implementation applies to hf:<model_type> targets only")
    if kind in ("catalog", "patterns"):  # "patterns:" is what the catalog was called before form_catalog/
        return _catalog_form(name, layers)
    if kind == "hf":
        return _transformers(name, layers, experts_implementation)
    if layers is not None:
        raise TargetError("--layers applies to catalog: and hf: targets only")
    return _callable(kind, name, spec)


def _importable_here() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def _catalog_form(name: str, layers: int | None) -> Target:
    _importable_here()
    try:
        form_catalog = importlib.import_module("form_catalog")
    except ImportError as error:
        raise TargetError(f"the catalog (form_catalog/) is not importable from here: {error}") from None
    try:
        form = importlib.import_module(f"form_catalog.{name}")
    except ModuleNotFoundError:
        known = ", ".join(form_catalog.FORMS)
        raise TargetError(f"unknown catalog form {name!r}; known forms: {known}") from None
    if not callable(getattr(form, "build", None)):
        raise TargetError(f"form_catalog.{name} has no build() function")
    overrides = {} if layers is None else {"layers": layers}
    try:
        model, example_inputs = form.build(**overrides)
    except Exception as error:  # noqa: BLE001 - reported as one line
        raise TargetError(f"form_catalog.{name}.build() failed: {_one_line(error)}") from None
    contexts = [lambda: form_catalog.dynamo_config(form)]
    if hasattr(form, "forward_context"):
        contexts.append(lambda: form.forward_context(model, example_inputs))
    return Target(f"catalog:{name}", model, tuple(example_inputs), {}, contexts)


def _transformers(family: str, layers: int | None, implementation: str | None) -> Target:
    from .. import tiny_models

    try:
        import transformers
    except ImportError:
        raise TargetError("hf: targets need transformers (pip install transformers)") from None
    if implementation is not None and implementation not in tiny_models.ALL_IMPLEMENTATIONS:
        raise TargetError(
            f"experts implementation must be one of {', '.join(tiny_models.ALL_IMPLEMENTATIONS)}, "
            f"got {implementation!r}"
        )
    transformers.logging.set_verbosity_error()
    try:
        model = tiny_models.tiny_model(family, implementation or "grouped_mm", layers)
    except tiny_models.NotBuildable as error:
        raise TargetError(str(error)) from None
    except Exception as error:  # noqa: BLE001 - reported as one line
        raise TargetError(f"building a tiny {family} model failed: {_one_line(error)}") from None
    args, kwargs = tiny_models.inputs(model)
    return Target(f"hf:{family}", model, args, kwargs)


def _callable(module_name: str, attribute: str, spec: str) -> Target:
    _importable_here()
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - ImportError or the module's own failure
        raise TargetError(f"cannot import {module_name}: {_one_line(error)}") from None
    factory = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise TargetError(f"{module_name} has no callable {attribute!r}")
    try:
        built = factory()
    except Exception as error:  # noqa: BLE001 - reported as one line
        raise TargetError(f"{spec}() failed: {_one_line(error)}") from None
    if not (isinstance(built, tuple | list) and len(built) in (2, 3)):
        raise TargetError(f"{spec}() must return (model, example_inputs) or (model, args, kwargs)")
    model, args, kwargs = built[0], built[1], built[2] if len(built) == 3 else {}
    if not callable(model):
        raise TargetError(f"{spec}() returned a model that is not callable: {type(model).__name__}")
    args = tuple(args) if isinstance(args, tuple | list) else (args,)
    if not isinstance(kwargs, dict):
        raise TargetError(f"{spec}() returned kwargs that are not a dict")
    return Target(spec, model, args, kwargs)


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def layer_list(model) -> tuple[str, torch.nn.ModuleList]:
    """(path, list) of the model's repeated layers, for regional compilation (one compile per layer)."""
    if not isinstance(model, torch.nn.Module):
        raise TargetError("--regional needs an nn.Module target")
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
        and len(module)
        and name.rsplit(".", 1)[-1] in ("layers", "h")
    ]
    if not candidates:
        raise TargetError("--regional found no layer list (an nn.ModuleList named layers or h) in the model")
    return min(candidates, key=lambda item: item[0].count("."))
