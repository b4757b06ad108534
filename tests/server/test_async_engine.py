"""The engine-core loop and its AsyncEngine client over ZeroMQ with a fake core (no model); body parsing; bench stats."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from dataclasses import dataclass, field

import pytest

from tandem.bench.serve import RequestResult, build_report, percentile, send_offsets
from tandem.engine.client import Accepted, AsyncEngine, Failed, QueueFullError, Rejected
from tandem.engine.process import EngineCoreLoop, timeline_path, write_timeline
from tandem.outputs import EngineOutput
from tandem.profiling.timeline import Timeline
from tandem.request import FinishReason
from tandem.sampling_params import SamplingParams
from tandem.server import protocol as p
from tandem.server.protocol import ApiError, loc_to_param, parse_body


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_free_blocks: int = 8
    num_blocks: int = 8
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0


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
            outputs.append(EngineOutput(rid, [7], None, done, FinishReason.LENGTH if done else None, None, 1, 0))
            if done:
                del self.requests[rid]
        return outputs

    def stats(self):
        return FakeStats(num_running=len(self.requests), num_steps=self.num_steps)


@dataclass
class Harness:
    core: FakeCore
    loop: EngineCoreLoop
    thread: threading.Thread
    ipc_dir: str
    engines: list[AsyncEngine] = field(default_factory=list)

    def client(self, index: int = 0, max_queue: int = 8) -> AsyncEngine:
        engine = AsyncEngine(f"ipc://{self.ipc_dir}/in", f"ipc://{self.ipc_dir}/out-{index}", client_index=index,
                             max_queue=max_queue)
        engine.start()
        self.engines.append(engine)
        return engine

    async def close(self) -> None:
        for engine in self.engines:
            if not engine._stopping:
                await engine.shutdown()
        _send_shutdown(f"ipc://{self.ipc_dir}/in")
        await asyncio.to_thread(self.thread.join, 10)
        assert not self.thread.is_alive()


def _send_shutdown(addr: str) -> None:
    import msgspec
    import zmq

    from tandem.engine.messages import Shutdown

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(addr)
    sock.send(msgspec.msgpack.encode([Shutdown()]))
    sock.close(linger=1000)


def start_loop(core: FakeCore, num_clients: int = 1, max_queue: int = 64) -> Harness:
    ipc_dir = tempfile.mkdtemp(prefix="tandem-test-ipc-")
    loop = EngineCoreLoop(core, f"ipc://{ipc_dir}/in", [f"ipc://{ipc_dir}/out-{i}" for i in range(num_clients)],
                          max_queue)
    thread = threading.Thread(target=loop.run, name="tandem-engine", daemon=True)
    thread.start()
    return Harness(core, loop, thread, ipc_dir)


async def _drain(stream: asyncio.Queue, until_terminal: int) -> list:
    items, terminal = [], 0
    while terminal < until_terminal:
        item = await asyncio.wait_for(stream.get(), 10)
        items.append(item)
        terminal += isinstance(item, (Rejected, Failed)) or bool(getattr(item, "finished", False))
    return items


def test_outputs_flow_and_engine_runs_in_its_own_loop():
    async def main():
        h = start_loop(FakeCore())
        engine = h.client(max_queue=4)
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=3)), ("b", [], SamplingParams(max_tokens=3))], stream)
        items = await _drain(stream, 2)
        assert any(isinstance(i, Rejected) and i.request_id == "b" and i.status == 400 for i in items)
        assert [i for i in items if isinstance(i, Accepted)] == [Accepted("a")]
        outs = [i for i in items if isinstance(i, EngineOutput)]
        assert sum(len(i.new_token_ids) for i in outs) == 3 and outs[-1].finish_reason == "length"
        assert h.core.threads == {"tandem-engine"}
        assert engine.num_requests == 0
        for _ in range(100):  # the engine went idle: its last stats reach the client
            if engine.stats is not None and engine.stats.num_running == 0 and engine.stats.num_steps == 3:
                break
            await asyncio.sleep(0.02)
        assert engine.stats.num_steps == 3
        await h.close()

    asyncio.run(main())


class TimedCore(FakeCore):
    """FakeCore with the EngineCore timeline interface (a Timeline whose step follows the core's steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.timeline: Timeline | None = None

    def start_timeline(self) -> Timeline:
        self.timeline = Timeline()
        return self.timeline

    def stop_timeline(self) -> Timeline | None:
        timeline, self.timeline = self.timeline, None
        return timeline

    def step(self):
        if self.timeline is not None:
            self.timeline.step = self.num_steps
            with self.timeline.span("schedule"):
                return super().step()
        return super().step()


def test_loop_records_receive_and_send_spans_and_writes_the_trace(tmp_path):
    async def main():
        core = TimedCore()
        core.start_timeline()
        h = start_loop(core)
        engine = h.client()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=4))], stream)
        await _drain(stream, 1)
        await asyncio.sleep(0.3)  # the loop idles, blocked on its commands socket
        await h.close()
        return core

    core = asyncio.run(main())
    timeline = core.timeline
    names = {s.name for s in timeline.spans}
    assert {"receive", "schedule", "send"} <= names
    # Only busy turns of the loop are spans: an idle wait for commands is no phase of a step.
    assert all(s.end - s.start < 0.2 for s in timeline.spans if s.name == "receive")
    write_timeline(core, str(tmp_path / "engine.json"), engine_index=1)
    assert core.timeline is None and timeline_path(str(tmp_path / "engine.json"), 1).endswith("engine.json.1")
    back, wall_start = Timeline.from_chrome_trace(str(tmp_path / "engine.json.1"))
    assert len(back.spans) == len(timeline.spans) and wall_start > 0
    assert back.summary()["steps"] == 4


