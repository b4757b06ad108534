"""scripts/bench_history.py on synthetic bench JSON: the per-GPU files, the history rows and the plot."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_history.py"


@pytest.fixture(scope="module")
def bench_history() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_history", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _result(workload: str, tokens_per_s: float, **extra: Any) -> dict[str, Any]:
    result: dict[str, Any] = {
        "workload": workload, "device": "NVIDIA H200", "dtype": "bfloat16", "scale": 1.0, "date": "2026-12-01",
        "quantization": None, "quantize_lm_head": False, "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
        "data_parallel_size": 1, "tokens_per_s": tokens_per_s, "roofline_fraction": 0.8851, "gpu_busy_pct": 99.81,
        "ceilings": {"copy_gbps": 4278.9, "matmul_tflops": 753.8, "fp8_matmul_tflops": None},
        "peers": {"tandem --sync": tokens_per_s / 1.05}, "ratios": {"tandem --sync": 1.0473},
    }
    result.update(extra)
    return result


def _bench_json(path: Path, results: list[dict[str, Any]]) -> Path:
    commands = [f"tandem bench --workload {r['workload']} --peers sync --out /tmp/x/bench.json --plot-dir /tmp/p"
                for r in results]
    path.write_text(json.dumps({"commands": commands, "missing_workloads": [], "results": results}))
    return path


def _add(bench_history: ModuleType, tmp_path: Path, bench: Path, *extra: str) -> None:
    bench_history.main(["add", str(bench), "--commit", "abc1234", "--results-dir", str(tmp_path / "results"),
                        "--history", str(tmp_path / "history.csv"), *extra])


def _rows(tmp_path: Path) -> list[dict[str, str]]:
    with (tmp_path / "history.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_add_writes_per_gpu_file_and_history_row(bench_history: ModuleType, tmp_path: Path) -> None:
    fp8 = _result("seed-async", 8720.6, quantization="fp8", peers={"tandem bf16": 6014.3},
                  ratios={"tandem bf16": 1.44997})
    bench = _bench_json(tmp_path / "bench.json", [_result("bs1", 283.78), fp8])
    _add(bench_history, tmp_path, bench)

    data = json.loads((tmp_path / "results" / "h200" / "bs1.json").read_text())
    assert data["record"] == {
        "date": "2026-12-01", "commit": "abc1234", "gpu": "h200", "device": "NVIDIA H200", "workload": "bs1",
        "command": "tandem bench --workload bs1 --peers sync",
    }
    assert data["results"][0]["tokens_per_s"] == 283.78
    assert (tmp_path / "results" / "h200" / "seed-async-fp8.json").exists()

    rows = _rows(tmp_path)
    assert list(rows[0]) == list(bench_history.COLUMNS)
    assert [(r["gpu"], r["workload"]) for r in rows] == [("h200", "bs1"), ("h200", "seed-async-fp8")]
    bs1, seed = rows
    assert (bs1["date"], bs1["commit"], bs1["tokens_per_s"], bs1["roofline_fraction"]) == (
        "2026-12-01", "abc1234", "283.8", "0.885")
    assert (bs1["gpu_busy_pct"], bs1["copy_gbps"]) == ("99.8", "4279")
    assert (bs1["sync_ratio"], bs1["bf16_ratio"]) == ("1.047", "")
    assert bs1["source"].endswith("h200/bs1.json")
    assert (seed["bf16_ratio"], seed["sync_ratio"]) == ("1.450", "")

    # A later run replaces the per-GPU file and adds a row; the same run twice is refused.
    later = _bench_json(tmp_path / "later.json", [_result("bs1", 290.0, date="2026-12-02")])
    _add(bench_history, tmp_path, later)
    assert json.loads((tmp_path / "results" / "h200" / "bs1.json").read_text())["record"]["date"] == "2026-12-02"
    assert len(_rows(tmp_path)) == 3
    with pytest.raises(SystemExit, match="already records"):
        _add(bench_history, tmp_path, later)


def test_add_names_multi_gpu_and_serve_runs(bench_history: ModuleType, tmp_path: Path) -> None:
    tp2 = _result("bs1", 343.1, tensor_parallel_size=2, ratios={"tandem TP=1": 1.257})
    tp4 = _result("70b-bs1", 90.0, tensor_parallel_size=4, ratios={"tandem TP=2": 1.612})
    serve = {"workload": "serve", "model": "gpt2", "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01",
             "server_over_offline": 0.7851, "command": "tandem bench --workload serve --serve-model gpt2",
             "server_overlap": {"saturation": {"summary": {"output_tokens_per_s": 218210.7}}},
             "server_dp2": {"saturation": {"summary": {"output_tokens_per_s": 400000.0}}}}
    _add(bench_history, tmp_path, _bench_json(tmp_path / "b.json", [tp2, tp4, serve]))
    assert (tmp_path / "results" / "2xh200" / "bs1-tp2.json").exists()
    assert (tmp_path / "results" / "h100" / "serve-gpt2.json").exists()
    tp_row, tp4_row, serve_row = _rows(tmp_path)
    assert (tp_row["gpu"], tp_row["workload"], tp_row["tp1_ratio"]) == ("2xh200", "bs1-tp2", "1.257")
    assert (tp4_row["workload"], tp4_row["tp1_ratio"], tp4_row["tp2_ratio"]) == ("70b-bs1-tp4", "", "1.612")
    assert (serve_row["tokens_per_s"], serve_row["server_over_offline"]) == ("218210.7", "0.785")
    assert serve_row["dp1_ratio"] == "1.833"  # the two-replica server over the one-replica one


def test_add_names_checkpoint_runs_and_tagged_variants(bench_history: ModuleType, tmp_path: Path) -> None:
    """A run from a checkpoint is named by it (a GGUF's file name, or its folder's for model.gguf), not filed as the
    workload's own weights; --tag adds a variant the result does not record."""
    gguf = _result("bs1-8b", 296.4, checkpoint="/tmp/q4km/model.gguf")
    gptq = _result("bs1-8b", 400.0, checkpoint="/tmp/llama3-8b-gptq")
    _add(bench_history, tmp_path, _bench_json(tmp_path / "b.json", [gguf, gptq]))
    _add(bench_history, tmp_path, _bench_json(tmp_path / "c.json", [gguf]), "--tag", "cudacore")
    names = sorted(p.name for p in (tmp_path / "results" / "h200").iterdir())
    assert names == ["bs1-8b-ckpt-llama3-8b-gptq.json", "bs1-8b-ckpt-q4km-cudacore.json", "bs1-8b-ckpt-q4km.json"]


