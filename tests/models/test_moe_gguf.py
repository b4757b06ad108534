"""GGUF mixture-of-experts tensors (ffn_gate_inp, ffn_*_exps stacked [experts, out, in], Qwen2-MoE's *_shexp) map
to the Hugging Face names and load into the same model as the safetensors checkpoint."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.models.gguf_weights import hf_tensor_name, iter_gguf_weights
from tandem.models.loader import load_model_and_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.models.gguf_files import finish_gguf  # noqa: E402
from tests.models.test_moe_parity import tiny_moe_config  # noqa: E402

_TO_GGUF = {"mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
            "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
            "mlp.shared_expert.down_proj": "ffn_down_shexp", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
            "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def test_moe_tensor_names():
    assert hf_tensor_name("blk.2.ffn_gate_exps.weight") == "model.layers.2.mlp.experts.gate_proj.weight"
    assert hf_tensor_name("blk.2.ffn_down_exps.weight") == "model.layers.2.mlp.experts.down_proj.weight"
    assert hf_tensor_name("blk.0.ffn_gate_inp.weight") == "model.layers.0.mlp.gate.weight"
    assert hf_tensor_name("blk.1.ffn_gate_inp_shexp.weight") == "model.layers.1.mlp.shared_expert_gate.weight"
    assert hf_tensor_name("blk.1.ffn_up_shexp.weight") == "model.layers.1.mlp.shared_expert.up_proj.weight"


def test_older_per_expert_names_and_mixtral_metadata(tmp_path):
    from tandem.models.gguf_weights import gguf_moe_config

    assert hf_tensor_name("blk.3.ffn_down.7.weight") == "model.layers.3.mlp.experts.7.down_proj.weight"
    path = str(tmp_path / "mixtral.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.expert_count", 8)
    writer.add_uint32("llama.expert_used_count", 2)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    finish_gguf(writer)
    assert gguf_moe_config(path) == {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}


def _gguf_tensors(state: dict[str, torch.Tensor], num_layers: int, num_experts: int) -> dict[str, torch.Tensor]:
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}
    for i in range(num_layers):
        pre = f"model.layers.{i}."
        for hf, name in _TO_GGUF.items():
            for kind in ("weight", "bias"):
                if pre + hf + "." + kind in state:
                    out[f"blk.{i}.{name}.{kind}"] = state[pre + hf + "." + kind]
        if pre + "mlp.experts.0.gate_proj.weight" in state:
            for proj in ("gate", "up", "down"):
                out[f"blk.{i}.ffn_{proj}_exps.weight"] = torch.stack(
                    [state[f"{pre}mlp.experts.{e}.{proj}_proj.weight"] for e in range(num_experts)])
    return out


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_gguf_moe_file_loads_like_safetensors(tmp_path, family):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family)).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    config = EngineConfig(model=str(tmp_path / "hf"), device="cpu", dtype="float32")
    expected, mc, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    if not any(".experts.0." in k for k in state):  # transformers' in-memory stacked layout: read the file back
        from safetensors.torch import load_file

        state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, family.replace("_", ""))
    for name, tensor in _gguf_tensors(state, mc.num_layers, mc.num_experts).items():
        array = tensor.float().numpy()
        if name.endswith("ffn_gate_inp_shexp.weight"):
            array = array.reshape(-1)  # llama.cpp keeps this [hidden] vector 1-D
        writer.add_tensor(name, array)
    finish_gguf(writer)
    model_cls = type(expected)
    with torch.device("cpu"):
        got = model_cls(mc)
    got.load_weights(iter_gguf_weights(path, mc))
    for (name, a), (_, b) in zip(sorted(expected.state_dict().items()), sorted(got.state_dict().items())):
        assert torch.equal(a, b), name
