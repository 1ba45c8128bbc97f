"""Coverage table: every MoE family of the installed transformers x experts implementation.

For each model family whose modeling code uses `use_experts_implementation`, build a tiny random
causal LM (2 layers, 4 experts, top-2; sizes shrunk generically from the config's defaults), compile
it with `backend="hpu_moe"` under each implementation, and record: fused layers / MoE layers, declined
candidates with reasons, graph breaks, and the logits' max difference to the unrewritten model.
Families whose tiny model cannot be built generically are listed with the construction error; MoE
families that do not use `use_experts_implementation` (their own expert code) run once, as "own forward".

    python tools/coverage.py                       # markdown table on stdout
    python tools/coverage.py --families mixtral qwen3_moe --json coverage.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import moe_passes  # noqa: E402
from moe_passes.explain import explain_and_run  # noqa: E402

IMPLEMENTATIONS = ("grouped_mm", "batched_mm")

# Generic shrinking: each key is set when the config has that attribute.
TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    expert_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    top_k=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=128,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=16,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_shared_experts=1,
    num_shared_experts=1,
)


MOE_CLASS = re.compile(r"^class \w*(SparseMoe|MoE|Moe|Experts)\w*\(", re.M)


def moe_families() -> dict[str, bool]:
    """{family: uses use_experts_implementation} for every family whose modeling code holds an MoE."""
    import transformers.models as models

    families = {}
    for info in pkgutil.iter_modules(models.__path__):
        path = os.path.join(models.__path__[0], info.name, f"modeling_{info.name}.py")
        if not os.path.exists(path):
            continue
        source = open(path).read()
        if "use_experts_implementation" in source:
            families[info.name] = True
        elif MOE_CLASS.search(source):
            families[info.name] = False
    return dict(sorted(families.items()))


def causal_lm_class(family: str):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    candidates = [
        cls
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if name.endswith("ForCausalLM") and cls.__module__ == module.__name__
    ]
    if not candidates:
        raise LookupError("no *ForCausalLM class")
    return sorted(candidates, key=lambda c: len(c.__name__))[0]


def tiny_config(model_cls, implementation: str):
    config = model_cls.config_class()
    for key, value in TINY.items():
        if hasattr(config, key) and getattr(config, key) is not None:
            setattr(config, key, value)
    for key in ("layer_types", "mlp_layer_types"):
        value = getattr(config, key, None)
        if isinstance(value, list) and value:
            setattr(config, key, value[: config.num_hidden_layers])
    if implementation in IMPLEMENTATIONS:
        config.experts_implementation = implementation
        if hasattr(config, "_experts_implementation_internal"):
            config._experts_implementation_internal = implementation
    return config


def moe_layer_count(model) -> int:
    return sum(
        1 for m in model.modules() if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")
    )


def run(family: str, implementation: str) -> dict:
    row = {"family": family, "implementation": implementation}
    try:
        model_cls = causal_lm_class(family)
        torch.manual_seed(0)
        model = model_cls(tiny_config(model_cls, implementation)).eval()
        ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model(ids).logits
    except Exception as error:  # noqa: BLE001 - recorded in the table
        row.update(status="not built", reason=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
        return row
    row["moe_layers"] = moe_layer_count(model)
    try:
        report, output = explain_and_run(model, ids, options={"inner": "eager", "target": "portable"})
    except Exception as error:  # noqa: BLE001
        row.update(
            status="compile failed", reason=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        )
        return row
    row.update(
        fused=len(report.fused),
        declined=[d.reason for d in report.declined],
        graph_breaks=report.graph_break_count,
        fallbacks=report.fallbacks,
        max_error=(output.logits.float() - expected.float()).abs().max().item(),
    )
    if report.fused and len(report.fused) == row["moe_layers"] and not report.graph_break_count:
        row["status"] = "fused"
    elif report.fused:
        row["status"] = "partly fused"
    else:
        row["status"] = "declined" if report.declined else "not found"
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| family | implementation | result | fused / MoE layers | breaks | max logit diff | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reason = r.get("reason") or "; ".join(sorted(set(r.get("declined", []))))[:200]
        fused = f"{r['fused']}/{r['moe_layers']}" if "fused" in r else ""
        error = f"{r['max_error']:.2g}" if "max_error" in r else ""
        lines.append(
            f"| {r['family']} | {r['implementation']} | {r['status']} | {fused} | "
            f"{r.get('graph_breaks', '')} | {error} | {reason} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import transformers

    rows = []
    families = moe_families()
    for family in args.families or families:
        for implementation in IMPLEMENTATIONS if families.get(family, True) else ("own forward",):
            try:
                rows.append(run(family, implementation))
            except Exception:  # noqa: BLE001 - one family never stops the table
                rows.append(
                    {
                        "family": family,
                        "implementation": implementation,
                        "status": "error",
                        "reason": traceback.format_exc().splitlines()[-1][:160],
                    }
                )
            print(f"{family:28s} {implementation:10s} {rows[-1]['status']}", file=sys.stderr)
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, moe_passes {moe_passes.__version__}\n"
    )
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
