"""A 4-bit GPTQ checkpoint served over two CPU processes (gloo) gives the greedy tokens of one process: a dense
Llama, and a MoE whose experts are in act order."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.models.quantized_llama import VOCAB, Case, save_quantized_llama

pytest.importorskip("transformers")

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4, block_size=8, num_kv_blocks=64)


def _greedy(llm: LLM) -> list[list[int]]:
    prompts = [[(5 * i) % (VOCAB - 4) + 4 for i in range(13)], [7, 8, 9], [60, 61, 62, 63] * 3]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", [
    # Group 64: o_proj's 128 input columns split into one whole group per rank, down_proj's 256 into two.
    Case("gptq", 4, 64, sym=False),
    # desc_act (g_idx in a shuffled order, gptq_v2): each row-parallel rank holds whole groups of the group-sorted
    # columns, from anywhere in the input, and gathers the ranks' inputs to read them.
    Case("gptq", 4, 32, sym=False, act_order=True, gptq_v1=False),
], ids=lambda c: c.id)
def test_tp2_int4_greedy_tokens_equal_tp1(case, tmp_path):
    save_quantized_llama(case, tmp_path)
    reference = LLM(str(tmp_path), **ENGINE)
    try:
        expected = _greedy(reference)
    finally:
        reference.shutdown()
    sharded = LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)
    try:
        got = _greedy(sharded)
    finally:
        sharded.shutdown()
    assert got == expected


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_tp2_act_order_moe_greedy_tokens_equal_tp1(expert_parallel, tmp_path):
    """Act-order (desc_act) MoE experts over two CPU processes: each rank holds whole experts (expert parallel), or
    every expert's rows of gate / up and half of down's group-sorted columns, whose order names columns of the
    whole intermediate size, so its down reads the ranks' activations gathered. TP=2 gives TP=1's greedy
    tokens."""
    from tests.models.test_int_moe import save_quantized_moe

    save_quantized_moe(Case("gptq", 4, 32, sym=False, act_order=True), "qwen3_moe", tmp_path,
                       moe_intermediate_size=64, intermediate_size=128)
    reference = LLM(str(tmp_path), **ENGINE)
    try:
        expected = _greedy(reference)
    finally:
        reference.shutdown()
    sharded = LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        got = _greedy(sharded)
    finally:
        sharded.shutdown()
    assert got == expected


def test_tp2_int8_with_the_lm_head_in_int8_equals_tp1(tmp_path):
    """quantization int8 with quantize_lm_head over two CPU processes: each rank quantizes its vocabulary rows of
    the head (round to nearest per row and group, so the codes are the unsharded head's) and the logits are
    gathered; TP=2 gives TP=1's greedy tokens. (Hidden 256, intermediate 512: each rank's o and down columns are
    whole groups of 128, so the body's codes are the unsharded model's too.)"""
    import torch
    import transformers

    from tests.models.quantized_llama import CONFIG

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "hidden_size": 256, "intermediate_size": 512})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    runs = []
    for tp in (1, 2):
        llm = LLM(str(tmp_path), tensor_parallel_size=tp, quantization="int8", quantize_lm_head=True, **ENGINE)
        try:
            runs.append(_greedy(llm))
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
