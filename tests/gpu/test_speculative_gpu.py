"""Speculative decoding on a GPU: n-gram drafts verified in piecewise-graph (or eager) steps beside decode graphs,
overlap on and off, give decoding's tokens without drafts in fp32; the embedded model (real weights, bf16) accepts
drafts on copying prompts."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

from tandem import LLM, SamplingParams  # noqa: E402
from tests.parallel.tiny_models import VOCAB, save_tiny  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[40, 41, 42, 43] * 7, [(3 * i) % 11 + 4 for i in range(30)], [(7 * i) % (VOCAB - 4) + 4 for i in range(26)],
           [99, 98, 99]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _run(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=30, max_tokens=40, ignore_eos=True, seed=5)]
    outs = llm.generate(PROMPTS, [params[0], params[0], params[1], params[0]], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("piecewise", [None, 0])
def test_fp32_tokens_equal_without_drafts(folder, overlap, piecewise):
    common = dict(device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=128,
                  overlap=overlap, piecewise_max_tokens=piecewise)
    plain = LLM(folder, **common)
    expected = _run(plain)
    plain.shutdown()
    spec = LLM(folder, speculative_config=SPEC, **common)
    try:
        got = _run(spec)
        stats = spec.engine.stats()
    finally:
        spec.shutdown()
    gc.collect()
    assert got == expected
    assert stats.spec_accepted_tokens > 0


@pytest.mark.gpu
def test_embedded_model_accepts_drafts_on_a_copying_prompt():
    text = ("Repeat the following sentence exactly: The committee agreed to increase funding for public libraries "
            "by ten percent and to delay the road repairs until spring.")
    llm = LLM(max_model_len=512, max_num_seqs=4, speculative_config=SPEC)
    try:
        out = llm.chat([[{"role": "user", "content": text}]], SamplingParams(temperature=0.0, max_tokens=64),
                       use_tqdm=False)[0]
    finally:
        llm.shutdown()
    drafted, accepted = out.metrics["spec_draft_tokens"], out.metrics["spec_accepted_tokens"]
    print(f"embedded model, copying prompt: {accepted} of {drafted} drafts accepted, "
          f"{len(out.outputs[0].token_ids)} tokens")
    assert accepted > 0.3 * drafted
