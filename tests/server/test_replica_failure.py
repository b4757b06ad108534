"""Failures across processes, at the AsyncEngine seam: two engine-core loops (fake cores, threads) behind one
client. A replica whose process dies or that falls silent fails only its own requests; the client routes around
it; a silent one rejoins when it speaks again; a dead API process's requests are freed in the engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from tandem.engine import process as engine_process
from tandem.engine.client import DEAD, HUNG, LIVE, Accepted, AsyncEngine, EngineUnavailableError, Failed
from tandem.engine.messages import AbortClient
from tandem.outputs import EngineOutput
from tandem.sampling_params import SamplingParams
from tests.server.test_async_engine import FakeCore, Harness, _send_shutdown, start_loop

LONG = SamplingParams(max_tokens=10**9)


class PacedCore(FakeCore):
    """FakeCore at ~100 steps per second, as a small model steps: the client keeps up with its outputs."""

    def step(self):
        time.sleep(0.01)
        return super().step()


class StallingCore(PacedCore):
    """A core whose step() blocks while `stall` is set: a deadlocked step, or a kernel that never returns."""

    def __init__(self) -> None:
        super().__init__()
        self.stall = threading.Event()
        self.resume = threading.Event()

    def step(self):
        if self.stall.is_set():
            self.resume.wait(30)
            self.stall.clear()
        return super().step()


def _send(addr: str, command) -> None:  # type: ignore[no-untyped-def]
    import msgspec
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(addr)
    sock.send(msgspec.msgpack.encode([command]))
    sock.close(linger=1000)


class Replicas:
    """Two engine-core loops (replicas 0 and 1) sending to one API process's output address."""

    def __init__(self, cores: list[FakeCore], heartbeat: tuple[bool, ...] = (True, True)) -> None:
        self.harnesses: list[Harness] = []
        import tempfile

        self.out = f"ipc://{tempfile.mkdtemp(prefix='tandem-test-out-')}/out"
        for index, core in enumerate(cores):
            ipc_dir = tempfile.mkdtemp(prefix="tandem-test-ipc-")
            # Without its heartbeat thread, a stalled loop is a silent replica (as a stopped process is).
            loop = engine_process.EngineCoreLoop(core, f"ipc://{ipc_dir}/in", [self.out], 64, engine_index=index,
                                                 heartbeat=heartbeat[index])
            thread = threading.Thread(target=loop.run, name=f"tandem-engine-{index}", daemon=True)
            thread.start()
            self.harnesses.append(Harness(core, loop, thread, ipc_dir))
        # Stand-ins for the replicas' processes: killing one is the replica's death as the client sees it.
        self.procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in cores]

    def client(self, **kwargs) -> AsyncEngine:  # type: ignore[no-untyped-def]
        engine = AsyncEngine([f"ipc://{h.ipc_dir}/in" for h in self.harnesses], self.out, max_queue=64,
                             engine_pids=[p.pid for p in self.procs], **kwargs)
        engine.start()
        return engine

    async def close(self, engine: AsyncEngine) -> None:
        await engine.shutdown()
        for h, proc in zip(self.harnesses, self.procs):
            core = h.core
            if isinstance(core, StallingCore):
                core.resume.set()
            _send_shutdown(f"ipc://{h.ipc_dir}/in")
            await asyncio.to_thread(h.thread.join, 10)
            assert not h.thread.is_alive()
            proc.kill()
            proc.wait()


