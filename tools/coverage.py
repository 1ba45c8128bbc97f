"""Coverage table: every MoE family of the installed transformers x experts implementation.

For each model family whose modeling code holds an MoE, build a tiny random model (2 layers, 4 experts,
top-2; sizes shrunk generically from the config's defaults, plus a few per-family overrides), compile
it with `backend="hpu_moe"` under each implementation, and record: fused layers / MoE layers, declined
candidates with reasons, graph breaks, and the output's max difference to the unrewritten model.

The model is the family's `*ForCausalLM`; families without one (vision-language, omni, encoder-decoder,
token classification) fall back to their text model (`*TextModel` on the tiny `text_config`), else to
the text-only top-level model, fed `input_ids` (and `decoder_input_ids` for encoder-decoders); where
the output has no logits, `last_hidden_state` is compared. MoE families that do not use
`use_experts_implementation` (their own expert code) run once, as "own forward".

"MoE layers" counts every token-routed expert FFN the input runs (stacked `*Experts`, ModuleLists of
experts, own-forward blocks; see `moe_layers`). Results: "fused" (every MoE layer fused, one graph, no
break), "fused (breaks)" (every MoE layer fused, graph breaks elsewhere), "partly fused", "declined",
"not found" (no candidate recognised), "compile failed", "not built". Every row that is not fused says
why: the construction error, the decline reasons, or a diagnosis from the run (the first graph break and
where it is, the backend's internal error, or what the experts hold when no candidate was recognised).

With `--training`, each model is compiled with gradients enabled (parameters requiring grad, eval mode
so that no dropout or router noise makes the two runs differ), run forward and backward once, and the
table also gives the largest relative difference of a parameter's gradient to the unrewritten model's;
"fused" then means every MoE layer fused in the training graph ("fused (training)" in the report).

    python tools/coverage.py                       # markdown table on stdout
    python tools/coverage.py --families mixtral qwen3_moe --json coverage.json
    python tools/coverage.py --training --json coverage_training.json
    python tools/coverage.py --implementations eager    # transformers' per-expert loop
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import moe_passes  # noqa: E402
from moe_passes.explain import explain_and_run  # noqa: E402
from moe_passes.tiny_models import (  # noqa: E402
    IMPLEMENTATIONS,
    TINY,
    NotBuildable,
    inputs,
    moe_families,
    output_tensor,
    tiny_model,
)


# A routed-experts container: "*Experts" modules (stacked expert weights, or a custom expert loop), or a
# ModuleList/module attribute named "experts". Shared experts are not routed.
def _is_experts(name: str, module) -> bool:
    kind = type(module).__name__
    if "Shared" in kind:
        return False
    return kind.endswith("Experts") or name.rsplit(".", 1)[-1] == "experts"


def moe_layers(model) -> list[str]:
    """Names of the MoE layers (token-routed expert FFNs) of `model`.

    An MoE layer is the module that holds a routed-experts container (see `_is_experts`), or a module
    whose class name ends in MoE/Moe with no such container (experts held as plain parameters or
    embeddings, e.g. Doge's CDMoE); routed experts inside attention (JetMoE's mixture of attention
    heads) are not FFN layers and are not counted.
    """
    modules = dict(model.named_modules())
    layers = []
    for name, module in modules.items():
        if not name or "attention" in name.lower() or "attn" in name.lower():
            continue
        has_experts = any(_is_experts(f"{name}.{child}", m) for child, m in module.named_children())
        named_moe = re.search(r"(MoE|Moe)$", type(module).__name__) and not any(
            _is_experts(n, m) for n, m in module.named_modules()
        )
        if (has_experts or named_moe) and not _is_experts(name, module):
            if not any(name.startswith(f"{layer}.") for layer in layers):
                layers.append(name)
    return layers


def moe_layer_count(model) -> int:
    return len(moe_layers(model))


def _holds(module) -> str:
    """A module's weights in short: "name [shape], ..."; N same-type children as "N x Type(...)"."""
    params = [f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=False)]
    by_type: dict[type, list[tuple[str, torch.nn.Module]]] = {}
    for name, child in module.named_children():
        by_type.setdefault(type(child), []).append((name, child))
    for kind, group in by_type.items():
        if len(group) >= TINY["num_experts"]:  # one entry per expert: summarise the first
            params.append(f"{len(group)} x {kind.__name__}({_holds(group[0][1])})")
        else:
            params += [
                f"{name}.{n} {list(p.shape)}" for name, child in group for n, p in child.named_parameters()
            ]
    return ", ".join(params)


def describe_experts(model, layers: list[str]) -> str:
    """What the first MoE layer holds: its expert container(s), or (no container) its weights."""
    if not layers:
        return ""
    layer = model.get_submodule(layers[0])
    children = dict(layer.named_children())
    experts = {name: m for name, m in children.items() if _is_experts(name, m)}
    parts = [f"{name}: {type(m).__name__}({_holds(m)})" for name, m in (experts or children).items()]
    return f"{type(layer).__name__}: " + "; ".join(part for part in parts if not part.endswith("()"))


