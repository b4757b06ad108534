"""FP8 on the CPU: quantization math, Hugging Face FP8 checkpoints through the loader, fp8 model vs full
precision through the PyTorch reference matmul, roofline bytes, and the clear errors (no GPU needed)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.bench.roofline import model_cost
from tandem.config import EngineConfig
from tandem.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tandem.layers.linear import Linear
from tandem.layers.quantization import (
    checkpoint_fp8_config,
    dequantize_fp8,
    dequantize_fp8_checkpoint,
    fp8_linear,
    fp8_linear_reference,
    quantize_activation_per_token,
    quantize_weight_fp8,
)
from tandem.models.loader import load_model_and_tokenizer, quantize_linears_fp8
from tests.models.paged_kv import PagedKV, Seq

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Relative L2 errors against full precision. One e4m3 rounding is <= 2^-4 relative per operand (~0.03 RMS
# for a product of two quantized operands); a tiny random model's logits (8 quantized activations, small
# logits) measure 0.05-0.09, so whole models are held to 0.15. The GPU test states the same bounds.
LINEAR_REL_L2 = 5e-2
LOGITS_REL_L2 = 0.15
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=256, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.05,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
BLOCK = (48, 48)  # not a divisor of 64 or 128: partial blocks at the edges
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------- quantization math


def test_weight_quantization_per_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of very different size
    w[5] = 0.0
    q, scale = quantize_weight_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (48, 1) and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(q[5].float(), torch.zeros(64))
    nonzero = [i for i in range(48) if i != 5]
    # Every row's largest magnitude maps to the top of the e4m3 range.
    assert torch.equal(q.float().abs().amax(dim=1)[nonzero], torch.full((47,), FP8_MAX))
    # Round to nearest: error at most half a step, 2^-4 of the value for normals (2^-10 absolute near 0).
    err = (dequantize_fp8(q, scale) - w).abs()
    assert (err <= w.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()


def test_activation_quantization_per_token():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=gen) * 5
    x[3] = 0.0
    q, scale = quantize_activation_per_token(x)
    assert q.shape == x.shape and scale.shape == (6, 1)
    assert torch.equal(q[3].float(), torch.zeros(64)) and torch.isfinite(scale).all()
    assert rel_l2(dequantize_fp8(q, scale), x) < 4e-2


def test_reference_linear_matches_full_precision_and_linear_dispatches():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 64, generator=gen)  # any leading shape
    w = torch.randn(32, 64, generator=gen) * 0.05
    b = torch.randn(32, generator=gen)
    q, scale = quantize_weight_fp8(w)
    out = fp8_linear_reference(x, q, scale, b)
    assert out.shape == (2, 3, 32) and out.dtype == x.dtype
    assert rel_l2(out - b, x @ w.t()) < LINEAR_REL_L2
    lin = Linear(64, 32, bias=True)
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b)
    assert lin.quantize_fp8_() and lin.weight.dtype == FP8_DTYPE and lin.weight_scale.shape == (32, 1)
    assert torch.equal(lin(x), fp8_linear(x, q, scale, b))  # CPU: fp8_linear is the reference
    assert not Linear(64, 40).quantize_fp8_()  # 40 is no multiple of 16: stays in the model dtype


# ----------------------------------------------------------------------------- checkpoints


def _quantize_for_checkpoint(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(fp8 weight, scale, scale tensor suffix) in the layout Hugging Face FP8 checkpoints use."""
    if kind == "per_tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(1)
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale, "weight_scale"
    if kind == "per_channel":
        q, scale = quantize_weight_fp8(w)
        return q, scale, "weight_scale"
    bo, bi = BLOCK
    rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            scale[i, j] = blk.abs().max() / FP8_MAX
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk / scale[i, j]).to(FP8_DTYPE)
    return q, scale, "weight_scale_inv"


