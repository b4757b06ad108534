"""`tandem bench soak`: a server under hours of mixed load at a set fraction of its capacity, watched over time.

It starts `tandem serve` (or uses --base-url with --pids), measures the server's capacity on the mix (closed
loop), then sends the mix open-loop (Poisson) at --load x capacity for --minutes: chat and completions,
streaming or not, n > 1, logprobs, stop strings, client aborts, a few percent bad bodies, short and long
prompts. Every --interval seconds it records latency p50/p99, tokens/s, the RSS and open descriptors of every
server process, the KV blocks in use (/metrics) and the 2xx/4xx/5xx counts. At the end it waits for the server
to go idle and checks: every request accounted for, no 5xx, RSS within --rss-tolerance of its value after the
warm-up, descriptors flat, KV blocks back to 0. Writes a JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.serve import CLIENT_KEEP_ALIVE_S, percentile

PROMPT_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
                "near an old stone bridge under the pale morning light").split()
BAD_BODIES = (  # each must get a 4xx, never a 5xx
    (b"{", "/v1/completions"),
    (b'{"prompt": "x", "temperature": -1}', "/v1/completions"),
    (b'{"prompt": "x", "n": "2"}', "/v1/completions"),
    (b'{"messages": [], "max_tokens": 4}', "/v1/chat/completions"),
    (b'{"prompt": [99999999], "max_tokens": 2}', "/v1/completions"),
    (b'{"prompt": "x", "max_tokens": 1000000000}', "/v1/completions"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "/v1/chat/completions"),
)


@dataclass(slots=True)
class Outcome:
    kind: str  # "2xx", "4xx", "5xx", "aborted" (the client hung up on purpose), "error" (transport, timeout)
    end: float  # monotonic
    latency_s: float | None = None
    num_tokens: int = 0
    num_choices: int = 0  # engine requests the server ran for it (n x prompts when accepted)
    expected_4xx: bool = False


@dataclass
class Soak:
    args: argparse.Namespace
    base_url: str
    model: str = ""
    max_model_len: int = 256
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    outcomes: list[Outcome] = field(default_factory=list)
    in_flight: int = 0
    sent: int = 0
    token_ids: bool = False  # the server has no tokenizer (a named shape): completions of token ids only

    # ---- one request of the mix -------------------------------------------------------------------------------

    def make(self) -> tuple[str, bytes | dict[str, Any], bool, float | None]:
        """(path, body, stream, abort_after_s or None) of the next request of the mix."""
        r = self.rng
        if r.random() < self.args.bad_fraction:
            body, path = r.choice(BAD_BODIES)
            return path, body, False, None
        long_prompt = r.random() < 0.1
        num_words = r.randint(self.max_model_len // 4, self.max_model_len // 2) if long_prompt else r.randint(3, 30)
        prompt: str | list[int] = " ".join(r.choice(PROMPT_WORDS) for _ in range(num_words))
        if self.token_ids:
            prompt = [r.randrange(1000, 30000) for _ in range(num_words)]
        body: dict[str, Any] = {"model": self.model, "max_tokens": r.randint(4, self.args.max_tokens),
                                "temperature": r.choice([0.0, 0.7, 1.0]), "seed": r.randint(0, 2**31)}
        if long_prompt:
            body["max_tokens"] = min(body["max_tokens"], 16)
        if r.random() < 0.15:
            body["n"] = r.randint(2, 3)
        if r.random() < 0.2:  # stop strings (token ids without a tokenizer)
            if self.token_ids:
                body["stop_token_ids"] = [r.randrange(1000, 30000) for _ in range(8)]
            else:
                body["stop"] = [r.choice(["\n\n", ".", " the"])]
        chat = r.random() < 0.5 and not self.token_ids
        if chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
            if r.random() < 0.15:
                body["logprobs"], body["top_logprobs"] = True, r.randint(0, 5)
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
            if r.random() < 0.15:
                body["logprobs"] = r.randint(0, 5)
        stream = r.random() < 0.5
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        abort = r.uniform(0.01, 0.5) if r.random() < self.args.abort_fraction else None
        return path, body, stream, abort

    async def one(self, session: Any) -> None:
        path, body, stream, abort_after = self.make()
        expected_4xx = isinstance(body, bytes)
        n = 1 if expected_4xx else body.get("n", 1)
        start = time.monotonic()
        self.sent += 1
        self.in_flight += 1
        outcome = Outcome("error", start, expected_4xx=expected_4xx)
        try:
            call = self._call(session, path, body, stream, n, outcome)
            if abort_after is not None:
                try:
                    await asyncio.wait_for(call, abort_after)
                except TimeoutError:
                    outcome.kind, outcome.num_choices = "aborted", n
            else:
                await asyncio.wait_for(call, self.args.timeout)
        except TimeoutError:
            outcome.kind = "error"
        except Exception as exc:  # noqa: BLE001 - a transport error is an outcome to count, not a crash
            outcome.kind = f"error:{type(exc).__name__}"
        finally:
            self.in_flight -= 1
            outcome.end = time.monotonic()
            if outcome.kind == "2xx":
                outcome.latency_s = outcome.end - start
            self.outcomes.append(outcome)

    async def _call(self, session: Any, path: str, body: bytes | dict[str, Any], stream: bool, n: int,
                    outcome: Outcome) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with session.post(self.base_url + path, data=data,
                                headers={"Content-Type": "application/json"}) as response:
            status = response.status
            if status >= 300:
                await response.read()
                outcome.kind = "5xx" if status >= 500 else "4xx"
                return
            outcome.num_choices = n  # accepted: the server runs n engine requests
            if not stream:
                payload = json.loads(await response.read())
                outcome.num_tokens = payload["usage"]["completion_tokens"]
                outcome.kind = "2xx"
                return
            async for line in response.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome.kind = "5xx"  # an engine failure in mid-stream
                        return
                    if chunk.get("usage"):
                        outcome.num_tokens = chunk["usage"]["completion_tokens"]
                elif line.startswith(b"data: [DONE]"):
                    outcome.kind = "2xx"
                    return

    # ---- load phases ------------------------------------------------------------------------------------------

    async def closed_loop(self, session: Any, concurrency: int, seconds: float) -> float:
        """Completed requests per second with `concurrency` clients back to back: the capacity on this mix."""
        deadline = time.monotonic() + seconds
        done = 0

        async def worker() -> None:
            nonlocal done
            while time.monotonic() < deadline:
                await self.one(session)
                done += 1

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - start)

    async def open_loop(self, session: Any, rate: float, seconds: float, on_tick: Any) -> None:
        tasks: set[asyncio.Task] = set()
        start = time.monotonic()
        next_send, next_tick = start, start + self.args.interval
        while True:
            now = time.monotonic()
            if now >= next_tick:
                await on_tick()
                next_tick += self.args.interval
            if now - start >= seconds:
                break
            if now >= next_send:
                task = asyncio.ensure_future(self.one(session))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_send += self.rng.expovariate(rate)
                continue
            await asyncio.sleep(min(next_send, next_tick) - now)
        if tasks:
            await asyncio.wait(tasks, timeout=self.args.timeout + 5)


# ---- the server's processes and figures ------------------------------------------------------------------------


def process_tree(root: int) -> list[int]:
    """root and every live process below it."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent_of[int(entry)] = int(fields[1])
    found, frontier = [root], {root}
    while frontier:
        frontier = {c for c, p in parent_of.items() if p in frontier} - set(found)
        found += sorted(frontier)
    return found


