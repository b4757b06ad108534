"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE), from tiny saved transformers checkpoints, give
transformers' logits and greedy tokens in fp32; each family's routing rule; the stacked-expert loading."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.kernels.moe_align import route_topk
from tandem.models.loader import load_model_and_tokenizer
from tests.models.test_hf_parity import run_and_compare

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)


def tiny_moe_config(family: str):  # type: ignore[no-untyped-def]
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    if family == "qwen2_moe":  # shared expert; the middle layer dense (mlp_only_layers); no renormalization
        return transformers.Qwen2MoeConfig(**COMMON, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                           norm_topk_prob=False)
    if family == "qwen3_moe":  # every second layer sparse; renormalized top-k
        return transformers.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                           head_dim=32, decoder_sparse_step=2, norm_topk_prob=True)
    raise ValueError(family)


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_models(request, tmp_path_factory):
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(request.param)).float().eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder)
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32")
    model, model_config, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)
    return request.param, hf_model, model, model_config, folder


def test_moe_prefill_then_paged_decode_matches_hf(moe_models):
    name, hf_model, model, model_config, _ = moe_models
    run_and_compare(name, hf_model, model, model_config, "cpu", atol=1e-4)


def test_moe_config_and_layers(moe_models):
    name, hf_model, model, mc, _ = moe_models
    assert mc.architecture == name and mc.num_experts == (hf_model.config.num_local_experts if name == "mixtral"
                                                         else hf_model.config.num_experts)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    expected = {"mixtral": ["FusedMoE"] * 3, "qwen2_moe": ["Qwen2MoeSparseBlock", "LlamaMLP", "Qwen2MoeSparseBlock"],
                "qwen3_moe": ["LlamaMLP", "FusedMoE", "LlamaMLP"]}[name]
    assert kinds == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_cuda_fp32_matches_hf(moe_models):
    name, hf_model, _, _, folder = moe_models
    config = EngineConfig(model=str(folder), device="cuda", dtype="float32")
    model, model_config, _ = load_model_and_tokenizer(config, torch.device("cuda"), torch.float32)
    run_and_compare(name, hf_model, model, model_config, "cuda", atol=3e-3)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_topk_rule(renormalize):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.5]])
    weights, ids = route_topk(logits, 2, renormalize)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1], [2, 3]] and ids.dtype == torch.int32
    expected = torch.stack([probs[0, [0, 1]], probs[1, [2, 3]]])
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected)


def test_stacked_expert_tensors_load_like_per_expert(moe_models):
    """transformers 5's fused [experts, 2 * inter, hidden] gate_up and [experts, hidden, inter] down tensors."""
    name, hf_model, model, mc, _ = moe_models
    layer = next(i for i in range(mc.num_layers) if mc.is_moe_layer(i))
    block = model.model.layers[layer].mlp
    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up = block.w13.data.clone()
    down = block.w2.data.clone()
    block.w13.data.zero_()
    block.w2.data.zero_()
    from tandem.models.weights import WeightLoader

    loader = WeightLoader(model)
    modules = dict(model.named_modules())
    assert model.load_special(f"{prefix}.gate_up_proj", gate_up, loader, modules)
    assert model.load_special(f"{prefix}.down_proj", down, loader, modules)
    assert torch.equal(block.w13.data, gate_up) and torch.equal(block.w2.data, down)
    assert loader.loaded[f"model.layers.{layer}.mlp.w13"] == gate_up.numel()


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("shape,experts", [("mixtral-8x7b", dict(num_local_experts=4)),
                                           ("qwen3-30b-a3b", dict(num_experts=8, moe_intermediate_size=32)),
                                           ("qwen1.5-moe-a2.7b", dict(num_experts=6, moe_intermediate_size=32,
                                                                      shared_expert_intermediate_size=48))])
def test_named_moe_shapes_run_dummy_and_fp8(shape, experts):
    """The named MoE shapes (shrunk by hf_overrides) build with random weights; FP8 experts stay close."""
    from tandem.models.loader import quantize_linears_fp8
    from tests.models.paged_kv import PagedKV, Seq

    config = EngineConfig(model=shape, load_format="dummy", device="cpu", dtype="float32",
                          hf_overrides={**SMALL, **experts})
    model, mc, tokenizer = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)
    assert tokenizer is None and mc.num_experts == next(iter(experts.values()))
    kv = PagedKV(mc)
    step = kv.step([Seq([5, 6, 7, 8, 9]), Seq([10, 11])])
    block = model.model.layers[0].mlp
    x = torch.randn(7, mc.hidden_size)
    with torch.inference_mode():
        hidden = model(step.input_ids, step.positions, kv.kv_cache, step.meta)
        assert torch.isfinite(hidden).all()
        expected = block(x)
        skipped = quantize_linears_fp8(model)
        assert block.w13.dtype == torch.float8_e4m3fn and block.w13_scale.shape == block.w13.shape[:2]
        assert block.gate.weight.dtype == torch.float32  # the router keeps the model dtype: same routing
        assert not any(name.endswith("mlp") for name in skipped)
        got = block(x)
    assert (got - expected).norm() / expected.norm() < 0.08  # e4m3's 3 mantissa bits, per-channel scales
