"""Grammar-forced tokens as drafts (structured_forced_drafts): the tokens a grammar forces are verified in one
forward, each row sampled under its own mask, so greedy and seeded outputs are the same with them on and off (overlap
on and off, both backends) in fewer steps; outputs validate; a request without a grammar in the batch keeps its
tokens; an abort or max_tokens inside a forced run leaks no KV block; the mask rows of a draft run are the masks
one token at a time would give, and the matcher is left where it was."""

from __future__ import annotations

import argparse
import json

import jsonschema
import pytest
import torch

from tandem import LLM
from tandem.config import EngineConfig
from tandem.sampling_params import SamplingParams, StructuredOutputParams
from tandem.structured.grammar import GrammarCache
from tandem.structured.matcher import HostMask

pytest.importorskip("llguidance")

# Fixed keys: most of the output is forced (keys, quotes, separators, brackets).
FIXED_KEYS = {
    "type": "object",
    "properties": {
        "full_name": {"type": "string", "maxLength": 12},
        "years_of_age": {"type": "integer", "minimum": 0, "maximum": 120},
        "home_address": {"type": "object", "properties": {"street_name": {"type": "string", "maxLength": 10},
                                                          "city_name": {"type": "string", "maxLength": 10}},
                         "required": ["street_name", "city_name"]},
    },
    "required": ["full_name", "years_of_age", "home_address"],
}
OTHER_SPECS = [StructuredOutputParams(regex=r"[0-9]{2}-forced-text-[a-z]{2}"),
               StructuredOutputParams(choice=("the first long answer", "the second long answer"))]
BACKENDS = ["llguidance"] + (["xgrammar"] if __import__("importlib").util.find_spec("xgrammar") else [])


@pytest.fixture(scope="module")
def forced_llm():
    llm = LLM(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8, num_kv_blocks=160, seed=0,
              grammar_backend="llguidance", structured_forced_drafts=True)
    assert llm.engine.forced_k == 8
    yield llm
    llm.shutdown()


@pytest.fixture
def backend_llm(forced_llm, request):
    """The shared engine with the backend `request.param` (llguidance when not parametrized), idle afterwards."""
    engine = forced_llm.engine
    free = engine.scheduler.num_free_blocks()
    engine.use_structured_backend(getattr(request, "param", "llguidance"))
    yield forced_llm
    engine.use_structured_backend("llguidance")
    engine.overlap = True
    engine.use_forced_drafts(True)
    assert not engine.has_unfinished_requests() and engine.num_host_masks() == 0
    assert engine.scheduler.num_free_blocks() == free, "KV blocks leaked"


def _generate(llm, forced: bool, overlap: bool):
    engine = llm.engine
    engine.overlap = overlap
    engine.use_forced_drafts(forced)
    free = engine.scheduler.num_free_blocks()
    schema = StructuredOutputParams(json=json.dumps(FIXED_KEYS))
    requests = [
        ("A person as JSON:\n", SamplingParams(temperature=0.0, max_tokens=80, structured_output=schema)),
        ("The capital of France is", SamplingParams(temperature=0.0, max_tokens=16)),
        ("Someone else, in JSON:", SamplingParams(temperature=1.0, seed=7, max_tokens=80, structured_output=schema)),
        ("Code:", SamplingParams(temperature=0.0, max_tokens=24, structured_output=OTHER_SPECS[0])),
        ("Pick one:", SamplingParams(temperature=0.8, seed=3, max_tokens=24, structured_output=OTHER_SPECS[1])),
    ]
    steps, drafted = engine.num_steps, engine.forced_draft_tokens
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    assert engine.scheduler.num_free_blocks() == free and engine.num_host_masks() == 0
    assert engine.num_grammar_rejections == 0
    return [list(o.outputs[0].token_ids) for o in outs], outs, engine.num_steps - steps, \
        engine.forced_draft_tokens - drafted