def first_line(text: str, limit: int = 160) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:limit]


class _BreakLocations(logging.Handler):
    """Collects {break title: where} (file:line (function)) from dynamo's graph_breaks log."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.locations: dict[str, str] = {}

    def emit(self, record):
        message = record.getMessage()
        at = re.search(r"in user code at (\S+):(\d+)", message)
        lines = [line.strip() for line in message.split("Graph Break Reason:", 1)[-1].splitlines()[1:]]
        title = next((line for line in lines if line), "")
        if not at or title in self.locations:
            return
        where = f"{os.path.basename(at.group(1))}:{at.group(2)}"
        for path, line, function in re.findall(r'File "([^"]+)", line (\d+), in (\w+)', message):
            if (path, line) == at.groups():
                where += f" ({function})"
        self.locations[title] = where


@contextlib.contextmanager
def break_locations():
    from torch._dynamo.symbolic_convert import graph_break_log

    handler = _BreakLocations()
    level, propagate = graph_break_log.level, graph_break_log.propagate
    graph_break_log.setLevel(logging.DEBUG)
    graph_break_log.propagate = False  # to this handler only, not to torch's stderr handler
    graph_break_log.addHandler(handler)
    try:
        yield handler.locations
    finally:
        graph_break_log.removeHandler(handler)
        graph_break_log.setLevel(level)
        graph_break_log.propagate = propagate


class _Fallbacks(logging.Handler):
    """Collects the backend's internal-error fallbacks (logged with their traceback) as short strings."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.fallbacks: list[str] = []

    def emit(self, record):
        if not record.exc_info:
            return
        error = record.exc_info[1]
        text = "".join(traceback.format_exception(*record.exc_info))
        node = re.search(r"While executing %\S+ : .*?target=([^\]]+)\]", text)
        frames = re.findall(r'File "([^"]+/models/[^"]+)", line (\d+), in (\w+)', text)
        where = ""
        if frames:
            path, line, function = frames[-1]
            where = f" at {os.path.basename(path)}:{line} ({function})"
        if node:
            where += f", node {node.group(1)}"
        message = re.sub(r' at "[^"]*"(:\d+)?', "", first_line(error, 400)).split(", please report")[0][:120]
        self.fallbacks.append(f"hpu_moe internal error{where}: {type(error).__name__}: {message}")


