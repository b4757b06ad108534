"""Records benchmark runs: the latest run per GPU kind and workload, one history.csv row per run, and its plot.

    python scripts/bench_history.py add BENCH.json [--gpu NAME] [--date YYYY-MM-DD] [--commit SHA]
    python scripts/bench_history.py add TABLE.json --name kernels-decode --command "python3 scripts/..."
    python scripts/bench_history.py plot

`add` takes what `tandem bench --out` writes (or the bench.json / serve.json of `scripts/gpu_check.sh`). Each
workload of it goes to benchmarks/results/<gpu>/<workload>.json, replacing the run there, with a "record" object
(date, commit, gpu, device, workload, command) added, and gets one row in benchmarks/history.csv. Any other JSON
(a kernel table, a test report) is copied the same way under --name, with no history row. `plot` draws
benchmarks/history.png from history.csv. benchmarks/results/README.md describes the files and the columns.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
HISTORY_CSV = REPO / "benchmarks" / "history.csv"
HISTORY_PNG = REPO / "benchmarks" / "history.png"

# history.csv's columns, in this order.
COLUMNS: tuple[str, ...] = (
    "date", "commit", "gpu", "workload", "tokens_per_s", "roofline_fraction", "gpu_busy_pct", "copy_gbps",
    "sync_ratio", "eager_ratio", "hf_ratio", "bf16_ratio", "tp1_ratio", "tp2_ratio", "dp1_ratio", "nopdl_ratio",
    "nogemv_ratio", "server_over_offline", "overlap_over_sync", "source",
)

# The peer names `tandem bench` writes in result["ratios"] (tandem's tokens/s over the peer's) -> column.
PEER_COLUMNS: tuple[tuple[str, str], ...] = (
    ("tandem --sync", "sync_ratio"),
    ("tandem --no-cuda-graph", "eager_ratio"),
    ("transformers generate_batch", "hf_ratio"),
    ("transformers generate (dynamic cache)", "hf_ratio"),
    ("tandem bf16", "bf16_ratio"),
    ("tandem TP=1", "tp1_ratio"),
    ("tandem TP=2", "tp2_ratio"),
    ("tandem DP=1", "dp1_ratio"),
    ("tandem without PDL", "nopdl_ratio"),
    ("tandem without GEMV", "nogemv_ratio"),
)

# Words of a device name that are not its model ("NVIDIA GeForce RTX 4090" -> "4090").
_VENDOR_WORDS: frozenset[str] = frozenset({"nvidia", "geforce", "tesla", "quadro", "rtx", "amd", "instinct"})
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_COMMIT = re.compile(r"[0-9a-f]{7,40}|unknown")
_NAME = re.compile(r"[a-z0-9][a-z0-9.-]*")


def gpu_kind(device: str, gpus: int = 1) -> str:
    """Directory name of a device: 'NVIDIA H200' -> 'h200', two of them -> '2xh200', any CPU -> 'cpu'."""
    words = [w for w in re.split(r"[\s_/()-]+", device.lower()) if w]
    if not words:
        raise ValueError("the result names no device; give --gpu NAME")
    if words[0] == "cpu":
        return "cpu"
    model = next((w for w in words if w not in _VENDOR_WORDS and any(c.isdigit() for c in w)), None)
    if model is None:
        raise ValueError(f"cannot tell the GPU kind from device {device!r}; give --gpu NAME")
    return model if gpus == 1 else f"{gpus}x{model}"


def workload_key(result: dict[str, Any], tag: str | None = None) -> str:
    """File name of a result: the workload, then what changes its meaning (FP8, FP8 lm_head, FP8 KV cache, a
    checkpoint in place of the workload's weights, TP/DP size; a serve run: its model), then `tag` (a variant the
    result does not record, e.g. an environment override), e.g. 'seed-async-fp8-lm-head', 'bs1-tp2',
    'serve-gpt2', 'bs1-8b-ckpt-q4km' (the checkpoint's file name, or its folder's for a model.gguf)."""
    name = str(result["workload"])
    if name == "serve":
        return f"serve-{result.get('model', 'unknown')}"
    if name == "spec":  # speculative decoding: the target, the draft model, and whether acceptance was set
        model = str(result.get("model") or "embedded").split(" ")[0].lower()
        name += f"-{model}-k{result.get('k')}"
        if result.get("draft_model"):
            name += f"-draft-{result['draft_model']}"
        if result.get("eagle3_head"):  # a head folder's name, or `random`
            name += f"-eagle3-{Path(str(result['eagle3_head'])).name}"
        if any("acceptance" in row for row in result.get("rows", ())):
            name += "-acceptance"
        return name
    if result.get("quantization"):
        name += f"-{result['quantization']}"
    if result.get("checkpoint"):
        path = Path(str(result["checkpoint"]))
        name += "-ckpt-" + (path.parent.name if path.stem == "model" else path.stem)
    if result.get("quantize_lm_head"):
        name += "-lm-head"
    kv = result.get("kv_cache_dtype") or "auto"
    if kv != "auto":
        name += "-kv-" + ("fp8" if kv.startswith("fp8") else kv)
    for key, short in (("tensor_parallel_size", "tp"), ("data_parallel_size", "dp")):
        if int(result.get(key) or 1) > 1:
            name += f"-{short}{result[key]}"
    return f"{name}-{tag}" if tag else name


def clean_command(command: str) -> str:
    """A recorded `tandem bench` command without its --out / --plot-dir (paths on the machine that ran it)."""
    words, kept = shlex.split(command), []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w in ("--out", "--plot-dir"):
            skip = True
        elif not w.startswith(("--out=", "--plot-dir=")):
            kept.append(w)
    return shlex.join(kept)


def workload_command(data: dict[str, Any], result: dict[str, Any]) -> str | None:
    """The `tandem bench` command that produced one result of a bench JSON (None where none was recorded)."""
    candidates: list[str] = []
    for value in (result.get("command"), data.get("command"), *(data.get("commands") or [])):
        if isinstance(value, str) and value:
            candidates.append(value)
    for command in candidates:
        words = shlex.split(command)
        at = words.index("--workload") + 1 if "--workload" in words else len(words)
        if at < len(words) and result["workload"] in words[at].split(","):
            return clean_command(command)
    return clean_command(candidates[0]) if len(candidates) == 1 else None


def head_commit() -> str:
    """The checkout's HEAD, the default commit of a run recorded right after it ran."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=7", "HEAD"], check=True,
                             capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"no git commit to record ({exc}); give --commit SHA (or --commit unknown)") from exc
    return out.stdout.strip()


