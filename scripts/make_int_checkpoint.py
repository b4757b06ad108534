"""Writes a random-weight 4- / 8-bit checkpoint of a named shape (GPTQ, AWQ or compressed-tensors, packed by the
tests' packers from the published layouts) for loading and speed runs of checkpoints where none can be downloaded.

    python scripts/make_int_checkpoint.py --shape llama-3-8b --format gptq --out /tmp/llama3-8b-gptq
    tandem bench --workload bs1-8b --checkpoint /tmp/llama3-8b-gptq --peers bf16
    python scripts/make_int_checkpoint.py --shape qwen3-30b-a3b --format gptq-desc-act --out /tmp/qwen3-moe-gptq
    tandem bench --workload moe-bs1 --checkpoint /tmp/qwen3-moe-gptq --no-peers

The weights are N(0, 0.02) like --load-format dummy; one safetensors file per decoder layer. MoE shapes (Qwen3-MoE,
Mixtral) write each expert's gate, up and down as its own quantized layer, as quantizers do, and the router in
bf16; with act order each expert has its own input-column orders (one for its gate and up)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file  # noqa: E402

from tandem.models.loader import NAMED_SHAPES  # noqa: E402
from tests.models.quantized_llama import Case  # noqa: E402

FORMATS = {
    "gptq": lambda bits, group: Case("gptq", bits, group, sym=True),
    "gptq-desc-act": lambda bits, group: Case("gptq", bits, group, sym=False, act_order=True, gptq_v1=False),
    "awq": lambda bits, group: Case("awq", 4, group, sym=False),
    "compressed-tensors": lambda bits, group: Case("compressed-tensors", bits, group, sym=True),
}


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def layer_linears(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """Each quantized linear of a decoder layer: (out, in, input id shared by projections of one input). A MoE
    shape's experts: mlp.experts.{e}.gate_proj / up_proj / down_proj (Mixtral: block_sparse_moe.experts.{e}.w1 /
    w3 / w2), each expert's gate and up one input id, its down another."""
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    linears = {"self_attn.q_proj": (q, hidden, 1), "self_attn.k_proj": (kv, hidden, 1),
               "self_attn.v_proj": (kv, hidden, 1), "self_attn.o_proj": (hidden, q, 2)}
    kind = cfg["model_type"]
    if kind == "llama":
        inter = cfg["intermediate_size"]
        return {**linears, "mlp.gate_proj": (inter, hidden, 3), "mlp.up_proj": (inter, hidden, 3),
                "mlp.down_proj": (hidden, inter, 4)}
    if kind == "qwen3_moe":
        experts, inter, names = cfg["num_experts"], cfg["moe_intermediate_size"], ("gate_proj", "up_proj", "down_proj")
        block = "mlp"
    else:  # mixtral
        experts, inter, names, block = cfg["num_local_experts"], cfg["intermediate_size"], ("w1", "w3", "w2"), \
            "block_sparse_moe"
    for e in range(experts):
        linears.update({f"{block}.experts.{e}.{names[0]}": (inter, hidden, 1000 + e),
                        f"{block}.experts.{e}.{names[1]}": (inter, hidden, 1000 + e),
                        f"{block}.experts.{e}.{names[2]}": (hidden, inter, 2000 + e)})
    return linears


def layer_extras(cfg: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors in bf16: its norms (and Qwen3's q / k norms) and a MoE shape's router."""
    hidden = cfg["hidden_size"]
    extras = {n: torch.ones(hidden, dtype=torch.bfloat16) for n in ("input_layernorm", "post_attention_layernorm")}
    if cfg["model_type"] == "qwen3_moe":
        head_dim = cfg["head_dim"]
        extras.update({n: torch.ones(head_dim, dtype=torch.bfloat16) for n in ("self_attn.q_norm", "self_attn.k_norm")})
        extras["mlp.gate"] = (torch.randn(cfg["num_experts"], hidden, generator=gen) * 0.02).bfloat16()
    elif cfg["model_type"] == "mixtral":
        extras["block_sparse_moe.gate"] = (torch.randn(cfg["num_local_experts"], hidden, generator=gen)
                                           * 0.02).bfloat16()
    return {f"{name}.weight": value for name, value in extras.items()}


def main() -> None:
    previous = torch.get_default_device()
    try:
        write_checkpoint()
    finally:  # the caller's default device back (a test calls this in its own process)
        torch.set_default_device(previous)


def write_checkpoint() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3-8b", choices=[s for s, c in NAMED_SHAPES.items()
                                                                   if c["model_type"] in ARCHITECTURES])
    parser.add_argument("--format", default="gptq", choices=sorted(FORMATS))
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    case = FORMATS[args.format](args.bits, args.group_size)
    cfg = dict(NAMED_SHAPES[args.shape])
    os.makedirs(args.out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # packing on a GPU: seconds a layer on a CPU
    torch.set_default_device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map: dict[str, str] = {}

    def write(file: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, os.path.join(args.out, file))
        weight_map.update({k: file for k in tensors})

    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    write("embed.safetensors", {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        **({} if cfg.get("tie_word_embeddings") else
           {"lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).bfloat16()}),
    })
    if cfg["model_type"] == "qwen3_moe" and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise SystemExit(f"{args.shape}: only shapes whose every layer holds experts are written")
    for i in range(cfg["num_hidden_layers"]):
        tensors = {f"model.layers.{i}.{n}": v for n, v in layer_extras(cfg, gen).items()}
        for name, (rows, cols, input_id) in layer_linears(cfg).items():
            packed, _ = case.pack(torch.randn(rows, cols, generator=gen) * 0.02, input_id)
            tensors.update({f"model.layers.{i}.{name}.{k}": v for k, v in packed.items()})
        write(f"layer-{i:03d}.safetensors", tensors)
        print(f"layer {i + 1}/{cfg['num_hidden_layers']}", flush=True)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**cfg, "architectures": [ARCHITECTURES[cfg["model_type"]]], "torch_dtype": "bfloat16",
                   "quantization_config": case.quantization_config()}, f, indent=1)


if __name__ == "__main__":
    main()
