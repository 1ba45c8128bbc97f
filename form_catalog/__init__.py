"""The catalog of MoE source forms the passes meet in the wild (not installed with the package).

Each module mirrors one real-world form in plain PyTorch, cites the code it mirrors, offers
`build(**overrides) -> (module, example_inputs)` with small defaults, and states in `EXPECTED` the
rewrite it must get (or why it must be declined). The demo, the tests and the tools run from here.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ._expected import Expected


def _form_modules() -> tuple[str, ...]:
    """Every module of this package that is a form: not `_private` helpers, not the `corpus` package,
    not a module that says `IN_CATALOG = False` (a calling convention that runs only inside its
    framework's context, e.g. `vllm_fused_moe`)."""
    names = sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.ispkg and not info.name.startswith("_"))
    return tuple(name for name in names if getattr(importlib.import_module(f"{__name__}.{name}"), "IN_CATALOG", True))


# Discovered, not listed: adding a form is adding its module (and its snapshot).
FORMS = _form_modules()


def catalog() -> dict[str, ModuleType]:
    """{form name: module}, in name order."""
    return {name: importlib.import_module(f"{__name__}.{name}") for name in FORMS}


def dynamo_config(form: ModuleType):
    """The `torch._dynamo.config` patch a form needs to be captured as its docstring says (often none)."""
    import torch

    return torch._dynamo.config.patch(**getattr(form, "DYNAMO_CONFIG", {}))


__all__ = ["Expected", "catalog", "dynamo_config", "FORMS"]
