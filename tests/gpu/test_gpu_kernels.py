"""GPU checks of the decode-path kernels: sampling captured in CUDA graphs (graph == eager, bitwise), the
fused q/k-norm + rotary + KV-write kernel and the split-KV decode attention in bf16 against the PyTorch
references, and seeded random sampling that gives the same tokens in overlap and sync mode with graphs on."""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

from tandem import SamplingParams  # noqa: E402
from tandem.runner.cuda_graphs import SAMPLER_VARIANTS  # noqa: E402
from tandem.sampling_params import MAX_LOGPROBS  # noqa: E402
from tests.gpu.test_gpu_engine import checkpoint, make_llm, random_prompt  # noqa: E402,F401

# ----------------------------------------------------------------------------- sampling inside the graphs


def _fill_params(runner, slot: int, bs: int, variant, gen: torch.Generator) -> None:
    """Per-row parameters that the variant covers, written straight into the slot's static device buffers."""
    buf = runner.buffers[slot]
    dev = "cuda"
    temp = torch.rand(bs, generator=gen) * 1.5 if variant.random else torch.zeros(bs)
    if variant.random:
        temp[::3] = 0.0  # greedy rows inside a random variant
    top_k = torch.randint(0, 40, (bs,), generator=gen, dtype=torch.int32) if variant.top_k_top_p else torch.zeros(
        bs, dtype=torch.int32)
    top_p = (0.5 + 0.5 * torch.rand(bs, generator=gen)) if variant.top_k_top_p else torch.ones(bs)
    buf.floats.dev["temperature"][:bs].copy_(temp.to(dev))
    buf.floats.dev["top_p"][:bs].copy_(top_p.to(dev))
    buf.ints.dev["top_k"][:bs].copy_(top_k.to(dev))
    buf.longs.dev["seeds"][:bs].copy_(torch.randint(0, 2**31, (bs,), generator=gen).to(dev))
    buf.longs.dev["sample_pos"][:bs].copy_(torch.randint(0, 500, (bs,), generator=gen).to(dev))


@pytest.mark.gpu
def test_sampling_graphs_equal_eager_sampling_bitwise(checkpoint):
    llm = make_llm(checkpoint("llama"), max_num_seqs=12)
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.captures_sampling
    gen = torch.Generator().manual_seed(0)
    for bs in graphs.batch_sizes:
        for variant in SAMPLER_VARIANTS:
            for slot in (0, 1):
                buf = runner.buffers[slot]
                _fill_params(runner, slot, bs, variant, gen)
                runner.executor.graph_logits[:bs].copy_(3 * torch.randn(bs, runner.executor.graph_logits.shape[1], generator=gen))
                graphs.replay_sample(slot, bs, variant)
                got = (buf.out_tokens[:bs].clone(), buf.out_logprob[:bs].clone(), buf.out_top_ids[:bs].clone(),
                       buf.out_top_lp[:bs].clone())
                buf.out_tokens.zero_(), buf.out_logprob.zero_(), buf.out_top_ids.zero_(), buf.out_top_lp.zero_()
                runner.executor.sample_into(slot, runner.executor.graph_logits[:bs], bs, not variant.random, variant.top_k_top_p,
                                    MAX_LOGPROBS if variant.logprobs else -1)
                label = f"bs {bs} {variant} slot {slot}"
                assert torch.equal(got[0], buf.out_tokens[:bs]), label
                if variant.logprobs:
                    assert torch.equal(got[1], buf.out_logprob[:bs]), label
                    assert torch.equal(got[2], buf.out_top_ids[:bs]), label
                    assert torch.equal(got[3], buf.out_top_lp[:bs]), label
                if not variant.random:
                    assert torch.equal(got[0], runner.executor.graph_logits[:bs].argmax(-1)), label


@pytest.mark.gpu
def test_seeded_sampling_with_graphs_is_the_same_in_overlap_and_sync(checkpoint):
    # Every request is admitted and prefilled in the first step and finishes in the same step, so both modes
    # run the same decode batches (same graphs, hence bitwise-equal logits) and must sample the same tokens;
    # overlap only adds one discarded step at the end.
    llm = make_llm(checkpoint("llama"), max_num_seqs=16, max_num_batched_tokens=512, num_kv_blocks=256)
    engine = llm.engine
    assert engine.runner.graphs is not None
    rng = random.Random(5)
    prompts = [random_prompt(rng, 20) for _ in range(16)]
    params = []
    for i in range(16):
        kind = i % 4  # greedy, temperature, top-k/top-p, temperature + logprobs
        params.append(SamplingParams(
            temperature=0.0 if kind == 0 else 0.9, top_k=20 if kind == 2 else 0, top_p=0.8 if kind == 2 else 1.0,
            seed=1000 + i, max_tokens=24, ignore_eos=True, logprobs=2 if kind == 3 else None))
    replays = []
    orig = type(engine.runner.graphs).replay_sample

    def counting(slot, bs, variant):  # noqa: ANN001
        replays.append(variant)
        return orig(engine.runner.graphs, slot, bs, variant)

    engine.runner.graphs.replay_sample = counting
    runs = {}
    try:
        for overlap in (False, True):
            engine.overlap = overlap
            engine.scheduler.reset_prefix_cache()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[overlap] = [o.outputs[0].token_ids for o in outs]
    finally:
        engine.overlap = llm.config.overlap
        del engine.runner.graphs.replay_sample
    assert runs[False] == runs[True]
    assert any(v.random and v.top_k_top_p and v.logprobs for v in replays), set(replays)
