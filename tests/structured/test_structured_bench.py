"""`tandem bench --workload structured` on the CPU (the embedded model, a few short requests): the four passes,
their ratios to the unconstrained pass, and grammar-mask time only where a pass has constrained requests."""

from __future__ import annotations

import json

from tandem.cli import main


def test_structured_workload_reports_each_pass(tmp_path):
    out = tmp_path / "structured.json"
    rc = main(["bench", "--workload", "structured", "--structured-model", "embedded", "--structured-requests", "4",
               "--scale", "0.1", "--out", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["workload"] == "structured" and r["structured_backend"] == "xgrammar"
    rows = r["rows"]
    assert [(x["constrained_fraction"], x["penalties"]) for x in rows] == [(0.0, False), (0.5, False), (1.0, False),
                                                                          (0.0, True)]
    assert all(x["generated_tokens"] == 4 * 25 for x in rows)
    assert rows[0]["vs_unconstrained"] == 1.0
    assert rows[0]["num_mask_steps"] == 0 and rows[3]["num_mask_steps"] == 0
    assert rows[1]["num_mask_steps"] > 0 and rows[2]["num_mask_steps"] > 0
