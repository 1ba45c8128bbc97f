"""Expert parallelism across processes: transformers' own EP, compiled with hpu_moe on every rank.

Each configuration (ranks x model x experts implementation x EP implementation) builds a tiny random
model (2 layers, 8 experts, top-2), saves it, and loads it on every rank with transformers'
`DistributedConfig(ep_size=ranks)`: the experts are sharded by expert (DTensor parameters, a contiguous
range of experts per rank) and the attention is replicated. Every rank compiles the model with
`backend="hpu_moe"` and reports: MoE layers fused, the expert range each rank holds, graph breaks,
compiles, whether each fused call's output feeds a collective (the all-reduce stays outside the fused
region), and the largest difference of the compiled EP model's logits to the single-process model's.

    python tools/expert_parallel.py                        # 2 and 4 ranks, markdown table on stdout
    python tools/expert_parallel.py --ranks 2 --models mixtral --forms grouped_mm --json ep.json
    torchrun --nproc-per-node 2 tools/expert_parallel.py   # the same, launched by torchrun

The process group uses gloo on CPU (`--backend`: nccl on CUDA, hccl on Gaudi, with `--device`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODELS = ("mixtral", "qwen3_moe")
FORMS = ("grouped_mm", "batched_mm")
EP_IMPLEMENTATIONS = ("all_reduce", "all_to_all")
TOKENS = 12


@dataclass(frozen=True)
class Config:
    ranks: int
    model: str
    form: str
    ep_implementation: str = "all_reduce"
    attention: str = "replicated"  # or "tensor_parallel": the model's own tp_plan (attention sharded)


@dataclass
class RankResult:
    rank: int
    moe_layers: int
    fused: int
    windows: list[str] = field(default_factory=list)  # "experts a..b of E" per fused layer
    graph_breaks: int = 0
    compiles: int = 0
    recompiles: int = 0
    fused_feeds_collective: bool = False
    kernel_calls: list[dict] = field(default_factory=list)  # per fused call: op, expert range, ids' producer
    max_difference: float = float("nan")
    eager_difference: float = float("nan")
    declined: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    report: str = ""


def transformers_expert_parallel() -> str | None:
    """None when the installed transformers splits experts over ranks (`DistributedConfig(ep_size=...)`),
    else why not (older releases have tensor parallelism only)."""
    try:
        import inspect

        import transformers
        from transformers.distributed import DistributedConfig
    except ImportError as error:
        return f"transformers has no DistributedConfig ({error})"
    if "ep_size" not in inspect.signature(DistributedConfig).parameters:
        return f"transformers {transformers.__version__}: DistributedConfig takes no ep_size (no expert parallelism)"
    return None


def tiny_config(model: str):
    """A 2-layer, 8-expert, top-2 config of the family, small enough for CPU tests."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    if model == "mixtral":
        return MixtralConfig(**common, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    if model == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, intermediate_size=48, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
            head_dim=8, norm_topk_prob=True,
        )
    raise ValueError(f"unknown model {model!r}; known: {MODELS}")


def save_tiny_model(model: str, directory: str) -> str:
    """Save a seeded random tiny model of the family under `directory`; returns its path."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    path = os.path.join(directory, model)
    AutoModelForCausalLM.from_config(tiny_config(model)).save_pretrained(path)
    return path


ATTENTION = ("replicated", "tensor_parallel")


def tp_plan(attention: str) -> dict[str, str] | None:
    """The tp_plan for `attention`: rules that keep attention whole on every rank, or None for the
    model's own plan (attention heads sharded over the ranks, DTensors computed in the graph). Either
    way the EP group is the tensor-parallel group, as transformers' all-reduce EP needs."""
    if attention == "tensor_parallel":
        return None
    return {f"model.layers.*.self_attn.{p}_proj": "replicate" for p in "qkvo"}


def fused_feeds_collective(gm: torch.fx.GraphModule) -> bool:
    """Whether every fused MoE call's output reaches a c10d collective in `gm` (the all-reduce that
    sums the ranks' shares stays outside the fused region, in the same graph)."""
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and "mixture_of_experts" in str(n.target)]
    if not fused:
        return False

    def reaches_collective(node) -> bool:
        seen, stack = set(), [node]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if current.op == "call_function" and "c10d" in str(current.target):
                return True
            stack.extend(current.users)
        return False

    return all(reaches_collective(n) for n in fused)


