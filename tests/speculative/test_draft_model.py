"""Speculative decoding with a draft model on the CPU: the target as its own draft accepts every draft; a smaller
draft gives the target's tokens; a draft with another vocabulary is refused at start-up."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.parallel.tiny_models import save_tiny, tiny_config

transformers = pytest.importorskip("transformers")

ENGINE = dict(device="cpu", dtype="float32", max_model_len=160, max_num_seqs=4, block_size=8, num_kv_blocks=128,
              max_num_batched_tokens=32)
PROMPTS = [[40, 41, 42, 43] * 5, [(3 * i) % 11 + 4 for i in range(21)], [99, 98, 99], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = save_tiny("llama", tmp_path_factory.mktemp("target"))
    torch.manual_seed(1)
    config = tiny_config("llama")
    config.num_hidden_layers = 1
    small = tmp_path_factory.mktemp("draft")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(small)
    config = tiny_config("llama")
    config.vocab_size = 140
    other = tmp_path_factory.mktemp("other-vocab")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(other)
    return str(target), str(small), str(other)


def _tokens(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, seed=3)]
    outs = llm.generate(PROMPTS, [params[0], params[0], params[1], params[0]], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_target_as_its_own_draft_accepts_every_greedy_draft(folders):
    target, _, _ = folders
    expected = _tokens(LLM(target, **ENGINE))
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3},
              **ENGINE)
    greedy = llm.generate(PROMPTS[:2] + PROMPTS[3:], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)
    for out in greedy:
        m = out.metrics
        assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] == m["spec_draft_tokens"], m
    assert _tokens(llm) == expected
    llm.shutdown()


def test_smaller_draft_gives_the_targets_tokens(folders):
    target, small, _ = folders
    expected = _tokens(LLM(target, overlap=False, **ENGINE))
    llm = LLM(target, speculative_config={"method": "draft_model", "model": small, "num_speculative_tokens": 4},
              **ENGINE)
    assert _tokens(llm) == expected
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens
    llm.shutdown()


def test_draft_with_another_vocabulary_is_refused(folders):
    target, _, other = folders
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target, speculative_config={"method": "draft_model", "model": other}, **ENGINE)
