"""A mixture-of-experts checkpoint served by `tandem serve`: a streamed completion gives the offline engine's tokens."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from tests.server.procs import ServeProcess

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A tiny random Qwen3-MoE with the embedded SmolLM2 tokenizer (its vocabulary size)."""
    from tandem.models.loader import default_model_path
    from tests.models.test_moe_parity import tiny_moe_config

    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    config = tiny_moe_config("qwen3_moe")
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    folder = tmp_path_factory.mktemp("moe-serve")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_moe_model_streams_through_tandem_serve(moe_folder, tmp_path):
    from tandem import LLM, SamplingParams

    prompt = "Once upon a time"
    llm = LLM(moe_folder, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    server = ServeProcess(str(tmp_path / "serve.log"), "--model", moe_folder, "--dtype", "float32")
    try:
        server.wait_healthy()
        body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": True, "temperature": 0.0}
        chunks = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        assert len(chunks) > 2, "expected a streamed response in several events"
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert text == expected
    finally:
        server.close()
