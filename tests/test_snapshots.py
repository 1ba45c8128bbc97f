"""Snapshots of every rewritten catalog graph, through the project's own stable printer.

Re-record with EXPECTTEST_ACCEPT=1 and read the diff before committing it.
"""

from __future__ import annotations

import expecttest
import torch

from form_catalog import catalog, dynamo_config
from moe_passes.printer import format_fused_calls, format_graph
from tests.helpers import run_hpu_moe, skip_unless_dynamo_slices_for


def rewritten_graph(name: str, **overrides) -> torch.fx.GraphModule:
    form = catalog()[name]
    model, inputs = form.build(layers=1, **overrides)
    with dynamo_config(form):
        _, _, recorder = run_hpu_moe(model, inputs)
    (graph,) = recorder.graphs
    return graph


def test_every_fused_catalog_form_has_a_snapshot():
    """A form the rewrite fuses is pinned here (a near miss is pinned by its decline reason: EXPECTED)."""
    methods = [name for name in dir(TestRewrittenGraphs) if name.startswith("test_")]
    missing = [
        name for name, form in catalog().items()
        if form.EXPECTED.fused and not any(m == f"test_{name}" or m.startswith(f"test_{name}_") for m in methods)
    ]
    assert not missing, f"add a snapshot method to TestRewrittenGraphs for {missing} (docs/adding_a_form.md)"


