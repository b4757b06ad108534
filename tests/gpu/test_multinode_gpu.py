"""Two torchrun "nodes" of two GPUs each on one four-GPU machine (node 1's agent sees GPUs 2 and 3), running
`python -m tandem.cli generate` at TP=4 over NCCL: rank 0 prints what one GPU prints (fp32), both exit 0."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
    pytest.skip("the two-node check needs 4 GPUs", allow_module_level=True)

pytest.importorskip("transformers")

from tests.parallel.test_multinode_cpu import _completions, run_two_nodes  # noqa: E402
from tests.parallel.tiny_models import save_tiny, save_tiny_tokenizer  # noqa: E402

GENERATE = ["generate", "--device", "cuda", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "128",
            "--max-num-seqs", "8", "--prompt", "Hello", "--prompt", "The sea is", "--max-tokens", "6",
            "--temperature", "0", "--ignore-eos", "--no-chat"]


def test_two_nodes_of_two_gpus(tmp_path):
    import subprocess
    import sys

    folder = save_tiny_tokenizer(save_tiny("llama", tmp_path / "llama"))
    one = subprocess.run([sys.executable, "-m", "tandem.cli", *GENERATE, "--model", folder], capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert one.returncode == 0, one.stderr[-3000:]
    outs = run_two_nodes(folder, GENERATE, 2, [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}])
    # fp32 with TP sums in another order: the 6 greedy tokens of these two prompts agree (no near-tie here).
    assert _completions(outs[0]) == _completions(one.stdout)
    assert _completions(outs[1]) == []