def kernel_call(node: torch.fx.Node) -> dict:
    """What a fused call hands the kernel: the op, the expert range, total_experts, and the op that
    produced its routing table (through casts and views): `topk` when it takes the router's own ids."""
    names = [a.name for a in node.target._schema.arguments]
    values = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    table = values["expert_routing_table"]
    passing = ("aten._to_copy.", "aten.view.", "aten.reshape.", "aten.clone.")
    while table.op == "call_function" and str(table.target).startswith(passing):
        table = table.args[0]
    producer = table.args[0] if "getitem" in str(table.target) else table
    return {
        "op": str(node.target),
        "experts_min": values["experts_min"],
        "experts_max": values["experts_max"],
        "total_experts": values.get("total_experts"),
        "ids_from": str(getattr(producer, "target", producer)),
    }


class _RecordingInductor:
    """The inner backend: inductor, after noting what each fused call takes and whether it feeds a
    collective."""

    __name__ = "inductor"

    def __init__(self) -> None:
        self.graphs_feeding: list[bool] = []
        self.calls: list[dict] = []

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        fused = [n for n in gm.graph.nodes if n.op == "call_function" and "mixture_of_experts" in str(n.target)]
        if fused:
            self.graphs_feeding.append(fused_feeds_collective(gm))
            self.calls.extend(kernel_call(n) for n in fused)
        return compile_fx(gm, example_inputs)


def run_rank(config: Config, path: str, rank: int, device: str = "cpu") -> RankResult:
    """One rank's result for `config` (the process group is already up)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import moe_passes
    from moe_passes.explain import explain_and_run

    ids = (torch.arange(TOKENS).reshape(1, TOKENS) * 5 % 64).to(device)
    reference = AutoModelForCausalLM.from_pretrained(path, experts_implementation=config.form).to(device).eval()
    distributed = DistributedConfig(
        tp_size=config.ranks,
        ep_size=config.ranks,
        tp_plan=tp_plan(config.attention),
        ep_implementation=config.ep_implementation,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path, experts_implementation=config.form, distributed_config=distributed
        ).eval()
    with torch.no_grad():
        expected = reference(ids).logits
        eager = model(ids).logits
    inner = _RecordingInductor()
    report, output = explain_and_run(model, ids, options={"inner": inner, "target": "auto"})
    del moe_passes  # imported for its backend registration
    return RankResult(
        rank=rank,
        moe_layers=model.config.num_hidden_layers,
        fused=len(report.fused),
        windows=[f.experts_text() for f in report.fused],
        graph_breaks=report.graph_break_count,
        compiles=report.compile_count,
        recompiles=report.recompile_count,
        fused_feeds_collective=bool(inner.graphs_feeding) and all(inner.graphs_feeding),
        kernel_calls=inner.calls,
        max_difference=(output.logits.float() - expected.float()).abs().max().item(),
        eager_difference=(eager.float() - expected.float()).abs().max().item(),
        declined=[d.reason for d in report.declined],
        fallbacks=list(report.fallbacks),
        advice=list(report.advice),
        report=str(report),
    )


def run_setup(setup: str | None) -> None:
    """Import `module` (or call `module:function`) in a rank before it compiles: e.g. habana_frameworks.torch
    on Gaudi, whose import registers the kernel."""
    if not setup:
        return
    module, _, function = setup.partition(":")
    imported = importlib.import_module(module)
    if function:
        getattr(imported, function)()


def keep_to_device(device: str) -> None:
    """On a CPU run, hide CUDA devices from this rank before anything initialises CUDA: transformers
    builds its device mesh for the machine's accelerator, and CPU tensors on a CUDA mesh crash gloo's
    collectives (torch 2.11 on the GPU machine: a segfault in the first all-gather)."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _worker(rank: int, world_size: int, port: int, backend: str, device: str, jobs, outbox, setup=None) -> None:
    keep_to_device(device)
    run_setup(setup)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = [asdict(run_rank(config, path, rank, device)) for config, path in jobs]
    finally:
        dist.destroy_process_group()
    outbox.put((rank, results))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    configs: list[Config], backend: str = "gloo", device: str = "cpu", setup: str | None = None
) -> list[tuple[Config, list[RankResult]]]:
    """Every configuration on its number of ranks (spawned processes); results per rank, rank order.
    `setup`: see `run_setup`."""
    import torch.multiprocessing as mp

    out = []
    with tempfile.TemporaryDirectory() as directory:
        paths = {model: save_tiny_model(model, directory) for model in {c.model for c in configs}}
        for ranks in sorted({c.ranks for c in configs}):
            jobs = [(c, paths[c.model]) for c in configs if c.ranks == ranks]
            context = mp.get_context("spawn")
            outbox = context.SimpleQueue()
            processes = mp.start_processes(
                _worker,
                args=(ranks, _free_port(), backend, device, jobs, outbox, setup),
                nprocs=ranks,
                join=False,
                start_method="spawn",
            )
            by_rank = {}
            while len(by_rank) < ranks:  # read before joining: a full pipe would block the workers
                if not outbox.empty():
                    rank, results = outbox.get()
                    by_rank[rank] = results
                elif processes.join(timeout=1):
                    break  # every worker exited (one failed: join raised); an empty outbox is an error
            while not outbox.empty():
                rank, results = outbox.get()
                by_rank[rank] = results
            processes.join()
            missing = sorted(set(range(ranks)) - set(by_rank))
            if missing:
                raise RuntimeError(f"ranks {missing} of {ranks} returned no result")
            for i, (config, _) in enumerate(jobs):
                out.append((config, [RankResult(**by_rank[r][i]) for r in range(ranks)]))
    return out


