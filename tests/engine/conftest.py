"""Shared engine fixtures: one embedded-model LLM and one transformers reference for the whole session."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def llm():
    from tandem import LLM

    # A small KV pool keeps CPU memory low; 512 blocks x 16 tokens is plenty for these tests.
    return LLM(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=32, num_kv_blocks=512, seed=0)


@pytest.fixture(scope="session")
def hf_model():
    from transformers import AutoModelForCausalLM

    from tandem.models.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture
def idle_llm(llm):
    """The shared LLM, checked to be idle with every KV block back in the pool after the test."""
    engine = llm.engine
    free_before = engine.scheduler.num_free_blocks()
    overlap_before = engine.overlap
    yield llm
    engine.overlap = overlap_before
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks() == free_before, "KV blocks leaked"
