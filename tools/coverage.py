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

    python tools/coverage.py                       # markdown table on stdout
    python tools/coverage.py --families mixtral qwen3_moe --json coverage.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import logging
import os
import pkgutil
import re
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import moe_passes  # noqa: E402
from moe_passes.explain import explain_and_run  # noqa: E402

IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
VOCAB = 128
SEQ = 6

# Generic shrinking: each key is passed to the config's constructor when the config has that attribute
# (also when its default is None: many MoE configs leave the expert count or top-k unset), so that derived
# fields (layer_types, mlp_layer_types, head_dim, ...) follow the tiny sizes.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    expert_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_hidden_layers=2,
    num_layers=2,  # T5-style (Switch Transformers) and DBRX names
    num_decoder_layers=2,
    encoder_layers=2,  # BART-style (NLLB-MoE) names
    decoder_layers=2,
    num_sparse_encoder_layers=2,  # Switch: every encoder/decoder layer sparse
    num_sparse_decoder_layers=2,
    encoder_sparse_step=1,
    num_dense_layers=0,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    num_heads=2,
    d_kv=16,
    d_ff=64,
    ffn_hidden_size=64,
    expert_ffn_hidden_size=16,
    moe_hidden_size=32,
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
    top_k_experts=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    moe_layer_freq=1,
    moe_layer_start_index=0,  # Ernie 4.5: MoE from the first layer (default: from layer 1)
    mlp_only_layers=[],
    max_position_embeddings=128,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=VOCAB,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=16,  # MLA: = head_dim (DeepSeek convention: head_dim is the RoPE part)
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_shared_experts=1,
    num_shared_experts=1,
    shared_intermediate_size=16,
    share_expert_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    mamba_n_heads=4,
    mamba_d_state=16,
    mamba_chunk_size=16,
    use_cache=False,  # one forward pass; hybrid (linear-attention only) caches cannot report a length
)
# Switches that turn a family's MoE block on (off by default in some configs), set where present.
MOE_ON = dict(enable_moe_block=True, is_moe=True)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Per-family config overrides (constructor keyword arguments of the config that is shrunk: the text
# config where the model is built from one), for what the generic shrinking cannot know.
FAMILY_OVERRIDES: dict[str, dict] = {
    # sizes live in sub-configs; DbrxAttention reads attn_config.rope_theta (not a DbrxAttentionConfig
    # field) and clamps q/k/v with clip_qkv unconditionally (None fails): give both
    "dbrx": dict(
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2),
    ),
    # its sliding-window layers' head_dim must be the whole MLA q/k head (nope + rope), checked by the config
    "dots3_note": dict(head_dim=TINY["qk_nope_head_dim"] + TINY["qk_rope_head_dim"]),
    # DSA attention must be NoPE (qk_rope_head_dim 0) and its indexer / KDA sizes are not generic names
    "glm5_next": dict(
        qk_rope_head_dim=0,
        index_topk=16,
        index_kpool=4,
        index_head_dim=16,
        index_n_heads=2,
        linear_head_dim=16,
        linear_num_heads=2,
    ),
    # MoE every layer (default: every 2nd from layer 1) and one attention layer (default: 1 in 8)
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1),
    # layer_types has no default (None fails): one short-conv and one attention layer
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # num_hidden_layers counts two attention sublayers per decoder layer (4 -> 2 layers); few zero
    # experts; head_dim is the RoPE part of the MLA head (= qk_rope_head_dim)
    "longcat_flash": dict(num_hidden_layers=4, zero_expert_num=2, head_dim=TINY["qk_rope_head_dim"]),
    # sliding layers double the kv heads (2 * kv <= heads); partial_rotary_factor 0.334 of the tiny head
    # dim is an odd rotary dim: use 0.5
    "mimo_v2_flash": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
            for kind in ("full_attention", "sliding_attention")
        },
    ),
    # head_dim is the whole MLA q/k head (nope + rope), its RoPE part a fraction of it
    "mistral4": dict(head_dim=TINY["qk_nope_head_dim"] + TINY["qk_rope_head_dim"]),
    # each layer is one block kind (mamba / moe / attention / mlp): two MoE blocks around one attention
    "nemotron_h": dict(layer_types=["moe", "full_attention", "moe"]),
    # its indexed-attention layers need the QSA indexer fields (all None by default); low-rank mixer size
    "qwen4_exp": dict(
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        hc_lowrank=8,
    ),
    # the text model always builds a sliding-window mask, which needs sliding_window (None by default)
    "step3p7": dict(sliding_window=64),
    # the config rejects anything but top-1 routing
    "zaya": dict(num_experts_per_tok=1),
}

