"""Two-node tensor parallelism the way users launch it, on one machine: two torchrun agents (`--nnodes 2
--node-rank 0|1 --nproc-per-node 1`) each running `python -m tandem.cli generate`, talking gloo over 127.0.0.1.
Rank 0 prints what one process prints; both agents exit 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.parallel.tiny_models import save_tiny, save_tiny_tokenizer

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATE = ["generate", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128",
            "--prompt", "Hello", "--prompt", "The sea is", "--max-tokens", "6", "--temperature", "0",
            "--ignore-eos", "--no-chat"]


def _completions(stdout: str) -> list[str]:
    """The '--- prompt' and completion lines (not the timing line)."""
    lines = stdout.splitlines()
    return [line for i, line in enumerate(lines) if line.startswith("--- ") or (i and lines[i - 1].startswith("--- "))]


def run_two_nodes(folder: str, generate: list[str], nproc_per_node: int, node_env: list[dict[str, str]]
                  ) -> list[str]:
    """Two torchrun agents ("nodes" 0 and 1 on 127.0.0.1) running `tandem.cli generate`; their stdouts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", str(nproc_per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "tandem.cli", *generate, "--model", folder, "--tensor-parallel-size", str(2 * nproc_per_node)]
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**base, **node_env[node]}))
    outs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=300)
            assert agent.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return outs


def test_torchrun_two_nodes_runs_the_cli(tmp_path, capsys):
    from tandem.cli import main

    folder = save_tiny_tokenizer(save_tiny("llama", tmp_path / "llama"))
    assert main([*GENERATE, "--model", folder]) == 0
    expected = _completions(capsys.readouterr().out)
    assert len(expected) == 4
    outs = run_two_nodes(folder, GENERATE, 1, [{"OMP_NUM_THREADS": "1"}] * 2)
    assert _completions(outs[0]) == expected  # rank 0 (node 0) prints the completions
    assert _completions(outs[1]) == []  # node 1's rank serves steps and prints nothing