def test_two_clients_get_only_their_own_outputs_and_the_global_queue_bound():
    async def main():
        h = start_loop(FakeCore(), num_clients=2, max_queue=3)
        first, second = h.client(0, max_queue=8), h.client(1, max_queue=8)
        s1: asyncio.Queue = asyncio.Queue()
        s2: asyncio.Queue = asyncio.Queue()
        first.add([("a", [1], SamplingParams(max_tokens=10**9)), ("b", [1], SamplingParams(max_tokens=10**9))], s1)
        await _wait_accepted(s1, 2)
        second.add([("c", [1], SamplingParams(max_tokens=2)), ("d", [1], SamplingParams(max_tokens=2))], s2)
        items = await _drain(s2, 2)
        assert {i.request_id for i in items} == {"c", "d"}  # nothing of a or b
        full = [i for i in items if isinstance(i, Rejected)]
        assert len(full) == 1 and full[0].status == 429  # one of c, d was over the engine's global bound
        first.abort("a")
        first.abort("b")
        await h.close()

    asyncio.run(main())


async def _wait_accepted(stream: asyncio.Queue, count: int) -> None:
    seen = 0
    while seen < count:
        item = await asyncio.wait_for(stream.get(), 10)
        seen += isinstance(item, Accepted)


def test_queue_bound_and_abort():
    async def main():
        h = start_loop(FakeCore())
        engine = h.client(max_queue=2)
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=10**9)), ("b", [1], SamplingParams(max_tokens=10**9))],
                   stream)
        with pytest.raises(QueueFullError):
            engine.add([("c", [1], SamplingParams())], stream)
        await _wait_accepted(stream, 2)
        engine.abort("a")
        engine.abort("b", FinishReason.STOP, "x")
        assert engine.num_requests == 0
        for _ in range(200):
            if len(h.core.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        assert not h.core.requests and dict(h.core.aborted) == {"a": FinishReason.ABORT, "b": FinishReason.STOP}
        await h.close()

    asyncio.run(main())


def test_step_exception_fails_live_requests_and_loop_goes_on():
    async def main():
        h = start_loop(FakeCore(fail_steps={2}))
        engine = h.client()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=5))], stream)
        items = await _drain(stream, 1)
        assert items[-1].error is not None and "boom" in items[-1].error and items[-1].finished
        engine.add([("b", [1], SamplingParams(max_tokens=2))], stream)
        items = await _drain(stream, 1)
        assert items[-1].finished and items[-1].request_id == "b" and items[-1].error is None
        assert engine.is_alive
        await h.close()
        assert not engine.is_alive

    asyncio.run(main())


def test_engine_shutdown_fails_whatever_is_left():
    async def main():
        h = start_loop(FakeCore())
        engine = h.client()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=10**9))], stream)
        await _wait_accepted(stream, 1)
        _send_shutdown(f"ipc://{h.ipc_dir}/in")
        items = await _drain(stream, 1)
        assert items[-1].error is not None and "shutting down" in items[-1].error
        await h.close()

    asyncio.run(main())


def test_engine_death_fails_open_requests_at_once(tmp_path):
    """A dead engine pid (here: a child that exits) fails every open request and calls the death callback."""
    import subprocess
    import sys

    async def main():
        h = start_loop(FakeCore())
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
        deaths: list[str] = []
        engine = AsyncEngine(f"ipc://{h.ipc_dir}/in", f"ipc://{h.ipc_dir}/out-0", max_queue=8,
                             engine_pids=[child.pid], on_engine_death=deaths.append)
        engine.start()
        h.engines.append(engine)
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], SamplingParams(max_tokens=10**9))], stream)
        await _wait_accepted(stream, 1)
        await asyncio.to_thread(child.wait)
        items = await _drain(stream, 1)
        assert isinstance(items[-1], Failed) and "died" in items[-1].message
        assert deaths and not engine.is_alive
        await h.close()

    asyncio.run(main())


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "x", "max_tokens": "3"}', "max_tokens"),
    (b'{"prompt": [1, "a"]}', "prompt"),
    (b'{"prompt": "x", "logit_bias": {"a": 1}}', "logit_bias"),
    (b'{"prompt": "x", "echo": true, "stream": true}', "echo"),
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
