"""`tandem bench --workload structured` on the CPU (the embedded model, two short requests): the passes of both
grammar backends on one engine (forced drafts off, and on at 100%), their ratios to the unconstrained pass,
grammar-mask time only where a pass has constrained requests, forced drafts accepted only where they are on, and
the same tokens with late grammar rows sitting their step out or not."""

from __future__ import annotations

import json

from tandem.cli import main

# Two requests (the 50% passes constrain one of them) of int(256 * 0.05) = 12 new tokens: enough steps for the
# schema's forced drafts and grammar masks; every pass of the table still runs.
NUM_REQUESTS, SCALE, OUTPUT_LEN = 2, "0.05", 12


def test_structured_workload_reports_each_pass(tmp_path):
    out = tmp_path / "structured.json"
    rc = main(["bench", "--workload", "structured", "--structured-model", "embedded", "--structured-requests",
               str(NUM_REQUESTS), "--structured-backends", "xgrammar,llguidance", "--scale", SCALE, "--out", str(out)])
    assert rc == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["workload"] == "structured" and r["structured_backends"] == ["xgrammar", "llguidance"]
    rows = r["rows"]
    # Late grammar rows sit their step out by default; a second 100% pass of each backend runs with that off.
    assert [(x["constrained_fraction"], x.get("backend"), x["forced_drafts"], x["penalties"], x["sit_out"])
            for x in rows] == [
        (0.0, None, False, False, True), (0.5, "xgrammar", False, False, True), (1.0, "xgrammar", False, False, True),
        (1.0, "xgrammar", False, False, False), (1.0, "xgrammar", True, False, True),
        (0.5, "llguidance", False, False, True), (1.0, "llguidance", False, False, True),
        (1.0, "llguidance", False, False, False), (1.0, "llguidance", True, False, True),
        (0.0, None, False, True, True)]
    assert all(x["same_tokens_as_sit_out_flipped"] for x in rows if not x["sit_out"])
    # The first 100% row of each backend keeps the figure of the grammar's first (cold) full pass.
    firsts = [x for x in rows if x["constrained_fraction"] == 1.0 and x["sit_out"] and not x["forced_drafts"]]
    assert all(x["cold_tokens_per_s"] > 0 and x["cold_vs_unconstrained"] > 0 for x in firsts)
    assert sum("cold_tokens_per_s" in x for x in rows) == 2
    assert all(x["sat_out_per_step"] == 0 for x in rows if not x["sit_out"] or x.get("backend") != "llguidance")
    assert all(x["generated_tokens"] == NUM_REQUESTS * OUTPUT_LEN for x in rows)
    assert rows[0]["vs_unconstrained"] == 1.0
    assert rows[0]["num_mask_steps"] == 0 and rows[-1]["num_mask_steps"] == 0
    assert all(x["num_mask_steps"] > 0 for x in rows[1:-1])
    assert all(x["grammar_rejections"] == 0 for x in rows)  # every sampled token was one its grammar allowed
    forced = [x for x in rows if x["forced_drafts"]]
    assert all(x["same_tokens_as_forced_off"] and x["forced_accepted_per_step"] > 0 for x in forced)
    assert all(x["forced_drafts_per_step"] == 0 for x in rows if not x["forced_drafts"])
