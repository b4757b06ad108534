"""`tandem bench soak`: the request mix and the verdict's arithmetic (fast), and a 1-minute soak of the embedded
model on CPU (slow; TANDEM_SOAK_MINUTES=N soaks longer, the 60-minute one is run by hand, see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from tandem.bench.soak import Soak, _device, _soak_arg_names, add_bench_soak_args, idle_fd_growth, plot, resource_drift
from tests.server.procs import REPO


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_soak_args(parser)
    return parser.parse_args(list(argv))


def test_the_mix_has_every_kind_of_request():
    soak = Soak(_args("--bad-fraction", "0.05", "--abort-fraction", "0.1"), "http://x")
    soak.model, soak.max_model_len = "m", 256
    made = [soak.make() for _ in range(2000)]
    bodies = [b for _, b, _, _ in made if isinstance(b, dict)]
    assert 50 <= sum(isinstance(b, bytes) for _, b, _, _ in made) <= 150  # bad bodies, about 5%
    assert 100 <= sum(a is not None for _, _, _, a in made) <= 300  # client aborts, about 10%
    assert any(b.get("stream") for b in bodies) and any(not b.get("stream") for b in bodies)
    assert any("messages" in b for b in bodies) and any("prompt" in b for b in bodies)
    assert any(b.get("n", 1) > 1 for b in bodies) and any("stop" in b for b in bodies)
    assert any("logprobs" in b for b in bodies)
    lengths = [len((b.get("prompt") or b["messages"][0]["content"]).split()) for b in bodies]
    assert min(lengths) < 40 and max(lengths) >= 64  # short and long prompts


def _sample(t: float, rss: list[float], fds: list[int], idle: str | None = None) -> dict:
    s = {"t_s": t, "processes": [{"pid": i, "name": f"p{i}", "rss_mb": r, "num_fds": f}
                                 for i, (r, f) in enumerate(zip(rss, fds))]}
    return {**s, "idle": idle} if idle else s


def test_drift_and_descriptor_verdicts():
    samples = [_sample(0, [100, 50], [30, 5], "before"), _sample(300, [110, 50], [60, 5]),
               _sample(600, [112, 51], [70, 5]), _sample(900, [115.5, 50], [31, 5], "after")]
    drift = resource_drift(samples[1:])
    assert drift["max_rss_drift_pct"] == 5.0  # 110 -> 115.5 MB after the warm-up
    assert drift["per_process"]["p0:0"]["fds_max"] == 70
    assert idle_fd_growth(samples) == 1  # in-flight sockets do not count: idle before vs idle after


def test_plot_writes_a_png(tmp_path):
    samples = [{**_sample(t, [100, 50], [30, 5]), "latency_p50_s": 0.1, "latency_p99_s": 0.3, "tokens_per_s": 10.0,
                "kv_blocks_in_use": 3, "in_flight": 2, "counts": {"2xx": t}} for t in (0, 30, 60)]
    report = {"samples": samples, "config": {"minutes": 1, "warmup_minutes": 0.5}, "request_rate": 1.0,
              "summary": {"passed": True, "max_rss_drift_pct": 0.0, "counts": {}, "idle_kv_blocks_in_use": 0}}
    plot(report, str(tmp_path / "soak.png"))
    assert (tmp_path / "soak.png").stat().st_size > 10_000


# CI soaks 1 minute at 1 request/s (as many requests as 2 minutes at 0.5); TANDEM_SOAK_MINUTES=N for a longer run.
SOAK_REQUEST_RATE = 1.0


def _soak_minutes() -> float:
    return float(os.environ.get("TANDEM_SOAK_MINUTES", "1"))


@pytest.mark.slow
def test_short_soak_on_cpu(tmp_path):
    minutes = _soak_minutes()
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "tandem", "bench", "soak", "--minutes", f"{minutes:g}", "--warmup-minutes", "0.5",
           "--request-rate", f"{SOAK_REQUEST_RATE:g}", "--max-tokens", "8", "--interval", "10", "--api-key", "k",
           "--server-args", "--device cpu --max-model-len 256 --num-kv-blocks 256 --api-key k",
           "--server-log", str(tmp_path / "server.log"), "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900 + 90 * minutes,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["passed"], json.dumps(summary, indent=1)
    assert run.returncode == 0
    expected = SOAK_REQUEST_RATE * minutes * 60  # Poisson arrivals: at least half sent, a third answered 2xx
    assert summary["sent"] >= expected / 2 and summary["counts"].get("2xx", 0) >= expected / 3
    assert report["server_exit_code"] == 0
    assert (tmp_path / "soak.png").exists()
    for key in ("date", "commit", "device", "command"):
        assert report[key], key
    assert report["device"].startswith("cpu (") and "structured_model" not in report["config"]


def test_the_record_names_where_the_server_ran(monkeypatch):
    args = _args()
    args.server_args = "--device cpu --max-model-len 256"
    assert _device(args).startswith("cpu (")
    args.server_args = "--model llama-3-8b"
    gpus = subprocess.CompletedProcess([], 0, stdout="NVIDIA H200\nNVIDIA H200\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: gpus)
    assert _device(args).startswith("2x NVIDIA H200 (server); client on the same host (")
    args.base_url = "http://host:8000"
    assert _device(args).startswith("server at http://host:8000; client on cpu (")
    assert "minutes" in _soak_arg_names() and "workload" not in _soak_arg_names()


def test_the_mix_without_a_tokenizer_sends_token_ids():
    soak = Soak(_args(), "http://x")
    soak.model, soak.max_model_len, soak.token_ids = "m", 4096, True
    bodies = [b for _, b, _, _ in (soak.make() for _ in range(500)) if isinstance(b, dict)]
    assert all(isinstance(b["prompt"], list) and "stop" not in b for b in bodies)
    assert any("stop_token_ids" in b for b in bodies)
