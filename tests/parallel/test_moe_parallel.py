"""MoE models over two CPU ranks (gloo): tensor-parallel experts (TP=2) and whole experts per rank (EP=2) give one
rank's greedy tokens; each rank loads exactly its shard of the experts."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig, ParallelConfig
from tandem.models.loader import load_model_and_tokenizer

transformers = pytest.importorskip("transformers")

from tests.models.test_moe_parity import tiny_moe_config  # noqa: E402  (after the transformers skip)

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4, block_size=8,
              max_num_batched_tokens=16)  # chunked prefill of the 30-token prompt


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family)).float().eval()
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        out[family] = str(folder)
    return out


def _tokens(llm: LLM) -> list[list[int]]:
    prompts = [[5, 9, 11, 13, 17], [(3 * i) % 120 + 4 for i in range(30)], [40, 41, 42, 43] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("family,expert_parallel", [("qwen2_moe", False), ("qwen2_moe", True),
                                                    ("qwen3_moe", True), ("mixtral", False)])
def test_two_ranks_equal_one(folders, family, expert_parallel):
    expected = _tokens(LLM(folders[family], num_kv_blocks=128, **ENGINE))
    sharded = LLM(folders[family], tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                  num_kv_blocks=128, **ENGINE)
    try:
        got = _tokens(sharded)
    finally:
        sharded.shutdown()
    assert got == expected


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_expert_shards(folders, expert_parallel):
    config = EngineConfig(model=folders["qwen3_moe"], device="cpu", dtype="float32")
    full = load_model_and_tokenizer(config, "cpu", torch.float32)[0].model.layers[1].mlp
    inter = full.w2.shape[2]
    for rank in range(2):
        tp = ParallelConfig(rank, 2, expert_parallel)
        block = load_model_and_tokenizer(config, "cpu", torch.float32, tp)[0].model.layers[1].mlp
        if expert_parallel:  # experts rank, rank + 2, ... whole
            assert torch.equal(block.w13, full.w13[rank::2]) and torch.equal(block.w2, full.w2[rank::2])
            assert block.expert_map.tolist() == [e // 2 if e % 2 == rank else -1 for e in range(8)]
        else:  # every expert, this rank's half of the intermediate dimension (gate and up halves each)
            half = slice(rank * inter // 2, (rank + 1) * inter // 2)
            gate, up = full.w13[:, :inter], full.w13[:, inter:]
            assert torch.equal(block.w13, torch.cat([gate[:, half], up[:, half]], dim=1))
            assert torch.equal(block.w2, full.w2[:, :, half])


def test_expert_parallel_needs_divisible_experts(folders):
    with pytest.raises(ValueError, match="experts cannot be spread"):
        LLM(folders["qwen2_moe"], tensor_parallel_size=4, enable_expert_parallel=True, **ENGINE)