@pytest.mark.parametrize("backend_llm, overlap", [("llguidance", True), ("llguidance", False)]
                         + [("xgrammar", True)] * ("xgrammar" in BACKENDS), indirect=["backend_llm"])
def test_forced_drafts_keep_the_tokens_in_fewer_steps(backend_llm, overlap):
    off, _, steps_off, drafted_off = _generate(backend_llm, forced=False, overlap=overlap)
    on, outs, steps_on, drafted_on = _generate(backend_llm, forced=True, overlap=overlap)
    assert drafted_off == 0 and drafted_on > 20
    assert on == off  # greedy and seeded rows alike; the unconstrained row among them
    assert steps_on < 0.75 * steps_off, (steps_on, steps_off)
    for i in (0, 2):
        assert outs[i].outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(outs[i].outputs[0].text), FIXED_KEYS)
    assert outs[3].outputs[0].text[2:15] == "-forced-text-"
    assert outs[4].outputs[0].text in OTHER_SPECS[1].choice


def test_max_tokens_and_abort_inside_a_forced_run_free_every_block(backend_llm):
    engine = backend_llm.engine
    engine.overlap = True
    engine.use_forced_drafts(True)
    free = engine.scheduler.num_free_blocks()
    schema = StructuredOutputParams(json=json.dumps(FIXED_KEYS))
    ids = backend_llm.tokenizer.encode("A person as JSON:\n")
    for n in range(1, 13):  # cut at every length of the first runs: inside forced runs and between them
        engine.add_request(f"cut-{n}", ids, SamplingParams(temperature=0.0, max_tokens=n, structured_output=schema))
    engine.add_request("abort-me", ids, SamplingParams(temperature=0.0, max_tokens=80, structured_output=schema))
    lengths: dict[str, int] = {}
    aborted = False
    while engine.has_unfinished_requests():
        inflight = engine._inflight
        if not aborted and inflight is not None and any(
                s.num_draft and s.request.request_id == "abort-me" for s in inflight.sched.scheduled):
            engine.abort_request("abort-me")  # its forced drafts are being verified now
            aborted = True
        for out in engine.step():
            lengths[out.request_id] = lengths.get(out.request_id, 0) + len(out.new_token_ids)
    assert aborted
    assert all(lengths[f"cut-{n}"] == n for n in range(1, 13)), lengths
    assert engine.scheduler.num_free_blocks() == free and engine.num_host_masks() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_draft_rows_get_the_masks_of_one_token_at_a_time(backend):
    vocab = 300  # the synthetic vocabulary: token t is chr(t + 32) for the printable ASCII
    cache = GrammarCache(None, vocab, [vocab - 1], backend_name=backend)
    try:
        compiled = cache.submit(StructuredOutputParams(regex=r"[ab]{1,3}-key-(x|yz)")).result()
        words = (vocab + 31) // 32
        mask, reference = HostMask(compiled), HostMask(compiled)
        assert mask.accept(ord("a") - 32) and reference.accept(ord("a") - 32)
        drafts = [ord(c) - 32 for c in "b-k"]
        expected = torch.zeros(len(drafts) + 1, words, dtype=torch.int32)
        for j in range(len(drafts) + 1):
            HostMask.fill_rows(expected, [(j, reference, [])])
            if j < len(drafts):
                assert reference.accept(drafts[j])
        other = HostMask(compiled)
        # Rows in any order (one position at a time), and consecutive rows (llguidance: in one call).
        for first_rows in ([3, 0, 1, 2], [0, 1, 2, 3]):
            bits = torch.zeros(len(drafts) + 3, words, dtype=torch.int32)
            # A second request whose draft the grammar refuses: its row after the refusal allows everything.
            HostMask.fill_draft_rows(bits, [(first_rows, mask, [], drafts), ([4, 5], other, [], [ord("z") - 32])])
            assert torch.equal(bits[first_rows], expected)
            assert bool((bits[5] == -1).all())
        # Both matchers are back where they were: the next token is checked from there.
        again = torch.zeros(1, words, dtype=torch.int32)
        HostMask.fill_rows(again, [(0, mask, [])])
        assert torch.equal(again[0], expected[0])
        assert other.accept(ord("b") - 32)
        # The grammar forces "-key-" after "ab" plus a third [ab] or "-": from "aab", all of "-key-" but its end.
        forced = HostMask(compiled)
        for c in "aab":
            assert forced.accept(ord(c) - 32)
        tokens = forced.forced_tokens(8, lambda text: [ord(c) - 32 for c in text])
        assert tokens and "".join(chr(t + 32) for t in tokens) in ("-key", "-key-")
        assert forced.forced_tokens(2, lambda text: [ord(c) - 32 for c in text]) == tokens[:2]
    finally:
        cache.shutdown()


