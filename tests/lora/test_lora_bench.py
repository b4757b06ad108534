"""`tandem bench --workload lora` on the CPU (a tiny Llama shape, random weights and adapters, short requests): every
pass reported, each adapter pass with its ratio to the base model's pass at the same batch size."""

from __future__ import annotations

import json

from tandem.cli import main
from tests.parallel.tiny_models import save_tiny


def test_lora_workload_reports_every_pass_and_its_ratio(tmp_path):
    out = tmp_path / "lora.json"
    folder = save_tiny("llama", tmp_path / "tiny")
    assert main(["bench", "--workload", "lora", "--lora-model", folder, "--scale", "0.03", "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["workload"] == "lora" and r["rank"] == 16 and r["max_loras"] == 16
    assert [x["pass"] for x in r["rows"]] == ["base-32", "base-1", "base-256", "8-adapters-32", "1-adapter-1",
                                             "64-adapters-256"]
    paging = r["rows"][-1]
    assert r["max_num_seqs"] == 64 and paging["num_seqs"] == 256
    # Every adapter not left in a slot by the warm-up paged in through the 16 slots, all from host copies made
    # before the pass.
    assert paging["page_ins"] >= 64 - 16 and paging["host_copies"] == 0
    rates = {x["pass"]: x["tokens_per_s"] for x in r["rows"]}
    assert r["vs_base"] == {"8-adapters-32": rates["8-adapters-32"] / rates["base-32"],
                            "1-adapter-1": rates["1-adapter-1"] / rates["base-1"],
                            "64-adapters-256": rates["64-adapters-256"] / rates["base-256"]}
