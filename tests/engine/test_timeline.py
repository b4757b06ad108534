"""The CPU/GPU timeline: spans of every step, GPU-busy %, Chrome trace and PNG."""

from __future__ import annotations

import json
import time

from tandem import SamplingParams
from tandem.profiling.timeline import Span, Timeline, plot_timelines


def test_gpu_busy_pct_is_the_union_of_gpu_spans_over_the_window():
    tl = Timeline()
    tl.spans += [Span("cpu", "schedule", 0.0, 10.0, 0), Span("gpu", "compute", 1.0, 4.0, 0),
                 Span("gpu", "compute", 3.0, 6.0, 1), Span("gpu", "compute", 8.0, 9.0, 2)]
    assert abs(tl.gpu_busy_pct() - 60.0) < 1e-9  # [1, 6] and [8, 9] of [0, 10]


def test_summary_gives_per_step_phases_inside_an_interval_and_survives_a_chrome_trace(tmp_path):
    tl = Timeline()
    for step in range(4):  # steps of 10 s: schedule 2 s, update 1 s, the GPU busy 5 s of each
        t = 10.0 * step
        tl.spans += [Span("cpu", "schedule", t, t + 2, step), Span("cpu", "update", t + 3, t + 4, step),
                     Span("gpu", "compute", t + 2, t + 7, step)]
    whole = tl.summary()
    assert whole["steps"] == 4 and whole["schedule_ms"] == 2000.0 and whole["update_ms"] == 1000.0
    assert whole["step_p50_ms"] == whole["step_p99_ms"] == whole["step_max_ms"] == 10000.0  # start to start
    middle = tl.summary(10.0, 30.0)  # steps 1 and 2 only
    assert middle["steps"] == 2 and middle["step_ms"] == 10000.0 and middle["gpu_busy_pct"] == 50.0
    assert tl.summary(50.0, 60.0) == {"seconds": 0.0, "steps": 0.0}
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(str(path))
    back, wall_start = Timeline.from_chrome_trace(str(path))
    assert abs(wall_start - time.time()) < 3600 * 24 * 365 and len(back.spans) == len(tl.spans)
    again = back.summary(10.0, 30.0)
    assert again.keys() == middle.keys() and all(abs(again[k] - middle[k]) < 1e-6 for k in middle)


def test_engine_records_cpu_and_gpu_spans(idle_llm, tmp_path):
    engine = idle_llm.engine
    tl = engine.start_timeline()
    idle_llm.generate(["Hello", "Tell me a story"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                      use_tqdm=False)
    assert engine.stop_timeline() is tl
    names = {(s.lane, s.name) for s in tl.spans}
    assert {("cpu", "schedule"), ("cpu", "launch"), ("cpu", "wait"), ("cpu", "update"), ("gpu", "compute")} <= names
    gpu = [s for s in tl.spans if s.lane == "gpu"]
    assert len(gpu) >= 6 and all(s.end > s.start for s in gpu)
    assert 0.0 < tl.gpu_busy_pct() <= 100.0
    trace = tmp_path / "trace.json"
    tl.to_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert len(events) == len(tl.spans) and all(e["dur"] >= 0 for e in events)
    png = tmp_path / "timeline.png"
    plot_timelines({"overlap": tl}, str(png), max_seconds=0.05, start_frac=0.5)
    assert png.stat().st_size > 1000
