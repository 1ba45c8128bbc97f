"""What a finder is: the ops that anchor its candidates, how it lists them, how it reads one.

Each form is one `experts_<form>.py` module of this package that defines `FINDER = Finder(...)` with
its priority; `discover()` collects them, so adding a form touches no list elsewhere. The pipeline looks
up the anchor nodes with `graph.find_nodes` (an index, not a scan), asks the finder for its candidates
among them, and reads each candidate on its own, so that a finder that raises on one layer costs that
layer only.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from .matches import Decline, ExpertsMatch

Result = ExpertsMatch | Decline | None


@dataclass(frozen=True)
class Candidate:
    """A place a finder will read: `anchor` names it (its layer, its node); `payload` is the finder's own."""

    anchor: Node
    payload: Any


@dataclass(frozen=True)
class Finder:
    """One way of writing the experts (a form), switchable by its name (`options={"forms": [...]}`)."""

    name: str
    anchors: tuple  # OpOverloads whose nodes may end (or start) a region of this form
    candidates: Callable[[torch.fx.Graph, list[Node]], Iterable[Candidate]]
    match: Callable[[Any], Result]
    # Where two finders match one region, the one with the lower priority wins.
    priority: int
    # The finder checks which of the router's experts each term is (probes), so a region may hold a
    # contiguous range of them (expert parallelism); the others must hold every expert the ids reach.
    partial_ranges: bool = False
    # The form runs every expert on every token and zeroes the unrouted results (0 * y): a NaN or inf in
    # an expert no token is routed to reaches eager's output, never the fused call's (strict declines).
    reads_every_expert: bool = False

    def anchor_nodes(self, graph: torch.fx.Graph) -> list[Node]:
        """The graph's nodes of the anchor ops, in graph order."""
        found = [n for op in self.anchors for n in graph.find_nodes(op="call_function", target=op)]
        if len(self.anchors) > 1:
            order = {n: i for i, n in enumerate(graph.nodes)}
            found.sort(key=order.__getitem__)
        return found


def each_anchor(accept: Callable[[Node], bool]) -> Callable[[torch.fx.Graph, list[Node]], Iterable[Candidate]]:
    """Candidates for finders that read one anchor node at a time: the anchors `accept` keeps."""

    def candidates(_graph: torch.fx.Graph, anchors: list[Node]) -> Iterable[Candidate]:
        return [Candidate(node, node) for node in anchors if accept(node)]

    return candidates


FINDER_MODULE_PREFIX = "experts_"


def discover() -> tuple[Finder, ...]:
    """Every `FINDER` of the package's `experts_*` modules, in priority order."""
    package = __name__.rpartition(".")[0]
    found = []
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.name.startswith(FINDER_MODULE_PREFIX):
            finder = getattr(importlib.import_module(f"{package}.{info.name}"), "FINDER", None)
            if not isinstance(finder, Finder):
                raise TypeError(f"{package}.{info.name} defines no FINDER = Finder(...)")
            found.append(finder)
    priorities = [f.priority for f in found]
    if len(set(priorities)) != len(priorities):
        raise ValueError(f"two finders share a priority: {sorted((f.priority, f.name) for f in found)}")
    return tuple(sorted(found, key=lambda f: f.priority))