def _checked(value: str, pattern: re.Pattern[str], what: str) -> str:
    if not pattern.fullmatch(value):
        raise ValueError(f"{what} {value!r} does not match {pattern.pattern}")
    return value


def make_record(*, date: str, commit: str, gpu: str, device: str | None, workload: str, command: str | None,
                run_with: str | None = None, source: str | None = None, note: str | None = None
                ) -> dict[str, Any]:
    """The "record" object put at the top of every file under benchmarks/results/."""
    record: dict[str, Any] = {
        "date": _checked(date, _DATE, "date"), "commit": _checked(commit, _COMMIT, "commit"),
        "gpu": _checked(gpu, _NAME, "gpu"), "device": device, "workload": workload,
        "command": command if command else "unknown",
    }
    for key, value in (("run_with", run_with), ("source", source), ("note", note)):
        if value:
            record[key] = value
    return record


def _number(value: Any, digits: int) -> str:
    return "" if value is None else f"{float(value):.{digits}f}"


def history_row(record: dict[str, Any], result: dict[str, Any], source: str) -> dict[str, str]:
    """One history.csv row of one result (empty cells where the run did not measure that figure)."""
    row = {c: "" for c in COLUMNS}
    row.update(date=record["date"], commit=record["commit"], gpu=record["gpu"], workload=record["workload"],
               source=source)
    if result["workload"] == "serve":
        saturation = ((result.get("server_overlap") or {}).get("saturation") or {}).get("summary") or {}
        row["tokens_per_s"] = _number(saturation.get("output_tokens_per_s"), 1)
        row["server_over_offline"] = _number(result.get("server_over_offline"), 3)
        row["overlap_over_sync"] = _number(result.get("server_overlap_over_sync"), 3)
        # With --serve-data-parallel-size M: the M-replica server's tokens/s over the one-replica server's.
        dp = [v for k, v in result.items() if k.startswith("server_dp") and isinstance(v, dict)]
        dp_tps = ((dp[0].get("saturation") or {}).get("summary") or {}).get("output_tokens_per_s") if dp else None
        if dp_tps and saturation.get("output_tokens_per_s"):
            row["dp1_ratio"] = _number(dp_tps / saturation["output_tokens_per_s"], 3)
        return row
    row["tokens_per_s"] = _number(result.get("tokens_per_s"), 1)
    row["roofline_fraction"] = _number(result.get("roofline_fraction"), 3)
    row["gpu_busy_pct"] = _number(result.get("gpu_busy_pct"), 1)
    row["copy_gbps"] = _number((result.get("ceilings") or {}).get("copy_gbps"), 0)
    ratios = result.get("ratios") or {}
    for peer, column in PEER_COLUMNS:
        if peer in ratios and not row[column]:
            row[column] = _number(ratios[peer], 3)
    return row


