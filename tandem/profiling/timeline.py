"""CPU/GPU span recorder: Chrome-trace export, a PNG timeline and the GPU-busy percentage."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class Span:
    lane: str  # "cpu", "gpu" (rank 0's), or "gpu1".. for the other tensor-parallel ranks
    name: str
    start: float  # time.perf_counter seconds
    end: float
    step: int


class Timeline:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.step = 0

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span("cpu", name, start, time.perf_counter(), self.step))

    def add_gpu(self, name: str, start: float, end: float, step: int, lane: str = "gpu") -> None:
        self.spans.append(Span(lane, name, start, end, step))

    def gpu_lanes(self) -> list[str]:
        """"gpu" (rank 0) first, then the other ranks' lanes."""
        return sorted({s.lane for s in self.spans if s.lane.startswith("gpu")}, key=lambda n: (len(n), n))

    def window(self) -> tuple[float, float]:
        if not self.spans:
            return 0.0, 0.0
        return min(s.start for s in self.spans), max(s.end for s in self.spans)

    def gpu_busy_pct(self, lane: str = "gpu") -> float:
        """Share of the recorded window during which at least one GPU span of `lane` is active."""
        start, end = self.window()
        return 100.0 * _covered([s for s in self.spans if s.lane == lane], start) / (end - start) if end > start else 0.0

    def summary(self, start: float | None = None, end: float | None = None) -> dict[str, float]:
        """Per-step figures inside [start, end] (perf_counter seconds; default: the whole window): steps begun,
        step period, each CPU phase's mean milliseconds per step and the GPU-busy share of the interval."""
        lo, hi = self.window()
        lo, hi = max(lo, start if start is not None else lo), min(hi, end if end is not None else hi)
        inside = [s for s in self.spans if s.start >= lo and s.end <= hi]
        starts = sorted(s.start for s in inside if s.lane == "cpu" and s.name == "schedule")  # one per step
        steps = len(starts)
        out: dict[str, float] = {"seconds": max(hi - lo, 0.0), "steps": float(steps)}
        if steps == 0 or hi <= lo:
            return out
        out["step_ms"] = 1e3 * (hi - lo) / steps
        gaps = sorted(b - a for a, b in zip(starts, starts[1:]))
        if gaps:  # step periods, start to start: their tail is the engine's share of long inter-token gaps
            out["step_p50_ms"] = 1e3 * gaps[len(gaps) // 2]
            out["step_p99_ms"] = 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
            out["step_max_ms"] = 1e3 * gaps[-1]
        for s in inside:
            if s.lane == "cpu":
                key = f"{s.name}_ms"
                out[key] = out.get(key, 0.0) + 1e3 * (s.end - s.start) / steps
        out["gpu_busy_pct"] = 100.0 * _covered([s for s in inside if s.lane == "gpu"], lo) / (hi - lo)
        return out

    def to_chrome_trace(self, path: str, label: str = "tandem") -> None:
        """Writes the spans as a Chrome trace; otherData.wall_start is the first span's time.time() value."""
        start, _ = self.window()
        wall_start = start + (time.time() - time.perf_counter())
        events = [
            {
                "name": s.name, "ph": "X", "pid": label, "tid": s.lane,
                "ts": (s.start - start) * 1e6, "dur": (s.end - s.start) * 1e6, "args": {"step": s.step},
            }
            for s in self.spans
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"wall_start": wall_start}}, f)

    @classmethod
    def from_chrome_trace(cls, path: str) -> tuple[Timeline, float]:
        """Reads a trace written by to_chrome_trace: the timeline (seconds from its first span) and wall_start."""
        with open(path) as f:
            data = json.load(f)
        tl = cls()
        for e in data["traceEvents"]:
            start = e["ts"] / 1e6
            tl.spans.append(Span(e["tid"], e["name"], start, start + e["dur"] / 1e6, e["args"]["step"]))
        return tl, float(data.get("otherData", {}).get("wall_start", 0.0))


def _covered(spans: list[Span], start: float) -> float:
    """Seconds after `start` covered by at least one of the spans."""
    busy, cursor = 0.0, start
    for s in sorted(spans, key=lambda s: s.start):
        lo, hi = max(s.start, cursor), s.end
        if hi > lo:
            busy += hi - lo
            cursor = hi
    return busy


def plot_timelines(timelines: dict[str, Timeline], path: str, max_seconds: float | None = None,
                   start_frac: float = 0.0) -> None:
    """One row pair (CPU, GPU) per run, like the seed's figures; the title carries GPU-busy % of the
    whole run. The drawn window starts `start_frac` into the run and lasts `max_seconds`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"schedule": "#1f77b4", "prepare": "#17becf", "launch": "#9467bd", "wait": "#d62728",
              "update": "#ff7f0e", "mask": "#e377c2", "compute": "#2ca02c",
              "sample": "#bcbd22"}
    rows = sum(len(tl.gpu_lanes() or ["gpu"]) + 1 for tl in timelines.values())
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, 0.9 * rows + 0.6), squeeze=False)
    for ax, (label, tl) in zip(axes[:, 0], timelines.items()):
        begin, t1 = tl.window()
        t0 = begin + start_frac * (t1 - begin)
        horizon = (t1 - t0) if max_seconds is None else min(max_seconds, t1 - t0)
        lanes = [*reversed(tl.gpu_lanes() or ["gpu"]), "cpu"]  # bottom to top: GPU N-1 .. GPU 0, CPU
        for row, lane in enumerate(lanes):
            bars = [(s.start - t0, s.end - s.start, colors.get(s.name, "#7f7f7f"))
                    for s in tl.spans if s.lane == lane and s.end >= t0 and s.start - t0 <= horizon]
            if bars:
                ax.broken_barh([(b[0] * 1e3, b[1] * 1e3) for b in bars], (row * 10, 8),
                               facecolors=[b[2] for b in bars])
        ax.set_xlim(0, horizon * 1e3)
        ax.set_yticks([4 + 10 * i for i in range(len(lanes))],
                      [{"gpu": "GPU", "cpu": "CPU"}.get(n, f"GPU {n[3:]}") for n in lanes])
        ax.set_title(f"{label}: GPU busy {tl.gpu_busy_pct():.1f}% over {(t1 - begin):.2f} s "
                     f"(window from {t0 - begin:.2f} s)", fontsize=10)
        ax.set_xlabel("ms into the window")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="lower center", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
