"""A MoE model through the whole engine on CPU: chunked prefill, prefix caching, preemption, and the overlap on or
off all give transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

from tests.models.test_moe_parity import tiny_moe_config  # noqa: E402

PREFIX = [(7 * i) % 120 + 4 for i in range(16)]  # two 8-token blocks shared by two prompts
PROMPTS = [PREFIX + [5, 9], PREFIX + [12, 13, 14], [(3 * i) % 120 + 4 for i in range(30)], [99, 98]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("qwen2_moe")).float().eval()
    folder = tmp_path_factory.mktemp("qwen2_moe")
    hf.save_pretrained(folder)
    expected = []
    for prompt in PROMPTS:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    return str(folder), expected


@pytest.mark.parametrize("overlap", [True, False])
def test_moe_engine_matches_transformers(qwen2_moe, overlap):
    folder, expected = qwen2_moe
    # 12 blocks of 8 for four requests of up to 38 tokens: some must be preempted; a 16-token budget chunks the
    # 30-token prompt.
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=64, block_size=8, num_kv_blocks=12,
              max_num_batched_tokens=16, max_num_seqs=4, overlap=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # publishes the shared prefix
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[1].num_cached_tokens >= len(PREFIX)
    assert llm.engine.stats().num_preemptions > 0