def read_history(history: Path) -> list[dict[str, str]]:
    """history.csv's rows (none when the file does not exist yet); a header other than COLUMNS is an error."""
    if not history.exists():
        return []
    with history.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{history} has columns {reader.fieldnames}, expected {list(COLUMNS)}")
        return list(reader)


def append_history(history: Path, rows: list[dict[str, str]]) -> None:
    """Appends rows, refusing any run already recorded (same date, commit, gpu, workload and source)."""
    key = ("date", "commit", "gpu", "workload", "source")
    seen = {tuple(r[k] for k in key) for r in read_history(history)}
    for row in rows:
        if tuple(row[k] for k in key) in seen:
            raise ValueError(f"{history} already records {row['gpu']}/{row['workload']} of {row['date']} "
                             f"at {row['commit']} from {row['source']}")
    new = not history.exists()
    history.parent.mkdir(parents=True, exist_ok=True)
    with history.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def add_bench(data: dict[str, Any], args: argparse.Namespace) -> list[Path]:
    """Every workload of a bench JSON to <results>/<gpu>/<workload>.json, and its history row."""
    results = data["results"]
    if not results:
        raise ValueError(f"{args.file} holds no results")
    commit = args.commit or head_commit()
    written, rows = [], []
    for result in results:
        if float(result.get("scale", 1.0)) != 1.0:
            raise ValueError(f"{args.file}: {result['workload']} ran at --scale {result['scale']} (a smoke run: "
                             "its figures do not compare); record only full-size runs")
        gpus = int(result.get("tensor_parallel_size") or 1) * int(result.get("data_parallel_size") or 1)
        device = result.get("device")
        gpu = args.gpu or gpu_kind(str(device or ""), gpus)
        date = args.date or str(result.get("date") or "")[:10]
        if not date:
            raise ValueError(f"{args.file}: {result['workload']} has no date; give --date YYYY-MM-DD")
        key = workload_key(result, args.tag)
        path = args.results_dir / gpu / f"{key}.json"
        record = make_record(date=date, commit=commit, gpu=gpu, device=device, workload=key,
                             command=args.command or workload_command(data, result), run_with=args.run_with,
                             source=args.source, note=args.note)
        _write_json(path, {"record": record, "command": record["command"], "results": [result]})
        written.append(path)
        rows.append(history_row(record, result, args.source or _relative(path)))
    if not args.no_history:
        append_history(args.history, rows)
    return written


def add_other(data: dict[str, Any], args: argparse.Namespace) -> Path:
    """A JSON that is not a bench result (kernel table, test report) to <results>/<gpu>/<name>.json."""
    _checked(args.name, _NAME, "--name")
    device = data.get("device") if isinstance(data.get("device"), str) else None
    gpu = args.gpu or gpu_kind(device or "")
    date = args.date or str(data.get("date") or "")[:10]
    if not date:
        raise ValueError(f"{args.file} has no date; give --date YYYY-MM-DD")
    command = args.command or (data.get("command") if isinstance(data.get("command"), str) else None)
    if not command:
        raise ValueError(f"{args.file} does not say how it was made; give --command")
    record = make_record(date=date, commit=args.commit or head_commit(), gpu=gpu, device=device,
                         workload=args.name, command=command, run_with=args.run_with, source=args.source,
                         note=args.note)
    path = args.results_dir / gpu / f"{args.name}.json"
    _write_json(path, {"record": record, **{k: v for k, v in data.items() if k != "record"}})
    return path


