"""How far o_proj's output moves when its input is quantized per token or in one group per kv head (CPU, fp32).

    python scripts/fp8_o_proj_error.py [--prompts 4] [--new-tokens 16]

Runs the embedded SmolLM2 in transformers (fp32) over a few chat prompts with greedy generation, and at every
o_proj call compares x W^T for x rounded to bf16 against the same product on x quantized to e4m3 per token
(quantize_activation_per_token_ref, what o_proj's own quantizer does) and per kv-head group
(quantize_activation_groups_ref, what the decode attention writes): mean and max relative L2 error over all calls.
The weight stays in fp32, so only the activation quantization differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.kernels.fp8 import QuantizedRows, quantize_activation_groups_ref, quantize_activation_per_token_ref  # noqa: E402
from tests.chat_prompts import QUESTIONS, chat_messages  # noqa: E402
from tests.conftest import SMOL_GGUF, smol_model_folder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    import transformers

    folder = smol_model_folder()
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=SMOL_GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOL_GGUF, dtype=torch.float32)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads * head_dim
    errors: dict[str, list[float]] = {"per token": [], f"per group of {group}": []}

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).to(torch.bfloat16).float()
        weight = module.weight.float()
        exact = x @ weight.T
        for name, quantized in zip(errors, (quantize_activation_per_token_ref(x),
                                            quantize_activation_groups_ref(x, group))):
            deq = QuantizedRows(*quantized, x.dtype).dequantize()
            errors[name].append(((deq @ weight.T - exact).norm() / exact.norm()).item())

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_pre_hook(hook)
    with torch.no_grad():
        for question in QUESTIONS[: args.prompts]:
            text = tok.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=False)
            ids = torch.tensor([tok(text)["input_ids"]])
            model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    for name, values in errors.items():
        print(f"{name}: mean relative error {statistics.mean(values):.5f}, max {max(values):.5f} "
              f"({len(values)} o_proj calls)")


if __name__ == "__main__":
    main()
