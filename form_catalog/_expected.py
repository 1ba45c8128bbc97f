"""What the rewrite must do with a catalog form: the contract each `form_catalog/` module states."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expected:
    """The outcome the `hpu_moe` backend must reach on a catalog form's default build.

    fused:    how many fused MoE calls the rewritten graphs must contain (one per MoE layer).
    overload: the overload emitted for each of them ("default", "fused_weights", "bias_fused_weights").
    declined: how many candidates must be reported as declined.
    reason:   a substring the decline reason must contain (None when nothing is declined).
    graph_breaks: whether dynamo breaks the graph on this form (then nothing can be fused, and the
              report must give advice containing `advice`).
    """

    fused: int
    overload: str | None = None
    declined: int = 0
    reason: str | None = None
    graph_breaks: bool = False
    advice: str | None = None

    def __post_init__(self) -> None:
        if self.fused < 0 or self.declined < 0:
            raise ValueError("Expected counts must be non-negative")
        if self.fused and self.overload not in ("default", "fused_weights", "bias_fused_weights"):
            raise ValueError(f"unknown overload {self.overload!r}")
        if self.declined and not self.reason:
            raise ValueError("a declined form must name the reason it is declined for")
        if self.graph_breaks and (self.fused or not self.advice):
            raise ValueError("a form that breaks the graph fuses nothing and must name the advice given")
