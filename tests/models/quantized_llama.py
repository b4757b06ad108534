"""Test helper: a tiny Llama quantized into GPTQ, AWQ or compressed-tensors and saved as a Hugging Face folder,
beside the same model with its weights dequantized to fp32."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from tests.models.int_packers import (
    act_order_g_idx,
    awq_tensors,
    compressed_tensors_tensors,
    gptq_tensors,
    quantize,
)

VOCAB = 128
# hidden 128, intermediate 256: every input size holds whole groups of 32, 64 and 128 (and of 64 at TP=2).
CONFIG = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, tie_word_embeddings=False)
# Each decoder linear, and the input it reads: projections of one input share one act-order g_idx.
LINEARS = {"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1, "self_attn.o_proj": 2,
           "mlp.gate_proj": 3, "mlp.up_proj": 3, "mlp.down_proj": 4}


@dataclass(frozen=True)
class Case:
    method: str  # gptq | awq | compressed-tensors
    bits: int
    group: int
    sym: bool
    act_order: bool = False
    gptq_v1: bool = True

    @property
    def id(self) -> str:
        fmt = ("-v1" if self.gptq_v1 else "-v2") if self.method == "gptq" else ""
        order = "-actorder" if self.act_order else ""
        return f"{self.method}{fmt}-w{self.bits}-g{self.group}-{'sym' if self.sym else 'asym'}{order}"

    def quantization_config(self) -> dict:
        if self.method == "gptq":
            return dict(quant_method="gptq", bits=self.bits, group_size=self.group, sym=self.sym,
                        desc_act=self.act_order, checkpoint_format="gptq" if self.gptq_v1 else "gptq_v2")
        if self.method == "awq":
            return dict(quant_method="awq", bits=4, group_size=self.group, zero_point=True, version="gemm")
        weights = dict(num_bits=self.bits, type="int", symmetric=self.sym,
                       strategy="channel" if self.group == -1 else "group",
                       group_size=None if self.group == -1 else self.group,
                       actorder="group" if self.act_order else None)
        return dict(quant_method="compressed-tensors", format="pack-quantized", ignore=["lm_head"],
                    quantization_status="compressed",
                    config_groups={"group_0": dict(targets=["Linear"], weights=weights, input_activations=None)})

    def pack(self, w: torch.Tensor, input_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(this format's tensors of one linear, its dequantized fp32 weight)."""
        g_idx = act_order_g_idx(w.shape[1], self.group, seed=input_id) if self.act_order else None
        q = quantize(w, self.bits, self.group, self.sym, g_idx, min_zero=1 if self.method == "gptq" else 0)
        if self.method == "gptq":
            return gptq_tensors(q, v1=self.gptq_v1), q.dequantize()
        if self.method == "awq":
            return awq_tensors(q), q.dequantize()
        return compressed_tensors_tensors(q, self.sym, with_g_idx=self.act_order), q.dequantize()


def save_quantized_llama(case: Case, folder: str, seed: int = 0, family: str = "llama",
                         lm_head: bool = False):  # -> a transformers model
    """Writes a tiny random Llama (or Qwen2: q/k/v biases, which stay in full precision) in `case`'s format to
    folder (config.json + model.safetensors) and returns the transformers model holding the dequantized
    weights (fp32, eval). lm_head: the lm_head quantized too (as GPTQModel's `lm_head: true` writes it; not for
    compressed-tensors, whose config here ignores it)."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**CONFIG) if family == "qwen2" else transformers.LlamaConfig(**CONFIG)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at zero: make them count
                param.normal_(0.0, 0.1)
    tensors, dequantized = {}, {}
    for name, t in hf.state_dict().items():
        layer, _, rest = name.partition(".layers.")
        linear = rest.split(".", 1)[-1].removesuffix(".weight") if rest.endswith(".weight") else None
        if lm_head and name == "lm_head.weight":
            linear, input_id = "lm_head", len(LINEARS) + 1
        else:
            input_id = LINEARS.get(linear)
        if input_id is not None:
            prefix = name.removesuffix(".weight")
            packed, w = case.pack(t, input_id)
            tensors.update({f"{prefix}.{k}": v.contiguous() for k, v in packed.items()})
            dequantized[name] = w
        else:
            tensors[name] = t.contiguous()
    hf.load_state_dict(dequantized, strict=False)
    hf.config.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = case.quantization_config()
    with open(path, "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return hf