def test_add_rejects_bad_input(bench_history: ModuleType, tmp_path: Path) -> None:
    smoke = _bench_json(tmp_path / "smoke.json", [_result("bs1", 10.0, scale=0.1)])
    with pytest.raises(SystemExit, match="smoke run"):
        _add(bench_history, tmp_path, smoke)
    bench = _bench_json(tmp_path / "bench.json", [_result("bs1", 283.8)])
    with pytest.raises(SystemExit, match="date"):
        _add(bench_history, tmp_path, bench, "--date", "yesterday")
    table = tmp_path / "kernels.json"
    table.write_text(json.dumps({"benchmark": "paged_decode_attention", "device": "NVIDIA H200", "rows": []}))
    with pytest.raises(SystemExit, match="not what `tandem bench --out` writes"):
        _add(bench_history, tmp_path, table)
    assert not (tmp_path / "history.csv").exists()


def test_add_copies_a_table_under_its_name(bench_history: ModuleType, tmp_path: Path) -> None:
    table = tmp_path / "kernels.json"
    table.write_text(json.dumps({"benchmark": "paged_decode_attention", "date": "2026-12-01T06:16:46+0000",
                                 "device": "NVIDIA H200", "rows": [{"batch": 1}]}))
    _add(bench_history, tmp_path, table, "--name", "kernels-decode", "--command", "python3 scripts/bench_kernels.py")
    data = json.loads((tmp_path / "results" / "h200" / "kernels-decode.json").read_text())
    assert data["record"]["date"] == "2026-12-01" and data["record"]["workload"] == "kernels-decode"
    assert data["rows"] == [{"batch": 1}]
    assert not (tmp_path / "history.csv").exists()


def test_plot_writes_png(bench_history: ModuleType, tmp_path: Path) -> None:
    runs = [_result("bs1", 280.0 + i, date=f"2026-12-0{i + 1}") for i in range(3)]
    runs.append(_result("seed-async", 8700.0, quantization="fp8", ratios={"tandem bf16": 1.45}))
    for i, run in enumerate(runs):
        _add(bench_history, tmp_path, _bench_json(tmp_path / f"b{i}.json", [run]))
    out = tmp_path / "history.png"
    bench_history.main(["plot", "--history", str(tmp_path / "history.csv"), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
