"""Two torchrun "nodes" on one machine, each agent seeing only its own GPUs (node 1's agent sees the second
half), running `python -m tandem.cli generate` over NCCL: rank 0 prints what one GPU prints (fp32), both exit 0.
One GPU a node (TP=2) runs on a two-GPU machine; two GPUs a node (TP=4) on a four-GPU one. As on two real
hosts, no process sees the other node's GPUs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("the two-node check needs at least 2 GPUs", allow_module_level=True)

pytest.importorskip("transformers")

from tests.parallel.test_multinode_cpu import _completions, run_two_nodes  # noqa: E402
from tests.parallel.tiny_models import save_tiny, save_tiny_tokenizer  # noqa: E402

GENERATE = ["generate", "--device", "cuda", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128",
            "--max-num-seqs", "8", "--prompt", "Hello", "--prompt", "The sea is", "--max-tokens", "6",
            "--temperature", "0", "--ignore-eos", "--no-chat"]


@pytest.mark.parametrize("gpus_per_node", [1, 2])
def test_two_nodes(tmp_path, gpus_per_node):
    if torch.cuda.device_count() < 2 * gpus_per_node:
        pytest.skip(f"two nodes of {gpus_per_node} GPU(s) need {2 * gpus_per_node} GPUs")
    folder = save_tiny_tokenizer(save_tiny("llama", tmp_path / "llama"))
    one = subprocess.run([sys.executable, "-m", "tandem.cli", *GENERATE, "--model", folder], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert one.returncode == 0, one.stderr[-3000:]
    nodes = [",".join(str(node * gpus_per_node + i) for i in range(gpus_per_node)) for node in (0, 1)]
    outs = run_two_nodes(folder, GENERATE, gpus_per_node, [{"CUDA_VISIBLE_DEVICES": ids} for ids in nodes])
    # fp32 with TP sums in another order: the 6 greedy tokens of these two prompts agree (no near-tie here).
    assert _completions(outs[0]) == _completions(one.stdout)
    assert _completions(outs[1]) == []
