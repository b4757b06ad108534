"""An integer Linear placed for the GPU kernels holds one copy of its weight: the kernels' layout (words, scales,
mins) replaces the checkpoint's (qweight, scales, zeros), and every path that runs no kernel reads it back."""

from __future__ import annotations

import torch

from tandem.bench.roofline import model_cost
from tandem.config import EngineConfig, ParallelConfig
from tandem.layers.int_quant import PackedIntWeight, quantize_rtn
from tandem.layers.linear import Linear
from tandem.models.int_loading import repack_int_linears
from tandem.models.loader import load_model_and_tokenizer


def held(module: torch.nn.Module) -> dict[str, int]:
    """Bytes of each tensor the module holds (parameters and buffers)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def int_linear(bits: int, group: int, act_order: bool, dtype: torch.dtype = torch.float32) -> Linear:
    torch.manual_seed(bits)
    layer = Linear(256, 96, bias=True).to(dtype)
    layer.weight.data.normal_(0.0, 0.05)
    layer.bias.data.normal_(0.0, 0.1)
    packed = quantize_rtn(layer.weight.data, bits, group)
    if act_order:
        packed = PackedIntWeight(packed.qweight, packed.scales, packed.zeros, bits, group, torch.randperm(256))
    del layer.weight
    layer._set_int(packed)
    return layer


def test_placed_linear_holds_one_copy_and_gives_the_same_output():
    for bits, group, act_order in [(4, 32, False), (8, 16, True), (4, 128, True)]:
        layer = int_linear(bits, group, act_order)
        x = torch.randn(3, 256)
        before = layer(x)
        packed = held(layer)
        layer.repack_int_()
        after = held(layer)
        groups = 256 // group
        expected = {"words": 96 * 256 * bits // 8, "scales": 96 * groups * 4, "mins": 96 * groups * 4, "bias": 96 * 4}
        if act_order:
            expected["perm"] = 256 * 8
        assert after == expected, (bits, group)
        assert sum(after.values()) == sum(packed.values())  # the same bytes: codes, scales, zeros -> mins
        assert layer.packed_weight() is None and layer.kernel_int_weight.words.data_ptr() == layer.words.data_ptr()
        assert layer.kernel_int_weight.scales.data_ptr() == layer.scales.data_ptr()
        # Off the kernels (the CPU) the layer dequantizes the kernels' layout: the same weight in fp32.
        torch.testing.assert_close(layer(x), before, atol=1e-5, rtol=1e-5)
        layer.repack_int_()  # placed already: nothing changes
        assert held(layer) == after


def test_placement_after_loading_a_tensor_parallel_shard_and_the_roofline(tmp_path):
    """The loader places integer linears on a GPU once every shard is cut; run here by hand on rank 1 of 2 loaded
    on the CPU, the layers keep their local shapes and the roofline reads the same weight count and bytes."""
    import transformers

    from tests.models.quantized_llama import CONFIG

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", quantization="int4")
    model, mc, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32, ParallelConfig(1, 2))
    assert hasattr(model.model.layers[0].mlp.down_proj, "qweight")  # on the CPU the loader keeps the int-N layout
    cost = model_cost(model, mc, tensor_parallel_size=2)
    repack_int_linears(model)
    down = model.model.layers[0].mlp.down_proj
    assert {n for n, _ in down.named_parameters()} == {"words", "scales", "mins"}
    assert down.words.shape == (CONFIG["hidden_size"], CONFIG["intermediate_size"] // 2 // 8)  # rank 1's columns
    placed = model_cost(model, mc, tensor_parallel_size=2)
    assert (placed.body_params, placed.weight_bytes) == (cost.body_params, cost.weight_bytes)
