"""AsyncEngine, body parsing and the bench's statistics, with a fake core (no model)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from tandem.bench.serve import build_report, percentile, send_offsets, RequestResult
from tandem.request import FinishReason
from tandem.sampling_params import SamplingParams
from tandem.server import protocol as p
from tandem.server.async_engine import Accepted, AsyncEngine, Failed, QueueFullError, Rejected
from tandem.server.protocol import ApiError, loc_to_param, parse_body


@dataclass
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None


class FakeCore:
    """Emits one token per step per request; records which thread called it."""

    def __init__(self, fail_steps: set[int] | None = None) -> None:
        self.requests: dict[str, int] = {}
        self.aborted: list[tuple[str, FinishReason]] = []
        self.fail_steps = fail_steps or set()
        self.num_steps = 0
        self.threads: set[str] = set()

    def add_request(self, request_id, prompt_token_ids, params):
        self.threads.add(threading.current_thread().name)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = params.max_tokens

    def abort_request(self, request_id, reason=FinishReason.ABORT, stop_reason=None):
        self.aborted.append((request_id, reason))
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.threads.add(threading.current_thread().name)
        self.num_steps += 1
        if self.num_steps in self.fail_steps:
            raise RuntimeError("boom")
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] -= 1
            done = self.requests[rid] == 0
            outputs.append(FakeOutput(rid, [7], done, FinishReason.LENGTH if done else None))
            if done:
                del self.requests[rid]
        return outputs

    def stats(self):
        return {"num_running": len(self.requests)}


async def _drain(stream: asyncio.Queue, until_terminal: int) -> list:
    items, terminal = [], 0
    while terminal < until_terminal:
        item = await asyncio.wait_for(stream.get(), 10)
        items.append(item)
        terminal += isinstance(item, (Rejected, Failed)) or bool(getattr(item, "finished", False))
    return items


def test_outputs_flow_and_engine_runs_in_its_own_thread():
    async def main():
        core = FakeCore()
        engine = AsyncEngine(core, max_queue=4)
        engine.start()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=3)), ("b", [], SamplingParams(max_tokens=3))], stream)
        items = await _drain(stream, 2)
        assert any(isinstance(i, Rejected) and i.request_id == "b" for i in items)
        assert [i for i in items if isinstance(i, Accepted)] == [Accepted("a")]
        assert sum(len(i.new_token_ids) for i in items if isinstance(i, FakeOutput)) == 3
        assert core.threads == {"tandem-engine"}
        assert engine.num_requests == 0
        await engine.shutdown()

    asyncio.run(main())


def test_queue_bound_and_abort():
    async def main():
        core = FakeCore()
        engine = AsyncEngine(core, max_queue=2)
        engine.start()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=10**6)), ("b", [1], SamplingParams(max_tokens=10**6))],
                   stream)
        with pytest.raises(QueueFullError):
            engine.add([("c", [1], SamplingParams())], stream)
        engine.abort("a")
        engine.abort("b", FinishReason.STOP, "x")
        assert engine.num_requests == 0
        for _ in range(200):
            if len(core.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        assert not core.requests and {r for r, _ in core.aborted} == {"a", "b"}
        await engine.shutdown()

    asyncio.run(main())


def test_step_exception_fails_live_requests_and_loop_goes_on():
    async def main():
        core = FakeCore(fail_steps={2})
        engine = AsyncEngine(core, max_queue=8)
        engine.start()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=5))], stream)
        items = await _drain(stream, 1)
        assert isinstance(items[-1], Failed) and "boom" in items[-1].message
        engine.add([("b", [1], SamplingParams(max_tokens=2))], stream)
        items = await _drain(stream, 1)
        assert items[-1].finished and items[-1].request_id == "b"
        assert engine.is_alive
        await engine.shutdown()
        assert not engine.is_alive

    asyncio.run(main())


def test_shutdown_fails_whatever_is_left():
    async def main():
        core = FakeCore()
        engine = AsyncEngine(core, max_queue=8)
        engine.start()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=10**9))], stream)
        await asyncio.wait_for(stream.get(), 10)  # accepted
        await engine.shutdown()
        items = []
        while not stream.empty():
            items.append(stream.get_nowait())
        await asyncio.sleep(0.05)
        while not stream.empty():
            items.append(stream.get_nowait())
        assert isinstance(items[-1], Failed) and "shutting down" in items[-1].message

    asyncio.run(main())


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
    (b'{"prompt": [1, "a"]}', "prompt"),
    (b'{"prompt": "x", "presence_penalty": 0.5}', "presence_penalty"),
    (b'{"prompt": "x", "echo": true}', "echo"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
    (b'{"prompt": "x"', None),
])
def test_parse_body_names_the_field(raw, param):
    with pytest.raises(ApiError) as info:
        parse_body(p.CompletionRequest, raw)
    assert info.value.status == 400 and info.value.param == param


def test_loc_to_param():
    assert loc_to_param(("messages", 0, "role")) == "messages[0].role"
    assert loc_to_param(("messages", 1, "content", "list[TextContentPart]", 0, "TextContentPart", "text")) == \
        "messages[1].content[0].text"
    assert loc_to_param(("prompt", "list[int]", 2)) == "prompt[2]"
    assert loc_to_param(()) is None


def test_send_offsets_and_percentiles():
    assert send_offsets(4, 50.0, "fixed", 0) == [0.0, 0.02, 0.04, 0.06]
    poisson = send_offsets(2000, 100.0, "poisson", 1)
    assert poisson == sorted(poisson) and abs(poisson[-1] / 2000 - 0.01) < 0.002
    assert send_offsets(3, float("inf"), "poisson", 0) == [0.0, 0.0, 0.0]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0


def test_report_definitions():
    ok = RequestResult(0, 0.0, 0.0, ok=True, ttft_s=0.1, latency_s=0.5, itl_s=[0.2, 0.2], num_output_tokens=3)
    bad = RequestResult(1, 0.02, 0.02, error="HTTP 500")
    report = build_report(type("A", (), {})(), "m", [ok, bad], duration=1.0)
    s = report["summary"]
    assert s["num_completed"] == 1 and s["num_failed"] == 1 and report["errors"] == ["HTTP 500"]
    assert s["tpot_s"]["p50"] == pytest.approx(0.2)  # (0.5 - 0.1) / (3 - 1)
    assert "queue_time_s" not in s