def process_figures(pid: int) -> dict[str, Any] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    with open(f"/proc/{pid}/comm") as f:
        name = f.read().strip()
    return {"pid": pid, "name": name, "cmd": cmdline[:80], "rss_mb": rss_kb / 1024, "num_fds": num_fds}


async def read_metrics(session: Any, base_url: str) -> dict[str, float]:
    async with session.get(base_url + "/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def engine_requests_finished(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("tandem_request_success_total")) + \
        m.get("tandem_request_failure_total", 0.0)


# ---- the run ---------------------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    cmd = [sys.executable, "-m", "tandem", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


async def wait_healthy(session: Any, base_url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            async with session.get(base_url + "/health") as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not become healthy")
        await asyncio.sleep(0.5)


async def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    proc = log = None
    if args.base_url:
        base_url, root_pids = args.base_url.rstrip("/"), [int(p) for p in (args.pids or "").split(",") if p]
    else:
        proc, base_url, log = start_server(args)
        root_pids = [proc.pid]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def new_session(limit: int) -> Any:
        # Idle connections are dropped well before the server's keep-alive closes them: a request sent on a
        # connection the server is closing at that moment would be lost to the race, not to the server.
        connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=CLIENT_KEEP_ALIVE_S)
        return aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None))

    # Two sessions: `control` (one connection: health, /metrics) and `load`; closing `load` before an idle sample
    # leaves the server only the descriptors it keeps for itself, so the idle samples before and after compare.
    control, load = new_session(1), new_session(0)
    soak = Soak(args, base_url)
    samples: list[dict[str, Any]] = []
    try:
        await wait_healthy(control, base_url, proc, 600)
        async with control.get(base_url + "/v1/models") as r:
            card = (await r.json())["data"][0]
        soak.model, soak.max_model_len = card["id"], card.get("max_model_len") or 256
        async with control.post(base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}) as r:
            soak.token_ids = r.status == 400 and "no tokenizer" in await r.text()
        if soak.token_ids:
            print("the server has no tokenizer: completions of token ids only", flush=True)
        if args.request_rate:
            capacity, rate = None, args.request_rate
        else:
            print(f"measuring capacity: {args.calibrate_concurrency} clients for {args.calibrate_seconds:g} s",
                  flush=True)
            capacity = await soak.closed_loop(load, args.calibrate_concurrency, args.calibrate_seconds)
            rate = args.load * capacity
            print(f"capacity {capacity:.3f} req/s; soaking at {rate:.3f} req/s ({args.load:.0%})", flush=True)
        await load.close()
        await wait_idle(control, base_url, 300)
        await asyncio.sleep(1.0)
        soak.outcomes.clear()
        soak.sent = 0
        start = time.monotonic()
        samples.append({**await sample(control, soak, base_url, root_pids, start, samples), "idle": "before"})
        metrics_start = await read_metrics(control, base_url)
        load = new_session(0)

        async def tick() -> None:
            samples.append(await sample(control, soak, base_url, root_pids, start, samples))
            s = samples[-1]
            print(f"[{s['t_s'] / 60:6.1f} min] p50 {s['latency_p50_s']} p99 {s['latency_p99_s']} "
                  f"tok/s {s['tokens_per_s']:.1f} kv {s['kv_blocks_in_use']} in flight {s['in_flight']} "
                  f"rss {[round(p['rss_mb']) for p in s['processes']]} fds {[p['num_fds'] for p in s['processes']]}",
                  flush=True)

        await soak.open_loop(load, rate, args.minutes * 60, tick)
        await load.close()
        idle = await wait_idle(control, base_url, 300)
        await asyncio.sleep(1.0)
        samples.append({**await sample(control, soak, base_url, root_pids, start, samples), "idle": "after"})
        metrics_end = await read_metrics(control, base_url)
    finally:
        await load.close()
        await control.close()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if log not in (None, subprocess.DEVNULL):
            log.close()
    report = build_report(args, soak, samples, capacity, rate, metrics_start, metrics_end, idle)
    if proc is not None:
        report["server_exit_code"] = proc.returncode
    return report


