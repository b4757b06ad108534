"""Tiny random Hugging Face checkpoints for the tensor-parallel tests (saved once per family)."""

from __future__ import annotations

import os

import torch

VOCAB = 131  # odd: the vocabulary-parallel tables carry a padding row at TP=2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, initializer_range=0.1)


def tiny_config(family: str):  # type: ignore[no-untyped-def]
    import transformers

    if family == "llama":  # KV heads 2: split over two ranks; untied lm_head
        return transformers.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False)
    if family == "mistral":  # head_dim decoupled from hidden / heads
        return transformers.MistralConfig(**COMMON, num_key_value_heads=2, head_dim=32, sliding_window=None)
    if family == "qwen2":  # q/k/v bias, tied embeddings
        return transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True)
    if family == "qwen3":  # one KV head: replicated on both ranks
        return transformers.Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                                       initializer_range=0.1)
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def save_tiny(family: str, folder: str) -> str:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).float().eval()
    model.save_pretrained(folder)
    return os.fspath(folder)


def save_tiny_tokenizer(folder: str) -> str:
    """A character-level tokenizer (74 ids, under VOCAB) beside a tiny checkpoint, for tests that pass text."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "<eos>", *string.ascii_letters, *string.digits, *" .,!?'-:;\n"]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    return os.fspath(folder)
