"""`tandem bench serve`: an open-loop streaming load generator for any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 95, 99)
# Seconds a benchmark client keeps an idle connection: below the server's keep-alive (tandem's default 5 s).
CLIENT_KEEP_ALIVE_S = 2.0

try:  # msgspec parses a streamed chunk in about a third of json's time: cycles the clients leave to the server
    from msgspec.json import decode as _loads
except ImportError:  # the load generator also runs where the server's packages are not installed
    _loads = json.loads


@dataclass(slots=True)
class RequestResult:
    index: int
    scheduled_s: float  # offset from the start the request was due to be sent
    sent_s: float  # offset from the start it was sent (later than scheduled under the concurrency cap)
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    queue_time_s: float | None = None  # from the server's response, when it reports one
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--api", default="completions", choices=["completions", "chat"])
    parser.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=50.0,
                        help="requests per second; inf sends all at once")
    parser.add_argument("--arrival", default="fixed", choices=["fixed", "poisson"],
                        help="fixed: one every 1/rate s; poisson: exponential gaps with that mean")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--num-clients", type=int, default=1,
                        help="client processes sharing the schedule (one Python process cannot parse every SSE "
                             "stream of a fast server); results are merged")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeatable, used round-robin); default: 'Hello'")
    parser.add_argument("--prompts-file", default=None, help="one prompt per line")
    parser.add_argument("--prompt-token-ids", default=None,
                        help="comma-separated token ids sent as the prompt (for servers without a tokenizer)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests stop at EOS (default: run every request to --max-tokens)")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) before the run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument("--per-request", action="store_true", help="include every request in the JSON")


def bench_serve_main(args: argparse.Namespace) -> int:
    if args.num_requests < 1 or args.max_tokens < 1 or args.request_rate <= 0 or args.num_clients < 1:
        raise ValueError("--num-requests, --max-tokens, --request-rate and --num-clients must be positive")
    prompts = load_prompts(args)
    report = run_benchmark(args, prompts)
    print_report(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if report["summary"]["num_failed"] == 0 else 1


def load_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    if getattr(args, "prompt_token_ids", None):
        return [[int(t) for t in args.prompt_token_ids.split(",")]]
    prompts: list[str | list[int]] = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or ["Hello"]


def send_offsets(num: int, rate: float, arrival: str, seed: int) -> list[float]:
    """Absolute send times (s from the start): the schedule never waits for responses (open loop)."""
    if rate == float("inf"):
        return [0.0] * num
    if arrival == "fixed":
        return [i / rate for i in range(num)]
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def run_benchmark(args: argparse.Namespace, prompts: list[str | list[int]]) -> dict[str, Any]:
    """Warm-up, then the open-loop schedule split over --num-clients processes (request i goes to client i % K).

    Every client follows the same absolute schedule from one wall-clock start, so K clients send what
    one would, only with K interpreters parsing the streams; the report merges them.
    """
    model = args.model or _run(_first_model_and_warmup(args, prompts))
    if args.model:
        _run(_first_model_and_warmup(args, prompts))
    offsets = send_offsets(args.num_requests, args.request_rate, args.arrival, args.seed)
    shares = [list(range(k, args.num_requests, args.num_clients)) for k in range(args.num_clients)]
    if args.num_clients == 1:
        start_wall = time.time()
        results, end_wall = _run(run_share(args, model, prompts, offsets, shares[0], start_wall))
    else:
        results, start_wall, end_wall = _run_client_processes(args, model, prompts, offsets, shares)
    results.sort(key=lambda r: r.index)
    report = build_report(args, model, results, end_wall - start_wall)
    report["wall"] = {"start": start_wall, "end": end_wall}  # time.time() of the shared start and the last end
    return report


async def _first_model_and_warmup(args: argparse.Namespace, prompts: list[str | list[int]]) -> str:
    async with _client(args, 2) as client:
        model = args.model or await first_model(client, args)
        for i in range(args.warmup):
            await one_request(client, args, model, prompts[i % len(prompts)], RequestResult(-1, 0.0, 0.0), 0.0)
    return model


def _client(args: argparse.Namespace, limit: int) -> Any:
    """An aiohttp session: its C HTTP parser costs a fraction of a pure-Python client's per streamed event, so
    the load generator leaves the cores it shares with the server to the server."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # Idle connections go before the server's keep-alive would close them (a request sent as it closes is lost).
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(
        limit=limit + 1, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
                                 timeout=aiohttp.ClientTimeout(total=args.timeout))


