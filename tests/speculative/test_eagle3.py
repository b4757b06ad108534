"""EAGLE-3 proposer on the CPU (fp32): a random head in the published folder format drafts what an independent
PyTorch EAGLE-3 forward drafts; greedy output with it equals greedy output without speculation (overlap on and off,
chunked prefill, prefix cache, preemption); a head that does not fit the target is refused naming the field."""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.config import ModelConfig
from tandem.request import Request, RequestStatus
from tandem.runner.executor import ModelExecutor
from tandem.scheduler.output import ScheduledRequest, SchedulerOutput
from tandem.speculative.eagle3 import Eagle3Proposer
from tandem.speculative.eagle3_head import Eagle3Config, Eagle3Head, read_head_tensors
from tests.parallel.tiny_models import VOCAB, save_tiny

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ENGINE = dict(device="cpu", dtype="float32", max_model_len=160, max_num_seqs=4, block_size=8, num_kv_blocks=128,
              max_num_batched_tokens=32)
PROMPTS = [[40, 41, 42, 43] * 5, [(3 * i) % 11 + 4 for i in range(41)], [99, 98, 99], [7, 8, 9, 10, 11]]
HIDDEN, LAYERS = 64, [0, 1, 1]  # the tiny target's width; its two layers' inputs (layer 0's: the embeddings)


def head_config(draft_vocab: int = 100, **overrides) -> dict:
    config = dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=HIDDEN, intermediate_size=80,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=VOCAB,
                  draft_vocab_size=draft_vocab, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": LAYERS})
    config.update(overrides)
    return config