async def _collect(stream: asyncio.Queue, ids: set[str], seconds: float) -> dict[str, list]:
    """Every item for `ids` that arrives within `seconds`."""
    got: dict[str, list] = {rid: [] for rid in ids}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            item = await asyncio.wait_for(stream.get(), max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            break
        got[item.request_id].append(item)
    return got


async def _accepted(stream: asyncio.Queue, count: int) -> None:
    seen = 0
    while seen < count:
        seen += isinstance(await asyncio.wait_for(stream.get(), 10), Accepted)


def test_a_dead_replica_fails_only_its_requests_and_new_ones_go_to_the_live_one():
    async def main():
        replicas = Replicas([PacedCore(), PacedCore()])
        deaths: list[str] = []
        engine = replicas.client(on_engine_death=deaths.append, engine_timeout=None)
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([(f"r{i}", [1], LONG) for i in range(4)], stream)
        await _accepted(stream, 4)
        on = dict(engine._replica_of)
        assert sorted(on.values()) == [0, 0, 1, 1]
        replicas.procs[1].kill()
        items = await _collect(stream, set(on), 1.5)
        for rid, replica in on.items():
            if replica == 1:  # ended at once with the replica named, a 503
                failed = [i for i in items[rid] if isinstance(i, Failed)]
                assert len(failed) == 1 and failed[0].status == 503, items[rid]
                assert f"engine replica 1 (pid {replicas.procs[1].pid}) died" in failed[0].message
            else:  # still streaming
                assert sum(isinstance(i, EngineOutput) for i in items[rid]) > 3 and not any(
                    isinstance(i, Failed) for i in items[rid])
        assert engine.is_alive and engine.num_live_replicas == 1 and engine.replica_state == [LIVE, DEAD]
        assert engine.num_replica_failures == 1 and not deaths
        before = set(replicas.harnesses[1].core.requests)
        engine.add([(f"n{i}", [1], SamplingParams(max_tokens=2)) for i in range(4)], stream)
        assert {engine._replica_of[f"n{i}"] for i in range(4)} == {0}
        got = await _collect(stream, {f"n{i}" for i in range(4)} | set(on), 1.0)
        assert all(any(getattr(i, "finished", False) for i in got[f"n{i}"]) for i in range(4))
        assert set(replicas.harnesses[1].core.requests) == before  # nothing new reached the dead one
        for rid, replica in on.items():
            if replica == 0:
                engine.abort(rid)
        replicas.procs[0].kill()  # the last one: the client is done, the server would exit
        for _ in range(100):
            if deaths:
                break
            await asyncio.sleep(0.02)
        assert deaths and not engine.is_alive and engine.num_live_replicas == 0
        with pytest.raises(EngineUnavailableError, match="died"):
            engine.add([("x", [1], LONG)], stream)
        await replicas.close(engine)

    asyncio.run(main())


def test_a_silent_replica_is_taken_out_within_the_timeout_and_rejoins_when_it_speaks(monkeypatch):
    monkeypatch.setattr(engine_process, "HEARTBEAT_S", 0.2)

    async def main():
        stalling = StallingCore()
        replicas = Replicas([PacedCore(), stalling], heartbeat=(True, False))
        engine = replicas.client(engine_timeout=1.0)
        await asyncio.sleep(1.6)  # idle past the timeout: the heartbeats keep both replicas in
        assert engine.replica_state == [LIVE, LIVE]
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([(f"r{i}", [1], LONG) for i in range(4)], stream)
        await _accepted(stream, 4)
        on = dict(engine._replica_of)
        stalling.stall.set()  # replica 1's loop stops turning mid-step
        stalled_at = time.monotonic()
        items = await _collect(stream, set(on), 2.5)
        for rid, replica in on.items():
            failed = [i for i in items[rid] if isinstance(i, Failed)]
            if replica == 1:
                assert len(failed) == 1 and "engine replica 1" in failed[0].message, items[rid]
                assert "sent nothing" in failed[0].message and "--engine-timeout 1 s" in failed[0].message
            else:
                assert not failed and sum(isinstance(i, EngineOutput) for i in items[rid]) > 3
        assert engine.replica_state == [LIVE, HUNG] and engine.is_alive and engine.num_replica_failures == 1
        assert time.monotonic() - stalled_at < 3
        engine.add([("n", [1], SamplingParams(max_tokens=2))], stream)
        assert engine._replica_of["n"] == 0
        stalling.resume.set()  # it speaks again: its failed requests are aborted there, it takes requests
        for _ in range(100):
            if engine.replica_state[1] == LIVE and not stalling.requests:
                break
            await asyncio.sleep(0.02)
        assert engine.replica_state == [LIVE, LIVE] and not stalling.requests
        for rid, replica in on.items():
            if replica == 0:
                engine.abort(rid)
        await replicas.close(engine)

    asyncio.run(main())


def test_one_stuck_step_makes_the_client_unavailable_until_the_engine_goes_round_again(monkeypatch):
    monkeypatch.setattr(engine_process, "HEARTBEAT_S", 0.2)

    async def main():
        stalling = StallingCore()
        replicas = Replicas([stalling])
        engine = replicas.client(engine_timeout=10.0, step_timeout=1.0)
        await asyncio.sleep(1.5)  # idle is no stall
        assert engine.is_alive
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], LONG)], stream)
        await _accepted(stream, 1)
        stalling.stall.set()  # the heartbeat thread goes on, saying how long the loop has been stuck
        items = await _collect(stream, {"a"}, 2.0)
        assert isinstance(items["a"][-1], Failed) and "the engine core process" in items["a"][-1].message
        assert not engine.is_alive and "has not finished a step" in engine.error
        assert "--engine-step-timeout 1 s" in engine.error
        with pytest.raises(EngineUnavailableError, match="has not finished a step"):
            engine.add([("b", [1], LONG)], stream)
        stalling.resume.set()
        for _ in range(100):
            if engine.is_alive:
                break
            await asyncio.sleep(0.02)
        assert engine.is_alive and not stalling.requests
        await replicas.close(engine)

    asyncio.run(main())


