"""LoRA under tensor parallelism on the CPU (gloo, two processes): A and B sharded like their base layers (B's rows
in the column-parallel qkv / gate_up / c_attn / c_fc, A's columns in the row-parallel o / down / c_proj), adapters
paged in on every rank through one slot, give TP=1's greedy tokens, which are transformers + peft's."""

from __future__ import annotations

import pytest

from tandem import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import peft_greedy, save_adapter, save_base

pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 9, 17, 33, 2, 71], [40, 41, 42], [8, 100, 3, 60, 12, 13, 14, 15, 90], [99, 1, 64, 30, 2]]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32, enable_lora=True, max_loras=1,
              max_lora_rank=8)


# qwen3: one KV head, replicated on both ranks, q split; gpt2: the fused c_attn's thirds each split over the ranks.
@pytest.mark.parametrize("family, targets", [("qwen3", ALL), ("gpt2", ["c_attn", "c_proj", "c_fc"])])
def test_tp2_lora_equals_tp1_and_peft(tmp_path, family, targets):
    base = save_base(family, str(tmp_path / "base"))
    attention = [t for t in targets if t in ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn")]
    loras = [LoRARequest("all", 1, save_adapter(base, str(tmp_path / "all"), targets, r=8, seed=1)),
             None,
             LoRARequest("attn", 2, save_adapter(base, str(tmp_path / "attn"), attention, r=4, use_rslora=True,
                                                 seed=2, scale=0.5))]
    loras.append(loras[0])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    sharded = LLM(base, tensor_parallel_size=2, **ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in sharded.generate(PROMPTS, params, use_tqdm=False, lora_request=loras)]
    finally:
        sharded.shutdown()
    expected = [peft_greedy(base, None if r is None else r.lora_path, p, 5) for r, p in zip(loras, PROMPTS)]
    assert got == expected
    assert got[0] != peft_greedy(base, None, PROMPTS[0], 5) or got[2] != peft_greedy(base, None, PROMPTS[2], 5)
