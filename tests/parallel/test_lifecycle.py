"""Engine lifecycles on the CPU: tensor-parallel engines built and shut down in turn in one process (each within
2 s, workers reaped, the group left so the next one starts), a process that exits 0 after them (explicit shutdown
or none), and data-parallel replicas stopped within 2 s."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist

from tandem import LLM, SamplingParams
from tests.parallel.tiny_models import VOCAB, save_tiny

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, block_size=8, num_kv_blocks=64)
PROMPTS = [[(5 * i + j) % (VOCAB - 4) + 4 for j in range(3 + 4 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHUTDOWN_LIMIT_S = 2.0


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_three_tp2_engines_in_turn_each_shut_down_within_2s(tiny_llama):
    reference = LLM(tiny_llama, **ENGINE)
    expected = _tokens(reference)
    reference.shutdown()
    for attempt in range(3):
        llm = LLM(tiny_llama, tensor_parallel_size=2, **ENGINE)
        workers = [p.pid for p in llm.engine.runner.group.procs]
        assert _tokens(llm) == expected, attempt
        start = time.monotonic()
        llm.shutdown()
        took = time.monotonic() - start
        assert took < SHUTDOWN_LIMIT_S, f"engine {attempt} took {took:.2f} s to shut down"
        assert not dist.is_initialized(), "the process group outlived its engine"
        assert not _alive(workers), "a tensor-parallel worker outlived shutdown"
        llm.shutdown()  # idempotent
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


EXIT_SCRIPT = """
import sys
from tandem import LLM, SamplingParams
if __name__ == "__main__":
    kwargs = dict(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2, num_kv_blocks=32,
                  tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(sys.argv[1], **kwargs)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.shutdown()
    last = LLM(sys.argv[1], **kwargs)  # left for interpreter exit to stop
    last.generate([[5, 6, 7]], params, use_tqdm=False)
    print("WORKER", last.engine.runner.group.procs[0].pid, flush=True)
"""


def test_process_exits_0_after_tp2_engines(tiny_llama, tmp_path):
    script = tmp_path / "engines.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), tiny_llama], capture_output=True, text=True, timeout=180,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    worker = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("WORKER")]
    assert worker and not _alive(worker), "the last engine's worker outlived the process"
    assert "was not destroyed" not in done.stderr and "did not exit" not in done.stderr, done.stderr[-3000:]


def test_dp2_shutdown_within_2s(tiny_llama):
    llm = LLM(tiny_llama, data_parallel_size=2, **ENGINE)
    pids = llm.engine.replica_pids
    assert len(_tokens(llm)) == len(PROMPTS)
    start = time.monotonic()
    llm.shutdown()
    took = time.monotonic() - start
    assert took < SHUTDOWN_LIMIT_S, f"data-parallel shutdown took {took:.2f} s"
    assert not _alive(pids), "a replica outlived shutdown"
