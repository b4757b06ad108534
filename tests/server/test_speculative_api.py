"""Speculative decoding through the server: streamed chunks may carry several tokens and add up to the
non-streamed text; /metrics counts drafted and accepted tokens."""

from __future__ import annotations

import argparse

import pytest

from tandem.engine_args import add_engine_args, engine_kwargs
from tests.server.conftest import MODEL_NAME, start_server, stop_server

openai = pytest.importorskip("openai")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPT = "one two three four five six seven, one two three four five six seven, one two three four five six seven,"


@pytest.fixture(scope="module")
def spec_server():
    live = start_server(speculative_config=SPEC)
    yield live
    stop_server(live)


def test_streamed_chunks_add_up_and_metrics_count_drafts(spec_server):
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused")
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0)
    chunks = [c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stream=True) if c.choices]
    assert "".join(chunks) == whole.choices[0].text
    assert whole.usage.completion_tokens == 32
    m = spec_server.wait_idle()
    assert m["tandem_spec_decode_num_accepted_tokens"] > 0
    assert m["tandem_spec_decode_num_draft_tokens"] >= m["tandem_spec_decode_num_accepted_tokens"]
    assert m['tandem_spec_decode_num_accepted_tokens_per_pos{position="0"}'] <= m["tandem_spec_decode_num_drafts"]


def test_speculative_config_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
