"""Mixtures of experts on a GPU: decode graphs of every batch size and piecewise prefill graphs equal eager, overlap
equals sync, FP8 experts stay close to bf16, 4- / 8-bit experts on the kernels close to their fp32 reference, and
TP=2 / EP=2 give one GPU's tokens (two GPUs)."""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

transformers = pytest.importorskip("transformers")

from tests.gpu.test_gpu_engine import (  # noqa: E402
    VOCAB,
    _release_gpu_memory,  # noqa: F401  (autouse fixture)
    assert_same_greedy,
    generate,
    make_llm,
    random_prompt,
)

COMMON = dict(vocab_size=VOCAB, initializer_range=0.05, bos_token_id=1, eos_token_id=2, hidden_size=256,
              intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
TINY_MOE = {
    # 32 experts, top 4, renormalized; every second layer sparse.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_hidden_layers=3, head_dim=64, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=128, norm_topk_prob=True, tie_word_embeddings=False),
    # Shared expert with its gate; qkv bias; no renormalization.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, num_hidden_layers=2, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, norm_topk_prob=False, tie_word_embeddings=False),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
        tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    folders: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in folders:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(TINY_MOE[arch]())
            folder = tmp_path_factory.mktemp(arch)
            model.to(torch.bfloat16).save_pretrained(folder)
            folders[arch] = str(folder)
        return folders[arch]

    return get


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(TINY_MOE))
def test_moe_decode_graphs_equal_eager(arch, moe_checkpoint):
    """Decode batches shrink from 24 to 1: the per-pair path (few tokens) and the aligned path, every graph."""
    n = 24
    llm = make_llm(moe_checkpoint(arch), max_num_seqs=n, num_kv_blocks=8 * n + 8)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.graphs is not None
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randint(4, 24)) for _ in range(n)]
    lengths = [2 + i for i in range(n)]
    with_graphs = generate(llm, prompts, lengths)
    engine.scheduler.reset_prefix_cache()
    graphs, runner.graphs = runner.graphs, None
    try:
        eager = generate(llm, prompts, lengths)
    finally:
        runner.graphs = graphs
    assert_same_greedy(eager, with_graphs, f"MoE graphs vs eager ({arch})")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_piecewise_graphs_equal_eager(arch, moe_checkpoint):
    llm = make_llm(moe_checkpoint(arch), max_num_seqs=16, max_num_batched_tokens=160, num_kv_blocks=400)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.piecewise is not None
    rng = random.Random(5)
    prompts = [random_prompt(rng, rng.choice([2, 7, 45, 130, 200])) for _ in range(32)]
    lengths = [rng.randint(1, 20) for _ in range(32)]
    with_pieces = generate(llm, prompts, lengths)
    engine.scheduler.reset_prefix_cache()
    pieces, runner.piecewise = runner.piecewise, None
    try:
        eager = generate(llm, prompts, lengths)
    finally:
        runner.piecewise = pieces
    assert_same_greedy(eager, with_pieces, f"MoE piecewise vs eager ({arch})")


@pytest.mark.gpu
def test_moe_overlap_equals_sync(moe_checkpoint):
    rng = random.Random(2)
    prompts = [random_prompt(rng, rng.randint(3, 60)) for _ in range(12)]
    lengths = [rng.randint(4, 24) for _ in range(12)]
    runs = []
    for overlap in (True, False):
        llm = make_llm(moe_checkpoint("qwen3_moe"), max_num_seqs=8, overlap=overlap, dtype="float32")
        runs.append(generate(llm, prompts, lengths))
        llm.shutdown()
    # Overlap may run a finished request one step longer, so a step's token count (and with it the MoE tile) can
    # differ from sync: the same rule as the dense models' overlap test, equal up to near-ties.
    assert_same_greedy(runs[1], runs[0], "MoE overlap vs sync")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs compute capability >= 8.9")
def test_moe_fp8_experts_close_to_bf16(moe_checkpoint):
    from tandem.kernels.fp8 import FP8_DTYPE

    rng = random.Random(3)
    prompts = [random_prompt(rng, 16) for _ in range(8)]
    llm = make_llm(moe_checkpoint("qwen3_moe"), quantization="fp8")
    block = llm.engine.runner.model.model.layers[1].mlp
    assert block.w13.dtype == FP8_DTYPE and block.gate.weight.dtype == torch.bfloat16
    fp8 = generate(llm, prompts, [8] * 8)
    llm.shutdown()
    bf16 = generate(make_llm(moe_checkpoint("qwen3_moe")), prompts, [8] * 8)
    first = [a[0][0] == b[0][0] for a, b in zip(fp8, bf16)]
    assert sum(first) >= 6, "FP8 experts changed most first tokens"


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_moe_int_experts_match_their_fp32_reference(moe_checkpoint, quantization):
    """4- / 8-bit experts on the Triton kernels (bf16, decode graphs; 8 sequences take the sorted path, the last
    one or two the pair path) against the same quantization run in fp32 (every integer weight dequantized into
    the PyTorch references): the same first tokens but for bf16's near-ties (as FP8 against bf16 above)."""
    rng = random.Random(5)
    prompts = [random_prompt(rng, 16) for _ in range(8)]
    llm = make_llm(moe_checkpoint("qwen3_moe"), quantization=quantization)
    block = llm.engine.runner.model.model.layers[1].mlp
    assert block.int_bits == int(quantization[3:]) and block.gate.weight.dtype == torch.bfloat16
    kernels = generate(llm, prompts, [8] * 8)
    llm.shutdown()
    llm = make_llm(moe_checkpoint("qwen3_moe"), quantization=quantization, dtype="float32")
    reference = generate(llm, prompts, [8] * 8)
    llm.shutdown()
    first = [a[0][0] == b[0][0] for a, b in zip(kernels, reference)]
    assert sum(first) >= 6, f"{quantization} experts on the kernels changed most first tokens"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_moe_two_gpus_equal_one(expert_parallel, moe_checkpoint):
    rng = random.Random(4)
    prompts = [random_prompt(rng, rng.randint(3, 40)) for _ in range(8)]
    lengths = [12] * 8
    # fp32: the tiny random router is near-uniform over 32 experts, so bf16's reordered sums flip experts and
    # move log-probs by more than 0.1 between one and two ranks (0.12 on CPU too, with no Triton kernel).
    one = make_llm(moe_checkpoint("qwen3_moe"), max_num_seqs=8, dtype="float32")
    ref = generate(one, prompts, lengths)
    one.shutdown()
    two = make_llm(moe_checkpoint("qwen3_moe"), max_num_seqs=8, tensor_parallel_size=2,
                   enable_expert_parallel=expert_parallel, dtype="float32")
    try:
        got = generate(two, prompts, lengths)
    finally:
        two.shutdown()
    assert_same_greedy(ref, got, f"two GPUs ({'EP' if expert_parallel else 'TP'}) vs one")