def test_abort_client_frees_that_api_process_requests_only():
    async def main():
        h = start_loop(PacedCore(), num_clients=2)
        first, second = h.client(0), h.client(1)
        s1: asyncio.Queue = asyncio.Queue()
        s2: asyncio.Queue = asyncio.Queue()
        first.add([("a", [1], LONG)], s1)
        second.add([("b", [1], LONG), ("c", [1], LONG)], s2)
        await _accepted(s1, 1)
        await _accepted(s2, 2)
        _send(f"ipc://{h.ipc_dir}/in", AbortClient(1))  # what the launcher sends when API process 1 died
        for _ in range(200):
            if set(h.core.requests) == {"a"}:
                break
            await asyncio.sleep(0.01)
        assert set(h.core.requests) == {"a"}
        assert sum(isinstance(i, EngineOutput) for i in (await _collect(s1, {"a"}, 0.3))["a"]) > 2
        second._streams.clear()  # this process is "dead": what it held is gone with it
        second._replica_of.clear()
        second.router.load = [0]
        first.abort("a")
        await h.close()

    asyncio.run(main())


class RankLostCore(PacedCore):
    """A core whose tensor-parallel rank died at step 3: every later step would fail."""

    @property
    def fatal_error(self):  # type: ignore[no-untyped-def]
        return "tensor-parallel worker rank 1 exited (exit code -9)" if self.num_steps >= 3 else None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's SystemExit
def test_an_engine_that_cannot_step_any_more_fails_its_requests_and_exits():
    async def main():
        h = start_loop(RankLostCore())
        engine = h.client()
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("a", [1], LONG)], stream)
        items = (await _collect(stream, {"a"}, 2.0))["a"]
        assert items[-1].finished and "rank 1 exited" in items[-1].error
        await asyncio.to_thread(h.thread.join, 10)
        assert not h.thread.is_alive()  # the loop ended: its process exits and the replica is taken out
        await engine.shutdown()

    asyncio.run(main())


def test_requests_are_routed_by_tokens_in_flight_and_the_work_is_given_back():
    async def main():
        replicas = Replicas([PacedCore(), PacedCore()])
        engine = replicas.client(engine_timeout=None)
        stream: asyncio.Queue = asyncio.Queue()
        engine.add([("long", [1], SamplingParams(max_tokens=1000))], stream)
        # By request count these would alternate; by tokens in flight all three fit beside the long one.
        engine.add([(f"s{i}", [1], SamplingParams(max_tokens=10)) for i in range(3)], stream)
        assert engine._replica_of["long"] == 0
        assert [engine._replica_of[f"s{i}"] for i in range(3)] == [1, 1, 1]
        assert engine.router.tokens == [1000, 30]
        await _collect(stream, {f"s{i}" for i in range(3)} | {"long"}, 1.0)  # the short ones finish
        assert engine.router.tokens == [1000, 0] and engine.router.load == [1, 0]
        engine.abort("long")
        assert engine.router.tokens == [0, 0] and engine.router.load == [0, 0]
        await replicas.close(engine)

    asyncio.run(main())
