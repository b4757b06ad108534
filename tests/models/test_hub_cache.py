"""Hub ids resolve through the Hugging Face cache; offline misses say what is missing. No network is used."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.models.loader import load_model_and_tokenizer, resolve_source

transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def tiny_tokenizer():
    """A word-level tokenizer over 128 ids, enough to show the tokenizer also comes from the snapshot."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline HF cache holding REPO_ID at main (COMMIT) and tag v2 (OTHER_COMMIT), as the hub lays it out."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, num_hidden_layers=2,
                                      max_position_embeddings=128)
    for commit, layers in ((COMMIT, 2), (OTHER_COMMIT, 1)):
        config.num_hidden_layers = layers
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(repo / "snapshots" / commit)
    tiny_tokenizer().save_pretrained(repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v2").write_text(OTHER_COMMIT)
    # A tokenizer-only repo (no config.json), for EngineConfig.tokenizer.
    tokenizer_repo = cache / "models--tiny-org--tiny-tokenizer"
    tiny_tokenizer().save_pretrained(tokenizer_repo / "snapshots" / OTHER_COMMIT)
    (tokenizer_repo / "refs").mkdir()
    (tokenizer_repo / "refs" / "main").write_text(OTHER_COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # never reach the network, whatever was imported
    return cache


def test_cached_hub_id_loads_offline(hub_cache):
    source = resolve_source(EngineConfig(model=REPO_ID))
    assert source.format == "safetensors"
    assert source.path == str(hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT)
    model, model_config, tokenizer = load_model_and_tokenizer(
        EngineConfig(model=REPO_ID, device="cpu"), torch.device("cpu"), torch.float32)
    assert (model_config.num_layers, model_config.hidden_size, model_config.vocab_size) == (2, 64, 128)
    assert tokenizer("w5 w7")["input_ids"] == [5, 7]


def test_tokenizer_from_a_tokenizer_only_hub_repo(hub_cache):
    _, _, tokenizer = load_model_and_tokenizer(
        EngineConfig(model=REPO_ID, revision="v2", tokenizer="tiny-org/tiny-tokenizer", device="cpu"),
        torch.device("cpu"), torch.float32)
    assert tokenizer("w9")["input_ids"] == [9]


def test_revision_selects_the_cached_ref_or_commit(hub_cache):
    for revision in ("v2", OTHER_COMMIT):
        source = resolve_source(EngineConfig(model=REPO_ID, revision=revision))
        assert source.path.endswith(OTHER_COMMIT)


def test_offline_miss_names_repo_cache_and_remedy(hub_cache):
    with pytest.raises(ValueError) as info:
        resolve_source(EngineConfig(model="tiny-org/not-downloaded"))
    message = str(info.value)
    assert "'tiny-org/not-downloaded'" in message and str(hub_cache) in message
    assert "HF_HUB_OFFLINE=1" in message and "local folder" in message
    with pytest.raises(ValueError, match="revision 'v9'.*not in the Hugging Face cache"):
        resolve_source(EngineConfig(model=REPO_ID, revision="v9"))


def test_revision_with_a_local_path_or_a_bad_value_raises(tmp_path, hub_cache):
    with pytest.raises(ValueError, match="applies to a Hugging Face Hub id"):
        resolve_source(EngineConfig(model=str(tmp_path), revision="main"))
    with pytest.raises(ValueError, match="revision must be"):
        EngineConfig(revision="  ")


def test_cli_revision_flag_reaches_the_engine_config():
    import argparse

    from tandem.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", REPO_ID, "--revision", "v2"])
    assert EngineConfig(**engine_kwargs(args)).revision == "v2"
