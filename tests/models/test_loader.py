"""Loader edge cases: bad paths, dummy weights of named shapes, config mapping, rope frequencies."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.config import EngineConfig
from tandem.layers.rotary import inverse_frequencies
from tandem.models.loader import NAMED_SHAPES, load_model_and_tokenizer, model_max_len
from tandem.models.registry import MODEL_REGISTRY, model_config_from_hf

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=256, num_hidden_layers=2, max_position_embeddings=256)


def load(**kwargs):
    return load_model_and_tokenizer(EngineConfig(device="cpu", **kwargs), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("model", ["/nonexistent/dir/model", "./no/such/model.gguf", "bad path with spaces"])
def test_unknown_path_raises_value_error(model):
    with pytest.raises(ValueError, match="not found"):
        load(model=model)


def test_folder_without_weights_and_wrong_file_type(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load(model=str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="gguf"):
        load(model=str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("shape", sorted(NAMED_SHAPES))
def test_named_shapes_map_to_model_configs(shape):
    values = dict(NAMED_SHAPES[shape])
    hf_config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    config = model_config_from_hf(hf_config)
    assert config.architecture in MODEL_REGISTRY and config.eos_token_ids


def test_dummy_named_shape_with_overrides_is_seeded():
    overrides = SMALL
    model, config, tokenizer = load(model="llama-3.2-1b", load_format="dummy", hf_overrides=overrides, seed=7)
    again, _, _ = load(model="llama-3.2-1b", load_format="dummy", hf_overrides=overrides, seed=7)
    assert tokenizer is None
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (2, 64, 256)
    assert config.rope_scaling["rope_type"] == "llama3" and config.tie_word_embeddings
    weight = model.model.layers[0].mlp.gate_up_proj.weight
    assert weight.dtype == torch.float32 and 0.015 < weight.std() < 0.025
    torch.testing.assert_close(weight, again.model.layers[0].mlp.gate_up_proj.weight)


def test_dummy_from_config_folder(tmp_path):
    transformers.Qwen3Config(**SMALL).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    model, config, tokenizer = load(model=str(tmp_path), load_format="dummy", dtype="float32")
    assert config.architecture == "qwen3" and config.qk_norm
    assert 7 in config.eos_token_ids and 9 in config.eos_token_ids
    assert model_max_len(config) == 256


def test_safetensors_format_mismatch_raises(tmp_path):
    transformers.Qwen3Config(**SMALL).save_pretrained(tmp_path)
    with pytest.raises(ValueError):
        load(model=str(tmp_path), load_format="gguf")


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_inverse_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=16, max_position_embeddings=131072,
                                      rope_parameters={"rope_theta": 500000.0, **(rope or {"rope_type": "default"})})
    ours = inverse_frequencies(128, 500000.0, rope)
    if rope is None:
        expected = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_and_model_type_raise():
    with pytest.raises(ValueError, match="rope_type"):
        model_config_from_hf(transformers.LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                       "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_hf(transformers.BertConfig())
