"""Tensor parallelism on the CPU (gloo, two and four processes): TP=2 and TP=4 give TP=1's greedy tokens; dead ranks
fail cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tandem import LLM, SamplingParams
from tests.parallel.tiny_models import FAMILIES, VOCAB, save_tiny

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, block_size=8,
              max_num_batched_tokens=16)  # 16-token budget: the 30-token prompts prefill in chunks
PREFIX = [(7 * i) % (VOCAB - 4) + 4 for i in range(24)]  # three 8-token blocks shared by two prompts


def _workload(llm: LLM) -> tuple[list[list[int]], int]:
    """Prefix hit, chunked prefill, a sampled request and (with a 16-block pool) preemption; returns
    (tokens, cached tokens)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate([PREFIX + [5, 9, 11]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    prompts = [PREFIX + [12, 13], [(3 * i) % (VOCAB - 4) + 4 for i in range(30)], [40, 41, 42, 43] * 7, [99, 98]]
    # The last request samples (seeded): every rank must draw the same tokens for its own carry-over.
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=12, ignore_eos=True, seed=7)
    outs = llm.generate(prompts, [greedy] * 3 + [sampled], use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + outs], outs[0].num_cached_tokens


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    return {f: save_tiny(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_greedy_tokens_equal_tp1(tiny_folders, family):
    folder = tiny_folders[family]
    reference = LLM(folder, num_kv_blocks=256, **ENGINE)
    expected, _ = _workload(reference)
    sharded = LLM(folder, tensor_parallel_size=2, num_kv_blocks=16, **ENGINE)
    try:
        # KV heads per rank: 2 -> 1 split, qwen3's single head replicated, gpt2's 4 (MHA) -> 2.
        assert sharded.engine.runner.num_kv_heads == (2 if family == "gpt2" else 1)
        got, cached = _workload(sharded)
        stats = sharded.engine.stats()
    finally:
        sharded.shutdown()
    assert got == expected, family
    assert cached >= len(PREFIX), "the second prompt should reuse the cached prefix"
    assert stats.num_preemptions > 0, "the 16-block pool should force preemption"


def test_tp2_prompt_logprobs_equal_tp1(tiny_folders):
    """Scoring chunked over 16-token steps beside a decoding request: every rank runs the lm_head's all-gather on
    the rows rank 0 sent, and rank 0 reads back what one rank computes alone."""
    folder = tiny_folders["llama"]
    prompts = [[(5 * i) % (VOCAB - 4) + 4 for i in range(37)], [40, 41, 42, 43] * 5, [7, 8]]
    params = [SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0, ignore_eos=True)]
    reference = LLM(folder, num_kv_blocks=256, **ENGINE)
    expected = reference.generate(prompts, params, use_tqdm=False)
    reference.shutdown()
    sharded = LLM(folder, tensor_parallel_size=2, num_kv_blocks=64, **ENGINE)
    try:
        got = sharded.generate(prompts, params, use_tqdm=False)
    finally:
        sharded.shutdown()
    for a, b in zip(expected, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for ea, eb in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (ea is None and eb is None) or (ea.keys() == eb.keys()
                                                   and all(abs(ea[t] - eb[t]) < 1e-4 for t in ea))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp4_greedy_tokens_equal_tp1(tiny_folders, family):
    """Four ranks (gloo, two cores): more ranks than KV heads, so each rank holds a copy of one (llama's 2 KV
    heads twice each, qwen3's one four times), and the same workload's tokens as one process."""
    folder = tiny_folders[family]
    expected, _ = _workload(LLM(folder, num_kv_blocks=256, **ENGINE))
    sharded = LLM(folder, tensor_parallel_size=4, num_kv_blocks=16, **ENGINE)
    try:
        assert sharded.engine.runner.num_kv_heads == 1 and len(sharded.engine.runner.group.procs) == 3
        got, cached = _workload(sharded)
    finally:
        sharded.shutdown()
    assert got == expected, family
    assert cached >= len(PREFIX)


def test_tp_size_validation(tiny_folders):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_folders["llama"], tensor_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="attention heads"):
        LLM(tiny_folders["llama"], tensor_parallel_size=3, **ENGINE)


def test_dead_rank_fails_the_engine_cleanly(tiny_folders):
    llm = LLM(tiny_folders["llama"], tensor_parallel_size=2, num_kv_blocks=64, **ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        engine = llm.engine
        engine.start_timeline()
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 50
        tl = engine.stop_timeline()
        # Both ranks' GPU (here: compute) spans, one per step each.
        assert tl.gpu_lanes() == ["gpu", "gpu1"]
        steps = {lane: sorted(s.step for s in tl.spans if s.lane == lane) for lane in tl.gpu_lanes()}
        assert steps["gpu1"] == steps["gpu"] and len(steps["gpu"]) >= 50
        assert 0 < tl.gpu_busy_pct("gpu1") <= 100
        assert llm.engine.runner.group.measure_all_reduce(1, 64, 5, reps=2) > 0  # workers join the bench loop
        worker = llm.engine.runner.group.procs[0]
        engine.add_request("a", [5, 6, 7, 8], params)
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)  # mid-run: the request is half generated
        deadline = time.monotonic() + 30
        errors = []
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            errors += [o.error for o in engine.step() if o.error is not None]
        assert not engine.has_unfinished_requests(), "the engine hung after a rank died"
        assert errors and "rank 1" in errors[0], errors
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()


def test_worker_exits_when_rank0_is_killed(tiny_folders, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys\n"
        "from tandem import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({tiny_folders['llama']!r}, tensor_parallel_size=2, num_kv_blocks=16, device='cpu',"
        " dtype='float32', max_model_len=64)\n"
        "    print(llm.engine.runner.group.procs[0].pid, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            text=True)
    try:
        worker_pid = int(proc.stdout.readline())
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker_pid), "the worker outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_two_processes(tiny_folders, nodes):
    """One torchrun agent with two processes, or two agents of one process each (the two-node launch, on
    one machine)."""
    folder = tiny_folders["qwen2"]
    prompts = [[5, 6, 7, 8], [9, 10, 11] * 9]
    reference = LLM(folder, num_kv_blocks=64, **{**ENGINE, "max_num_batched_tokens": 4096})
    expected = [o.outputs[0].token_ids for o in reference.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    entry = os.path.join(REPO, "tests", "parallel", "torchrun_entry.py")
    agents = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(2 // nodes),
               "--nnodes", str(nodes), "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), entry, folder, json.dumps(prompts)]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    stdout = ""
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=120)
            assert agent.returncode == 0, err[-3000:]
            stdout += out
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    lines = [line for line in stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, stdout  # rank 0 only
    assert json.loads(lines[0][len("TOKENS "):]) == expected


def test_step_header_round_trip():
    """The header rank 0 broadcasts carries every field a worker launches from, the piecewise bucket included."""
    import numpy as np

    from tandem.distributed.ranks import STEP_FIELDS
    from tandem.runner.step_plan import StepPlan

    for plan in (StepPlan(1, 3, 40, None, False, True, 2, 37, 90, 11, True, 2, 64),
                 StepPlan(0, 5, 5, 8, True, False, -1, 1, 33, 12, False, 5, None),
                 StepPlan(1, 2, 30, None, True, False, -1, 29, 29, 13, False, 1, None, 28, 3)):
        header = np.array(plan.fields(), dtype=np.int64)  # as the gloo broadcast carries it
        assert header.shape == (STEP_FIELDS,)
        assert StepPlan.from_fields(header) == plan


def test_an_all_reduce_that_gave_up_fails_the_group(tiny_folders):
    """The fused all-reduce's timeout flag (set on the GPU when a peer never arrives; faked here on rank 0): the
    step that sees it fails its requests, every later step fails the same way, and the engine reports it."""
    import torch

    llm = LLM(tiny_folders["llama"], tensor_parallel_size=2, num_kv_blocks=64, **ENGINE)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 20
        assert engine.fatal_error is None
        runner = engine.runner
        runner._timeout_flag = (torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
        engine.add_request("a", [5, 6, 7, 8], params)
        errors = []
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            errors += [o.error for o in engine.step() if o.error is not None]
        assert errors and "gave up waiting for a peer" in errors[0], errors
        assert "gave up waiting" in (engine.fatal_error or "")
        with pytest.raises(RuntimeError, match="gave up waiting"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False)
    finally:
        llm.shutdown()