def save_head(folder, config: dict, seed: int = 5, d2t: torch.Tensor | None = None) -> str:
    """A random head in the Hugging Face layout: midlayer.*, fc, norm, lm_head, d2t and t2d."""
    g = torch.Generator().manual_seed(seed)
    h, inter, dv = config["hidden_size"], config["intermediate_size"], config["draft_vocab_size"]
    hd = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    tensors = {"fc.weight": rand(h, 3 * HIDDEN) * 0.3, "norm.weight": 1 + rand(h), "lm_head.weight": rand(dv, h) * 5,
               "midlayer.input_layernorm.weight": 1 + rand(h), "midlayer.hidden_norm.weight": 1 + rand(h),
               "midlayer.post_attention_layernorm.weight": 1 + rand(h),
               "midlayer.self_attn.q_proj.weight": rand(q, 2 * h), "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
               "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, q),
               "midlayer.mlp.gate_proj.weight": rand(inter, h), "midlayer.mlp.up_proj.weight": rand(inter, h),
               "midlayer.mlp.down_proj.weight": rand(h, inter)}
    if d2t is None:  # draft id i -> target id 2 i (an offset table, as published)
        d2t = torch.arange(dv, dtype=torch.int64) if 2 * dv <= VOCAB else torch.zeros(dv, dtype=torch.int64)
    tensors["d2t"] = d2t
    tensors["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    os.makedirs(folder, exist_ok=True)
    safetensors_torch.save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return os.fspath(folder)


def save_likely_head(folder, outputs: list[list[int]]) -> str:
    """A head whose draft vocabulary is the four tokens most frequent in `outputs` (the target's greedy tokens):
    some of its drafts get accepted."""
    common = [t for t, _ in Counter(t for out in outputs for t in out).most_common(4)]
    d2t = torch.tensor(common, dtype=torch.int64) - torch.arange(4)
    return save_head(folder, head_config(draft_vocab=4), seed=7, d2t=d2t)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return save_head(tmp_path_factory.mktemp("head"), head_config())


# ---------------------------------------------------------------- an independent EAGLE-3 forward


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [n, heads, dim], rotate-half layout
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def reference_drafts(folder: str, target_model, tokens: list[int], k: int) -> list[int]:
    """k greedy drafts after `tokens` (the target computed all but the last): rows q = 0 .. n-1 read
    (embedding of token q + 1, fc of the target's hidden states at q); chain rows read their own output. One
    thread: its many tiny ops would otherwise wait on the thread pool far longer than they compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_drafts(folder, target_model, tokens, k)
    finally:
        torch.set_num_threads(threads)


def _reference_drafts(folder: str, target_model, tokens: list[int], k: int) -> list[int]:
    cfg = json.load(open(os.path.join(folder, "config.json")))
    w = safetensors_torch.load_file(os.path.join(folder, "model.safetensors"))
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    with torch.no_grad():
        out = target_model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in LAYERS], dim=-1)  # input of layer i, per position
        embed = target_model.model.embed_tokens.weight
        hidden = aux @ w["fc.weight"].T
        ids = list(tokens[1:])
        keys, values, drafts = [], [], []
        pos = 0
        # Every row, fed one at a time (the KV of earlier rows is what a later row attends to).
        for row in range(len(ids) + k - 1):
            e = _rms(embed[ids[row]], w["midlayer.input_layernorm.weight"], eps)
            hn = _rms(hidden[row], w["midlayer.hidden_norm.weight"], eps)
            x = torch.cat([e, hn])
            q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(1, nh, hd)
            kk = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(1, nkv, hd)
            vv = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(nkv, hd)
            p = torch.tensor([pos])
            q, kk = _rope(q, p, theta)[0], _rope(kk, p, theta)[0]
            keys.append(kk)
            values.append(vv)
            K, V = torch.stack(keys), torch.stack(values)  # [t, nkv, hd]
            K, V = K.repeat_interleave(nh // nkv, dim=1), V.repeat_interleave(nh // nkv, dim=1)  # head h: kv h // g
            a = torch.softmax(torch.einsum("thd,hd->th", K, q) / math.sqrt(hd), dim=0)
            attn = torch.einsum("th,thd->hd", a, V).reshape(-1) @ w["midlayer.self_attn.o_proj.weight"].T
            s = attn + hidden[row]
            m = _rms(s, w["midlayer.post_attention_layernorm.weight"], eps)
            m = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
                @ w["midlayer.mlp.down_proj.weight"].T
            s = s + m
            pos += 1
            if row >= len(ids) - 1:
                d = int((_rms(s, w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
                token = d + int(w["d2t"][d])
                drafts.append(token)
                ids.append(token)
                hidden = torch.cat([hidden, s[None]])
        return drafts


def _request(rid: str, tokens: list[int], computed: int) -> Request:
    r = Request(rid, list(tokens), SamplingParams(), frozenset(), 160, 0)
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, computed
    return r


@pytest.mark.parametrize("feed_rows", [None, 0])
def test_head_drafts_equal_an_independent_eagle3_forward(target, head, feed_rows):
    """Two requests fed in chunks (as prefill chunks come), then chained: the drafts are the reference's, with the
    feeds on the static buffers (one query row per position) or as prompt chunks run (the prefill attention)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    cfg = Eagle3Config.from_folder(head)
    eagle = Eagle3Head(cfg, read_head_tensors(head), torch.device("cpu"), torch.float32, 200)
    eagle.use_target_embeddings(model.model.embed_tokens.weight.detach())
    proposer = Eagle3Proposer(eagle, num_blocks=16, block_size=4, stream=None, chain_rows=3, feed_rows=feed_rows)
    # a's chain starts inside a block (position 10), b's at a block's first position (8).
    seqs = {"a": [5, 9, 17, 33, 2, 8, 8, 40, 41, 3, 7], "b": [60, 61, 62, 1, 2, 3, 4, 50, 51]}
    tables = {"a": [3, 7, 1], "b": [9, 2, 5]}
    requests = {rid: _request(rid, toks, len(toks) - 1) for rid, toks in seqs.items()}
    with torch.no_grad():
        aux = {rid: torch.cat([h[0] for h in (lambda o: [o.hidden_states[i] for i in LAYERS])(
            model(torch.tensor([toks[:-1]]), output_hidden_states=True))], -1) for rid, toks in seqs.items()}
    # Step 1: a's positions 0..5 and b's 0..3; step 2: the rest (b's as a flat verify-like layout is not needed).
    for lo, hi in (({"a": 0, "b": 0}), ({"a": 6, "b": 4})), (({"a": 6, "b": 4}), ({"a": 10, "b": 8})):
        sched = [ScheduledRequest(requests[rid], lo[rid], hi[rid] - lo[rid], seqs[rid][lo[rid]:hi[rid]], False,
                                  tables[rid], True) for rid in ("a", "b")]
        rows = torch.cat([aux[rid][lo[rid]:hi[rid]] for rid in ("a", "b")])
        proposer.observe(SchedulerOutput(sched, len(rows), []), flat=False, aux=rows)
    got = proposer.propose_all([(requests["a"], 4), (requests["b"], 3)])
    assert got == [reference_drafts(head, model, seqs["a"], 4), reference_drafts(head, model, seqs["b"], 3)]
    # A request the head was not fed up to its last position gets no drafts.
    stale = _request("c", [1, 2, 3], 2)
    assert proposer.propose_all([(stale, 2)]) == [[]]


def _greedy(llm: LLM, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(target):
    llm = LLM(target, **ENGINE)
    tokens = _greedy(llm)
    llm.shutdown()
    return tokens


@pytest.fixture(scope="module")
def likely_head(tmp_path_factory, plain):
    """A head whose draft vocabulary is the four tokens the target emits most: some drafts get accepted."""
    return save_likely_head(tmp_path_factory.mktemp("likely"), plain)


@pytest.mark.parametrize("overlap, device_drafts", [(True, True), (False, False)])
def test_greedy_with_eagle3_equals_greedy_without(target, likely_head, plain, overlap, device_drafts, monkeypatch):
    """Drafts left on the device (stand-in ids swapped on the device before the verify forward) or brought to the
    host: the same tokens as without speculation."""
    spec = {"method": "eagle3", "model": likely_head, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(target, speculative_config=spec, overlap=overlap, **ENGINE)
    llm.engine.device_drafts = device_drafts
    swaps = []
    take = ModelExecutor.take_drafts
    monkeypatch.setattr(ModelExecutor, "take_drafts", lambda self, *a: swaps.append(a[2]) or take(self, *a))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert bool(swaps) == device_drafts
    drafted = sum(o.metrics["spec_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["spec_accepted_tokens"] for o in outs)
    assert drafted >= accepted > 0
    # Again, the prompts' blocks now prefix-cache hits: the same tokens, and nothing leaks.
    assert _greedy(llm) == plain
    proposer = llm.engine.proposer
    assert not proposer.last
    assert llm.engine.scheduler.num_free_blocks() == ENGINE["num_kv_blocks"] - 1
    llm.shutdown()
    # Shut down, the head holds no memory: no weights, no KV, no reference to the target's embeddings.
    assert proposer.kv.numel() == 0 and proposer.head.lm_head.numel() == 0 and proposer.head.embed is None


@pytest.mark.parametrize("case", ["greedy", "seeded", "stop"])
def test_verify_step_scheduled_behind_the_one_in_flight(target, likely_head, plain, case, monkeypatch):
    """Overlap on, drafts on the device: the next verify step is scheduled before the one in flight is collected,
    as if every draft in flight were accepted, and the device moves its rows back by the rejected ones
    (ModelExecutor.shift_rows). Tokens equal those without speculation: greedy, seeded sampling (each row keeps
    its position's noise, so a wrong sampling position shows) and stop tokens ending requests inside an accepted
    run (the step behind it is dropped); without it (the default) every verify step is collected first."""
    # The two tokens the greedy runs write most after their fifth (in the head's draft vocabulary): stop tokens
    # that end requests inside accepted runs.
    common = [t for t, _ in Counter(t for out in plain for t in out[5:]).most_common(2)]
    stop = {"stop_token_ids": common} if case == "stop" else {}
    params = SamplingParams(temperature=0.8 if case == "seeded" else 0.0, seed=11, max_tokens=24, ignore_eos=True,
                            **stop)
    llm = LLM(target, **ENGINE)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    spec = {"method": "eagle3", "model": likely_head, "num_speculative_tokens": 3, "adaptive": False}
    shifted = []
    shift_rows = ModelExecutor.shift_rows
    monkeypatch.setattr(ModelExecutor, "shift_rows", lambda self, *a: shifted.append(a[1]) or shift_rows(self, *a))
    for ahead in (True, False):
        shifted.clear()
        llm = LLM(target, speculative_config=spec, **ENGINE)
        llm.engine.ahead = ahead
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, ahead
        assert (len(shifted) >= 3) == ahead, shifted
        assert llm.engine.stats().spec_accepted_tokens > 0
        if case == "stop":
            assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 2
        assert llm.engine.scheduler.num_free_blocks() == ENGINE["num_kv_blocks"] - 1
        llm.shutdown()


def test_greedy_with_eagle3_under_preemption(target, likely_head, plain):
    """A KV pool too small for every request at once: preempted requests are computed again."""
    spec = {"method": "eagle3", "model": likely_head, "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(target, speculative_config=spec, **{**ENGINE, "num_kv_blocks": 18})
    assert _greedy(llm) == plain
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()


@pytest.mark.parametrize("change, field", [
    ({"hidden_size": 32}, "hidden_size"),
    ({"target_hidden_size": 48}, "hidden_size"),
    ({"vocab_size": VOCAB + 1}, "vocab_size"),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, "eagle_aux_hidden_state_layer_ids"),
])
def test_head_that_does_not_fit_the_target_is_refused(target, tmp_path, change, field):
    folder = save_head(tmp_path / "bad", head_config())
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config.update(change)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=field):
        LLM(target, speculative_config={"method": "eagle3", "model": folder}, **ENGINE)


def test_weights_that_do_not_match_the_config_are_refused(target, tmp_path):
    folder = save_head(tmp_path / "bad", head_config(draft_vocab=8), d2t=torch.full((8,), VOCAB, dtype=torch.int64))
    with pytest.raises(ValueError, match="d2t"):
        LLM(target, speculative_config={"method": "eagle3", "model": folder}, **ENGINE)
    folder = save_head(tmp_path / "bad2", head_config())
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] = 96
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="gate_proj"):
        LLM(target, speculative_config={"method": "eagle3", "model": folder}, **ENGINE)


def test_default_aux_layers_are_two_middle_and_third_from_last():
    config = Eagle3Config.from_dict({**head_config(), "eagle_config": {}})
    target = ModelConfig("llama", VOCAB, HIDDEN, 32, 4, 2, 16, 96, 256)
    assert config.check_target(target) == (2, 16, 29)


def test_head_folder_without_weights_is_refused(target, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with open(empty / "config.json", "w") as f:
        json.dump(head_config(), f)
    with pytest.raises(ValueError, match="no safetensors"):
        LLM(target, speculative_config={"method": "eagle3", "model": str(empty)}, **ENGINE)


def test_tp2_with_eagle3_equals_greedy_without(target, likely_head, plain):
    """Both ranks copy the hidden states the head reads (summing a rank's share is a collective both join); the head
    runs on rank 0 and its drafts reach the other rank with the step's inputs."""
    spec = {"method": "eagle3", "model": likely_head, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(target, speculative_config=spec, tensor_parallel_size=2, **ENGINE)
    try:
        got = _greedy(llm)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert got == plain
    assert stats.spec_draft_tokens >= stats.spec_accepted_tokens > 0


def test_engine_feeds_the_head_the_targets_hidden_states(target, likely_head):
    """Inside the engine (overlap on: a step is fed after the next one is scheduled; prefill chunks, verify steps in
    both layouts, a second request's chunk beside the first's drafts), the head's drafts are the reference's from
    the target's own hidden states: those the engine takes (mostly chained behind a verify step on the device
    before its accepted counts reached the host) and, every third step, a chain run anew."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    spec = {"method": "eagle3", "model": likely_head, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(target, speculative_config=spec, **ENGINE)
    engine = llm.engine
    engine.ahead = True  # verify steps scheduled behind the one in flight too (drafts_ahead)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("a", PROMPTS[1], params)
    checked, steps = Counter(), 0
    propose_on_device = engine.eagle3.propose_on_device

    def drafts_on_device(requests):
        """The engine's drafts left on the device (mostly chained behind the verify step, before its accepted
        counts reached the host): each request's, resolved, is the reference's."""
        prefetched = bool(engine.eagle3._ready)
        stand_ins, tokens = propose_on_device(requests)
        for (request, _), ids in zip(requests, stand_ins):
            got = tokens.reshape(-1)[[-2 - i for i in ids]].tolist()
            assert got == reference_drafts(likely_head, model, request.all_token_ids, 3)[: len(ids)], (prefetched, request.request_id, len(request.all_token_ids), ids, dict(checked))
            checked["prefetched" if prefetched else "chained"] += bool(ids)
        return stand_ins, tokens

    engine.eagle3.propose_on_device = drafts_on_device
    drafts_ahead, ahead = engine.eagle3.drafts_ahead, []

    def record_ahead(sched, ks, accepted):
        """Drafts chained behind a verify step still in flight, for the step scheduled behind it: the whole chain
        row of each request (all 3, however many it verifies), checked once that step's tokens reach the host."""
        stand_ins, tokens = drafts_ahead(sched, ks, accepted)
        assert all(ids == [-2 - 3 * g - j for j in range(k)] for g, (ids, k) in enumerate(zip(stand_ins, ks)))
        ahead.extend((s.request, tokens[g].tolist()) for g, s in enumerate(sched.scheduled))
        return stand_ins, tokens

    engine.eagle3.drafts_ahead = record_ahead
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for request, got in ahead:  # the step they were drafted behind is collected now
            if request.status is RequestStatus.RUNNING:
                assert got == reference_drafts(likely_head, model, request.all_token_ids, 3), steps
                checked["ahead"] += 1
        ahead.clear()
        if steps == 4:
            engine.add_request("b", PROMPTS[0] * 2, params)  # a 40-token prompt: chunks beside a's verify steps
        if steps % 3:
            continue  # the chains below overwrite the one the engine drafted behind its verify step: not every step
        for rid, request in list(engine._requests.items()):
            last = engine.eagle3.last.get(rid)
            if last is not None and last.position == len(request.all_token_ids) - 2:
                got = engine.eagle3.propose_all([(request, 3)])[0]
                assert got == reference_drafts(likely_head, model, request.all_token_ids, 3), (rid, steps)
                stand_ins, on_device = propose_on_device([(request, 2)])
                assert stand_ins == [[-2, -3]] and on_device[0, :2].tolist() == got[:2]
                checked[rid] += 1
    assert checked["a"] >= 2 and checked["b"] >= 2 and checked["prefetched"] >= 3 and checked["ahead"] >= 3, checked
    llm.shutdown()


def test_head_with_tensors_of_another_format_is_refused(target, tmp_path):
    folder = save_head(tmp_path / "bias", head_config())
    path = os.path.join(folder, "model.safetensors")
    tensors = safetensors_torch.load_file(path)
    tensors["midlayer.self_attn.q_proj.bias"] = torch.zeros(HIDDEN)
    safetensors_torch.save_file(tensors, path)
    with pytest.raises(ValueError, match="q_proj.bias"):
        LLM(target, speculative_config={"method": "eagle3", "model": folder}, **ENGINE)


def test_bench_random_head_fits_the_named_shape(tmp_path):
    """`tandem bench --workload spec --spec-eagle3-head random`: a head config of the target's shape (weights are
    drawn at start-up, with dummy weights)."""
    from tandem.bench.spec_workload import random_eagle3_folder
    from tandem.config import EngineConfig
    from tandem.models.loader import load_model_config

    config = Eagle3Config.from_folder(random_eagle3_folder("llama-3-8b", str(tmp_path)))
    assert config.check_target(load_model_config(EngineConfig(model="llama-3-8b", load_format="dummy"))) == (2, 16, 29)
    assert (config.hidden_size, config.draft_vocab_size, config.num_kv_heads) == (4096, 32000, 8)


@pytest.mark.parametrize("ahead", [False, True])
def test_eagle3_under_adapters_equals_adapters_without_drafts(target, likely_head, plain, tmp_path, ahead,
                                                              monkeypatch):
    """Requests with and without a LoRA adapter in one batch: drafts verified under each row's adapter (also with
    the next verify step scheduled behind the one in flight) give the tokens of the adapters without drafts."""
    pytest.importorskip("peft")
    from tandem import LoRARequest
    from tests.lora.adapters import save_adapter

    adapter = LoRARequest("all", 1, save_adapter(target, str(tmp_path / "all"), ["q_proj", "v_proj", "down_proj"],
                                                 r=4, seed=3, scale=0.1))
    order = [adapter if i % 2 == 0 else None for i in range(len(PROMPTS))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lora = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    llm = LLM(target, **lora, **ENGINE)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=order)]
    llm.shutdown()
    assert any(w != p for w, p, r in zip(want, plain, order) if r is not None)  # the adapter changes them
    spec = {"method": "eagle3", "model": likely_head, "num_speculative_tokens": 3, "adaptive": False}
    shifted = []
    shift_rows = ModelExecutor.shift_rows
    monkeypatch.setattr(ModelExecutor, "shift_rows", lambda self, *a: shifted.append(a[1]) or shift_rows(self, *a))
    llm = LLM(target, speculative_config=spec, **lora, **ENGINE)
    llm.engine.ahead = ahead
    outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=order)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.stats().spec_accepted_tokens > 0 and (len(shifted) >= 3) == ahead
    assert llm.engine.scheduler.num_free_blocks() == ENGINE["num_kv_blocks"] - 1
    llm.shutdown()
