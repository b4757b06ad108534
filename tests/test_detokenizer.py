"""IncrementalDetokenizer against the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from tandem.detokenizer import IncrementalDetokenizer
from tandem.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "héllo wörld — naïve café, 1 + 2 = 3",
    "emoji 😀🎉👍🏽 and family 👨‍👩‍👧‍👦 done",
    "中文测试：你好，世界！日本語のテキスト。한국어 문장.",
    "mixed 😀中文 ASCII ∑∫√ ελληνικά кириллица\n\ttabs  and   spaces",
    "  leading spaces and trailing  ",
]
PROMPT = "Write something:"


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None):
    """Feeds the ids in chunks; returns (deltas, stop)."""
    deltas: list[str] = []
    stop = None
    i, k = 0, 0
    while i < len(token_ids):
        size = 1 if chunk_sizes is None else chunk_sizes[k % len(chunk_sizes)]
        delta, stop = detok.update(token_ids[i:i + size])
        deltas.append(delta)
        i, k = i + size, k + 1
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.flush())
    return deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_one_token_at_a_time_equals_full_decode(smol_tokenizer, text, skip_special):
    tok = smol_tokenizer
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), SamplingParams(skip_special_tokens=skip_special))
    deltas, stop = stream(detok, ids)
    expected = tok.decode(ids, skip_special_tokens=skip_special)
    assert stop is None
    assert "".join(deltas) == expected
    assert detok.text == expected
    assert all("\ufffd" not in d for d in deltas), deltas
    assert ("<|im_end|>" in expected) is (not skip_special)


@pytest.mark.parametrize("text", TEXTS)
def test_chunked_updates_equal_full_decode(smol_tokenizer, text):
    tok = smol_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    for sizes in ([2], [3, 1], [5], [len(ids)]):
        detok = IncrementalDetokenizer(tok, [], SamplingParams())
        deltas, _ = stream(detok, ids, sizes)
        assert "".join(deltas) == tok.decode(ids)
        assert all("\ufffd" not in d for d in deltas)


def test_multibyte_char_is_held_until_complete(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("世", add_special_tokens=False)
    assert len(ids) > 1, "the test needs a character split over several byte tokens"
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for token_id in ids[:-1]:
        assert detok.update([token_id]) == ("", None)
    assert detok.update([ids[-1]]) == ("世", None)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=40),
       chunk=st.integers(min_value=1, max_value=4), skip=st.booleans())
def test_random_token_ids_reassemble(smol_tokenizer, ids, chunk, skip):
    """Even invalid byte sequences reassemble to the full decode (U+FFFD where the bytes are invalid)."""
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
    deltas, _ = stream(detok, ids, [chunk])
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_split_across_tokens(smol_tokenizer):
    tok = smol_tokenizer
    text = "The answer is forty-two. END OF STORY and more text after"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END OF STORY"]))
    deltas, stop = stream(detok, ids)
    assert stop == "END OF STORY"
    assert "".join(deltas) == "The answer is forty-two. "
    assert detok.text == "The answer is forty-two. "
    assert all("END" not in d for d in deltas)
    # Tokens after the one completing the stop string are not consumed.
    consumed = ids[:detok.num_output_tokens]
    assert "END OF STORY" in tok.decode(consumed)
    assert "END OF STORY" not in tok.decode(consumed[:-1])
    assert detok.update(ids[-2:]) == ("", "END OF STORY")
    assert detok.flush() == ""


def test_include_stop_str_in_output(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["three"], include_stop_str_in_output=True))
    deltas, stop = stream(detok, ids)
    assert stop == "three"
    assert "".join(deltas) == "one two three"


def test_earliest_stop_wins_and_inside_one_token(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["delta", "et"]))
    deltas, stop = stream(detok, ids)
    assert stop == "et"  # in the middle of the token " beta"
    assert "".join(deltas) == "alpha b"


def test_partial_stop_prefix_is_held_then_released(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["<END>"]))
    out = []
    for piece in ["Hello <", "EN", "D is not <END", "X", " really"]:
        ids = tok.encode(piece, add_special_tokens=False)
        delta, stop = detok.update(ids)
        assert stop is None
        out.append(delta)
    assert not "".join(out).endswith("<")
    out.append(detok.flush())
    assert "".join(out) == "Hello <END is not <ENDX really"


def test_held_stop_prefix_flushed_at_finish(smol_tokenizer):
    tok = smol_tokenizer
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["###"]))
    delta, _ = detok.update(tok.encode("text ##", add_special_tokens=False))
    assert delta == "text "
    assert detok.text == "text ##"
    assert detok.flush() == "##"


def test_unicode_stop_string(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("你好，世界！再见", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["世界"]))
    deltas, stop = stream(detok, ids)
    assert stop == "世界"
    assert "".join(deltas) == "你好，"
    assert all("\ufffd" not in d for d in deltas)


def test_leading_space_of_first_output_token_kept(smol_tokenizer):
    tok = smol_tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    full = tok.encode("The capital of France is Paris", add_special_tokens=False)
    assert full[:len(prompt)] == prompt
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    deltas, _ = stream(detok, full[len(prompt):])
    assert "".join(deltas) == " Paris"


def test_prompt_ending_inside_a_character(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("ab世界", add_special_tokens=False)
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, ids[:split], SamplingParams())
    deltas, _ = stream(detok, ids[split:])
    assert "".join(deltas) == tok.decode(ids[split:])


def test_long_random_stream_with_stops(smol_tokenizer):
    """Random texts with a stop string inserted: output equals the text before the first stop."""
    tok = smol_tokenizer
    rng = random.Random(0)
    words = ["foo", "bar", "😀", "中文", "STOP", "ST", "OP", " ", "\n", "é"]
    for _ in range(30):
        text = "".join(rng.choice(words) for _ in range(30))
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
        deltas, stop = stream(detok, ids, [rng.randint(1, 3)])
        full = tok.decode(ids)
        expected = full.split("STOP")[0]
        assert "".join(deltas) == expected
        assert stop == ("STOP" if "STOP" in full else None)
