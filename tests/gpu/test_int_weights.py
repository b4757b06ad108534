"""4- and 8-bit integer weights on a GPU: checkpoints load onto the device in their packed layout, the logits
of a tiny quantized Llama match transformers on the dequantized weights, and int4 decode captured in CUDA
graphs (with the overlap loop) gives the eager, synchronous run's greedy tokens.

Stated tolerance: in fp32 the GPU path multiplies the same dequantized weights as transformers, so logits agree
to the 3e-3 the fp32 parity test allows for TF32 dot products."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

transformers = pytest.importorskip("transformers")

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.models.loader import load_model_and_tokenizer  # noqa: E402
from tests.models.quantized_llama import CONFIG, VOCAB, Case, save_quantized_llama  # noqa: E402
from tests.models.test_hf_parity import run_and_compare  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [Case("gptq", 4, 128, sym=True), Case("awq", 4, 128, sym=False),
                                  Case("compressed-tensors", 8, 64, sym=True, act_order=True)], ids=lambda c: c.id)
def test_quantized_checkpoint_on_cuda_matches_dequantized_transformers(case, tmp_path):
    hf = save_quantized_llama(case, tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32")
    model, model_config, _ = load_model_and_tokenizer(config, CUDA, torch.float32)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qweight.is_cuda and qkv.qweight.dtype == torch.uint8
    assert not hasattr(qkv, "weight")  # no full-precision copy
    run_and_compare(case.id, hf, model, model_config, "cuda", atol=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["int4", "int4-one-row", "int4-many-rows", "int4-lm-head", "gptq-desc-act"])
def test_int4_graphs_and_overlap_equal_eager_sync(source, tmp_path):
    """Decode captured in CUDA graphs with the overlap loop gives the eager, synchronous tokens: round to nearest
    at load (three rows a step: the tensor-core GEMV's rows; one: its one-row kernel, group 128 and K 128 / 256;
    twelve: the many-row kernel; the lm_head in int4 too, writing the graphs' static logits), and a GPTQ desc_act
    checkpoint (the input permutation inside the graphs)."""
    if source.startswith("int4"):
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    else:
        save_quantized_llama(Case("gptq", 4, 64, sym=False, act_order=True), tmp_path)
    prompts = [[(5 * i) % (VOCAB - 4) + 4 for i in range(13)], [7, 8, 9], [60, 61, 62, 63] * 3]
    prompts = prompts[:1] if source == "int4-one-row" else prompts
    if source == "int4-many-rows":
        prompts = [[(7 * i + j) % (VOCAB - 4) + 4 for i in range(5 + j)] for j in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", cuda_graph=graphs, overlap=graphs,
                  quantization="int4" if source.startswith("int4") else None, max_model_len=64,
                  max_num_seqs=len(prompts), quantize_lm_head=source == "int4-lm-head")
        try:
            if source == "int4-lm-head":
                assert llm.engine.runner.model.lm_head.kernel_int_weight is not None
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_int4_one_row_split_sums_deferred_and_folded_give_the_reduce_kernels_tokens(tmp_path, monkeypatch):
    """A Llama wide enough that the one-row tensor-core GEMV splits K (hidden 2048: qkv in 2, o and down in more),
    in CUDA graphs with the overlap loop: o_proj and down_proj handing their partial sums to the add + RMSNorm and
    qkv adding its own (the split counters reset on every replay) give the greedy tokens of the reduce kernels
    after every split (TANDEM_DEFER_REDUCE off, TANDEM_INT_MMA_FOLD_REDUCE=0): the same sums in the same order."""
    import tandem.kernels.triton_quant as quant
    from tandem.kernels.triton_int_gemv_mma import mma_gemv_config

    shape = dict(CONFIG, hidden_size=2048, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert mma_gemv_config(2048 + 2 * 512, 2048, 4, sms)["SPLIT_K"] > 1  # qkv
    assert mma_gemv_config(2048, 4096, 4, sms)["SPLIT_K"] > 1  # down
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(quant, "DEFER_REDUCE", fused)
        monkeypatch.setenv("TANDEM_INT_MMA_FOLD_REDUCE", "1" if fused else "0")
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", quantization="int4", max_model_len=64,
                  max_num_seqs=1)
        try:
            runs.append(llm.generate([[5, 9, 13, 17, 21]], greedy, use_tqdm=False)[0].outputs[0].token_ids)
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_int4_llama3_8b_shape_loads_without_its_bf16_copy():
    """The 8B shape at int4 holds ~5.8 GB (a 3.5 GB packed body, 0.2 GB of bf16 scales and zeros, 2.1 GB of bf16
    embeddings and lm_head) where bf16 holds 16 GB; the peak stays under 10 GiB because each linear is drawn and
    quantized on its own (the largest, gate_up, with its fp32 temporaries: ~2 GB)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    config = EngineConfig(model="llama-3-8b", load_format="dummy", device="cuda", dtype="bfloat16",
                          quantization="int4")
    model, _, _ = load_model_and_tokenizer(config, CUDA, torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 5.5e9 < held < 6.2e9
    assert torch.cuda.max_memory_allocated() - base < 10 * 2**30
    # One copy of each integer weight, in the kernels' layout (repack_int_ at load): what the device holds is the
    # parameters plus the buffers (rotary tables), nothing kept beside them.
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "qweight") and qkv.words.dtype == torch.int32 and qkv.kernel_int_weight is not None
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert torch.cuda.memory_allocated() - base <= held + buffers + 64 * 2**20
    del model
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("family,case", [("qwen3_moe", Case("gptq", 4, 32, sym=False)),
                                         ("mixtral", Case("awq", 4, 32, sym=False)),
                                         ("qwen3_moe", Case("gptq", 4, 32, sym=False, act_order=True))],
                         ids=["qwen3-gptq", "mixtral-awq", "qwen3-gptq-actorder"])
def test_checkpoint_experts_on_cuda_give_the_dequantized_models_tokens(family, case, tmp_path):
    """A MoE checkpoint whose experts are quantized, in bf16 on the GPU (the integer MoE kernels reading the
    stacks the checkpoint's experts were repacked into; in act order, each pair's rows read through its expert's
    column orders first), against the same model with every weight dequantized and stored in full precision: the
    same greedy tokens, a near-tie aside."""
    from tests.gpu.test_gpu_engine import assert_same_greedy
    from tests.models.test_int_moe import save_quantized_moe

    quantized, dense = tmp_path / "quantized", tmp_path / "dense"
    quantized.mkdir()
    save_quantized_moe(case, family, quantized).save_pretrained(dense)
    prompts = [[5, 9, 17, 33], [40, 41, 42], [8, 100, 3, 60, 12], [7, 7, 21]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    runs = []
    for folder in (dense, quantized):
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.shutdown()
    # The tiny random MoE's top log-probs lie within ~0.1 of each other, so most requests reach a near-tie within
    # 16 tokens (on an H200, 2026-11-29: 3 of 4 for Qwen3-MoE GPTQ, each on a near-tie): the test holds the
    # log-probs of the identical prefixes close and every divergence to a near-tie, not their number.
    assert_same_greedy(runs[0], runs[1], f"{family} {case.id}: checkpoint experts vs dequantized weights",
                       max_diverging=len(prompts))
