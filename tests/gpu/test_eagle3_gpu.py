"""EAGLE-3 drafts on a GPU in fp32: a random head in the published folder format, its steps on the target's compute
stream behind decode, verify and piecewise graphs (or eager steps), overlap on and off, gives the target's greedy
tokens without drafts."""

from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

from tandem import LLM, SamplingParams  # noqa: E402
from tests.parallel.tiny_models import save_tiny  # noqa: E402
from tests.speculative.test_eagle3 import PROMPTS, save_likely_head  # noqa: E402

COMMON = dict(dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(folder):
    plain = LLM(folder, device="cuda", **COMMON)
    tokens = _greedy(plain)
    plain.shutdown()
    gc.collect()
    return tokens


@pytest.fixture(scope="module")
def head(tmp_path_factory, expected):
    return save_likely_head(tmp_path_factory.mktemp("head"), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("piecewise", [None, 0])
def test_fp32_greedy_with_eagle3_equals_without(folder, head, expected, overlap, piecewise):
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(folder, device="cuda", speculative_config=spec, overlap=overlap, piecewise_max_tokens=piecewise,
              **COMMON)
    # With overlap and piecewise graphs, verify steps are also scheduled behind the one in flight (shift_rows).
    llm.engine.ahead = overlap and piecewise is None
    try:
        got = _greedy(llm)
        stats = llm.engine.stats()
        steps = llm.engine.eagle3.steps  # the head's feeds and chains replay CUDA graphs
        graphs = (len(steps.feed_graphs), len(steps.chain_graphs))
    finally:
        llm.shutdown()
    gc.collect()
    assert got == expected
    assert stats.spec_draft_tokens >= stats.spec_accepted_tokens > 0
    assert graphs == (len(steps.feed_buckets), len(steps.chain_buckets)), graphs

