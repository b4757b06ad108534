"""Writes a random-weight GGUF file of a named Llama shape with its tensors in the block types a llama.cpp
quantization mix uses, for loading and speed runs of GGUF files where none can be downloaded.

    python scripts/make_gguf_checkpoint.py --shape llama-3-8b --mix q4_k_m --out /tmp/llama3-8b-q4km
    tandem bench --workload bs1-8b --checkpoint /tmp/llama3-8b-q4km --peers bf16

k-quant blocks hold random code bytes under fixed fp16 super-block scales (weights of ~0.05 spread); Q4_0 / Q8_0
are quantized from N(0, 0.05) by the gguf package. No tokenizer: benchmarks feed token ids."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.models.loader import NAMED_SHAPES  # noqa: E402
from tests.models.gguf_files import gguf_blocks  # noqa: E402

# mix -> (most tensors, attn_v / ffn_down of the layers that get more bits, the other attn_v / ffn_down,
# token_embd, output): llama.cpp's Q4_K_M and Q5_K_M give attn_v and ffn_down Q6_K in the first and last eighth
# of the layers and every third layer between (use_more_bits), the output Q6_K.
MIXES = {
    "q4_k_m": ("Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K"),
    "q5_k_m": ("Q5_K", "Q6_K", "Q5_K", "Q5_K", "Q6_K"),
    "q8_0": ("Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0"),
    "q4_0": ("Q4_0", "Q4_0", "Q4_0", "Q4_0", "Q6_K"),
}


def more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def main() -> None:
    import gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b", choices=[s for s, c in NAMED_SHAPES.items()
                                                                   if c["model_type"] == "llama"])
    parser.add_argument("--mix", default="q4_k_m", choices=sorted(MIXES))
    parser.add_argument("--out", required=True, help="a folder; the file is written as model.gguf in it")
    args = parser.parse_args()
    cfg = NAMED_SHAPES[args.shape]
    body, more, other, embd, output = MIXES[args.mix]
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(os.path.join(args.out, "model.gguf"), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])  # no llama3 scaling
    writer.add_vocab_size(cfg["vocab_size"])

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, gguf_blocks(kind, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", embd, cfg["vocab_size"], hidden)
    if not cfg.get("tie_word_embeddings"):
        add("output.weight", output, cfg["vocab_size"], hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        wide = more if more_bits(i, layers) else other
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
        for name, kind, rows, cols in [("attn_q", body, heads * head_dim, hidden),
                                       ("attn_k", body, kv_heads * head_dim, hidden),
                                       ("attn_v", wide, kv_heads * head_dim, hidden),
                                       ("attn_output", body, hidden, heads * head_dim),
                                       ("ffn_gate", body, inter, hidden), ("ffn_up", body, inter, hidden),
                                       ("ffn_down", wide, hidden, inter)]:
            add(f"blk.{i}.{name}.weight", kind, rows, cols)
        print(f"layer {i + 1}/{layers}", flush=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
