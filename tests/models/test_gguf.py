"""The embedded SmolLM2 GGUF through our loader matches transformers' own GGUF loading in fp32; GGUF metadata read
from the header alone equals the gguf package's reading."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.config import EngineConfig
from tandem.models.loader import default_model_path, load_model_and_tokenizer, model_max_len
from tests.models.gguf_files import finish_gguf
from tests.models.paged_kv import PagedKV, Seq

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smol():
    config = EngineConfig(device="cpu", dtype="float32")  # model=None: the embedded GGUF
    return load_model_and_tokenizer(config, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def hf_smol():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


def test_default_model_path_is_the_packaged_gguf():
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_tokenizer_chat_template_and_eos(smol):
    _, model_config, tokenizer = smol
    assert model_config.architecture == "llama" and model_config.num_kv_heads == 3
    assert tokenizer.eos_token_id in model_config.eos_token_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert model_max_len(model_config) == 8192
    assert model_max_len(model_config, 1024) == 1024
    with pytest.raises(ValueError):
        model_max_len(model_config, 100_000)


def test_logits_match_transformers_gguf(smol, hf_smol):
    model, model_config, tokenizer = smol
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompts = [tokenizer.encode(chat), tokenizer.encode("The quick brown fox jumps over the")]
    kv = PagedKV(model_config, num_blocks=32, block_size=16)
    step = kv.step([Seq(list(p)) for p in prompts])
    with torch.inference_mode():
        logits = model.compute_logits(model(step.input_ids, step.positions, kv.kv_cache, step.meta))
        for prompt, row in zip(prompts, logits[step.last_token_idx]):
            expected = hf_smol(torch.tensor([prompt])).logits[0, -1].float()
            torch.testing.assert_close(row, expected, atol=2e-3, rtol=1e-3)
            assert int(row.argmax()) == int(expected.argmax())


def _scalar_fields(path: str) -> dict[str, object]:
    """gguf's own reading of the file's number and string metadata (its GGUF.* entries are the header's)."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    return {k: f.contents() for k, f in fields.items()
            if not k.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}


@pytest.mark.parametrize("endian", ["little", "big"])
def test_header_metadata_equals_the_gguf_reader(tmp_path, endian):
    import gguf

    from tandem.models.gguf_weights import gguf_has_tokenizer, gguf_metadata

    path = str(tmp_path / "meta.gguf")
    order = gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "qwen2", endianess=order)
    writer.add_uint32("qwen2.block_count", 3)
    writer.add_int64("a.int64", -5)
    writer.add_float32("a.float", 0.5)
    writer.add_bool("a.bool", True)
    writer.add_string("a.before_arrays", "x")
    writer.add_array("a.strings", ["é", "", "long " * 40])
    writer.add_array("a.ints", [1, 2, 3])
    writer.add_array("a.nested", [[1, 2], [3]])
    writer.add_uint8("a.after_arrays", 7)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    finish_gguf(writer)
    expected = _scalar_fields(path)
    assert expected["a.after_arrays"] == 7 and expected["general.architecture"] == "qwen2"
    assert gguf_metadata(path, [*expected, "a.strings", "missing"]) == pytest.approx(expected)
    assert gguf_metadata(path, ["a.bool"]) == {"a.bool": True}
    assert not gguf_has_tokenizer(path)


def test_the_embedded_gguf_header(tmp_path):
    import gguf

    from tandem.models.gguf_weights import gguf_has_tokenizer, gguf_metadata, gguf_moe_config

    path = default_model_path()
    expected = _scalar_fields(path)
    assert gguf_metadata(path, expected) == pytest.approx(expected)
    assert gguf_has_tokenizer(path) and gguf_moe_config(path) == {}
    other = str(tmp_path / "other.gguf")
    writer = gguf.GGUFWriter(other, "bert")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'bert' is not supported"):
        gguf_has_tokenizer(other)


def test_skip_tokenizer_init_runs_token_ids_without_a_tokenizer():
    """skip_tokenizer_init: no tokenizer is built (a GGUF's large vocabulary can take minutes to convert), token-id
    prompts give the tokens they give with one, the outputs carry no text, and a text prompt is refused."""
    from tandem import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    for skip in (True, False):
        llm = LLM(skip_tokenizer_init=skip, max_model_len=64, device="cpu", dtype="float32")
        try:
            out = llm.generate([[1, 504, 3158, 314]], greedy, use_tqdm=False)[0].outputs[0]
            runs.append(out.token_ids)
            assert (out.text == "") == skip
            if skip:
                with pytest.raises(ValueError, match="token-id"):
                    llm.generate(["hello"], greedy, use_tqdm=False)
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