class TestRewrittenGraphs(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_static_dense_loop(self):
        self.assertExpectedInline(
            format_graph(rewritten_graph("static_dense_loop")),
            """\
graph(in0, in1, in2, in3, in4, in5):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = aten.reshape(%1, [-1, 16])
  %12 = moe_passes.mixture_of_experts.stacked_fused_weights(%11, %8, %10, in4, in5, True, 'silu', 0, 3)
  %13 = aten.reshape(%12, [1, 6, 16])
  %14 = aten.reshape(%13, [1, 6, 16])
  %15 = aten.add.Tensor(in2, %14)
  return [%15]""",
        )

    def test_modulelist_dense_mask(self):
        self.assertExpectedInline(
            format_graph(rewritten_graph("modulelist_dense_mask")),
            """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9, in10, in11, in12, in13, in14, in15):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = aten.reshape(%1, [-1, 16])
  %12 = moe_passes.mixture_of_experts(%11, %8, %10, [in4, in7, in10, in13], [in5, in8, in11, in14], [in6, in9, in12, in15], True, 'silu', 0, 3)
  %13 = aten.reshape(%12, [1, 6, 16])
  %14 = aten.add.Tensor(in2, %13)
  return [%14]""",
        )

    def test_hf_grouped_mm(self):
        self.assertExpectedInline(
            format_graph(rewritten_graph("hf_grouped_mm")),
            """\
graph(in0, in1, in2, in3, in4, in5):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._to_copy(%4, dtype=float32)
  %6 = aten._softmax(%5, -1, False)
  %7 = aten.topk(%6, 2)
  %8 = getitem(%7, 0)
  %9 = getitem(%7, 1)
  %10 = aten.sum.dim_IntList(%8, [-1], True)
  %11 = aten.div.Tensor(%8, %10)
  %12 = aten._to_copy(%11, dtype=bfloat16)
  %13 = moe_passes.mixture_of_experts.stacked_fused_weights(%2, %9, %12, in4, in5, True, 'silu', 0, 3)
  %14 = aten.reshape(%13, [1, 6, 16])
  %15 = aten.add.Tensor(in2, %14)
  return [%15]""",
        )

    def test_hf_batched_mm(self):
        self.assertExpectedInline(
            format_graph(rewritten_graph("hf_batched_mm")),
            """\
graph(in0, in1, in2, in3, in4, in5):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = moe_passes.mixture_of_experts.stacked_fused_weights(%2, %8, %10, in4, in5, True, 'silu', 0, 3)
  %12 = aten.reshape(%11, [1, 6, 16])
  %13 = aten.add.Tensor(in2, %12)
  return [%13]""",
        )

    def test_topk_softmax_routing_feeds_the_fused_call(self):
        graph = rewritten_graph("hf_batched_mm", routing="topk_softmax")
        self.assertExpectedInline(
            format_fused_calls(graph),
            """\
graph(in0, in1, in2, in3):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2)
  %3 = getitem(%2, 0)
  %4 = getitem(%2, 1)
  %5 = aten._softmax(%3, -1, False)
  %6 = moe_passes.mixture_of_experts.stacked_fused_weights(%1, %4, %5, in2, in3, True, 'silu', 0, 3)""",
        )

    def test_hf4_sparse_loop(self):
        """The whole loop, its per-expert nonzero and the runtime checks on their sizes are gone."""
        self.assertExpectedInline(
            format_graph(rewritten_graph("hf4_sparse_loop", num_experts=2)),
            """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = aten.reshape(%1, [-1, 16])
  %12 = moe_passes.mixture_of_experts(%11, %8, %10, [in4, in7], [in5, in8], [in6, in9], True, 'silu', 0, 1)
  %13 = aten.reshape(%12, [1, 6, 16])
  %14 = aten.add.Tensor(in2, %13)
  return [%14]""",
        )

    def test_hf4_hit_expert_loop(self):
        """The loop over the hit experts is traced over every expert and fused exactly like the range(E)
        loop: the same rewritten graph as test_hf4_sparse_loop pins."""
        self.assertEqual(
            format_graph(rewritten_graph("hf4_hit_expert_loop", num_experts=2)),
            format_graph(rewritten_graph("hf4_sparse_loop", num_experts=2)),
        )

    def test_deepseek_v2_count_loop(self):
        """The loop over the per-expert counts, its `if n == 0: continue` removed, sliced with unbacked
        offsets: one `default` call with w1 = gate_proj, w2 = up_proj, w3 = down_proj of each expert."""
        skip_unless_dynamo_slices_for("deepseek_v2_count_loop")
        self.assertExpectedInline(
            format_fused_calls(rewritten_graph("deepseek_v2_count_loop", num_experts=2)),
            """\
graph(in0, in1, in2, in3, in4, in5, in6, in7):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2)
  %3 = getitem(%2, 0)
  %4 = getitem(%2, 1)
  %5 = aten.sum.dim_IntList(%3, [-1], True)
  %6 = aten.div.Tensor(%3, %5)
  %7 = moe_passes.mixture_of_experts(%1, %4, %6, [in2, in3], [in4, in5], [in6, in7], True, 'silu', 0, 1)""",
        )

    def test_aria4_offset_segments(self):
        """Cumsum offsets, outputs written over their rows twice around silu(first) * second: one
        `stacked_fused_weights` call on the stacked [E, in, out] fc1 and fc2."""
        skip_unless_dynamo_slices_for("aria4_offset_segments")
        self.assertExpectedInline(
            format_fused_calls(rewritten_graph("aria4_offset_segments", num_experts=2)),
            """\
graph(in0, in1, in2, in3):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2, 1)
  %3 = getitem(%2, 0)
  %4 = getitem(%2, 1)
  %5 = aten._softmax(%3, -1, False)
  %6 = moe_passes.mixture_of_experts.stacked_fused_weights(%1, %4, %5, in2, in3, False, 'silu', 0, 1)""",
        )

    def test_mixtral4_sparse_loop_passes_w3_as_up_and_w2_as_down(self):
        """Mixtral's w1/w3/w2 reach the kernel as w1 (gate), w2 (up), w3 (down): roles, not names."""
        model, inputs = catalog()["mixtral4_sparse_loop"].build(layers=1, num_experts=2)
        with dynamo_config(catalog()["mixtral4_sparse_loop"]):
            _, _, recorder = run_hpu_moe(model, inputs)
        (call,) = recorder.fused_nodes()
        names = recorder.parameter_names(model)
        roles = {
            role: [names[w] for w in call.args[index]] for role, index in (("w1", 3), ("w2", 4), ("w3", 5))
        }
        self.assertEqual(
            roles,
            {
                "w1": ["moes.0.experts.0.w1.weight", "moes.0.experts.1.w1.weight"],
                "w2": ["moes.0.experts.0.w3.weight", "moes.0.experts.1.w3.weight"],
                "w3": ["moes.0.experts.0.w2.weight", "moes.0.experts.1.w2.weight"],
            },
        )

    def test_mistral_where_loop(self):
        """mistral-inference's `out[tok] += w * expert(x[tok])` loop: one call, w1/w3/w2 as gate/up/down."""
        self.assertExpectedInline(format_graph(rewritten_graph("mistral_where_loop", num_experts=2)), """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten.topk(%4, 2)
  %6 = getitem(%5, 0)
  %7 = getitem(%5, 1)
  %8 = aten._softmax(%6, 1, False)
  %9 = aten.reshape(%1, [-1, 16])
  %10 = moe_passes.mixture_of_experts(%9, %7, %8, [in4, in7], [in5, in8], [in6, in9], True, 'silu', 0, 1)
  %11 = aten.reshape(%10, [1, 6, 16])
  %12 = aten.add.Tensor(in2, %11)
  return [%12]""")

    def test_torchtitan_grouped_experts(self):
        """torchtitan's argsort + gather + scatter_add around separate w1/w3/w2 grouped GEMMs: one default call."""
        self.assertExpectedInline(format_graph(rewritten_graph("torchtitan_grouped_experts")), """\
graph(in0, in1, in2, in3, in4, in5, in6):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._to_copy(%4, dtype=float32)
  %6 = aten._softmax(%5, 1, False)
  %7 = aten.topk(%6, 2, 1)
  %8 = getitem(%7, 0)
  %9 = getitem(%7, 1)
  %10 = aten._to_copy(%8, dtype=bfloat16)
  %11 = moe_passes.mixture_of_experts.stacked(%2, %9, %10, in4, in5, in6, True, 'silu', 0, 3)
  %12 = aten.reshape(%11, [1, 6, 16])
  %13 = aten.add.Tensor(in2, %12)
  return [%13]""")

    def test_gpt_fast_gathered_einsum(self):
        """gpt-fast's w[ids] einsums (views, permutes and bmms in the graph): one default call."""
        self.assertExpectedInline(format_graph(rewritten_graph("gpt_fast_gathered_einsum")), """\
graph(in0, in1, in2, in3, in4, in5, in6):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = moe_passes.mixture_of_experts.stacked(%2, %8, %10, in4, in5, in6, True, 'silu', 0, 3)
  %12 = aten.reshape(%11, [1, 6, 16])
  %13 = aten.add.Tensor(in2, %12)
  return [%13]""")

    def test_corpus_jetstream_picked_outputs(self):
        """JetStream's Mixtral (corpus): every expert on every token, each token's outputs picked at its
        ids and weighted: one call; the all-experts einsums are gone."""
        from form_catalog.corpus import jetstream_mixtral_moe

        model, inputs = jetstream_mixtral_moe.build()
        _, _, recorder = run_hpu_moe(model, inputs)
        (graph,) = recorder.graphs
        self.assertExpectedInline(format_graph(graph), """\
graph(in0, in1, in2, in3, in4, in5, in6):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = moe_passes.mixture_of_experts.stacked(%2, %8, %10, in4, in5, in6, True, 'silu', 0, 7)
  %12 = aten.reshape(%11, [1, 7, 16])
  %13 = aten.add.Tensor(in2, %12)
  return [%13]""")

    def test_corpus_trtllm_sorted_slots(self):
        """TensorRT-LLM's VanillaMoE (corpus): this rank's slots boolean-gathered and argsorted in forward,
        a loop in `run_experts` over boolean masks of the sorted ids: one call on the [T, k] routing."""
        from form_catalog.corpus import trtllm_vanilla_moe

        model, inputs = trtllm_vanilla_moe.build()
        _, _, recorder = run_hpu_moe(model, inputs)
        (graph,) = recorder.graphs
        self.assertExpectedInline(format_graph(graph), """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9, in10, in11, in12, in13, in14, in15, in16, in17, in18, in19):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten.topk(%4, 2)
  %6 = getitem(%5, 0)
  %7 = getitem(%5, 1)
  %8 = aten._softmax(%6, -1, False)
  %9 = aten.reshape(%1, [-1, 16])
  %10 = moe_passes.mixture_of_experts.fused_weights(%9, %7, %8, [in4, in6, in8, in10, in12, in14, in16, in18], [in5, in7, in9, in11, in13, in15, in17, in19], True, 'silu', 0, 7)
  %11 = aten.reshape(%10, [1, 7, 16])
  %12 = aten.add.Tensor(in2, %11)
  return [%12]""")

    def test_loop_over_the_ids_present(self):
        """`for e in ids.unique().tolist():` runs over every expert: one call, and the run-time check that
        every id names an expert (the original raised on `self.experts[e]` otherwise)."""
        from tests.loop_models import PresentIds

        torch.manual_seed(0)
        _, _, recorder = run_hpu_moe(PresentIds().eval(), (torch.randn(6, 8),))
        (graph,) = recorder.graphs
        self.assertExpectedInline(format_graph(graph), """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9, in10, in11, in12, in13):
  %0 = aten.t(in0)
  %1 = aten.mm(in1, %0)
  %2 = aten._softmax(%1, -1, False)
  %3 = aten.topk(%2, 2)
  %4 = getitem(%3, 0)
  %5 = getitem(%3, 1)
  %6 = aten.sum.dim_IntList(%4, [-1], True)
  %7 = aten.div.Tensor(%4, %6)
  %8 = aten.ge.Scalar(%5, 0)
  %9 = aten.lt.Scalar(%5, 4)
  %10 = aten.bitwise_and.Tensor(%8, %9)
  %11 = aten.all(%10)
  %12 = aten._assert_async.msg(%11, 'an expert id is negative or past the experts: the loop over the ids present runs over experts 0..number - 1 under hpu_moe (the original indexed the experts with the id)')
  %13 = moe_passes.mixture_of_experts(in1, %5, %7, [in2, in5, in8, in11], [in3, in6, in9, in12], [in4, in7, in10, in13], True, 'silu', 0, 3)
  return [%13]""")

    def test_vllm_omni_dense_einsum(self):
        """vLLM-Omni's dense einsums over every expert and the one-hot [T, E] table: one default call."""
        self.assertExpectedInline(format_graph(rewritten_graph("vllm_omni_dense_einsum")), """\
graph(in0, in1, in2, in3, in4, in5, in6):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = moe_passes.mixture_of_experts.stacked(%2, %8, %10, in4, in5, in6, True, 'silu', 0, 3)
  %12 = aten.reshape(%11, [1, 6, 16])
  %13 = aten.add.Tensor(in2, %12)
  return [%13]""")

    def test_sglang_native_einsum(self):
        """SGLang's chunked w13[ids] einsums: one fused_weights call with w13 as the kernel's w12."""
        self.assertExpectedInline(format_graph(rewritten_graph("sglang_native_einsum")), """\
graph(in0, in1, in2, in3, in4, in5):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = moe_passes.mixture_of_experts.stacked_fused_weights(%2, %8, %10, in4, in5, True, 'silu', 0, 3)
  %12 = aten.reshape(%11, [1, 6, 16])
  %13 = aten.add.Tensor(in2, %12)
  return [%13]""")

    def test_megatron_sequential_mlp(self):
        """Megatron's expert-major cell permutation, host-side split and scatter_add: one fused_weights call;
        the counts, cell sort and split the layer read are gone with it."""
        skip_unless_dynamo_slices_for("megatron_sequential_mlp")
        self.assertExpectedInline(format_graph(rewritten_graph("megatron_sequential_mlp")), """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9, in10, in11):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten.topk(%4, 2, 1)
  %6 = getitem(%5, 0)
  %7 = getitem(%5, 1)
  %8 = aten._softmax(%6, -1, False)
  %9 = moe_passes.mixture_of_experts.fused_weights(%2, %7, %8, [in4, in6, in8, in10], [in5, in7, in9, in11], True, 'silu', 0, 3)
  %10 = aten.reshape(%9, [1, 6, 16])
  %11 = aten.add.Tensor(in2, %10)
  return [%11]""")

    def test_hf517_grouped_mm_sentinel_masks_are_gone(self):
        """transformers 5.17's sentinel masks and id clamp are inside the replaced region."""
        self.assertExpectedInline(format_graph(rewritten_graph("hf517_grouped_mm")), """\
graph(in0, in1, in2, in3, in4, in5):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._to_copy(%4, dtype=float32)
  %6 = aten._softmax(%5, -1, False)
  %7 = aten.topk(%6, 2)
  %8 = getitem(%7, 0)
  %9 = getitem(%7, 1)
  %10 = aten.sum.dim_IntList(%8, [-1], True)
  %11 = aten.div.Tensor(%8, %10)
  %12 = aten._to_copy(%11, dtype=bfloat16)
  %13 = moe_passes.mixture_of_experts.stacked_fused_weights(%2, %9, %12, in4, in5, True, 'silu', 0, 3)
  %14 = aten.reshape(%13, [1, 6, 16])
  %15 = aten.add.Tensor(in2, %14)
  return [%15]""")

    def test_hf517_batched_mm_id_clamp_is_gone(self):
        self.assertExpectedInline(format_fused_calls(rewritten_graph("hf517_batched_mm")), """\
graph(in0, in1, in2, in3):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2)
  %3 = getitem(%2, 0)
  %4 = getitem(%2, 1)
  %5 = aten.sum.dim_IntList(%3, [-1], True)
  %6 = aten.div.Tensor(%3, %5)
  %7 = moe_passes.mixture_of_experts.stacked_fused_weights(%1, %4, %6, in2, in3, True, 'silu', 0, 3)""")

    def test_hf_transposed_experts(self):
        self.assertExpectedInline(
            format_fused_calls(rewritten_graph("hf_transposed_experts")),
            """\
graph(in0, in1, in2, in3):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2)
  %3 = getitem(%2, 0)
  %4 = getitem(%2, 1)
  %5 = aten.sum.dim_IntList(%3, [-1], True)
  %6 = aten.div.Tensor(%3, %5)
  %7 = moe_passes.mixture_of_experts.stacked_fused_weights(%1, %4, %6, in2, in3, False, 'silu', 0, 3)""",
        )

    def test_gpt_oss_experts(self):
        self.assertExpectedInline(
            format_fused_calls(rewritten_graph("gpt_oss_experts")),
            """\
graph(in0, in1, in2, in3, in4, in5):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2)
  %3 = getitem(%2, 0)
  %4 = getitem(%2, 1)
  %5 = aten._softmax(%3, -1, False)
  %6 = aten.unbind.int(in2, 0)
  %7 = aten.unbind.int(in3, 0)
  %8 = aten.unbind.int(in4, 0)
  %9 = aten.unbind.int(in5, 0)
  %10 = moe_passes.mixture_of_experts.bias_fused_weights(%1, %4, %5, %6[0:4], %7[0:4], %8[0:4], %9[0:4], permuted_weights=False, experts_min=0, experts_max=3, alpha=1.702, limit=7)""",
        )

    def test_gpt_oss4_dense_bmm(self):
        """transformers 4.55 GPT-OSS: the E-fold repeat + bmm and the score table's product are gone; the
        table's scatter stays only if something else reads it (nothing here: removed)."""
        self.assertExpectedInline(format_graph(rewritten_graph("gpt_oss4_dense_bmm")), """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.addmm(in4, %2, %3)
  %5 = aten.topk(%4, 2)
  %6 = getitem(%5, 0)
  %7 = getitem(%5, 1)
  %8 = aten._softmax(%6, 1, False)
  %9 = aten.reshape(%1, [-1, 16])
  %10 = aten.unbind.int(in5, 0)
  %11 = aten.unbind.int(in7, 0)
  %12 = aten.unbind.int(in6, 0)
  %13 = aten.unbind.int(in8, 0)
  %14 = moe_passes.mixture_of_experts.bias_fused_weights(%9, %7, %8, %10[0:4], %11[0:4], %12[0:4], %13[0:4], permuted_weights=False, experts_min=0, experts_max=3, alpha=1.702, limit=7)
  %15 = aten.reshape(%14, [1, 6, 16])
  %16 = aten.reshape(%15, [1, 6, 16])
  %17 = aten.add.Tensor(in2, %16)
  return [%17]""")

    def test_gpt_oss4_hit_loop(self):
        """transformers 4.57 GPT-OSS on CPU (hit loop, sentinel class): the same call as the dense form."""
        self.assertEqual(
            format_fused_calls(rewritten_graph("gpt_oss4_hit_loop")),
            format_fused_calls(rewritten_graph("gpt_oss4_dense_bmm")),
        )

    def test_qwen2_shared_expert(self):
        self.assertExpectedInline(
            format_graph(rewritten_graph("qwen2_shared_expert")),
            """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9):
  %0 = aten.native_layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = getitem(%0, 0)
  %2 = aten.reshape(%1, [-1, 16])
  %3 = aten.t(in3)
  %4 = aten.mm(%2, %3)
  %5 = aten._softmax(%4, -1, False)
  %6 = aten.topk(%5, 2)
  %7 = getitem(%6, 0)
  %8 = getitem(%6, 1)
  %9 = aten.sum.dim_IntList(%7, [-1], True)
  %10 = aten.div.Tensor(%7, %9)
  %11 = moe_passes.mixture_of_experts.stacked_fused_weights(%2, %8, %10, in4, in5, True, 'silu', 0, 3)
  %12 = aten.t(in6)
  %13 = aten.mm(%2, %12)
  %14 = aten.sigmoid(%13)
  %15 = aten.t(in7)
  %16 = aten.mm(%2, %15)
  %17 = aten.silu(%16)
  %18 = aten.t(in8)
  %19 = aten.mm(%2, %18)
  %20 = aten.mul.Tensor(%17, %19)
  %21 = aten.t(in9)
  %22 = aten.mm(%20, %21)
  %23 = aten.mul.Tensor(%14, %22)
  %24 = aten.add.Tensor(%11, %23)
  %25 = aten.reshape(%24, [1, 6, 16])
  %26 = aten.add.Tensor(in2, %25)
  return [%26]""",
        )

    def test_deepseek_v3_routing(self):
        self.assertExpectedInline(
            format_fused_calls(rewritten_graph("deepseek_v3_routing")),
            """\
graph(in0, in1, in2, in3, in4, in5):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2, -1, True, False)
  %3 = getitem(%2, 1)
  %4 = aten.div.Tensor(in2, in3)
  %5 = aten.mul.Tensor(%4, 2.5)
  %6 = moe_passes.mixture_of_experts.stacked_fused_weights(%1, %3, %5, in4, in5, True, 'silu', 0, 3)""",
        )

    def test_granite4_segments(self):
        """GraniteMoE's segments: one fused call."""
        self.assertExpectedInline(format_fused_calls(rewritten_graph("granite4_segments")), """\
graph(in0, in1, in2, in3):
  %0 = getitem(in0, 0)
  %1 = aten.reshape(%0, [-1, 16])
  %2 = aten.topk(in1, 2, 1)
  %3 = getitem(%2, 0)
  %4 = getitem(%2, 1)
  %5 = aten._softmax(%3, 1, False)
  %6 = moe_passes.mixture_of_experts.stacked_fused_weights(%1, %4, %5, in2, in3, True, 'silu', 0, 3)""")

    def test_expert_parallel_sparse_loop(self):
        """A rank's range of experts: one call on the router's own ids, with the held window."""
        self.assertExpectedInline(format_fused_calls(rewritten_graph("expert_parallel_sparse_loop")), """\
graph(in0, in1, in2, in3, in4, in5, in6, in7):
  %0 = getitem(in0, 0)
  %1 = aten.topk(in1, 2)
  %2 = getitem(%1, 0)
  %3 = getitem(%1, 1)
  %4 = aten.sum.dim_IntList(%2, [-1], True)
  %5 = aten.div.Tensor(%2, %4)
  %6 = aten.reshape(%0, [-1, 16])
  %7 = moe_passes.mixture_of_experts(%6, %3, %5, [in2, in3], [in4, in5], [in6, in7], True, 'silu', 2, 3)""")

    def test_near_miss_is_left_as_captured(self):
        graph = rewritten_graph("near_miss_input_scaled", num_experts=2)
        self.assertExpectedInline(
            format_graph(graph),
            """\
graph(in0, in1, in2, in3, in4, in5, in6, in7, in8, in9):
  %0 = layer_norm(in2, [16], in0, in1, 1e-05)
  %1 = reshape(%0, -1, 16)
  %2 = linear(%1, in3, None)
  %3 = softmax(%2, dim=-1, dtype=float32)
  %4 = topk(%3, 2, dim=-1)
  %5 = getitem(%4, 0)
  %6 = getitem(%4, 1)
  %7 = sum(%5, dim=-1, keepdim=True)
  %8 = truediv(%5, %7)
  %9 = to(%8, float32)
  %10 = zeros_like(%1)
  %11 = eq(%6, 0)
  %12 = mul(%9, %11)
  %13 = sum(%12, dim=-1, keepdim=True)
  %14 = mul(%1, %13)
  %15 = linear(%14, in4, None)
  %16 = silu(%15)
  %17 = linear(%14, in5, None)
  %18 = mul(%16, %17)
  %19 = linear(%18, in6, None)
  %20 = add(%10, %19)
  %21 = eq(%6, 1)
  %22 = mul(%9, %21)
  %23 = sum(%22, dim=-1, keepdim=True)
  %24 = mul(%1, %23)
  %25 = linear(%24, in7, None)
  %26 = silu(%25)
  %27 = linear(%24, in8, None)
  %28 = mul(%26, %27)
  %29 = linear(%28, in9, None)
  %30 = add(%20, %29)
  %31 = view(%30, [1, 6, 16])
  %32 = add(in2, %31)
  return [%32]""",
        )
