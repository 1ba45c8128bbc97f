"""Tiny random transformers models of any MoE family, for the dump tool, the coverage table and tests.

`tiny_model(family, implementation)` builds the family's causal LM (else its text model) from its config
class with every size shrunk (2 layers, 4 experts, top-2 unless the family only allows other values;
`TINY` generically, `FAMILY_OVERRIDES` per family, each commented), seeded and in eval mode, with the
requested experts implementation; `inputs(model)` gives it a batch of token ids. transformers is
imported only when a model is built.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re

import torch

IMPLEMENTATIONS = ("grouped_mm", "batched_mm")  # the stacked-expert implementations (both fused)
ALL_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "eager")  # eager: the loop over the experts that were hit
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
    moe_k=2,  # ERNIE-4.5-MoE 4.x: top-k under its own name (num_experts_per_tok maps to it only in 5.x)
    use_mamba_kernels=False,  # Jamba 4.x: the CUDA-only fast Mamba kernels are required unless turned off
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
# The TINY keys that count layers (of the decoder, encoder, or their sparse layers).
LAYER_COUNTS = (
    "num_hidden_layers",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
    "num_sparse_encoder_layers",
    "num_sparse_decoder_layers",
)
# Switches that turn a family's MoE block on (off by default in some configs), set where present.
MOE_ON = dict(enable_moe_block=True, is_moe=True)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# 4.x configs that leave `layer_types` None although the model indexes it (GraniteMoE-Hybrid 4.57 maps
# `layers_block_type` to it): every layer of this kind.
UNSET_LAYER_TYPES = {"granitemoehybrid": "attention"}

# Per-family config overrides (constructor keyword arguments of the config that is shrunk: the text
# config where the model is built from one), for what the generic shrinking cannot know.
FAMILY_OVERRIDES: dict[str, dict] = {
    # sizes live in sub-configs; DbrxAttention reads attn_config.rope_theta (not a DbrxAttentionConfig
    # field) and clamps q/k/v with clip_qkv unconditionally (None fails): give both
    "dbrx": dict(
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2),
    ),
    # 4.x derives its query heads as kv heads x top-k (the attention is a mixture of heads); its head size
    # (kv_channels, default 128) must equal hidden / heads, which 4.55's rotary embedding assumes
    "jetmoe": dict(
        num_attention_heads=TINY["num_key_value_heads"] * TINY["num_experts_per_tok"],
        kv_channels=TINY["hidden_size"] // (TINY["num_key_value_heads"] * TINY["num_experts_per_tok"]),
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


def tiny_kwargs(config_cls, family: str, layers: int | None = None) -> dict:
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
    layers = layers or TINY["num_hidden_layers"]
    layer_types = values.get("layer_types")
    if layer_types is None and family in UNSET_LAYER_TYPES and _settable(config_cls, "layer_types"):
        kwargs["layer_types"] = [UNSET_LAYER_TYPES[family]] * layers
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
    if layers != TINY["num_hidden_layers"]:
        kwargs.update({aliases.get(k, k): layers for k in LAYER_COUNTS if aliases.get(k, k) in kwargs})
    return {aliases.get(key, key): value for key, value in kwargs.items()}


def modeling_source(family: str) -> str:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return inspect.getsource(module)


def rope_kwargs(family: str, values: dict) -> dict:
    """Multimodal RoPE (M-RoPE) sections scaled to the tiny head dim (they must sum to its rotary half).

    transformers 4.x keeps them in `rope_scaling`, which some 4.57 configs leave None although the model
    reads `rope_scaling.get("mrope_section", ...)` (Qwen3-VL-MoE, Qwen3-Omni-MoE): a default RoPE then.
    """
    key = "rope_parameters" if "rope_parameters" in values else "rope_scaling"
    rope = values.get(key)
    if rope is None and key == "rope_scaling" and re.search(r'rope_scaling\.get\(\s*"mrope_section"', modeling_source(family)):
        rope = {"rope_type": "default"}
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
    return {key: {**rope, "mrope_section": scaled}}


def model_types() -> list[str]:
    """Every model type (family) of the installed transformers with its own modeling code."""
    import transformers.models as models

    return sorted(
        info.name
        for info in pkgutil.iter_modules(models.__path__)
        if os.path.exists(os.path.join(models.__path__[0], info.name, f"modeling_{info.name}.py"))
    )


def tiny_model(family: str, implementation: str | None, layers: int | None = None):
    """The tiny model of `family`, in eval mode, with `implementation` as its experts implementation
    (one of ALL_IMPLEMENTATIONS; None or "own forward" keeps the family's default) and `layers` layers.
    """
    if family in NOT_BUILDABLE:
        raise NotBuildable(NOT_BUILDABLE[family])
    if family not in model_types():
        raise NotBuildable(f"transformers has no model type {family!r}")
    if layers is not None and (not isinstance(layers, int) or layers < 1):
        raise ValueError(f"layers must be a positive int, got {layers!r}")
    model_cls = model_class(family)
    config_cls = model_cls.config_class
    config = config_cls(**tiny_kwargs(config_cls, family, layers))
    if implementation in ALL_IMPLEMENTATIONS:
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
