"""Penalties, logit bias, allowed ids, bad words and min-p, held to transformers' logits processors (fp32)."""

from __future__ import annotations

import pytest
import torch

from tandem.sampling_params import SamplingParams
from tests.parallel.tiny_models import save_tiny

PROMPTS = [[5, 9, 17, 9, 33, 5, 64], [100, 3, 3, 7], [42]]
NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers

    from tandem import LLM

    folder = save_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8, num_kv_blocks=64,
              seed=0)
    yield llm, hf
    llm.shutdown()


def _tandem(llm, overlap: bool, **kwargs) -> list[list[int]]:
    llm.engine.overlap = overlap
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kwargs)
    outs = llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _hf_greedy(hf, prompt: list[int], processor) -> list[int]:
    """Greedy decoding with one logits processor, step by step (processor(input_ids, scores) as in generate)."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW):
            scores = hf(ids).logits[:, -1, :].float()
            scores = processor(ids, scores)
            token = int(scores.argmax(dim=-1))
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def _presence_frequency(presence: float, frequency: float, prompt_len: int):
    def proc(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(ids[0, prompt_len:], minlength=scores.shape[-1]).float()
        return scores - frequency * counts - presence * (counts > 0).float()
    return proc


@pytest.mark.parametrize("overlap", [True, False])
def test_repetition_penalty_matches_transformers(tiny, overlap):
    from transformers import RepetitionPenaltyLogitsProcessor

    llm, hf = tiny
    got = _tandem(llm, overlap, repetition_penalty=1.8)
    assert got == [_hf_greedy(hf, p, RepetitionPenaltyLogitsProcessor(1.8)) for p in PROMPTS]
    assert got != _tandem(llm, overlap)  # the penalty changed something


@pytest.mark.parametrize("overlap", [True, False])
def test_presence_and_frequency_penalties_match_the_reference(tiny, overlap):
    llm, hf = tiny
    got = _tandem(llm, overlap, presence_penalty=0.7, frequency_penalty=1.3)
    assert got == [_hf_greedy(hf, p, _presence_frequency(0.7, 1.3, len(p))) for p in PROMPTS]
    assert got != _tandem(llm, overlap)


def test_logit_bias_matches_sequence_bias(tiny):
    from transformers import SequenceBiasLogitsProcessor

    llm, hf = tiny
    bias = {7: 3.0, 11: 2.5, 64: -100.0}
    got = _tandem(llm, True, logit_bias=bias)
    proc = SequenceBiasLogitsProcessor({(t,): v for t, v in bias.items()})
    assert got == [_hf_greedy(hf, p, proc) for p in PROMPTS]


def test_allowed_ids_and_mixed_batch_rows_keep_their_own_tokens(tiny):
    """A batch mixing penalised and plain rows: each row gets what it gets alone (batch invariance)."""
    llm, _ = tiny
    plain = _tandem(llm, True)
    allowed = _tandem(llm, True, allowed_token_ids=[3, 8, 21])
    assert all(set(toks) <= {3, 8, 21} for toks in allowed)
    llm.engine.overlap = True
    mixed = llm.generate(
        [list(p) for p in PROMPTS],
        [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **kw)
         for kw in ({"allowed_token_ids": [3, 8, 21]}, {}, {"repetition_penalty": 1.8})], use_tqdm=False)
    assert list(mixed[0].outputs[0].token_ids) == allowed[0]
    assert list(mixed[1].outputs[0].token_ids) == plain[1]
    assert list(mixed[2].outputs[0].token_ids) == _tandem(llm, True, repetition_penalty=1.8)[2]


def test_penalties_at_temperature_one_are_seeded_and_overlap_invariant(tiny):
    llm, _ = tiny
    kw = dict(temperature=1.0, seed=7, max_tokens=NEW, ignore_eos=True, frequency_penalty=0.5, min_p=0.05)
    runs = []
    for overlap in (True, False):
        llm.engine.overlap = overlap
        outs = llm.generate([list(p) for p in PROMPTS], SamplingParams(**kw), use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    assert runs[0] == runs[1]
    llm.engine.overlap = True
    assert llm.engine.runner.logits_state.held == {} or all(
        r.is_finished for r, _ in llm.engine.runner.logits_state.held.values())


def test_min_p_matches_transformers_warper():
    from transformers import MinPLogitsWarper

    from tandem.runner.sampler import apply_top_k_top_p

    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    min_p = torch.tensor([0.0, 0.05, 0.3, 0.9])
    got = apply_top_k_top_p(logits, torch.zeros(4, dtype=torch.int32), torch.ones(4), min_p)
    for i in range(4):
        ref = MinPLogitsWarper(float(min_p[i])).__call__(None, logits[i : i + 1].clone()) if min_p[i] > 0 \
            else logits[i : i + 1]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref[0])), i


@pytest.mark.parametrize("kwargs, word", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_values_are_value_errors(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_out_of_vocab_ids_are_rejected_and_the_engine_keeps_serving(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)
    assert _tandem(llm, True) == _tandem(llm, False)