async def wait_idle(session: Any, base_url: str, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = await read_metrics(session, base_url)
        if (m.get("tandem_num_requests_running", 1) == 0 and m.get("tandem_num_requests_waiting", 1) == 0
                and m.get("tandem_num_requests_in_server", 1) == 0 and m.get("tandem_kv_blocks_in_use", 1) == 0) \
                or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.5)


async def sample(session: Any, soak: Soak, base_url: str, root_pids: list[int], start: float,
                 previous: list[dict[str, Any]]) -> dict[str, Any]:
    now = time.monotonic()
    since = previous[-1]["_mono"] if previous else start
    window = [o for o in soak.outcomes if o.end > since]
    latencies = sorted(o.latency_s for o in window if o.latency_s is not None)
    m = await read_metrics(session, base_url)
    pids = [pid for root in root_pids for pid in process_tree(root)]
    counts: dict[str, int] = {}
    for o in soak.outcomes:
        kind = "error" if o.kind.startswith("error") else o.kind
        counts[kind] = counts.get(kind, 0) + 1
    return {
        "_mono": now, "t_s": round(now - start, 1),
        "latency_p50_s": round(percentile(latencies, 50), 4) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 99), 4) if latencies else None,
        "tokens_per_s": sum(o.num_tokens for o in window) / max(now - since, 1e-9),
        "requests_per_s": len(window) / max(now - since, 1e-9),
        "in_flight": soak.in_flight, "sent": soak.sent, "counts": counts,
        "kv_blocks_in_use": m.get("tandem_kv_blocks_in_use"),
        "num_running": m.get("tandem_num_requests_running"), "num_waiting": m.get("tandem_num_requests_waiting"),
        "processes": [f for f in (process_figures(pid) for pid in pids) if f is not None],
    }