def _run(coro: Any) -> Any:
    """asyncio.run on uvloop when it is installed (the server's loop too)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _url(args: argparse.Namespace, path: str) -> str:
    return args.base_url.rstrip("/") + path


async def run_share(args: argparse.Namespace, model: str, prompts: list[str | list[int]], offsets: list[float],
                    indices: list[int], start_wall: float) -> tuple[list[RequestResult], float]:
    """Sends requests `indices` at start_wall + offsets[i] (wall clock); returns their results and the end time."""
    limit = max(1, (args.max_concurrency or args.num_requests) // args.num_clients)
    async with _client(args, limit) as client:
        semaphore = asyncio.Semaphore(limit)
        start = time.perf_counter() + (start_wall - time.time())  # the shared start on this process's clock

        async def scheduled(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with semaphore:
                result = RequestResult(i, offsets[i], time.perf_counter() - start)
                return await one_request(client, args, model, prompts[i % len(prompts)], result, start)

        # No garbage collection while timing: a full collection over a run's results pauses every stream this
        # process reads, and the pause would show up as the server's inter-token latency.
        collect = gc.isenabled()
        gc.disable()
        try:
            results = await asyncio.gather(*(scheduled(i) for i in indices))
        finally:
            if collect:
                gc.enable()
    return list(results), time.time()


def _client_process(args: argparse.Namespace, model: str, prompts: list[str | list[int]], offsets: list[float],
                    indices: list[int], conn: Any) -> None:
    conn.send("ready")
    start_wall = conn.recv()
    results, end_wall = _run(run_share(args, model, prompts, offsets, indices, start_wall))
    conn.send(([asdict(r) for r in results], end_wall))
    conn.close()


def _run_client_processes(args: argparse.Namespace, model: str, prompts: list[str | list[int]],
                          offsets: list[float], shares: list[list[int]]) -> tuple[list[RequestResult], float, float]:
    """Runs each share in its own process; returns the merged results, the common start and the last end."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    pipes, procs = [], []
    for share in shares:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_client_process, args=(plain, model, prompts, offsets, share, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for conn in pipes:
        if conn.recv() != "ready":
            raise RuntimeError("a benchmark client process did not start")
    start_wall = time.time() + 0.2  # every client is ready: start together, shortly
    for conn in pipes:
        conn.send(start_wall)
    results: list[RequestResult] = []
    end_wall = start_wall
    for conn, proc in zip(pipes, procs):
        rows, end = conn.recv()
        results += [RequestResult(**row) for row in rows]
        end_wall = max(end_wall, end)
        proc.join(30)
    return results, start_wall, end_wall


async def first_model(client: Any, args: argparse.Namespace) -> str:
    async with client.get(_url(args, "/v1/models")) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def one_request(client: Any, args: argparse.Namespace, model: str, prompt: str | list[int], result: RequestResult,
                      start: float) -> RequestResult:
    body: dict[str, Any] = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature,
                                stream=True, stream_options={"include_usage": True}, ignore_eos=args.ignore_eos)
    if args.api == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    sent = start + result.sent_s if start else time.perf_counter()
    last: float | None = None
    num_chunks = 0
    try:
        async with client.post(_url(args, path), json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read()).decode()[:300]}"
                return result
            async for raw in response.content:  # one line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[len(b"data: "):].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = _loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk_has_output(chunk, args.api):
                    num_chunks += 1
                    if last is None:
                        result.ttft_s = now - sent
                    else:
                        result.itl_s.append(now - last)
                    last = now
                for choice in chunk.get("choices") or []:
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                read_usage(chunk, result)
    except Exception as exc:  # network errors and timeouts count as failures, the run goes on
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if last is None:
        result.error = "no output tokens streamed"
        return result
    result.latency_s = last - sent
    if not result.num_output_tokens:
        result.num_output_tokens = num_chunks
    result.ok = True
    return result


def chunk_has_output(chunk: dict[str, Any], api: str) -> bool:
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if api == "chat" else choice.get("text")
        if text or choice.get("logprobs") or choice.get("token_ids"):
            return True
    return False


def read_usage(chunk: dict[str, Any], result: RequestResult) -> None:
    usage = chunk.get("usage")
    if usage:
        result.num_output_tokens = int(usage.get("completion_tokens") or 0)
        result.num_prompt_tokens = usage.get("prompt_tokens")
    metrics = chunk.get("metrics") or {}
    if metrics.get("queue_time_s") is not None:
        result.queue_time_s = float(metrics["queue_time_s"])


def distribution(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    out = {"mean": sum(ordered) / len(ordered)}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ordered, q)
    out["max"] = ordered[-1]
    return out


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def build_report(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    num_out = sum(r.num_output_tokens for r in ok)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_failed": len(results) - len(ok),
        "duration_s": duration,
        "output_tokens": num_out,
        "output_tokens_per_s": num_out / duration if duration > 0 else 0.0,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "max_send_lag_s": max((r.sent_s - r.scheduled_s for r in results), default=0.0),
    }
    for name, values in (
        ("ttft_s", [r.ttft_s for r in ok if r.ttft_s is not None]),
        ("tpot_s", [t for r in ok if (t := r.tpot_s) is not None]),
        ("itl_s", [gap for r in ok for gap in r.itl_s]),
        ("latency_s", [r.latency_s for r in ok if r.latency_s is not None]),
        ("queue_time_s", [r.queue_time_s for r in ok if r.queue_time_s is not None]),
    ):
        dist = distribution(values)
        if dist is not None:  # queue time is left out when the server does not report it
            summary[name] = dist
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k in _own_arg_names() and k != "api_key"} | {"model": model},
        "summary": summary,
        "errors": sorted({r.error for r in results if r.error})[:20],
    }
    if getattr(args, "per_request", False):
        report["requests"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in results]
    return report


def _own_arg_names() -> set[str]:
    """The dests add_bench_serve_args defines (a parent parser's arguments stay out of the report)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_bench_serve_args(parser)
    return {action.dest for action in parser._actions}


def print_report(report: dict[str, Any]) -> None:
    s = report["summary"]
    print(f"requests: {s['num_completed']}/{s['num_requests']} completed, {s['num_failed']} failed "
          f"in {s['duration_s']:.2f} s; output {s['output_tokens_per_s']:.1f} tok/s")
    for name in ("ttft_s", "tpot_s", "itl_s", "latency_s", "queue_time_s"):
        d = s.get(name)
        if d:
            print(f"  {name[:-2]:>10} ms: " + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in d.items()))
    for err in report["errors"]:
        print(f"  error: {err}", file=sys.stderr)
