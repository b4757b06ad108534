"""Scheduler unit tests: validation, chunking, carry placeholders, preemption with tokens in flight, aborts."""

from __future__ import annotations

import ast
import pathlib

import pytest

import tandem.scheduler
from tandem.request import FinishReason, RequestStatus
from tandem.scheduler import PLACEHOLDER_TOKEN_ID, Scheduler, SchedulerConfig

from .sim import make_request


def scheduler(**overrides) -> Scheduler:
    values = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_blocks=33)
    values.update(overrides)
    return Scheduler(SchedulerConfig(**values))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8, max_model_len=8, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, block_size=4, num_blocks=1)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16, block_size=4, num_blocks=8,
            enable_chunked_prefill=False,
        )


def test_add_request_rejects_what_can_never_run() -> None:
    s = scheduler(num_blocks=5)  # 16 positions of KV
    with pytest.raises(ValueError, match="at least one token"):
        s.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="context limit"):
        s.add_request(make_request("long", [1] * 64))
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(make_request("big", [1] * 17))
    s.add_request(make_request("ok", [1] * 16))
    assert s.requests["ok"].max_model_len == 17  # the pool acts as the context limit
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("ok", [1]))
    assert s.num_waiting() == 1 and s.num_running() == 0


def test_chunked_prefill_then_decode() -> None:
    s = scheduler(max_num_batched_tokens=4)
    r = make_request("a", list(range(1, 11)), max_tokens=3, eos=False)
    s.add_request(r)
    chunks = []
    for _ in range(3):
        out = s.schedule()
        (entry,) = out.scheduled
        chunks.append((entry.num_computed_tokens, entry.token_ids, entry.sample))
        s.update_from_output(out, [42], None)
    assert chunks == [(0, [1, 2, 3, 4], False), (4, [5, 6, 7, 8], False), (8, [9, 10], True)]
    assert r.output_token_ids == [42] and r.num_cached_tokens == 0 and r.first_token_time is not None
    out = s.schedule()
    assert out.scheduled[0].token_ids == [42] and not out.scheduled[0].carry
    assert len(out.scheduled[0].block_ids) == 3


def test_budget_is_shared_running_first() -> None:
    s = scheduler(max_num_batched_tokens=6)
    s.add_request(make_request("a", [1, 2, 3, 4], max_tokens=5))
    s.add_request(make_request("b", [5, 6, 7, 8], max_tokens=5))
    out = s.schedule()
    assert [(e.request.request_id, e.num_scheduled_tokens) for e in out.scheduled] == [("a", 4), ("b", 2)]
    s.update_from_output(out, [9, -1], None)
    out = s.schedule()
    assert [(e.request.request_id, e.num_scheduled_tokens) for e in out.scheduled] == [("a", 1), ("b", 2)]
    assert out.num_scheduled_tokens == 3


def test_overlap_schedules_a_placeholder_and_carries() -> None:
    s = scheduler()
    r = make_request("a", [1, 2, 3], max_tokens=4, eos=False)
    s.add_request(r)
    first = s.schedule()
    assert r.num_pending_tokens == 1
    second = s.schedule()  # before update(first)
    (entry,) = second.scheduled
    assert entry.carry and entry.sample and entry.token_ids == [PLACEHOLDER_TOKEN_ID]
    assert entry.num_computed_tokens == 3 and r.num_pending_tokens == 2
    with pytest.raises(AssertionError):
        s.schedule()  # a third step ahead of update(first) breaks the engine's ordering
    assert s.update_from_output(first, [11], None) == [r]
    assert r.num_pending_tokens == 1 and r.output_token_ids == [11]


def test_no_compute_once_pending_tokens_reach_max_tokens() -> None:
    s = scheduler()
    r = make_request("a", [1, 2, 3], max_tokens=1)
    s.add_request(r)
    first = s.schedule()
    assert s.schedule().scheduled == []
    s.update_from_output(first, [5], None)
    assert r.is_finished and r.finish_reason == FinishReason.LENGTH
    assert s.num_free_blocks() == 32 and not s.has_unfinished_requests()


