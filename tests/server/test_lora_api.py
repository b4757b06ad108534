"""LoRA adapters over HTTP with the openai client: `--lora-modules` adapters listed with their parent, a request's
`model` picks its adapter (tokens equal transformers + peft), unknown names are 404, adapters load and unload at run
time behind the API key (400 with the reason for a bad one), and unloading lets a running request finish."""

from __future__ import annotations

import httpx
import pytest

from tests.lora.adapters import peft_greedy, save_adapter, save_base
from tests.server.conftest import MODEL_NAME, start_server, stop_server

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

KEY = "lora-test-key"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 9, 17, 33, 2, 71]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = save_base("llama", str(root / "base"))
    paths = {"all": save_adapter(base, str(root / "all"), ALL, r=8, seed=1),
             "attn": save_adapter(base, str(root / "attn"), ALL[:4], r=4, seed=2, scale=0.5)}
    live = start_server(api_key=KEY, api_settings=dict(lora_modules={"all": paths["all"]}), model=base,
                        max_model_len=128, num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    yield live, base, paths, root
    stop_server(live)


def _tokens(client, model: str, max_tokens: int = 6, prompt: list[int] = PROMPT) -> list[int]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].model_extra["token_ids"]


def test_models_list_adapters_with_their_parent(lora_server):
    live, _, paths, _ = lora_server
    cards = {m.id: m for m in live.openai().models.list().data}
    assert set(cards) == {MODEL_NAME, "all"}
    assert cards["all"].model_extra["parent"] == MODEL_NAME and cards["all"].model_extra["root"] == paths["all"]


def test_model_names_the_adapter(lora_server):
    live, base, paths, _ = lora_server
    client = live.openai()
    assert _tokens(client, "all") == peft_greedy(base, paths["all"], PROMPT, 6)
    assert client.completions.create(model="all", prompt=PROMPT, max_tokens=1).model == "all"
    assert _tokens(client, MODEL_NAME) == peft_greedy(base, None, PROMPT, 6)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _tokens(client, "nope")


def test_load_and_unload_at_run_time(lora_server):
    live, base, paths, root = lora_server
    client = live.openai()
    assert httpx.post(f"{live.url}/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": paths["attn"]},
                      timeout=30).status_code == 401  # behind the API key
    bad = live.post("/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": str(root / "nowhere")})
    assert bad.status_code == 400 and "not a folder" in bad.json()["error"]["message"]
    big = live.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": save_adapter(
        base, str(root / "big"), ["q_proj"], r=16)})
    assert big.status_code == 400 and "exceeds max_lora_rank 8" in big.json()["error"]["message"]
    r = live.post("/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": paths["attn"]})
    assert r.status_code == 200, r.text
    assert _tokens(client, "attn") == peft_greedy(base, paths["attn"], PROMPT, 6)
    # A streaming request with the adapter is running when it is unloaded: it finishes, with the adapter's tokens.
    stream = client.completions.create(model="attn", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    assert live.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 200
    rest = list(chunks)
    tokens = [t for c in [first, *rest] for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert tokens == peft_greedy(base, paths["attn"], PROMPT, 24)
    assert rest[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "attn")
    assert live.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 404
    # Loaded again: the same tokens.
    assert live.post("/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": paths["attn"]}).status_code == 200
    assert _tokens(client, "attn") == peft_greedy(base, paths["attn"], PROMPT, 6)


def test_load_in_place_serves_new_weights_from_the_same_folder(lora_server, tmp_path):
    """A training loop's update: new weights written into the adapter's folder, then loaded in place under the same
    name: the new weights answer (not the old host copy, slot or prefix-cache blocks of a prompt seen before)."""
    live, base, _, _ = lora_server
    client = live.openai()
    folder = save_adapter(base, str(tmp_path / "rl"), ALL, r=8, seed=11)
    prompt = PROMPT * 7  # 42 tokens: two full KV blocks the prefix cache keeps
    assert live.post("/v1/load_lora_adapter", json={"lora_name": "rl", "lora_path": folder}).status_code == 200
    before = _tokens(client, "rl", prompt=prompt)
    assert before == peft_greedy(base, folder, prompt, 6)
    save_adapter(base, folder, ALL, r=8, seed=12)
    again = live.post("/v1/load_lora_adapter", json={"lora_name": "rl", "lora_path": folder})
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    r = live.post("/v1/load_lora_adapter", json={"lora_name": "rl", "lora_path": folder, "load_inplace": True})
    assert r.status_code == 200, r.text
    after = _tokens(client, "rl", prompt=prompt)
    assert after == peft_greedy(base, folder, prompt, 6) != before
    assert live.post("/v1/unload_lora_adapter", json={"lora_name": "rl"}).status_code == 200


def test_lora_modules_flag_parsing():
    from tandem.server.launcher import lora_modules_from_args

    assert lora_modules_from_args(["a=/x", "b=/y=z"], True) == {"a": "/x", "b": "/y=z"}
    # vLLM's JSON form, its base_model_name one of the served model's names
    assert lora_modules_from_args(['{"name": "c", "path": "/c", "base_model_name": "m"}', "d=/d"], True,
                                  ["m", "/models/m"]) == {"c": "/c", "d": "/d"}
    for items, enabled, reason in ((["a=/x"], False, "needs --enable-lora"), (["a"], True, "NAME=PATH"),
                                   (["a=/x", "a=/y"], True, "twice"), (['{"name": "a"'], True, "not JSON"),
                                   (['{"name": "a", "path": "/x", "rank": 8}'], True, "NAME=PATH"),
                                   (['{"name": "a", "path": "/x", "base_model_name": "other"}'], True,
                                    "base_model_name 'other' is not a name of the served model")):
        with pytest.raises(ValueError, match=reason):
            lora_modules_from_args(items, enabled, ["m"])
