"""The roofline floor of a run, step by step, and where a run's GPU time goes against it by kind of step."""

from __future__ import annotations

import pytest

from tandem.bench.roofline import Ceilings, ModelCost, floor_seconds, step_classes, step_floor_seconds
from tandem.profiling.timeline import Span, Timeline

COST = ModelCost(weight_bytes=1000, body_params=100, lm_head_params=10, kv_bytes_per_token=10,
                 attn_flops_per_pair=4)
CEIL = Ceilings(copy_gbps=1e-6, matmul_tflops=1e-9)  # 1000 bytes/s, 1000 FLOP/s


def test_step_floor_is_bytes_or_flops_whichever_is_slower():
    # Decode of 2 sequences over 30 context tokens: 1000 + 300 bytes = 1.3 s; 2 * 100 * 2 + 2 * 10 * 2
    # + 4 * 30 = 560 FLOPs = 0.56 s.
    assert step_floor_seconds(2, 2, 30, COST, CEIL) == pytest.approx(1.3)
    # A 40-token prefill of one sequence: 2 * 100 * 40 + 2 * 10 + 4 * (40 * 40 // 2) = 11220 FLOPs.
    assert step_floor_seconds(1, 40, 40, COST, CEIL) == pytest.approx(11.22)
    log = [(2, 2, 30), (1, 40, 40)]
    assert floor_seconds(log, COST, CEIL) == pytest.approx(1.3 + 11.22)


def test_step_classes_split_gpu_time_and_floor_by_kind_of_step():
    log = [(1, 40, 40), (200, 200, 2000), (40, 40, 400), (40, 40, 400), (3, 3, 30), (9, 12, 90)]
    tl = Timeline()
    tl.spans.append(Span("cpu", "schedule", 0.0, 100.0, 0))  # CPU spans are not steps' GPU time
    for i in range(len(log)):
        tl.spans.append(Span("gpu", "compute", 10.0 * i, 10.0 * i + 2.0 + i, i))
    classes = step_classes(log, tl, COST, CEIL)
    assert set(classes) == {"prefill or mixed", "decode >= 128 seqs", "decode 32-127 seqs", "decode < 8 seqs"}
    mixed = classes["prefill or mixed"]
    assert mixed["steps"] == 2 and mixed["gpu_s"] == pytest.approx(2.0 + 7.0)
    assert mixed["floor_s"] == pytest.approx(step_floor_seconds(1, 40, 40, COST, CEIL)
                                             + step_floor_seconds(9, 12, 90, COST, CEIL))
    mid = classes["decode 32-127 seqs"]
    assert mid["steps"] == 2 and mid["gpu_s"] == pytest.approx(4.0 + 5.0)
    assert mid["roofline_fraction"] == pytest.approx(mid["floor_s"] / mid["gpu_s"])
    assert sum(c["steps"] for c in classes.values()) == len(log)
    assert sum(c["floor_s"] for c in classes.values()) == pytest.approx(floor_seconds(log, COST, CEIL))
    assert step_classes(log[:-1], tl, COST, CEIL) is None  # a span per step, or nothing
    assert step_classes(log, None, COST, CEIL) is None


def test_cpu_bench_reports_step_classes(tmp_path):
    from tandem.bench.offline import bench_workload
    from tandem.bench.workloads import Workload
    from tests.parallel.tiny_models import save_tiny

    w = Workload("tiny", save_tiny("llama", tmp_path), 6, (8, 24), (4, 12), dtype="float32", device="cpu")
    r = bench_workload(w, [], 1.0, None)
    classes = r["step_classes"]
    assert sum(c["steps"] for c in classes.values()) == r["num_steps"]
    assert classes["prefill or mixed"]["steps"] >= 1
    assert sum(c["floor_s"] for c in classes.values()) == pytest.approx(r["roofline_floor_s"])


def test_moe_step_reads_the_experts_its_tokens_route_to():
    moe = ModelCost(weight_bytes=1000, body_params=100, lm_head_params=10, kv_bytes_per_token=10,
                    attn_flops_per_pair=4, expert_bytes=8000, expert_params=800, num_experts=8, top_k=2)
    assert moe.expected_experts(1) == pytest.approx(2.0)  # one token: exactly top_k experts
    assert moe.expected_experts(1000) == pytest.approx(8.0)  # a large batch touches every expert
    # Decode of 1 sequence over 30 context tokens: 1000 + 300 + 2/8 of 8000 bytes.
    assert step_floor_seconds(1, 1, 30, moe, CEIL) == pytest.approx(3.3)
    # The FLOPs count top_k of 8 experts per token: 2 * 800 * 2 / 8 = 400 per token.
    prefill = step_floor_seconds(1, 40, 40, moe, CEIL)
    assert prefill == pytest.approx(11.22 + 40 * 400 / 1000)


def test_model_cost_counts_expert_stacks_apart():
    import torch

    from tandem.bench.roofline import model_cost
    from tandem.config import EngineConfig
    from tandem.models.loader import load_model_and_tokenizer

    overrides = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=8, moe_intermediate_size=32)
    config = EngineConfig(model="qwen3-30b-a3b", load_format="dummy", device="cpu", dtype="float32",
                          hf_overrides=overrides)
    model, mc, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)
    cost = model_cost(model, mc)
    assert cost.num_experts == 8 and cost.top_k == 8
    assert cost.expert_params == 2 * 8 * 3 * 64 * 32  # layers x experts x (gate, up, down) x hidden x inter
    assert cost.expert_bytes == 4 * cost.expert_params
    total = sum(p.numel() for p in model.parameters())
    assert cost.body_params + cost.expert_params == total - 2 * 256 * 64  # minus embedding and lm_head


def test_moe_bench_counts_the_experts_its_steps_route_to(tmp_path):
    import torch
    import transformers

    from tandem.bench.offline import bench_workload
    from tandem.bench.workloads import Workload
    from tests.models.test_moe_parity import tiny_moe_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen3_moe")).float().save_pretrained(tmp_path)
    w = Workload("tiny-moe", str(tmp_path), 4, (8, 16), (4, 8), dtype="float32", device="cpu")
    r = bench_workload(w, [], 1.0, None)
    routing = r["moe_routing"]
    assert routing["moe_layers"] == 1  # decoder_sparse_step 2 of 3 layers
    # Every step's tokens route somewhere: at least top_k distinct experts per step, at most all of them.
    assert 3 * r["num_steps"] <= routing["distinct_experts_routed"] <= 8 * r["num_steps"]
    assert 0.3 < routing["over_uniform_estimate"] < 3.0
    assert r["expert_bytes"] > 0
