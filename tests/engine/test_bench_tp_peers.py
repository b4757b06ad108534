"""`tandem bench --peers tpK`: which sizes run, and a K > 1 peer as a child `tandem bench` whose result is read back
(a later tensor-parallel group of the same process would only get NCCL, not the peer-to-peer all-reduce)."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from tandem.bench.offline import (
    TensorParallelPeerError,
    add_bench_args,
    run_tensor_parallel_peer,
    tensor_parallel_peer_sizes,
)
from tandem.bench.workloads import WORKLOADS


def test_tp_peer_sizes_below_the_run_in_the_order_given():
    assert tensor_parallel_peer_sizes(["hf", "tp2", "tp1", "tp4", "tpx", "tp2", "tp0", "sync"], 4) == [2, 1]
    assert tensor_parallel_peer_sizes(["tp1", "tp2"], 2) == [1]
    assert tensor_parallel_peer_sizes(["tp1"], 1) == []


def test_a_tp_peer_runs_the_same_workload_in_a_child_bench(monkeypatch):
    calls = []

    def fake_run(cmd, capture_output, text):  # type: ignore[no-untyped-def]
        calls.append(cmd)
        with open(cmd[cmd.index("--out") + 1], "w") as f:
            json.dump({"results": [{"tokens_per_s": 123.5, "seconds": 2.0, "generated_tokens": 247,
                                    "roofline_fraction": 0.7, "gpu_busy_pct": 99.0, "peers": {}}]}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    r = run_tensor_parallel_peer(WORKLOADS["70b-bs1"], 2, 0.5, "fp8", "fp8", True, False)
    assert r == {"tokens_per_s": 123.5, "seconds": 2.0, "generated_tokens": 247, "roofline_fraction": 0.7,
                 "gpu_busy_pct": 99.0}
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "tandem", "bench"]
    parser = argparse.ArgumentParser()
    add_bench_args(parser.add_subparsers(dest="command"), lambda p: None)
    args = parser.parse_args(cmd[3:])  # the child's flags are the CLI's
    assert (args.workload, args.tensor_parallel_size, args.scale, args.no_peers) == ("70b-bs1", 2, 0.5, True)
    assert (args.quantization, args.kv_cache_dtype, args.quantize_lm_head) == ("fp8", "fp8", True)
    assert not args.enable_expert_parallel

    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no GPUs"))
    with pytest.raises(TensorParallelPeerError, match="TP=2 peer exited 1: no GPUs"):
        run_tensor_parallel_peer(WORKLOADS["70b-bs1"], 2, 1.0, None, "auto", False, True)