# Families whose tiny model cannot be built as a text model, with the reason (investigated by hand).
NOT_BUILDABLE: dict[str, str] = {
    "vitpose_backbone": "ViTPose backbone takes images, and its MoE MLP picks one expert per image by a given "
    "dataset_index (VitPoseNaiveMoe), not per token by a router",
}

LIST_MOE_VALUES = ("sparse", "moe", "experts")  # entries of mlp_layer_types that mean "MoE layer"
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


class NotBuildable(Exception):
    """The family has no model this script can build and feed token ids."""


def _is_composite(config_cls) -> bool:
    return bool(getattr(config_cls, "sub_configs_defaults", None))


def model_class(family: str):
    """The class to build: the causal LM, else the text model, else a text-only top-level model."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    classes = {
        name: cls
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__ and hasattr(cls, "config_class") and "PreTrained" not in name
    }

    def pick(suffix, text_only=False):
        found = [
            cls
            for name, cls in classes.items()
            if name.endswith(suffix) and not (text_only and _is_composite(cls.config_class))
        ]
        return sorted(found, key=lambda c: (len(c.__name__), c.__name__))[0] if found else None

    for suffix, text_only in (
        ("ForCausalLM", False),
        ("TextModel", True),
        ("ForConditionalGeneration", True),
        ("ForTokenClassification", True),
        ("Model", True),
    ):
        cls = pick(suffix, text_only)
        if cls is not None and "vocab_size" in _attributes(cls.config_class):
            return cls
    raise NotBuildable(f"no causal LM or text model among {', '.join(sorted(classes)) or 'its classes'}")


def _attributes(config_cls) -> dict:
    """The default config's attributes (per-layer ones included), without heterogeneity checks."""
    config = config_cls()
    values = dict(vars(config))
    for key in [*dir(type(config)), *config.attribute_map]:
        if not key.startswith("_") and key not in values:
            try:
                values[key] = config._getattr_without_heterogeneous_validation(key)
            except Exception:  # noqa: BLE001 - properties that need more than the defaults
                pass
    return values


def _settable(config_cls, key: str) -> bool:
    attribute = inspect.getattr_static(config_cls, key, None)
    return not isinstance(attribute, property) or attribute.fset is not None


