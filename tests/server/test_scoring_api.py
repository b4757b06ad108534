"""Scoring through `tandem serve`: the requests lm-evaluation-harness's local-completions model sends for
log-likelihood tasks (echo, logprobs 1, token-id prompts), on a small multiple-choice task, against transformers."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.parallel.tiny_models import save_tiny, save_tiny_tokenizer
from tests.server.procs import ServeProcess

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

# A multiple-choice task: (context, choices, index of the gold answer). lm-eval scores each choice as the
# continuation of the context and picks the one with the highest log-likelihood.
TASK = [
    ("Q: What color is the sky on a clear day?\nA:", [" blue", " green", " red", " black"], 0),
    ("Q: How many legs does a cat have?\nA:", [" two", " four", " six"], 1),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin"], 0),
    ("Paris is the capital of", [" France", " Spain", " Italy", " Peru"], 0),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-scoring"))
    save_tiny("llama", folder)
    save_tiny_tokenizer(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    server = ServeProcess(str(log), "--model", folder, "--dtype", "float32", "--served-model-name", "tiny",
                          "--max-num-batched-tokens", "48")
    try:
        server.wait_healthy()
        yield server, tok, hf
    finally:
        server.close()


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: the whole string's tokens, the context's tokens, and the rest as the continuation."""
    whole = tok.encode(context + continuation, add_special_tokens=False)
    context_ids = tok.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def hf_loglikelihood(hf, ids: list[int], ctxlen: int) -> tuple[float, bool]:
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    rows = logprobs[ctxlen - 1 : len(ids) - 1]
    target = torch.tensor(ids[ctxlen:])
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def lm_eval_payload(prompts: list[list[int]], max_tokens: int) -> dict:
    """LocalCompletionsAPI._create_payload for log-likelihood requests (tokenized prompts, a batch)."""
    return {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}


def parse_logprobs(body: dict, ctxlens: list[int], drop_last: bool) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs: the continuation's summed token_logprobs, and whether each of its
    tokens was the top-1 alternative."""
    results = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        end = -1 if drop_last else None
        token_lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        greedy = all(lp == max(top.values()) for lp, top in zip(token_lps, tops))
        results.append((sum(token_lps), greedy))
    return results


@pytest.mark.parametrize("max_tokens", [1, 0], ids=["lm-eval-max-tokens-1", "max-tokens-0"])
def test_multiple_choice_loglikelihoods_match_transformers(served, max_tokens):
    server, tok, hf = served
    prompts, ctxlens, gold, sizes = [], [], [], []
    for context, choices, answer in TASK:
        for continuation in choices:
            context_ids, continuation_ids = encode_pair(tok, context, continuation)
            prompts.append(context_ids + continuation_ids)
            ctxlens.append(len(context_ids))
        gold.append(answer)
        sizes.append(len(choices))
    r = httpx.post(f"{server.url}/v1/completions", json=lm_eval_payload(prompts, max_tokens), timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    for choice, ids in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
        assert choice["text"].startswith(tok.decode(ids))
        assert choice["finish_reason"] == "length"
    got = parse_logprobs(body, ctxlens, drop_last=max_tokens == 1)
    expected = [hf_loglikelihood(hf, ids, ctxlen) for ids, ctxlen in zip(prompts, ctxlens)]
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, expected):
        assert abs(ll - ll_ref) < 1e-4 * max(1.0, abs(ll_ref)), (ll, ll_ref)
        assert greedy == greedy_ref
    picked, picked_ref, at = [], [], 0
    for n in sizes:
        picked.append(max(range(n), key=lambda i: got[at + i][0]))
        picked_ref.append(max(range(n), key=lambda i: expected[at + i][0]))
        at += n
    assert picked == picked_ref
    accuracy = sum(p == g for p, g in zip(picked, gold)) / len(gold)
    accuracy_ref = sum(p == g for p, g in zip(picked_ref, gold)) / len(gold)
    assert accuracy == accuracy_ref


def test_echo_through_the_openai_client(served):
    server, tok, hf = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    text = "Paris is the capital of France"
    r = client.completions.create(model="tiny", prompt=[text, "The sky"], echo=True, logprobs=2, max_tokens=0,
                                  temperature=0)
    ids = tok.encode(text, add_special_tokens=False)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.text_offset == list(range(len(ids)))  # one character a token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - float(ref[j - 1, ids[j]])) < 1e-4
        assert len(lp.top_logprobs[j]) <= 2
        assert abs(max(lp.top_logprobs[j].values()) - float(ref[j - 1].max())) < 1e-4
    assert r.choices[1].text == "The sky" and r.usage.completion_tokens == 0
    # Echo with generated tokens: the prompt first, then the completion, logprobs for both.
    r = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=0, max_tokens=3, temperature=0,
                                  n=2)
    for choice in r.choices:
        assert choice.text.startswith(text) and len(choice.logprobs.token_logprobs) == len(ids) + 3
        assert choice.logprobs.text_offset[len(ids)] == len(text)


def test_prompt_logprobs_extension_and_refusals(served):
    server, tok, hf = served
    url = server.url
    ids = tok.encode("Hello there", add_special_tokens=False)
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "Hello there"}], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1},
        timeout=120)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    chat_ids = tok.encode("Hello there\n", add_special_tokens=False)
    assert plp[0] is None and len(plp) == len(chat_ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([chat_ids])).logits[0].float(), dim=-1)
    for j in range(1, len(chat_ids)):
        entry = plp[j][str(chat_ids[j])]
        assert abs(entry["logprob"] - float(ref[j - 1, chat_ids[j]])) < 1e-4
        assert entry["decoded_token"] == tok.decode([chat_ids[j]])
        assert any(e["rank"] == 1 for e in plp[j].values())
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 0,
                                                  "prompt_logprobs": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
    assert len(r.json()["choices"][0]["prompt_logprobs"]) == len(ids)
    for body, param in [({"echo": True, "stream": True}, "echo"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")]:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text
    # The server goes on.
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