@contextlib.contextmanager
def backend_fallbacks():
    """The backend's logged fallbacks, kept out of stderr (the table carries them)."""
    logger = logging.getLogger("moe_passes")
    handler = _Fallbacks()
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler.fallbacks
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def break_summary(reason: str) -> str:
    """A graph break reason's title and the first sentence of its explanation."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    title = lines[0] if lines else ""
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
    explanation = explanation.removeprefix("Explanation:").strip().split(". ")[0]
    return f"{title}: {explanation}"[:200] if explanation else title[:200]


def error_text(error: Exception) -> str:
    if isinstance(error, NotBuildable):
        return f"not a causal/text model: {error}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(error).__name__}: {text[:240]}"


def diagnosis(report, model, layers: list[str], locations: dict[str, str]) -> str:
    """Why nothing (or not everything) was fused, from the run."""
    if not layers:
        return "the tiny model has no MoE layer"
    parts = []
    if report.break_reasons:
        first = report.break_reasons[0]
        where = locations.get(first_line(first, 1000))
        where = f" at {where}" if where else ""
        parts.append(f"{report.graph_break_count} graph break(s), first{where}: {break_summary(first)}")
    if report.fallbacks:
        parts.append(f"fallback: {first_line(report.fallbacks[0])}")
    if report.declined:
        parts.append("declined: " + "; ".join(sorted({d.reason for d in report.declined})))
    if not parts:
        parts.append(f"expert form not recognised: {describe_experts(model, layers)}")
    return " | ".join(parts)


def _loss(output) -> torch.Tensor:
    return output_tensor(output).float().square().mean()


def _gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _train_step(model, args, kwargs):
    """(report, output, gradients) of one forward + backward compiled with hpu_moe."""
    with moe_passes.explaining({"inner": "eager", "target": "portable"}) as session:
        output = torch.compile(model, backend=session.backend)(*args, **kwargs)
        _loss(output).backward()
    return session.report, output, _gradients(model)


def _worst_gradient_error(got: dict, want: dict) -> float:
    if set(got) != set(want):
        return float("inf")  # a parameter lost (or gained) its gradient
    return max(
        ((got[n].float() - want[n].float()).norm() / want[n].float().norm().clamp_min(1e-12)).item() for n in want
    )


def run(family: str, implementation: str, training: bool = False) -> dict:
    row = {"family": family, "implementation": implementation}
    start = time.perf_counter()
    try:
        model = tiny_model(family, implementation)
        args, kwargs = inputs(model)
        layers = moe_layers(model)
        ran = []  # the MoE layers the token ids exercise (e.g. not Ernie 4.5 VL's vision experts)
        hooks = [
            model.get_submodule(name).register_forward_hook(lambda *_, name=name: ran.append(name))
            for name in layers
        ]
        try:
            if training:
                model.requires_grad_(True)
                reference = model(*args, **kwargs)
                _loss(reference).backward()
                expected, expected_grads = output_tensor(reference).detach(), _gradients(model)
            else:
                with torch.no_grad():
                    expected = output_tensor(model(*args, **kwargs))
        finally:
            for hook in hooks:
                hook.remove()
    except Exception as error:  # noqa: BLE001 - recorded in the table
        row.update(status="not built", reason=error_text(error))
        return row
    row["model"] = type(model).__name__
    idle = [name for name in layers if name not in ran]
    layers = [name for name in layers if name in ran]
    row["moe_layers"] = len(layers)
    if idle:
        row["idle_moe_layers"] = idle
    try:
        with break_locations() as locations, backend_fallbacks() as fallbacks:
            if training:
                report, output, grads = _train_step(model, args, kwargs)
                row["max_grad_rel_error"] = _worst_gradient_error(grads, expected_grads)
            else:
                report, output = explain_and_run(
                    model, *args, options={"inner": "eager", "target": "portable"}, **kwargs
                )
    except Exception as error:  # noqa: BLE001
        # the backend's own fallback, when there was one, comes first: it is usually the cause
        cause = f"{fallbacks[0]}; then " if fallbacks else ""
        message = error_text(error).split(". ")[0]
        row.update(status="compile failed", reason=f"{cause}{message}")
        return row
    row.update(
        fused=len(report.fused),
        declined=[d.reason for d in report.declined],
        graph_breaks=report.graph_break_count,
        break_reasons=[first_line(r, 300) for r in report.break_reasons],
        fallbacks=report.fallbacks,
        max_error=(output_tensor(output).detach().float() - expected.float()).abs().max().item(),
        seconds=round(time.perf_counter() - start, 1),
    )
    if training and not all(f.training for f in report.fused):
        row["status"] = "error"
        row["reason"] = "a layer fused without its training mark"
        return row
    if report.fused and len(report.fused) >= len(layers) and not report.graph_break_count:
        row["status"] = "fused"
    elif report.fused and len(report.fused) >= len(layers):
        row["status"] = "fused (breaks)"  # every MoE layer fused, but the model has graph breaks elsewhere
    elif report.fused:
        row["status"] = "partly fused"
    else:
        row["status"] = "declined" if report.declined else "not found"
    notes = []
    if row["status"] != "fused":
        notes.append(diagnosis(report, model, layers, locations))
    if idle:
        notes.append(f"not counted: {len(idle)} MoE layer(s) the token ids do not run ({idle[0]}, ...)")
    if notes:
        row["reason"] = " | ".join(notes)
    return row


def markdown(rows: list[dict]) -> str:
    training = any("max_grad_rel_error" in r for r in rows)
    grad_header = " max grad rel. diff |" if training else ""
    lines = [
        f"| family | implementation | result | fused / MoE layers | breaks | max output diff |{grad_header} reason |",
        "|---|---|---|---|---|---|" + ("---|" if training else "") + "---|",
    ]
    for r in rows:
        reason = (r.get("reason") or "").replace("|", "/")[:400]
        fused = f"{r.get('fused', '-')}/{r['moe_layers']}" if "moe_layers" in r else ""
        error = f"{r['max_error']:.2g}" if "max_error" in r else ""
        grad = f" {r['max_grad_rel_error']:.2g} |" if "max_grad_rel_error" in r else (" |" if training else "")
        lines.append(
            f"| {r['family']} | {r['implementation']} | {r['status']} | {fused} | "
            f"{r.get('graph_breaks', '')} | {error} |{grad} {reason} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    by_family: dict[str, set] = {}
    for r in rows:
        by_family.setdefault(r["family"], set()).add(r["status"])
    counts: dict[str, int] = {}
    for statuses in by_family.values():
        key = statuses.pop() if len(statuses) == 1 else "mixed"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--training", action="store_true", help="compile with gradients enabled, run backward")
    parser.add_argument("--implementations", nargs="*", default=list(IMPLEMENTATIONS),
                        help="experts implementations of the families that take one (default: %(default)s; "
                             "transformers also has 'eager', its per-expert loop)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    families = moe_families()
    for family in args.families or families:
        for implementation in args.implementations if families.get(family, True) else ("own forward",):
            try:
                rows.append(run(family, implementation, args.training))
            except Exception:  # noqa: BLE001 - one family never stops the table
                rows.append(
                    {
                        "family": family,
                        "implementation": implementation,
                        "status": "error",
                        "reason": traceback.format_exc().splitlines()[-1][:160],
                    }
                )
            print(
                f"{family:28s} {implementation:12s} {rows[-1]['status']:12s} {rows[-1].get('seconds', '')}",
                file=sys.stderr,
            )
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, moe_passes {moe_passes.__version__}"
        f"; families: {summary(rows)}\n"
    )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
