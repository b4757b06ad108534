"""GGUF files kept in their blocks: each block type unpacks to what the `gguf` package dequantizes, and a tiny Llama
written to a GGUF file in Q4_0 + Q8_0 / Q4_1 / a Q4_K_M-like mix gives in tandem (fp32, CPU, from its blocks) the
logits and greedy tokens of transformers loading the same file dequantized."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tandem.config import EngineConfig
from tandem.layers.int_quant import quantize_rtn
from tandem.models.gguf_blocks import BLOCK_TYPES, unpack_gguf_tensor, widen
from tandem.models.loader import load_model_and_tokenizer
from tests.models.gguf_files import gguf_blocks, write_tiny_llama_gguf
from tests.models.test_hf_parity import run_and_compare

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", sorted(BLOCK_TYPES))
def test_blocks_unpack_to_the_gguf_dequantization(kind):
    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    data = gguf_blocks(kind, rows, cols, rng)
    expected = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]))
    packed = unpack_gguf_tensor(kind, torch.from_numpy(data), cols, "w")
    spec = BLOCK_TYPES[kind]
    assert (packed.bits, packed.group_size) == (spec.bits, spec.group)
    assert packed.qweight.shape == (rows, cols * spec.bits // 8) and packed.scales.shape == (rows, cols // spec.group)
    # Q4_0 / Q8_0 / Q6_K are (q - zero) * scale in gguf's own fp32 order; a min (Q4_1, k-quants) becomes a real
    # zero point, -min / scale, whose fp32 product differs from scale * q + min in the last bits.
    exact = kind in ("Q4_0", "Q8_0", "Q6_K")
    tol = 0.0 if exact else 1e-6 * float(expected.abs().max())
    torch.testing.assert_close(packed.dequantize(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_a_group_with_zero_scale_keeps_its_constant(kind):
    rng = np.random.default_rng(1)
    data = gguf_blocks(kind, 2, 256, rng)
    if kind == "Q4_1":  # block 3 of row 0: d = 0, m = 0.25 -> every value 0.25
        data[0, 3 * 20:3 * 20 + 4] = np.array([0.0, 0.25], np.float16).view(np.uint8)
    else:  # row 1's super-block: sub-scale 2 (byte 4 + 2, low 6 bits) = 0 -> value -dmin * min_2
        data[1, 4 + 2] &= 0xC0
    expected = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]))
    packed = unpack_gguf_tensor(kind, torch.from_numpy(data), 256)
    assert torch.isfinite(packed.zeros).all()
    torch.testing.assert_close(packed.dequantize(), expected, rtol=0, atol=1e-6 * float(expected.abs().max()))


def test_widen_is_exact():
    w = torch.randn(4, 64)
    packed = quantize_rtn(w, 4, 32)
    wide = widen(packed, 8, 16)
    assert (wide.bits, wide.group_size, tuple(wide.scales.shape)) == (8, 16, (4, 4))
    assert torch.equal(wide.dequantize(), packed.dequantize())
    with pytest.raises(ValueError, match="cannot hold"):
        widen(wide, 4, 32)


def test_bytes_that_do_not_fit_name_the_tensor():
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight'.*Q4_0 bytes"):
        unpack_gguf_tensor("Q4_0", torch.zeros(2, 17, dtype=torch.uint8), 32, "blk.0.attn_q.weight")
    with pytest.raises(ValueError, match="Q5_0 is not kept"):
        unpack_gguf_tensor("Q5_0", torch.zeros(2, 22, dtype=torch.uint8), 32, "blk.0.attn_q.weight")


# Q4_K_M-like: Q4_K with Q6_K v / down in layer 0 (qkv and down then 8-bit group 16), Q5_K beside Q4_K in layer
# 1's gate / up (8-bit group 32), and a k projection in Q5_0, which is not kept: layer 1's whole qkv is dequantized.
K_MIX = {"*": "Q4_K", "blk.0.attn_v.weight": "Q6_K", "blk.0.ffn_down.weight": "Q6_K",
         "blk.1.ffn_up.weight": "Q5_K", "blk.1.attn_k.weight": "Q5_0"}
# Q4_0 in layer 0, Q8_0 in layer 1 (one model, to keep the test fast).
Q4_0_Q8_0 = {f"blk.1.{n}.weight": "Q8_0" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                   "ffn_down")} | {"*": "Q4_0"}
CASES = {"Q4_0-Q8_0": (Q4_0_Q8_0, "F32"), "Q4_1": ({"*": "Q4_1"}, "Q8_0"), "Q4_K_M": (K_MIX, "Q6_K")}
_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# (layer, module) -> (bits, group) expected for each case; absent: dequantized to the model dtype.
LAYOUTS = {
    "Q4_0-Q8_0": {(i, m): (8 if i else 4, 32) for i in (0, 1) for m in _LINEARS},
    "Q4_1": {(i, m): (4, 32) for i in (0, 1) for m in _LINEARS},
    "Q4_K_M": {(0, "self_attn.qkv_proj"): (8, 16), (0, "self_attn.o_proj"): (4, 32), (0, "mlp.gate_up_proj"): (4, 32),
               (0, "mlp.down_proj"): (8, 16), (1, "self_attn.o_proj"): (4, 32), (1, "mlp.gate_up_proj"): (8, 32),
               (1, "mlp.down_proj"): (4, 32)},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_llama_from_its_blocks_matches_transformers(case, tmp_path, caplog):
    types, embedding = CASES[case]
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, types, embedding)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                           dtype=torch.float32).eval()
    config = EngineConfig(model=path, device="cpu", dtype="float32")
    with caplog.at_level(logging.INFO, logger="tandem.models.gguf_int"):
        model, model_config, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32,
                                                          load_tokenizer=False, gguf_blocks=True)
    for i, layer in enumerate(model.model.layers):
        for name in _LINEARS:
            linear = layer.get_submodule(name)
            want = LAYOUTS[case].get((i, name))
            got = (linear.int_bits, linear.group_size) if linear.int_bits else None
            assert got == want, (i, name)
            assert want is not None or linear.weight.dtype == torch.float32
    logged = caplog.text
    if case == "Q4_K_M":
        assert "blk.1.attn_k.weight (Q5_0: block type not kept)" in logged
        assert "blk.1.attn_q.weight (Q4_K: another part of its fused projection is not kept)" in logged
    if embedding != "F32":
        assert f"token_embd.weight ({embedding}: not a decoder linear)" in logged
    run_and_compare(case, hf, model, model_config, "cpu", atol=1e-4)


def test_dequantized_load_is_unchanged_by_default_on_cpu(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, {"*": "Q4_1"})
    config = EngineConfig(model=path, device="cpu", dtype="float32")
    model, _, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32, load_tokenizer=False)
    assert model.model.layers[0].self_attn.qkv_proj.int_bits == 0  # the CPU dequantizes at load


def test_tensor_parallel_shards_of_the_blocks_hold_the_dequantized_weight(tmp_path):
    """At TP=2 each rank's integer shards (row-parallel: whole groups of 32 or 16 input columns; column-parallel:
    its output rows of each fused part, q / k rotary order undone) put together give the dequantized load's."""
    from tandem.config import ParallelConfig

    path = str(tmp_path / "tiny.gguf")
    write_tiny_llama_gguf(path, K_MIX)
    config = EngineConfig(model=path, device="cpu", dtype="float32")
    cpu = torch.device("cpu")
    full, mc, _ = load_model_and_tokenizer(config, cpu, torch.float32, load_tokenizer=False)
    ranks = [load_model_and_tokenizer(config, cpu, torch.float32, ParallelConfig(rank=r, size=2), load_tokenizer=False,
                                      gguf_blocks=True)[0] for r in range(2)]
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    for name in _LINEARS:
        whole = full.get_submodule(f"model.layers.0.{name}").weight.detach()
        shards = [m.get_submodule(f"model.layers.0.{name}").packed_weight().dequantize() for m in ranks]
        if name.endswith(("o_proj", "down_proj")):
            torch.testing.assert_close(torch.cat(shards, dim=1), whole, atol=1e-6, rtol=0)
            continue
        parts = whole.split([q, kv, kv] if "qkv" in name else [mc.intermediate_size] * 2)
        for r, shard in enumerate(shards):
            expected = torch.cat([p[r * p.shape[0] // 2:(r + 1) * p.shape[0] // 2] for p in parts])
            torch.testing.assert_close(shard, expected, atol=1e-6, rtol=0)
