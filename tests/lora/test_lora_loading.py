"""Adapters' host copies are made off the engine loop: a request waits (outside the scheduler) while its adapter is
being read and packed, then runs and gives transformers + peft's tokens; an adapter that fails to load fails its
requests only, naming it, and leaks no KV block; the host LRU never drops a copy a request still needs."""

from __future__ import annotations

import shutil
import threading

import pytest

from tandem import LLM, LoRARequest, SamplingParams
from tandem.lora.host import HostAdapters
from tandem.lora.pack import PackedAdapter
from tests.lora.adapters import peft_greedy, save_adapter, save_base

pytest.importorskip("peft")

MAX_TOKENS = 5
PROMPTS = [[5, 9, 17, 33, 2, 71], [40, 41, 42], [8, 100, 3, 60, 12]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_base("llama", str(tmp_path_factory.mktemp("llama") / "base"))


def _gate(llm: LLM) -> threading.Event:
    """Holds the loader thread until the returned event is set."""
    host = llm.engine.runner.lora.host
    make, gate = host._make, threading.Event()

    def held(request):
        assert gate.wait(30), "the test never opened the gate"
        return make(request)

    host._make = held
    return gate


def _llm(base: str) -> LLM:
    return LLM(base, device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
               num_kv_blocks=64, max_model_len=64)


def test_a_request_waits_for_its_adapter_copy_then_matches_peft(base, tmp_path):
    path = save_adapter(base, str(tmp_path / "a"), ALL, r=8, seed=5)
    llm = _llm(base)
    engine = llm.engine
    gate = _gate(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("lora", PROMPTS[0], params, LoRARequest("a", 1, path))
    engine.add_request("base", PROMPTS[1], params)
    tokens: dict[str, list[int]] = {"lora": [], "base": []}
    for _ in range(MAX_TOKENS + 3):  # the base request runs to its end while the adapter is being made
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert len(tokens["base"]) == MAX_TOKENS and tokens["lora"] == []
    assert "lora" in engine._loading and not engine.scheduler.requests.get("lora")
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["lora"] == peft_greedy(base, path, PROMPTS[0], MAX_TOKENS)
    assert tokens["base"] == peft_greedy(base, None, PROMPTS[1], MAX_TOKENS)
    assert engine.runner.lora.host.pins == {}


def test_an_adapter_that_fails_to_load_fails_only_its_requests(base, tmp_path):
    """The folder passes the check at add time, then is gone when the loader reads it: its two requests end with
    the reason, naming the adapter; the base-model and other-adapter requests finish; no KV block stays held."""
    good = save_adapter(base, str(tmp_path / "good"), ["q_proj", "v_proj"], r=4, seed=6)
    gone = save_adapter(base, str(tmp_path / "gone"), ALL, r=8, seed=7)
    llm = _llm(base)
    engine = llm.engine
    free = engine.scheduler.num_free_blocks()
    gate = _gate(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lost = LoRARequest("gone", 2, gone)
    engine.add_request("g1", PROMPTS[0], params, lost)
    engine.add_request("ok", PROMPTS[1], params, LoRARequest("good", 1, good))
    engine.add_request("base", PROMPTS[2], params)
    engine.add_request("g2", PROMPTS[2], params, lost)
    shutil.rmtree(gone)
    gate.set()
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    for rid in ("g1", "g2"):
        assert outs[rid].error is not None and "'gone'" in outs[rid].error and "not a folder" in outs[rid].error
    assert outs["ok"].error is None and outs["base"].error is None
    assert engine.scheduler.num_free_blocks() == free and engine.runner.lora.host.pins == {}
    assert "gone" not in [r.lora_name for r in engine.list_loras()]
    # The engine goes on serving, and the same name loads again once its folder is back.
    save_adapter(base, gone, ALL, r=8, seed=7)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=lost)[0]
    assert out.outputs[0].token_ids == peft_greedy(base, gone, PROMPTS[0], MAX_TOKENS)


def _packed(lora_id: int) -> PackedAdapter:
    return PackedAdapter(lora_id, {}, 0)


def _wait(host: HostAdapters, request: LoRARequest) -> None:
    host.wait_any(5)
    assert host.ready(request)


def test_host_copies_keep_the_cap_and_never_drop_a_pinned_one():
    made: list[int] = []

    def make(request: LoRARequest) -> PackedAdapter:
        made.append(request.lora_int_id)
        return _packed(request.lora_int_id)

    host = HostAdapters(make, capacity=2)
    a, b, c, d = (LoRARequest(n, i + 1, f"/adapters/{n}") for i, n in enumerate("abcd"))
    host.pin(a)
    host.pin(b)
    _wait(host, a)
    _wait(host, b)
    host.pin(c)  # no room: both copies are pinned
    assert not host.ready(c) and list(host.wanted) == [3] and set(host.cpu) == {1, 2}
    host.unpin(1)  # a's copy may go now: c's is made in its place
    _wait(host, c)
    assert set(host.cpu) == {2, 3} and host.get(2) is not None and made == [1, 2, 3]
    host.want(d)  # a preload (no request): only an unpinned copy could make room, and there is none
    assert list(host.wanted) == [4]
    host.unpin(2)
    host.wait(5)
    assert set(host.cpu) == {3, 4} and len(host.cpu) + len(host.loading) <= 2
    host.unpin(3)
    host.forget(3)  # unloaded with no request left: its copy goes at once
    assert set(host.cpu) == {4}
    host.shutdown()


def test_a_failed_copy_is_raised_to_its_requests_and_tried_again_later():
    fail = {"a"}

    def make(request: LoRARequest) -> PackedAdapter:
        if request.lora_name in fail:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: broken")
        return _packed(request.lora_int_id)

    host = HostAdapters(make, capacity=1)
    a = LoRARequest("a", 1, "/adapters/a")
    host.pin(a)
    host.wait_any(5)
    with pytest.raises(ValueError, match="'a': broken"):
        host.ready(a)
    fail.clear()
    assert not host.ready(a)  # made again for the next request that asks
    _wait(host, a)
    host.shutdown()


def test_adapter_from_the_hugging_face_cache(tmp_path, monkeypatch):
    """lora_path as a Hub id (`org/name`, no such local folder) reads the adapter's snapshot from the Hugging Face
    cache (offline here: no network), giving the tokens of the same folder given as a path; an id the cache lacks
    is refused offline naming the adapter, the cache and what to do."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    from tandem.lora import peft as peft_module

    base = save_base("llama", str(tmp_path / "base"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--sql-lora"
    save_adapter(base, str(repo / "snapshots" / commit), ["q_proj", "down_proj"], r=4, seed=3)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(peft_module, "_HUB_FOLDERS", {})
    monkeypatch.chdir(tmp_path)  # no local folder named tiny-org/sql-lora
    llm = LLM(base, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=32,
              max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = [[5, 9, 17, 33, 2, 71]]
    hub = llm.generate(prompt, params, use_tqdm=False, lora_request=LoRARequest("sql", 1, "tiny-org/sql-lora"))
    local = llm.generate(prompt, params, use_tqdm=False,
                         lora_request=LoRARequest("sql-local", 2, str(repo / "snapshots" / commit)))
    plain = llm.generate(prompt, params, use_tqdm=False)
    assert hub[0].outputs[0].token_ids == local[0].outputs[0].token_ids != plain[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"'missing'.*not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        llm.generate(prompt, params, use_tqdm=False, lora_request=LoRARequest("missing", 3, "tiny-org/nope"))
    with pytest.raises(ValueError, match="'gone'.*the path is not a folder"):
        llm.generate(prompt, params, use_tqdm=False, lora_request=LoRARequest("gone", 4, "./no/such/folder"))