def build_report(args: argparse.Namespace, soak: Soak, samples: list[dict[str, Any]], capacity: float | None,
                 rate: float, m0: dict[str, float], m1: dict[str, float], idle: dict[str, float]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for o in soak.outcomes:
        kind = "error" if o.kind.startswith("error") else o.kind
        counts[kind] = counts.get(kind, 0) + 1
    errors = sorted({o.kind for o in soak.outcomes if o.kind.startswith("error")})
    unexpected_4xx = sum(1 for o in soak.outcomes if o.kind == "4xx" and not o.expected_4xx)
    bad_not_refused = sum(1 for o in soak.outcomes if o.expected_4xx and o.kind != "4xx")
    # Every accepted choice ends on the server as stop / length / abort / failure: the two ledgers must agree.
    engine_client = sum(o.num_choices for o in soak.outcomes)
    engine_server = engine_requests_finished(m1) - engine_requests_finished(m0)
    warm = [s for s in samples if s["t_s"] >= args.warmup_minutes * 60 and s.get("idle") != "before"]
    drift = resource_drift(warm)
    idle_fds = idle_fd_growth(samples)
    checks = {
        "all_requests_accounted": len(soak.outcomes) == soak.sent and engine_client == engine_server,
        "no_lost_requests": counts.get("error", 0) == 0,
        "no_5xx": counts.get("5xx", 0) == 0,
        "bad_bodies_refused_with_4xx": bad_not_refused == 0 and unexpected_4xx == 0,
        "rss_within_tolerance": drift["max_rss_drift_pct"] is not None
        and drift["max_rss_drift_pct"] <= 100 * args.rss_tolerance,
        # Each request in flight holds a socket: descriptors are compared idle (before) with idle (after).
        "fds_flat": idle_fds is not None and idle_fds <= args.fd_tolerance,
        "kv_blocks_back_to_0": idle.get("tandem_kv_blocks_in_use") == 0,
    }
    latencies = sorted(o.latency_s for o in soak.outcomes if o.latency_s is not None)
    soak_keys = _soak_arg_names()  # the soak's own flags, not the rest of `tandem bench`'s
    return {
        "benchmark": "soak",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(), "device": _device(args), "command": "tandem " + " ".join(sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k in soak_keys and k != "api_key"},
        "capacity_requests_per_s": capacity, "request_rate": rate,
        "summary": {
            "passed": all(checks.values()), "checks": checks, "sent": soak.sent, "counts": counts,
            "transport_errors": errors, "unexpected_4xx": unexpected_4xx, "bad_bodies_not_refused": bad_not_refused,
            "engine_requests_client": engine_client, "engine_requests_server": engine_server,
            "latency_p50_s": percentile(latencies, 50) if latencies else None,
            "latency_p99_s": percentile(latencies, 99) if latencies else None,
            "idle_kv_blocks_in_use": idle.get("tandem_kv_blocks_in_use"), "idle_fd_growth": idle_fds, **drift,
        },
        "samples": [{k: v for k, v in s.items() if k != "_mono"} for s in samples],
    }


def idle_fd_growth(samples: list[dict[str, Any]]) -> int | None:
    """Largest growth of any process's open descriptors from the idle sample before the load to the one after."""
    before = next((s for s in samples if s.get("idle") == "before"), None)
    after = next((s for s in samples if s.get("idle") == "after"), None)
    if before is None or after is None:
        return None
    fds = {p["pid"]: p["num_fds"] for p in after["processes"]}
    return max(fds.get(p["pid"], 0) - p["num_fds"] for p in before["processes"])


def resource_drift(later: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest RSS change (% of the warm-up value, the first of `later`) and descriptor growth of any process."""
    base = later[0] if len(later) > 1 else None
    if base is None:
        return {"max_rss_drift_pct": None, "max_fd_growth": None, "per_process": {}}
    per: dict[str, dict[str, float]] = {}
    for proc in base["processes"]:
        key = f"{proc['name']}:{proc['pid']}"
        rows = [p for s in later for p in s["processes"] if p["pid"] == proc["pid"]]
        rss_drift = max(abs(p["rss_mb"] - proc["rss_mb"]) / proc["rss_mb"] * 100 for p in rows)
        per[key] = {"rss_mb_after_warmup": round(proc["rss_mb"], 1),
                    "rss_mb_end": round(rows[-1]["rss_mb"], 1), "max_rss_drift_pct": round(rss_drift, 2),
                    "fds_after_warmup": proc["num_fds"], "fds_max": max(p["num_fds"] for p in rows),
                    "fds_end": rows[-1]["num_fds"]}
    return {"max_rss_drift_pct": max((v["max_rss_drift_pct"] for v in per.values()), default=None),
            "max_fd_growth": max((v["fds_max"] - v["fds_after_warmup"] for v in per.values()), default=None),
            "per_process": per}


def _commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _device(args: argparse.Namespace) -> str:
    """Where the server ran (its GPUs, named by nvidia-smi, unless it runs on the CPU) and the client's host."""
    import platform
    import shlex

    client = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    if args.base_url:
        return f"server at {args.base_url}; client on cpu ({client})"
    words = shlex.split(args.server_args)
    on_cpu = "--device=cpu" in words or any(a == "--device" and b == "cpu" for a, b in zip(words, words[1:]))
    gpus: list[str] = []
    if not on_cpu:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout
            gpus = [line.strip() for line in out.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    if not gpus:
        return f"cpu ({client})"
    server = gpus[0] if len(gpus) == 1 else f"{len(gpus)}x {gpus[0]}"
    return f"{server} (server); client on the same host ({client})"


def _soak_arg_names() -> set[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_bench_soak_args(parser)
    return set(vars(parser.parse_args([])))


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)
    ax = axes[0][0]
    ax.plot(t, [s["latency_p50_s"] for s in samples], label="p50")
    ax.plot(t, [s["latency_p99_s"] for s in samples], label="p99")
    ax.set_ylabel("request latency (s)")
    ax.legend()
    axes[0][1].plot(t, [s["tokens_per_s"] for s in samples])
    axes[0][1].set_ylabel("output tokens/s")
    pids = {p["pid"]: f"{p['name']} ({p['pid']})" for s in samples for p in s["processes"]}
    for pid, label in pids.items():
        rows = [(s["t_s"] / 60, p) for s in samples for p in s["processes"] if p["pid"] == pid]
        axes[1][0].plot([r[0] for r in rows], [r[1]["rss_mb"] for r in rows], label=label)
        axes[1][1].plot([r[0] for r in rows], [r[1]["num_fds"] for r in rows], label=label)
    axes[1][0].set_ylabel("RSS (MiB)")
    axes[1][0].legend(fontsize=7)
    axes[1][1].set_ylabel("open file descriptors")
    axes[2][0].plot(t, [s["kv_blocks_in_use"] for s in samples], label="KV blocks in use")
    axes[2][0].plot(t, [s["in_flight"] for s in samples], label="requests in flight (client)")
    axes[2][0].set_ylabel("count")
    axes[2][0].legend()
    for kind in ("2xx", "4xx", "5xx", "aborted", "error"):
        axes[2][1].plot(t, [s["counts"].get(kind, 0) for s in samples], label=kind)
    axes[2][1].set_ylabel("requests (cumulative)")
    axes[2][1].legend()
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    warm = report["config"]["warmup_minutes"]
    for ax in axes.flat:
        ax.axvline(warm, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    s = report["summary"]
    fig.suptitle(f"tandem bench soak: {report['config']['minutes']:g} min at {report['request_rate']:.2f} req/s, "
                 f"{'PASSED' if s['passed'] else 'FAILED'}; max RSS drift {s['max_rss_drift_pct']}%, "
                 f"5xx {s['counts'].get('5xx', 0)}, idle KV blocks {s['idle_kv_blocks_in_use']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_bench_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the open-loop soak")
    parser.add_argument("--warmup-minutes", type=float, default=5.0,
                        help="RSS and descriptors are compared with their values this far in")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity to send")
    parser.add_argument("--request-rate", type=float, default=None, help="requests/s (skips the capacity run)")
    parser.add_argument("--calibrate-seconds", type=float, default=60.0)
    parser.add_argument("--calibrate-concurrency", type=int, default=16)
    parser.add_argument("--server-args", default="--device cpu",
                        help="arguments of the `tandem serve` the soak starts (engine flags, --api-server-count ...)")
    parser.add_argument("--server-log", default=None, help="write the started server's log here")
    parser.add_argument("--base-url", default=None, help="soak a running server instead of starting one")
    parser.add_argument("--pids", default=None, help="with --base-url: comma list of the server's root pids")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens is drawn from 4..this")
    parser.add_argument("--bad-fraction", type=float, default=0.03, help="share of bad bodies (expect 4xx)")
    parser.add_argument("--abort-fraction", type=float, default=0.05, help="share of requests the client abandons")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it counts as lost")
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("--fd-tolerance", type=int, default=8, help="descriptors a process may gain after warm-up")
    parser.add_argument("--out", default="soak.json", help="results JSON; the PNG goes beside it")


def bench_soak_main(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or not 0 < args.load <= 1.5 or args.warmup_minutes >= args.minutes:
        raise ValueError("need --minutes > --warmup-minutes >= 0 and 0 < --load <= 1.5")
    import signal

    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the server the soak started is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    commit = _commit()  # the code that ran, even if the checkout moves on during a long soak
    report = asyncio.run(run_soak(args))
    report["commit"] = commit
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    try:
        plot(report, png)
    except ImportError as exc:  # matplotlib is optional where only the server's packages are installed
        png = f"(no PNG: {exc})"
    s = report["summary"]
    print(json.dumps({k: v for k, v in s.items() if k != "per_process"}, indent=1))
    print(f"wrote {args.out} and {png}: {'PASSED' if s['passed'] else 'FAILED'}")
    return 0 if s["passed"] else 1