def test_preempted_request_receives_its_in_flight_token_while_waiting() -> None:
    s = scheduler(block_size=2, num_blocks=5, max_model_len=9)  # 4 usable blocks
    a = make_request("a", [1, 2, 3], max_tokens=5, eos=False)
    b = make_request("b", [4, 5, 6], max_tokens=2, eos=False)
    s.add_request(a)
    s.add_request(b)
    step1 = s.schedule()  # both prefill: 2 blocks each, pool full
    step2 = s.schedule()  # both decode position 3 with a placeholder: no new block
    assert [e.carry for e in step2.scheduled] == [True, True]
    s.update_from_output(step1, [10, 20], None)
    step3 = s.schedule()  # a needs a 3rd block: b (last) is preempted with its step-2 token in flight
    assert step3.preempted_request_ids == ["b"] and [e.request for e in step3.scheduled] == [a]
    assert b.status == RequestStatus.WAITING and b.num_pending_tokens == 1 and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    touched = s.update_from_output(step2, [11, 21], None)  # b's 2nd token: max_tokens reached
    assert b in touched and b.is_finished and b.output_token_ids == [20, 21]
    assert s.num_waiting() == 0
    s.update_from_output(step3, [12], None)
    assert a.output_token_ids == [10, 11, 12]
    s.abort_request("a")
    assert s.num_free_blocks() == 4


def test_preempted_request_with_pending_token_is_not_admitted() -> None:
    s = scheduler(block_size=2, num_blocks=5, max_model_len=9)
    a = make_request("a", [1, 2, 3], max_tokens=5, eos=False)
    b = make_request("b", [4, 5, 6], max_tokens=5, eos=False)
    s.add_request(a)
    s.add_request(b)
    step1 = s.schedule()
    c = make_request("c", [7], max_tokens=5, eos=False)
    s.add_request(c)  # no room: waits
    step2 = s.schedule()
    s.update_from_output(step1, [10, 20], None)
    step3 = s.schedule()
    assert step3.preempted_request_ids == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # preempted go to the front
    s.abort_request("a")  # frees room; b still has a token in flight
    assert s.schedule().scheduled == []  # the head waits for its token, and FIFO holds c back
    s.update_from_output(step2, [11, 21], None)
    assert b.output_token_ids == [20, 21] and b.num_pending_tokens == 0
    out = s.schedule()
    entry = out.scheduled[0]
    # b's own first block survived in the prefix cache (its tail block was evicted first).
    assert entry.request is b and entry.num_computed_tokens == 2 and entry.token_ids == [6, 20, 21]
    assert entry.sample and b.num_cached_tokens == 0  # recorded at first admission only
    assert [e.request for e in out.scheduled] == [b, c]


def test_abort_while_in_flight_drops_the_token_and_frees_once() -> None:
    s = scheduler()
    r = make_request("a", [1, 2, 3, 4, 5], max_tokens=8)
    s.add_request(r)
    out = s.schedule()
    assert s.num_free_blocks() == 30
    assert s.abort_request("a") is r
    assert r.is_finished and r.finish_reason == FinishReason.ABORT and s.num_free_blocks() == 32
    assert s.abort_request("a") is None and s.abort_request("nope") is None
    assert s.update_from_output(out, [3], None) == []
    assert r.output_token_ids == [] and s.num_free_blocks() == 32


def test_abort_waiting_request() -> None:
    s = scheduler(max_num_seqs=1)
    s.add_request(make_request("a", [1, 2]))
    s.add_request(make_request("b", [3, 4]))
    s.schedule()
    assert s.num_running() == 1 and s.num_waiting() == 1
    assert s.abort_request("b").status == RequestStatus.FINISHED
    assert s.num_waiting() == 0


def test_finish_request_with_stop_string() -> None:
    s = scheduler()
    r = make_request("a", [1, 2, 3])
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, [9], None)
    assert s.finish_request("a", FinishReason.STOP, "###") is r
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == "###" and s.num_free_blocks() == 32
    assert s.finish_request("a", FinishReason.STOP) is None


