"""`tandem bench --workload serve` end to end on the CPU: offline passes, a server it starts itself, saturation
passes through several client processes, a Poisson pass, and the JSON that reports them."""

from __future__ import annotations

import json

import psutil

from tandem.cli import main
from tests.parallel.tiny_models import save_tiny


def test_serve_workload_reports_offline_and_server_passes(tmp_path):
    model = save_tiny("llama", tmp_path / "llama")
    out = tmp_path / "serve.json"
    before = {p.pid for p in psutil.process_iter()}
    rc = main(["bench", "--workload", "serve", "--serve-model", str(model), "--serve-requests", "6",
               "--serve-output-len", "5", "--serve-prompt-ids", "5,6,7", "--num-clients", "2",
               "--serve-repeats", "2", "--serve-poisson-rate", "40", "--serve-timeline",
               "--serve-data-parallel-size", "2", "--out", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["workload"] == "serve" and r["requests"] == 6 and r["num_clients"] == 2
    offline = r["offline_tokens_per_s_runs"]
    assert len(offline) == 2 and all(t > 0 for t in offline) and r["offline_tokens_per_s"] == max(offline)
    server = r["server_overlap"]
    passes = server["saturation_tokens_per_s_runs"]
    assert len(passes) == 2 and server["saturation"]["summary"]["output_tokens_per_s"] == max(passes)
    for name in ("saturation", "poisson"):
        summary = server[name]["summary"]
        assert summary["num_completed"] == 6 and summary["num_failed"] == 0, (name, server[name]["errors"])
        assert summary["output_tokens"] == 6 * 5
    assert r["server_over_offline"] == max(passes) / max(offline)
    assert server["exit_code"] == 0
    # --serve-data-parallel-size 2: a second server of two replicas served every request.
    dp = r["server_dp2"]
    assert dp["exit_code"] == 0 and dp["saturation"]["summary"]["num_completed"] == 6
    assert r["server_dp_efficiency"] == max(dp["saturation_tokens_per_s_runs"]) / (2 * max(passes))
    # --serve-timeline: the engine core wrote its trace and the report sliced both engines' step phases.
    for phases in (r["offline_step_phases"], server["step_phases"]):
        assert phases["seconds"] > 0 and phases["steps"] >= 0
    assert any(name.startswith("tandem-engine") for name in server["cpu_percent"])
    # The server it started is gone, children included.
    leftover = [p for p in psutil.process_iter(["name"]) if p.pid not in before
                and (p.info["name"] or "").startswith("tandem-")]
    assert not leftover, leftover
