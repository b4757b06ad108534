"""GPTQ, AWQ and compressed-tensors layers unpacked into the tandem int-N layout match a reference dequantization
of tensors packed in the tests from each format's published bit layout; the layout's own packing, round to
nearest, the linear, and the refusals."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.ops import int_weight_linear
from tandem.kernels.reference import dequantize_int_weight
from tandem.layers.int_quant import PackedIntWeight, int_linear, pack_int4_rows, quantize_rtn
from tandem.layers.linear import Linear
from tandem.models.int_checkpoints import (
    checkpoint_int_config,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)
from tests.models.int_packers import (
    act_order_g_idx,
    awq_tensors,
    compressed_tensors_tensors,
    gptq_tensors,
    quantize,
)

OUT, IN = 48, 256


def weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)) * 0.05


def gptq_cfg(bits=4, group=128, sym=True, desc_act=False, fmt="gptq"):
    qc = dict(quant_method="gptq", bits=bits, group_size=group, sym=sym, desc_act=desc_act, checkpoint_format=fmt)
    return checkpoint_int_config({"quantization_config": qc})


def ct_cfg(bits=4, strategy="group", group=128, sym=True, actorder=None):
    weights = dict(num_bits=bits, type="int", symmetric=sym, strategy=strategy, actorder=actorder,
                   group_size=group if strategy == "group" else None)
    qc = dict(quant_method="compressed-tensors", format="pack-quantized",
              config_groups={"group_0": dict(targets=["Linear"], weights=weights, input_activations=None)})
    return checkpoint_int_config({"quantization_config": qc})


def test_layout_packing_and_reference():
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_int4_rows(codes)
    assert packed.shape == (3, 4)
    assert int(packed[1, 2]) == int(codes[1, 4]) | (int(codes[1, 5]) << 4)  # element k in byte k // 2
    scales, zeros = torch.rand(3, 2) + 0.5, torch.randint(0, 16, (3, 2)).float()
    w = dequantize_int_weight(packed, scales, zeros, 4, 4)
    assert w[2, 5] == (codes[2, 5].float() - zeros[2, 1]) * scales[2, 1]
    w8 = dequantize_int_weight(codes, scales, zeros, 8, -1)  # one group a row: group 0 only
    assert torch.equal(w8, (codes.float() - zeros[:, :1]) * scales[:, :1])


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_error_bound_and_linear(bits):
    w = weight()
    packed = quantize_rtn(w, bits, 128)
    assert packed.qweight.dtype == torch.uint8 and packed.qweight.shape == (OUT, IN * bits // 8)
    assert packed.scales.shape == packed.zeros.shape == (OUT, 2)
    # Round to nearest: every weight within half a step of its group's scale.
    err = (packed.dequantize() - w).abs().reshape(OUT, 2, 128)
    assert bool((err <= packed.scales[:, :, None] * 0.5 + 1e-6).all())
    x = torch.randn(5, IN)
    expected = x @ packed.dequantize().t()
    torch.testing.assert_close(int_weight_linear(x, packed.qweight, packed.scales, packed.zeros, bits, 128), expected)
    linear = Linear(IN, OUT)
    linear.weight.data.copy_(w)
    linear.quantize_int_(bits, 128)
    assert not hasattr(linear, "weight") or linear.weight is None
    torch.testing.assert_close(linear(x), expected)
    torch.testing.assert_close(linear.forward_silu_and_mul(x),
                               torch.nn.functional.silu(expected[:, :OUT // 2]) * expected[:, OUT // 2:])


def test_act_order_permutation_applied_once():
    w = weight(1)
    packed = quantize_rtn(w, 4, 64)
    perm = torch.randperm(IN)
    permuted = PackedIntWeight(packed.qweight, packed.scales, packed.zeros, 4, 64, perm)
    x = torch.randn(3, IN)
    y = int_linear(x, permuted, None)
    torch.testing.assert_close(y, x[:, perm] @ packed.dequantize().t())
    torch.testing.assert_close(y, x @ permuted.dequantize().t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_unpack(bits, group, sym, fmt):
    w = weight()
    q = quantize(w, bits, group, sym, min_zero=1 if fmt == "gptq" else 0)
    packed = unpack_gptq("layer", gptq_cfg(bits, group, sym, False, fmt), gptq_tensors(q, v1=fmt == "gptq"))
    assert packed.perm is None and packed.group_size == (IN if group == -1 else group)
    assert torch.equal(packed.dequantize(), q.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_desc_act_unpack(bits, fmt):
    w = weight(2)
    q = quantize(w, bits, 64, sym=False, g_idx=act_order_g_idx(IN, 64, seed=3), min_zero=1)
    packed = unpack_gptq("layer", gptq_cfg(bits, 64, False, True, fmt), gptq_tensors(q, v1=fmt == "gptq"))
    assert packed.perm is not None and not torch.equal(packed.perm, torch.arange(IN))
    torch.testing.assert_close(packed.dequantize(), q.dequantize(), atol=0, rtol=0)
    x = torch.randn(4, IN)
    torch.testing.assert_close(int_linear(x, packed, None), x @ q.dequantize().t(), atol=1e-5, rtol=1e-5)


def test_awq_unpack():
    w = weight(4)
    q = quantize(w, 4, 128, sym=False)
    cfg = checkpoint_int_config({"quantization_config": dict(quant_method="awq", bits=4, group_size=128,
                                                             zero_point=True, version="gemm")})
    packed = unpack_awq("layer", cfg, awq_tensors(q))
    assert torch.equal(packed.dequantize(), q.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("strategy", ["group", "channel"])
@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_unpack(bits, strategy, sym):
    w = weight(5)
    q = quantize(w, bits, 64 if strategy == "group" else -1, sym)
    packed = unpack_compressed_tensors("layer", ct_cfg(bits, strategy, 64, sym), compressed_tensors_tensors(q, sym))
    assert torch.equal(packed.dequantize(), q.dequantize())


def test_compressed_tensors_group_actorder_unpack():
    q = quantize(weight(6), 4, 32, True, g_idx=act_order_g_idx(IN, 32, seed=7))
    packed = unpack_compressed_tensors("layer", ct_cfg(4, "group", 32, True, "group"),
                                       compressed_tensors_tensors(q, True, with_g_idx=True))
    torch.testing.assert_close(packed.dequantize(), q.dequantize(), atol=0, rtol=0)


def test_config_refusals():
    with pytest.raises(ValueError, match="3-bit"):
        gptq_cfg(bits=3)
    with pytest.raises(ValueError, match="group_size 256"):
        gptq_cfg(group=256)
    with pytest.raises(ValueError, match="'marlin'"):
        gptq_cfg(fmt="marlin")
    with pytest.raises(ValueError, match="version 'gemv'"):
        checkpoint_int_config({"quantization_config": dict(quant_method="awq", bits=4, group_size=128,
                                                           version="gemv")})
    with pytest.raises(ValueError, match="strategy 'tensor'"):
        ct_cfg(strategy="tensor")
    with pytest.raises(ValueError, match="format"):
        checkpoint_int_config({"quantization_config": dict(
            quant_method="compressed-tensors", format="int-quantized",
            config_groups={"g": dict(weights=dict(num_bits=8, type="int", strategy="channel", symmetric=True))})})
    assert checkpoint_int_config({}) is None
    assert checkpoint_int_config({"quantization_config": dict(quant_method="fp8")}) is None


def test_tensors_disagreeing_with_config_are_refused():
    q = quantize(weight(), 4, 128, True)
    # The config says 8 bits: qweight then implies another input size than the scales' groups.
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj'.*scales"):
        unpack_gptq("model.layers.0.mlp.up_proj", gptq_cfg(bits=8), gptq_tensors(q, v1=True))
    with pytest.raises(ValueError, match="group_size=64"):
        unpack_gptq("layer", gptq_cfg(group=64), gptq_tensors(q, v1=True))
    tensors = gptq_tensors(q, v1=True)
    tensors["qweight"] = tensors["qweight"].float()
    with pytest.raises(ValueError, match="qweight must be a 2-D int32"):
        unpack_gptq("layer", gptq_cfg(), tensors)
    shuffled = quantize(weight(), 4, 64, True, g_idx=act_order_g_idx(IN, 64, seed=1))
    with pytest.raises(ValueError, match="no act order"):
        unpack_gptq("layer", gptq_cfg(group=64), gptq_tensors(shuffled, v1=True))
    with pytest.raises(ValueError, match="weight_scale"):
        unpack_compressed_tensors("layer", ct_cfg(group=32), compressed_tensors_tensors(q, True))


def test_layout_refusals_name_the_layer():
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj: group size 128"):
        quantize_rtn(torch.randn(8, 96), 4, 128, name="model.layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match="3-bit"):
        Linear(64, 8).use_int_weight_(3, 32, name="x")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("strategy", ["group", "channel"])
@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_package_round_trip(bits, strategy, sym):
    """Tensors written by the compressed-tensors package's own compressor unpack to the weights its own
    decompressor gives back."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                            group_size=64 if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    gen = torch.Generator().manual_seed(bits)
    groups = IN // 64 if strategy == "group" else 1
    half = 1 << (bits - 1)
    state = {"weight": weight(9), "weight_scale": torch.rand(OUT, groups, generator=gen) * 0.01 + 0.002,
             "weight_zero_point": (torch.zeros(OUT, groups) if sym else
                                   torch.randint(-half, half, (OUT, groups), generator=gen)).to(torch.int8)}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    expected = PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]
    packed = unpack_compressed_tensors("layer", ct_cfg(bits, strategy, 64, sym), compressed)
    torch.testing.assert_close(packed.dequantize(), expected.float(), atol=0, rtol=0)
