"""`tandem bench --workload spec`'s acceptance mode on the CPU (a tiny named Llama shape, a random EAGLE-3 head):
the recorded continuation offered with acceptance 1 is taken whole, with acceptance 0 never, and speculating
changes no token (the head's drafts are computed on the device path, their tokens replaced)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.bench.offline import bench_workload
from tandem.bench.spec_workload import run_spec_workload
from tandem.bench.workloads import Workload
from tandem.models import loader
from tandem.runner.executor import ModelExecutor

TINY = dict(model_type="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def test_eagle3_acceptance_mode(monkeypatch):
    """Also through verify steps scheduled behind the one in flight, whose offered drafts are gathered on the device
    from that step's accepted count (OracleProposer.drafts_ahead): with acceptance 1 every one of them is right."""
    monkeypatch.setitem(loader.NAMED_SHAPES, "tiny-llama", TINY)
    monkeypatch.setenv("TANDEM_VERIFY_AHEAD", "1")
    shifted = []
    shift_rows = ModelExecutor.shift_rows
    monkeypatch.setattr(ModelExecutor, "shift_rows", lambda self, *a: shifted.append(a[1]) or shift_rows(self, *a))
    result = run_spec_workload("tiny-llama", k=3, acceptance=[1.0, 0.0], batch_sizes=[1], max_tokens=16,
                               eagle3_head="random")
    assert len(shifted) >= 4
    always, never = result["rows"]
    assert always["same_tokens"] and never["same_tokens"]
    assert always["spec"]["output_tokens"] == never["spec"]["output_tokens"] == 16
    # Every draft right: each verify step keeps all its drafts (the last may be cut by max_tokens).
    assert always["spec"]["accepted_tokens"] == always["spec"]["draft_tokens"] > 0
    assert always["spec"]["num_steps"] < never["spec"]["num_steps"]
    assert never["spec"]["accepted_tokens"] == 0 and never["spec"]["draft_tokens"] > 0


def test_named_workload_with_speculation_beside_the_same_without(monkeypatch):
    """`tandem bench --speculative-config '{"method": "eagle3", "model": "random", ...}' --peers nospec`: the
    workload's engine with a random head of its shape, and the same workload in an engine without one, side by side
    with the same tokens."""
    monkeypatch.setitem(loader.NAMED_SHAPES, "tiny-llama", TINY)
    w = Workload("tiny-spec", "tiny-llama", 2, (12, 12), (10, 10), dtype="float32", device="cpu")
    spec = {"method": "eagle3", "model": "random", "num_speculative_tokens": 2}
    r = bench_workload(w, ["nospec"], 1.0, None, speculative_config=spec)
    assert r["speculative_config"] == spec
    peer = r["peer_details"]["tandem without speculation"]
    assert peer["identical_requests_fraction"] == 1.0 and peer["generated_tokens"] == r["generated_tokens"] == 20
    assert r["ratios"]["tandem without speculation"] == r["tokens_per_s"] / peer["tokens_per_s"]
    with pytest.raises(ValueError, match="named shape"):
        bench_workload(replace(w, model=None), ["nospec"], 1.0, None, speculative_config=spec)