def test_forced_drafts_flags():
    from tandem.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    off = engine_kwargs(parser.parse_args([]))
    assert off["structured_forced_drafts"] is False and off["max_forced_drafts"] == 8
    on = engine_kwargs(parser.parse_args(["--structured-forced-drafts", "--max-forced-drafts", "3"]))
    assert on["structured_forced_drafts"] is True and on["max_forced_drafts"] == 3
    assert EngineConfig().forced_drafts == 0  # off by default
    assert EngineConfig(structured_forced_drafts=True).forced_drafts == 8
    assert EngineConfig(structured_forced_drafts=True, max_forced_drafts=3).forced_drafts == 3
    assert EngineConfig(structured_forced_drafts=True, enable_lora=True).forced_drafts == 8
    assert EngineConfig(structured_forced_drafts=True, tensor_parallel_size=2).forced_drafts == 0
    for bad in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match="max_forced_drafts"):
            EngineConfig(max_forced_drafts=bad)
    with pytest.raises(ValueError, match="structured_forced_drafts"):
        EngineConfig(structured_forced_drafts="yes")


def _tiny_byte_level_llama(folder: str) -> str:
    """A tiny random Llama with a byte-level tokenizer (one id per byte, no merges; a grammar backend reads it)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from tests.parallel.tiny_models import tiny_config

    config = tiny_config("llama")
    config.vocab_size = 260
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().eval().save_pretrained(folder)
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)
    return folder


def test_forced_drafts_under_adapters_keep_each_adapters_tokens(tmp_path):
    """Forced runs of requests under two LoRA adapters and the base model in one batch: each draft row is verified
    under its request's adapter (the row after a forced run samples the next free character from it), so the tokens
    are those with forced drafts off."""
    pytest.importorskip("peft")
    from tandem import LoRARequest
    from tests.lora.adapters import save_adapter
    base = _tiny_byte_level_llama(str(tmp_path / "base"))
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    loras = [LoRARequest(f"a{i}", i + 1, save_adapter(base, str(tmp_path / f"a{i}"), targets, r=4, seed=i, scale=0.5))
             for i in range(2)]
    spec = StructuredOutputParams(regex=r"[a-z]{3}-forced-text-[a-z]{4}")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_output=spec)
    order = [loras[0], None, loras[1], loras[0]]
    prompts = ["Code:", "Code:", "Code:", "Name:"]
    llm = LLM(base, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, seed=0,
              grammar_backend="llguidance", structured_forced_drafts=True, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    engine = llm.engine
    runs = {}
    for forced in (False, True):
        engine.use_forced_drafts(forced)
        drafted = engine.forced_draft_tokens
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=order)
        runs[forced] = [o.outputs[0].text for o in outs]
        assert (engine.forced_draft_tokens > drafted) == forced
    assert runs[True] == runs[False]
    assert all(text[3:16] == "-forced-text-" for text in runs[True])
    assert len({runs[True][0][16:], runs[True][1][16:], runs[True][2][16:]}) > 1  # the adapters move the free part
    assert engine.scheduler.num_free_blocks() == 63
    llm.shutdown()