def test_logprobs_recorded_only_when_asked() -> None:
    s = scheduler()
    with_lp = make_request("a", [1, 2], logprobs=1)
    without = make_request("b", [1, 3])
    s.add_request(with_lp)
    s.add_request(without)
    out = s.schedule()
    entries = [(-0.5, [(7, -0.5)]), (-1.0, [(8, -1.0)])]
    s.update_from_output(out, [7, 8], entries)
    assert with_lp.output_logprobs == [entries[0]] and without.output_logprobs == []


def test_stop_token_sets_stop_reason_and_min_tokens_defers_eos() -> None:
    s = scheduler()
    stop = make_request("s", [1], stop_token_ids=[5], max_tokens=10)
    early_eos = make_request("m", [1], min_tokens=2, max_tokens=10)
    s.add_request(stop)
    s.add_request(early_eos)
    s.update_from_output(s.schedule(), [5, 7], None)  # 7 is EOS, but min_tokens=2
    assert stop.is_finished and stop.finish_reason == FinishReason.STOP and stop.stop_reason == 5
    assert not early_eos.is_finished
    s.update_from_output(s.schedule(), [7], None)
    assert early_eos.finish_reason == FinishReason.STOP and early_eos.stop_reason is None


def test_waiting_head_blocks_fifo_and_seats_limit() -> None:
    s = scheduler(max_num_seqs=3, num_blocks=8)  # 7 usable blocks of 4
    s.add_request(make_request("a", [1] * 20, max_tokens=2))  # 5 blocks
    s.add_request(make_request("b", [2] * 20, max_tokens=2))  # its 12-token chunk needs 3: no room
    s.add_request(make_request("c", [3] * 2, max_tokens=2))  # would fit, but FIFO stops at b
    out = s.schedule()
    assert [e.request.request_id for e in out.scheduled] == ["a"]
    assert s.kv_cache_usage() == pytest.approx(5 / 7) and s.num_waiting() == 2


def test_scheduler_package_stays_pure_python() -> None:
    forbidden = ("torch", "tandem.runner", "tandem.models", "tandem.layers", "tandem.kernels", "tandem.engine")
    package = pathlib.Path(tandem.scheduler.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                assert not module.startswith(forbidden), f"{path.name} imports {module}"


def test_max_tokens_zero_finishes_with_its_prompt_and_never_decodes() -> None:
    """Scoring (max_tokens=0): chunked over steps scheduled back to back as the overlap loop does, then finished
    for length by the step that computes the prompt's last position, with no token and no decode scheduled."""
    s = scheduler(max_num_batched_tokens=4)
    r = make_request("score", list(range(1, 11)), max_tokens=0, prompt_logprobs=0)
    s.add_request(r)
    first = s.schedule()
    second = s.schedule()  # before the first step's update, as with overlap
    s.update_from_output(first, [42], None)
    third = s.schedule()
    s.update_from_output(second, [42], None)
    assert [(e.num_computed_tokens, e.num_scheduled_tokens, e.sample) for o in (first, second, third)
            for e in o.scheduled] == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert s.schedule().scheduled == []  # the last chunk's token is in flight: nothing to decode
    touched = s.update_from_output(third, [42], None)
    assert touched == [r] and r.output_token_ids == [] and r.finish_reason == FinishReason.LENGTH
    assert r.status == RequestStatus.FINISHED and not s.has_unfinished_requests()
    assert s.num_free_blocks() == 32


def test_prompt_logprobs_request_bypasses_prefix_cache_hits() -> None:
    s = scheduler()
    prompt = list(range(1, 14))
    s.add_request(make_request("warm", prompt, max_tokens=1))
    s.update_from_output(s.schedule(), [42], None)
    s.add_request(make_request("hit", prompt, max_tokens=1))
    s.add_request(make_request("score", prompt, max_tokens=0, prompt_logprobs=1))
    out = s.schedule()
    starts = {e.request.request_id: e.num_computed_tokens for e in out.scheduled}
    assert starts == {"hit": 12, "score": 0}
