"""Test helper: GGUF blocks of each kept type (quantized by the `gguf` package where it can, built from the published
layout otherwise) and a tiny Llama written to a GGUF file with its linears in chosen block types."""

from __future__ import annotations

import numpy as np

from tandem.models.gguf_blocks import BLOCK_TYPES

# Per K-quant type: (fp16 d, dmin as a multiple of d, offset of d in the block) for random code bytes that give
# weights of roughly unit-0.05 spread centred near zero (sub-scales and mins 0-63; Q6_K's int8 sub-scales).
_K_SCALES = {"Q4_K": (1.6e-4, 7.5, 0), "Q5_K": (8e-5, 15.5, 0), "Q6_K": (4e-5, 0.0, 208)}
VOCAB = 128  # tests.models.test_hf_parity's run_and_compare draws prompts below it
CONFIG = dict(hidden=256, intermediate=256, layers=2, heads=4, kv_heads=2)  # K-quants: rows of whole 256-blocks


def gguf_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / block * block bytes] of `kind`: random weights quantized with gguf.quants.quantize, or
    (k-quants, which it cannot quantize) random code bytes under fixed fp16 super-block scales."""
    import gguf

    if kind not in _K_SCALES:
        weights = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(np.float32)
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])
    spec = BLOCK_TYPES[kind]
    nb = rows * cols // spec.block
    blocks = rng.integers(0, 256, (nb, spec.block_bytes), dtype=np.uint8)
    d, ratio, at = _K_SCALES[kind]
    blocks[:, at:at + 2] = np.full(nb, d, np.float16).view(np.uint8).reshape(nb, 2)
    if kind != "Q6_K":
        blocks[:, 2:4] = np.full(nb, d * ratio, np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def write_tiny_llama_gguf(path: str, types: dict[str, str], embedding: str = "F32", seed: int = 0) -> None:
    """A tiny random Llama (CONFIG) in llama.cpp's layout (q / k rows rotary-permuted, as its converter writes
    them; random weights, so drawn in that order) with each linear in types[<blk.N.name>] (default Q4_0 from
    types["*"]), the embedding table in `embedding`, and no output.weight (tied head)."""
    import gguf

    rng = np.random.default_rng(seed)
    c = CONFIG
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(c["hidden"])
    writer.add_block_count(c["layers"])
    writer.add_feed_forward_length(c["intermediate"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_dimension_count(c["hidden"] // c["heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_freq_base(10000.0)
    _add(writer, "token_embd.weight", embedding, VOCAB, c["hidden"], rng)
    head_dim = c["hidden"] // c["heads"]
    shapes = {"attn_q": (c["hidden"], c["hidden"]), "attn_k": (c["kv_heads"] * head_dim, c["hidden"]),
              "attn_v": (c["kv_heads"] * head_dim, c["hidden"]), "attn_output": (c["hidden"], c["hidden"]),
              "ffn_gate": (c["intermediate"], c["hidden"]), "ffn_up": (c["intermediate"], c["hidden"]),
              "ffn_down": (c["hidden"], c["intermediate"])}
    for i in range(c["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(c["hidden"])).astype(np.float32))
        for name, (rows, cols) in shapes.items():
            full = f"blk.{i}.{name}.weight"
            _add(writer, full, types.get(full, types.get("*", "Q4_0")), rows, cols, rng)
    writer.add_tensor("output_norm.weight", np.ones(c["hidden"], np.float32))
    finish_gguf(writer)


def finish_gguf(writer) -> None:  # type: ignore[no-untyped-def]
    """Writes a gguf.GGUFWriter's header, metadata and tensors, and closes the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add(writer, name: str, kind: str, rows: int, cols: int, rng: np.random.Generator) -> None:
    import gguf

    if kind in ("F32", "F16"):
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32 if kind == "F32" else np.float16)
        writer.add_tensor(name, w)
        return
    writer.add_tensor(name, gguf_blocks(kind, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