def tiny_kwargs(config_cls, family: str) -> dict:
    """Constructor kwargs that make `config_cls` tiny: TINY, layer lists, token ids, family overrides."""
    default = config_cls()
    values = _attributes(config_cls)
    aliases = default.attribute_map  # e.g. DBRX: hidden_size -> d_model
    kwargs = {}
    for key, value in TINY.items():
        if key in values and _settable(config_cls, key):
            if isinstance(values[key], list) and values[key] and isinstance(value, int):
                # per-modality sizes, e.g. Ernie 4.5 VL's text and vision experts
                value = [value] * len(values[key])
            kwargs[aliases.get(key, key)] = value
    kwargs.update({key: value for key, value in MOE_ON.items() if key in values})
    layers = TINY["num_hidden_layers"]
    layer_types = values.get("layer_types")
    if isinstance(layer_types, list) and layer_types and _settable(config_cls, "layer_types"):
        # keep every kind of layer the family has (hybrids: one full/indexed attention layer next to the
        # linear-attention one; the cache needs an attention layer to know the sequence length)
        kinds = list(dict.fromkeys(layer_types))
        kwargs["layer_types"] = (kinds + [kinds[0]] * layers)[:layers]
    kwargs.update(rope_kwargs(family, values))
    mlp_types = values.get("mlp_layer_types", ())
    if "mlp_layer_types" in values and _settable(config_cls, "mlp_layer_types"):
        # every layer an MoE layer ("sparse" where the default leaves the list to __post_init__)
        moe = [value for value in mlp_types or () if value in LIST_MOE_VALUES]
        kwargs["mlp_layer_types"] = [moe[0] if moe else "sparse"] * layers
    for key, value in TOKEN_IDS.items():
        if isinstance(values.get(key), int) and values[key] >= VOCAB:
            kwargs[key] = value
        elif isinstance(values.get(key), list):
            kwargs[key] = [value]
    if getattr(default, "is_heterogeneous", False):
        overrides = default._heterogeneity_spec.per_layer_overrides
        kwargs["per_layer_config"] = {
            index: {key: kwargs.get(key, value) for key, value in layer.items()}
            for index, layer in overrides.items()
            if index < layers
        }
    kwargs.update(FAMILY_OVERRIDES.get(family, {}))
    return {aliases.get(key, key): value for key, value in kwargs.items()}


def modeling_source(family: str) -> str:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return inspect.getsource(module)


def rope_kwargs(family: str, values: dict) -> dict:
    """Multimodal RoPE (M-RoPE) sections scaled to the tiny head dim (they must sum to its rotary half)."""
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict):
        return {}
    sections = rope.get("mrope_section")
    if sections is None:
        # the modeling code's default, e.g. rope_parameters.get("mrope_section", [8, 12, 12])
        found = re.search(r'get\(\s*"mrope_section"\s*,\s*\[([\d,\s]+)\]', modeling_source(family))
        if not found:
            return {}
        sections = [int(x) for x in found.group(1).split(",")]
    factor = rope.get("partial_rotary_factor") or values.get("partial_rotary_factor") or 1.0
    target = int(TINY["head_dim"] * factor) // 2
    scaled = [max(1, round(s * target / sum(sections))) for s in sections]
    scaled[-1] = target - sum(scaled[:-1])
    return {"rope_parameters": {**rope, "mrope_section": scaled}}


def tiny_model(family: str, implementation: str):
    """The tiny model of `family`, in eval mode, with `implementation` as its experts implementation."""
    if family in NOT_BUILDABLE:
        raise NotBuildable(NOT_BUILDABLE[family])
    model_cls = model_class(family)
    config_cls = model_cls.config_class
    config = config_cls(**tiny_kwargs(config_cls, family))
    if implementation in IMPLEMENTATIONS:
        config.experts_implementation = implementation
        if hasattr(config, "_experts_implementation_internal"):
            config._experts_implementation_internal = implementation
    torch.manual_seed(0)
    return model_cls(config).eval()


def inputs(model) -> tuple[tuple, dict]:
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    kwargs = {}
    if getattr(model.config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids
    return (ids,), kwargs


def output_tensor(output) -> torch.Tensor:
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, torch.Tensor):
        return output
    return output[0]


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


def run(family: str, implementation: str) -> dict:
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
        max_error=(output_tensor(output).float() - expected.float()).abs().max().item(),
        seconds=round(time.perf_counter() - start, 1),
    )
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
    lines = [
        "| family | implementation | result | fused / MoE layers | breaks | max output diff | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reason = (r.get("reason") or "").replace("|", "/")[:400]
        fused = f"{r.get('fused', '-')}/{r['moe_layers']}" if "moe_layers" in r else ""
        error = f"{r['max_error']:.2g}" if "max_error" in r else ""
        lines.append(
            f"| {r['family']} | {r['implementation']} | {r['status']} | {fused} | "
            f"{r.get('graph_breaks', '')} | {error} | {reason} |"
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
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
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
