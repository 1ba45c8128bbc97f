"""The catalog of MoE source forms the passes meet in the wild (not installed with the package).

Each module mirrors one real-world form in plain PyTorch, cites the code it mirrors, offers
`build(**overrides) -> (module, example_inputs)` with small defaults, and states in `EXPECTED` the
rewrite it must get (or why it must be declined). The demo, the tests and the tools run from here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._expected import Expected

FORMS = (
    "static_dense_loop",
    "modulelist_dense_mask",
    "hf_grouped_mm",
    "hf_batched_mm",
    "hf_transposed_experts",
    "hf517_grouped_mm",
    "hf517_batched_mm",
    "gpt_oss_experts",
    "qwen2_shared_expert",
    "deepseek_v3_routing",
    "hf4_sparse_loop",
    "mixtral4_sparse_loop",
    "hf4_hit_expert_loop",
    "gpt_oss4_hit_loop",
    "gpt_oss4_dense_bmm",
    "granite4_segments",
    "deepseek_v2_count_loop",
    "aria4_offset_segments",
    "expert_parallel_sparse_loop",
    "mistral_where_loop",
    "torchtitan_grouped_experts",
    "gpt_fast_gathered_einsum",
    "sglang_native_einsum",
    "vllm_omni_dense_einsum",
    "megatron_sequential_mlp",
    "near_miss_input_scaled",
    "near_miss_mixed_activation",
    "near_miss_output_escapes",
    "near_miss_unequal_experts",
    "near_miss_exact_gelu",
    "near_miss_clamped_swiglu",
    "near_miss_concatenated_swiglu",
    "near_miss_llama4_dense_bmm",
    "near_miss_data_dependent_loop",
    "near_miss_torchtitan_score_before_experts",
    "near_miss_deepspeed_capacity",
)


def catalog() -> dict[str, ModuleType]:
    """{form name: module}, in a stable order."""
    return {name: importlib.import_module(f"{__name__}.{name}") for name in FORMS}


def dynamo_config(form: ModuleType):
    """The `torch._dynamo.config` patch a form needs to be captured as its docstring says (often none)."""
    import torch

    return torch._dynamo.config.patch(**getattr(form, "DYNAMO_CONFIG", {}))


__all__ = ["Expected", "catalog", "dynamo_config", "FORMS"]
