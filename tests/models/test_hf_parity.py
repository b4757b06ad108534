"""Each architecture, loaded from a saved tiny Hugging Face checkpoint, matches transformers in fp32."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.models.loader import load_model_and_tokenizer
from tests.models.paged_kv import PagedKV, Seq

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, initializer_range=0.1)

TINY_CONFIGS = {
    # Llama 3.x rope scaling with a small original context so the scaled band covers real frequencies.
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32),
        bos_token_id=1, eos_token_id=[2, 3],
    ),
    # head_dim decoupled from hidden_size / num_heads.
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, head_dim=32, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                            initializer_range=0.1),
}
PROMPT_LENS = (5, 11, 3)
NUM_DECODE_STEPS = 4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def models(request, tmp_path_factory):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(TINY_CONFIGS[request.param]()).float().eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32")
    model, model_config, tokenizer = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)
    return request.param, hf_model, model, model_config, tokenizer


def hf_last_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def run_and_compare(name, hf_model, model, model_config, device: str, atol: float) -> None:
    """One flattened prefill of three prompts, then paged decode steps (with padding rows), checked against HF."""
    gen = torch.Generator().manual_seed(1)
    seqs = [Seq(torch.randint(4, VOCAB, (n,), generator=gen).tolist()) for n in PROMPT_LENS]
    kv = PagedKV(model_config, device=device)

    with torch.inference_mode():
        step = kv.step(seqs)
        logits = model.compute_logits(model(step.input_ids, step.positions, kv.kv_cache, step.meta))
        assert logits.dtype == torch.float32 and logits.shape == (step.input_ids.shape[0], VOCAB)
        for _ in range(NUM_DECODE_STEPS):
            last = logits[step.last_token_idx].cpu()
            for seq, row in zip(seqs, last):
                torch.testing.assert_close(row, hf_last_logits(hf_model, seq.token_ids), atol=atol, rtol=atol)
                seq.token_ids.append(int(row.argmax()))
            step = kv.step(seqs, num_padding_rows=2)
            hidden = model(step.input_ids, step.positions, kv.kv_cache, step.meta)
            assert torch.isfinite(hidden).all()
            logits = model.compute_logits(hidden)

    for seq, prompt_len in zip(seqs, PROMPT_LENS):
        expected = hf_model.generate(torch.tensor([seq.token_ids[:prompt_len]]), max_new_tokens=NUM_DECODE_STEPS,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)
        assert seq.token_ids == expected[0].tolist(), name


def test_prefill_then_paged_decode_matches_hf(models):
    name, hf_model, model, model_config, tokenizer = models
    assert tokenizer is None  # the tiny checkpoints have no tokenizer files
    run_and_compare(name, hf_model, model, model_config, "cpu", atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp32_matches_hf(models, tmp_path):
    name, hf_model, _, _, _ = models
    hf_model.save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32")
    model, model_config, _ = load_model_and_tokenizer(config, torch.device("cuda"), torch.float32)
    assert all(p.is_cuda for p in model.parameters())
    # Looser than on CPU: GPU kernels may use TF32 for fp32 dot products.
    run_and_compare(name, hf_model, model, model_config, "cuda", atol=3e-3)


def test_model_config_mapping(models):
    name, hf_model, _, model_config, _ = models
    expected_arch = {"mistral": "llama"}.get(name, name)
    assert model_config.architecture == expected_arch
    assert model_config.tie_word_embeddings == bool(hf_model.config.tie_word_embeddings)
    if name == "llama":
        assert model_config.eos_token_ids == (2, 3)
        assert model_config.rope_scaling["rope_type"] == "llama3"