def _under_torchrun(configs: list[Config], backend: str, device: str, setup: str | None):
    """Launched by torchrun: this process is one rank of WORLD_SIZE; rank 0 gathers the results."""
    keep_to_device(device)
    run_setup(setup)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with tempfile.TemporaryDirectory() as directory:
            mine = [c for c in configs if c.ranks == world]
            paths = {}
            for model in sorted({c.model for c in mine}):
                holder = [save_tiny_model(model, directory) if rank == 0 else None]
                dist.broadcast_object_list(holder, src=0)  # ranks share a file system here
                paths[model] = holder[0]
            results = [run_rank(c, paths[c.model], rank, device) for c in mine]
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(results, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return [(c, [gathered[r][i] for r in range(world)]) for i, c in enumerate(mine)]


def table(results) -> str:
    lines = [
        "| ranks | model | experts | EP | attention | fused / MoE layers (every rank) | ranks' experts | graph breaks | "
        "compiles per rank | all-reduce after the fused call | max diff vs 1 process |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, ranks in results:
        fused = "/".join(str(r.fused) for r in ranks)
        layers = ranks[0].moe_layers
        windows = ", ".join(sorted({w.split(": ", 1)[-1] for r in ranks for w in r.windows})) or "-"
        feeds = "yes" if all(r.fused_feeds_collective for r in ranks) else "no"
        worst = max(r.max_difference for r in ranks)
        lines.append(
            f"| {config.ranks} | {config.model} | {config.form} | {config.ep_implementation} | {config.attention} | "
            f"{fused} of {layers} | "
            f"{windows} | {max(r.graph_breaks for r in ranks)} | {max(r.compiles for r in ranks)} | {feeds} | "
            f"{worst:.1e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--ep-implementation", nargs="+", default=["all_reduce"], choices=EP_IMPLEMENTATIONS)
    parser.add_argument("--attention", nargs="+", default=["replicated"], choices=ATTENTION)
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo, nccl, hccl)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--setup", help="module (or module:function) each rank imports first, e.g. habana_frameworks.torch")
    parser.add_argument("--json", help="write the per-rank results here")
    parser.add_argument("--reports", action="store_true", help="print each rank's moe_passes report")
    args = parser.parse_args(argv)
    configs = [
        Config(r, m, f, e, a)
        for r in args.ranks
        for m in args.models
        for f in args.forms
        for e in args.ep_implementation
        for a in args.attention
    ]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        results = _under_torchrun(configs, args.backend, args.device, args.setup)
        if results is None:
            return 0
    else:
        results = run(configs, args.backend, args.device, args.setup)
    print(f"torch {torch.__version__}, {args.backend} on {args.device}")
    print(table(results))
    if args.reports:
        for config, ranks in results:
            for r in ranks:
                print(f"\n== {config} rank {r.rank}\n{r.report}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"config": asdict(c), "ranks": [asdict(r) for r in rs]} for c, rs in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
