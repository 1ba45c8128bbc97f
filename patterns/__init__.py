"""The catalog of MoE forms was renamed: `patterns/` is now `form_catalog/` ("pattern" means a search
graph everywhere else in PyTorch).

`from patterns import catalog, dynamo_config, Expected, FORMS` keeps working, with a DeprecationWarning;
importing a module of it (`patterns.hf_grouped_mm`, `from patterns import hf_grouped_mm`) fails with an
error naming its new place.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

from form_catalog import FORMS, Expected, catalog, dynamo_config

warnings.warn("the `patterns` catalog is now `form_catalog`: import form_catalog instead", DeprecationWarning,
              stacklevel=2)


class _Renamed(importlib.abc.MetaPathFinder):
    """`import patterns.<module>` raises, naming `form_catalog.<module>`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(f"{__name__}."):
            new = "form_catalog" + fullname[len(__name__):]
            raise ModuleNotFoundError(f"{fullname} was renamed: import {new}", name=fullname)
        return None


def __getattr__(name: str):
    """`from patterns import <module>` raises, naming `form_catalog.<module>`."""
    if name in FORMS or name == "corpus":
        raise ImportError(f"patterns.{name} was renamed: import form_catalog.{name}", name=f"patterns.{name}")
    raise AttributeError(f"module 'patterns' has no attribute {name!r}")


if not any(isinstance(finder, _Renamed) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Renamed())

__all__ = ["FORMS", "Expected", "catalog", "dynamo_config"]