def cmd_add(args: argparse.Namespace) -> None:
    try:
        data = json.loads(Path(args.file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read {args.file}: {exc}") from exc
    if not isinstance(data, dict):
        raise SystemExit(f"bench_history: {args.file} is not a JSON object")
    is_bench = isinstance(data.get("results"), list) and all(
        isinstance(r, dict) and "workload" in r for r in data["results"])
    if is_bench and args.name is None:
        for path in add_bench(data, args):
            print(f"wrote {_relative(path)}")
        if not args.no_history:
            print(f"appended to {_relative(args.history)}")
    elif args.name is not None:
        print(f"wrote {_relative(add_other(data, args))}")
    else:
        raise ValueError(f"{args.file} is not what `tandem bench --out` writes; give --name to copy it as a table")


def plot_history(history: Path, out: Path) -> None:
    """history.png: roofline fraction, FP8 / bf16 and server / offline per run, one line per gpu/workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(read_history(history), key=lambda r: r["date"])  # stable: same-day rows keep file order
    if not rows:
        raise ValueError(f"{history} has no rows to plot")
    panels = (
        ("roofline_fraction", "roofline fraction, 16-bit and fp32 runs (1.0 = at the floor)", False),
        ("bf16_ratio", "FP8 tokens/s over bf16 tokens/s, same run", True),
        ("server_over_offline", "server tokens/s over offline tokens/s, same run", True),
    )
    shown = [p for p in panels if any(r[p[0]] and (p[2] or "fp8" not in r["workload"]) for r in rows)]
    # A line's colour is its workload, its style and marker its GPU kind (the most recorded one solid).
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["gpu"]] = counts.get(r["gpu"], 0) + 1
    gpus = sorted(counts, key=lambda g: (-counts[g], g))
    styles = {g: (("-", "o"), (":", "s"), ("--", "^"), ("-.", "D"))[i % 4] for i, g in enumerate(gpus)}
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 3.4 * len(shown)), sharex=True, squeeze=False)
    for ax, (column, title, with_fp8) in zip(axes[:, 0], shown):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for i, r in enumerate(rows):
            if r[column] and (with_fp8 or "fp8" not in r["workload"]):
                series.setdefault((r["gpu"], r["workload"]), []).append((i, float(r[column])))
        workloads = sorted({w for _, w in series})
        for (gpu, workload), points in sorted(series.items(), key=lambda kv: (kv[0][1], gpus.index(kv[0][0]))):
            xs, ys = zip(*points)
            ax.plot(xs, ys, linestyle=styles[gpu][0], marker=styles[gpu][1], markersize=3, linewidth=1.2,
                    color=colors(workloads.index(workload) % 10), label=f"{gpu} {workload}")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    firsts: dict[str, int] = {}
    for i, r in enumerate(rows):
        firsts.setdefault(r["date"], i)
    last = axes[-1, 0]
    last.set_xticks(list(firsts.values()), list(firsts.keys()), rotation=30, ha="right")
    last.set_xlabel("recorded runs in order (history.csv); a tick marks the first run of each date")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def cmd_plot(args: argparse.Namespace) -> None:
    plot_history(args.history, args.out)
    print(f"wrote {_relative(args.out)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command_name", required=True)
    add = sub.add_parser("add", help="record a run: the per-GPU file and its history.csv row(s)")
    add.add_argument("file", help="a `tandem bench --out` JSON (or gpu_check.sh's bench.json / serve.json)")
    add.add_argument("--gpu", help="directory under results/ (default: from the device, e.g. h200, 2xh200, cpu)")
    add.add_argument("--date", help="YYYY-MM-DD (default: the date the run wrote)")
    add.add_argument("--commit", help="the code measured (default: this checkout's HEAD; 'unknown' if unknown)")
    add.add_argument("--command", help="how the run was made (default: the command the JSON recorded)")
    add.add_argument("--run-with", help="the wrapper it ran under, e.g. the scripts/gpu_check.sh line")
    add.add_argument("--note", help="anything a reader needs to compare it (e.g. an environment override)")
    add.add_argument("--source", help="where the original file lives, e.g. REV:PATH (history.csv's source; "
                                      "default: the file written)")
    add.add_argument("--name", help="copy a JSON that is not a bench result under this name, no history row")
    add.add_argument("--tag", help="appended to a bench result's file name: a variant the result does not record "
                                   "(e.g. an environment override; say which in --note)")
    add.add_argument("--no-history", action="store_true", help="write the per-GPU files only")
    plot = sub.add_parser("plot", help="draw history.png from history.csv")
    plot.add_argument("--out", type=Path, default=HISTORY_PNG)
    for p in (add, plot):
        p.add_argument("--history", type=Path, default=HISTORY_CSV)
    add.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cmd_add(args) if args.command_name == "add" else cmd_plot(args)
    except ValueError as exc:
        raise SystemExit(f"bench_history: {exc}") from exc
    return 0


if __name__ == "__main__":
    sys.exit(main())
