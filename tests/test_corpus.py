"""The wild corpus (form_catalog/corpus/), measured as tools/corpus.py measures it: never worse than eager.

Every entry compiles and runs with backend="hpu_moe" wherever backend="eager" does, and a fused entry
equals eager. The outcome of each entry is pinned below, so that a change in what is fused, declined or
not captured shows here (and docs/corpus/ is regenerated with `python tools/corpus.py`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from form_catalog.corpus import entries
from tests.helpers import torch_release

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("corpus_tool", ROOT / "tools" / "corpus.py")
corpus_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus_tool)

# Measured on torch 2.13 (the development wheel); docs/corpus/after*.md hold the tables, torch 2.9 included.
PINNED_ON = (2, 13)
OUTCOMES = {
    "afmoe_trinity": "fused",
    "arctic_moe": "fused",
    "aria_moe": "fused",
    "bailing_moe": "fused",
    "bailing_moe_v2": "fused",
    "blackmamba_moe": "declined",
    "chaofa_share_expert_moe": "declined",
    "colossalai_moe": "declined",
    "competesmoe_siglip": "declined",
    "cumo_moe": "declined",
    "davidmrau_moe": "not captured",
    "dbrx_reference_moe": "fused",
    "deepctr_mmoe": "declined",
    "deepseek_moe_16b": "fused",
    "deepseek_v3_hub_moe_infer": "fused",
    "deepseek_v3_inference": "fused",
    "deepseek_vl2_moe": "fused",
    "deepspeed_moe": "not captured",
    "doge_cdmoe": "no candidate",
    "dolomite_moe": "not captured",
    "dynmoe_topany": "declined",
    "ernie45_moe": "fused",
    "esft_deepseek_moe": "fused",
    "fairscale_moe": "declined",
    "fairseq_moe": "declined",
    "feizc_dit_moe": "fused",
    "glm45_moe": "fused",
    "gpt_fast_mixtral_moe": "fused",
    "gpt_oss_torch_reference": "fused",
    "grok1_moe": "declined",
    "grove_moe": "fused",
    "hf_nllb_moe": "declined",
    "hf_switch_transformers": "declined",
    "hidream_i1_moe": "fused",
    "hunyuan_a13b_moe": "declined",
    "hunyuan_large_moe": "fused",
    "internevo_moe": "declined",
    "jamba_v01_remote_moe": "fused",
    "jetmoe_original": "fused",
    "jetstream_mixtral_moe": "fused",
    "kimi_linear_moe": "fused",
    "ktransformers_experts": "fused",
    "kyegomez_switch": "not captured",
    "labml_switch": "fused",
    "litgpt_llama_moe": "fused",
    "llama4_reference_moe": "declined",
    "llama_moe": "declined",
    "llm_foundry_dmoe": "fused",
    "llmcompressor_qwen3_moe": "declined",
    "longcat_flash_fused_experts": "fused",
    "longcat_flash_moe": "fused",
    "longcat_next_deterministic": "fused",
    "lucidrains_moe": "declined",
    "lucidrains_soft_moe": "declined",
    "lucidrains_st_moe": "declined",
    "make_moe": "declined",
    "megatron_moe": "declined",
    "megatron_switch_mlp": "declined",
    "minicpm_moe": "fused",
    "minimax_m2_moe": "fused",
    "minimax_text01_moe": "fused",
    "minimind3_moe": "fused",
    "minimind_moe": "fused",
    "mistral_inference_moe": "fused",
    "mixlora_sparse_moe": "declined",
    "mixtral_offloading": "not captured",
    "mixtralkit_moe": "fused",
    "moduleformer_moe": "not captured",
    "moe_mamba_switch_block": "not captured",
    "moefication_moe": "declined",
    "moirai_moe": "fused",
    "nano_moe": "declined",
    "nanotron_moe": "not captured",
    "nemo_automodel_kimivl_moe": "not captured",
    "nomic_embed_v2_moe": "declined",
    "olmo_core_moe": "not captured",
    "openmoe": "declined",
    "opennmt_moe": "declined",
    "optimum_habana_moe": "fused",
    "phi35_moe": "fused",
    "pytorch_mixtures_expert_choice": "declined",
    "rasbt_gpt_moe": "fused",
    "remoe_relu_router": "declined",
    "sglang_native_moe": "fused",
    "skywork_moe_plus_plus": "fused",
    "smallthinker_moe": "fused",
    "time_moe": "fused",
    "torchao_mixtral_moe": "declined",
    "torchscale_xmoe": "declined",
    "torchtitan_moe": "declined",
    "torchtune_llama4_moe": "declined",
    "torchtune_qwen3_moe": "fused",
    "trtllm_vanilla_moe": "fused",
    "tt_forge_deepseek_v3_batched": "fused",
    "tutel_moe": "not captured",
    "unimoe2_dcmoe": "not captured",
    "unsloth_qwen3_moe": "fused",
    "vllm_gaudi_static_moe": "fused",
    "vllm_omni_lingbot_dense": "fused",
    "xverse_moe": "fused",
    "yuan2_m32_moe": "fused",
}


def test_every_entry_has_a_pinned_outcome():
    assert sorted(entries()) == sorted(OUTCOMES)


@pytest.mark.parametrize("name", sorted(OUTCOMES))
def test_entry_is_never_worse_than_eager(name):
    row = corpus_tool.measure(name)
    assert row["eager_compile"] == "ok", row
    assert row["outcome"] not in ("RAISES", "WRONG"), row
    if torch_release() == PINNED_ON:  # other torch releases capture differently (docs/corpus/after_torch29.md)
        assert row["outcome"] == OUTCOMES[name], row
    if row["outcome"] != "fused":
        assert row["detail"], row  # a decline or a break says what stopped it