QUANT_CONFIGS = {
    "per_tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "per_channel": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (FP8 checkpoint folder, folder of the same model with those weights dequantized to fp32)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL)
    state = {k: v.float().contiguous() for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    out = {}
    for kind, qc in QUANT_CONFIGS.items():
        fp8_dir, deq_dir = tmp_path_factory.mktemp(f"fp8-{kind}"), tmp_path_factory.mktemp(f"deq-{kind}")
        fp8_state, deq_state = {}, {}
        for name, w in state.items():
            if name.endswith(".weight") and name.split(".")[-2] in _PROJ:
                q, scale, suffix = _quantize_for_checkpoint(w, kind)
                fp8_state[name] = q
                fp8_state[name[: -len("weight")] + suffix] = scale
                if kind == "per_tensor":  # static activation scale: read past, never used
                    fp8_state[name[: -len("weight")] + "input_scale"] = torch.ones(1)
                deq_state[name] = fp8_state[name].float() * (
                    scale if kind != "block" else
                    scale.repeat_interleave(BLOCK[0], 0)[: w.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : w.shape[1]])
            else:
                fp8_state[name] = deq_state[name] = w
        config.save_pretrained(deq_dir)
        safetensors_torch.save_file(deq_state, str(deq_dir / "model.safetensors"))
        with open(deq_dir / "config.json") as f:
            cfg = json.load(f)
        cfg["quantization_config"] = qc
        with open(fp8_dir / "config.json", "w") as f:
            json.dump(cfg, f)
        safetensors_torch.save_file(fp8_state, str(fp8_dir / "model.safetensors"))
        out[kind] = (str(fp8_dir), str(deq_dir))
    return out


def load(folder: str, quantization: str | None = None):
    config = EngineConfig(model=folder, device="cpu", quantization=quantization)
    return load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)[0]


def prefill_logits(model, mc, prompt: list[int]) -> torch.Tensor:
    kv = PagedKV(mc, num_blocks=32, block_size=4)
    step = kv.step([Seq(list(prompt))])
    with torch.inference_mode():
        return model.compute_logits(model(step.input_ids, step.positions, kv.kv_cache, step.meta))


@pytest.mark.parametrize("kind", sorted(QUANT_CONFIGS))
def test_fp8_checkpoint_loads_dequantized(checkpoints, kind):
    """Without quantization an FP8 checkpoint loads as its dequantized weights, fused projections included."""
    fp8_dir, deq_dir = checkpoints[kind]
    got, want = load(fp8_dir), load(deq_dir)
    params = dict(want.named_parameters())
    for name, p in got.named_parameters():
        assert torch.equal(p, params[name]), name


@pytest.mark.parametrize("kind", sorted(QUANT_CONFIGS))
def test_fp8_checkpoint_quantized_per_channel(checkpoints, kind):
    fp8_dir, deq_dir = checkpoints[kind]
    model = load(fp8_dir, quantization="fp8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (qkv.out_features, 1)
    assert model.lm_head.weight.dtype == torch.float32  # lm_head and embeddings keep the model dtype
    assert model.model.embed_tokens.weight.dtype == torch.float32
    if kind == "per_channel":
        # Every row keeps its maximum, so re-quantizing reproduces the checkpoint's fp8 values exactly.
        with safetensors_torch.safe_open(f"{fp8_dir}/model.safetensors", "pt") as f:
            parts = [f.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv"]
        assert torch.equal(qkv.weight.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    mc = load_model_and_tokenizer(EngineConfig(model=deq_dir, device="cpu"), "cpu", torch.float32)[1]
    prompt = [5, 17, 99, 3, 250, 42, 7, 8, 120, 64]
    ref = prefill_logits(load(deq_dir), mc, prompt)
    assert rel_l2(prefill_logits(model, mc, prompt), ref) < LOGITS_REL_L2


def test_quantized_model_close_to_full_precision(checkpoints):
    """Load-time quantization of a full-precision model (the --quantization fp8 path for bf16 checkpoints)."""
    _, deq_dir = checkpoints["per_channel"]
    model, mc, _ = load_model_and_tokenizer(EngineConfig(model=deq_dir, device="cpu"), "cpu", torch.float32)
    ref = prefill_logits(model, mc, list(range(3, 40)))
    assert quantize_linears_fp8(model) == []
    got = prefill_logits(model, mc, list(range(3, 40)))
    assert rel_l2(got, ref) < LOGITS_REL_L2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_checkpoint_errors():
    w = torch.zeros(16, 16, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="without a weight_scale"):
        list(dequantize_fp8_checkpoint([("a.weight", w)], {}))
    with pytest.raises(ValueError, match="without an FP8 weight"):
        list(dequantize_fp8_checkpoint([("a.weight_scale", torch.ones(1))], {}))
    with pytest.raises(ValueError, match="neither per-tensor"):
        list(dequantize_fp8_checkpoint([("a.weight", w), ("a.weight_scale", torch.ones(3, 3))], {}))
    with pytest.raises(ValueError, match="not supported"):
        checkpoint_fp8_config({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    int8 = {"quant_method": "compressed-tensors",
            "config_groups": {"g0": {"weights": {"type": "int", "num_bits": 8}}}}
    with pytest.raises(ValueError, match="not FP8"):
        checkpoint_fp8_config({"quantization_config": int8})
    fp8 = {"quant_method": "compressed-tensors",
           "config_groups": {"g0": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}
    assert checkpoint_fp8_config({"quantization_config": fp8}) == fp8
    assert checkpoint_fp8_config({}) is None


# ----------------------------------------------------------------------------- config, errors, roofline


def test_config_and_cpu_error():
    from tandem import LLM
    from tandem.engine_args import add_engine_args, engine_kwargs

    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int3")  # int4 and int8 are weight-only integer codes
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(quantization="fp8", dtype="float16")
    with pytest.raises(ValueError, match=r"compute capability >= 8.9 \(Ada/Hopper\); this run is on cpu"):
        LLM(device="cpu", quantization="fp8", load_format="dummy", model="llama-3-8b")
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--quantization", "fp8"]))["quantization"] == "fp8"
    assert engine_kwargs(parser.parse_args([]))["quantization"] is None


def test_roofline_counts_fp8_bytes(checkpoints):
    _, deq_dir = checkpoints["per_channel"]
    model, mc, _ = load_model_and_tokenizer(EngineConfig(model=deq_dir, device="cpu"), "cpu", torch.float32)
    full = model_cost(model, mc)
    quantize_linears_fp8(model)
    fp8 = model_cost(model, mc)
    linear = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head")
    rows = sum(m.out_features for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head")
    # Linear weights go from 4 bytes (fp32 here) to 1 byte per element, plus one fp32 scale per row.
    assert full.weight_bytes - fp8.weight_bytes == 3 * linear - 4 * rows
    assert fp8.kv_bytes_per_token == full.kv_bytes_per_token and fp8.body_params == full.body_params
    assert fp8.fp8_body_params == linear and full.fp8_body_params == 0


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> str:
    """A tiny Llama whose logits read the embedding table (tie_word_embeddings), in fp32."""
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "tie_word_embeddings": True}))
    folder = tmp_path_factory.mktemp("tied")
    model.float().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantize_lm_head(checkpoints, tied_checkpoint, tied):
    """quantize_lm_head puts the logits projection in FP8 (per vocabulary row) beside the other linears; a tied
    model gets an FP8 copy for its logits while its embedding lookups keep the model dtype. Logits stay within
    the whole-model FP8 bound of full precision, and the roofline reads the head's FP8 bytes."""
    folder = tied_checkpoint if tied else checkpoints["per_channel"][1]
    full, mc, _ = load_model_and_tokenizer(EngineConfig(model=folder, device="cpu"), "cpu", torch.float32)
    body = load(folder, quantization="fp8")
    config = EngineConfig(model=folder, device="cpu", quantization="fp8", quantize_lm_head=True)
    model = load_model_and_tokenizer(config, "cpu", torch.float32)[0]
    assert mc.tie_word_embeddings == tied
    assert model.lm_head.weight.dtype == FP8_DTYPE and model.lm_head.weight_scale.shape == (SMALL["vocab_size"], 1)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, full.model.embed_tokens.weight)
    head = full.lm_head.weight if not tied else full.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight.view(torch.uint8), quantize_weight_fp8(head)[0].view(torch.uint8))
    prompt = list(range(3, 40))
    ref, got = prefill_logits(full, mc, prompt), prefill_logits(model, mc, prompt)
    assert not torch.equal(got, prefill_logits(body, mc, prompt))  # the head's rounding shows
    assert rel_l2(got, ref) < LOGITS_REL_L2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
    vocab, hidden = SMALL["vocab_size"], SMALL["hidden_size"]
    with_head, without = model_cost(model, mc), model_cost(body, mc)
    # fp32 head (4 bytes an element) -> FP8 (1 byte) + one fp32 scale a vocabulary row
    assert without.weight_bytes - with_head.weight_bytes == 3 * vocab * hidden - 4 * vocab
    assert with_head.body_params == without.body_params and with_head.fp8_body_params == without.fp8_body_params


def test_quantize_lm_head_errors():
    from tandem.engine_args import add_engine_args, engine_kwargs

    with pytest.raises(ValueError, match="quantize_lm_head needs quantization fp8"):
        EngineConfig(quantize_lm_head=True)
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--quantization", "fp8", "--quantize-lm-head"]))["quantize_lm_head"]
    assert not engine_kwargs(parser.parse_args([]))["quantize_lm_head"]
    with pytest.raises(ValueError, match="quantize_lm_head is not supported for gpt2"):
        load_model_and_tokenizer(EngineConfig(model="gpt2", load_format="dummy", device="cpu", quantization="fp8",
                                              quantize_lm_head=True), "cpu", torch.float32)
