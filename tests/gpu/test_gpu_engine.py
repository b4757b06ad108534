"""The engine on a GPU, end to end: graph replay vs eager for every batch size, parity with transformers per
architecture, overlap vs sync, a long mixed workload that returns every block, and a step() that returns
before the GPU is done.

Tiny random checkpoints are written with save_pretrained on the spot (no file outside the repository is
needed); the asynchronous-step test uses random weights of a named shape. Two greedy runs whose batches
differ in shape may differ in the last bits (cuBLAS picks kernels per batch size), so `assert_same_greedy`
accepts a different token only where both runs saw a near-tie, and nowhere else.
"""

from __future__ import annotations

import collections
import gc
import random
import statistics
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU tests need CUDA", allow_module_level=True)

transformers = pytest.importorskip("transformers")

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from tandem.request import FinishReason  # noqa: E402

DEVICE = "cuda"  # without an index, as users pass it
DTYPE = "bfloat16"
VOCAB = 512
NEAR_TIE = 0.02  # log-prob gap under which two numerically different runs may pick different greedy tokens

COMMON = dict(vocab_size=VOCAB, initializer_range=0.05, bos_token_id=1, eos_token_id=2)
TINY = {
    # GQA (4 query heads, 2 kv heads), head_dim 64, separate lm_head.
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
    # 8 kv heads (MHA), head_dim 64: many decode programs per row, so KV splits depend on the batch size.
    "llama-mha8": lambda: transformers.LlamaConfig(
        **COMMON, hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=False),
    # qkv bias, head_dim 128, tied embeddings.
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True),
    # q/k norm, head_dim 128 decoupled from hidden_size, tied embeddings.
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=2048, tie_word_embeddings=True),
    # learned positions, LayerNorm, gelu_new, head_dim 64.
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=1024, n_embd=256, n_layer=2, n_head=4, initializer_range=0.05,
        bos_token_id=1, eos_token_id=2),
}

# Per request: greedy tokens and, per token, {token id: logprob} (the chosen token and the top alternatives).
Run = list[tuple[list[int], list[dict[int, float]]]]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """arch -> folder of a tiny random bf16 checkpoint (config.json + model.safetensors), built on first use."""
    folders: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in folders:
            torch.manual_seed(sorted(TINY).index(arch))
            model = transformers.AutoModelForCausalLM.from_config(TINY[arch]())
            folder = tmp_path_factory.mktemp(arch)
            model.to(torch.bfloat16).save_pretrained(folder)
            folders[arch] = str(folder)
        return folders[arch]

    return get


def make_llm(folder: str, **overrides) -> LLM:
    # num_kv_blocks is always explicit: sizing from free memory would take 90% of the GPU per LLM.
    kwargs = dict(model=folder, dtype=DTYPE, device=DEVICE, max_model_len=512, max_num_seqs=8, num_kv_blocks=256,
                  seed=0)
    kwargs.update(overrides)
    return LLM(**kwargs)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def greedy(max_tokens: int, logprobs: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def generate(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> Run:
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same_greedy(ref: Run, got: Run, label: str, max_diverging: int | None = None,
                       max_lp_gap: float = 0.1) -> None:
    """Same lengths; same tokens up to each request's first difference, which must sit on a near-tie.

    The tie tolerance grows with the log-prob disagreement the two runs show where they still agree (at most
    max_lp_gap), so bitwise-identical runs admit only tiny gaps and a real bug (a wrong carried token, a
    corrupted padding row, stale KV) shows up as a difference at a position where one token clearly won.
    """
    assert len(ref) == len(got)
    max_lp_diff, firsts = 0.0, []
    for i, ((ref_tokens, ref_lps), (tokens, lps)) in enumerate(zip(ref, got)):
        assert len(tokens) == len(ref_tokens), f"{label}: request {i} has {len(tokens)} tokens, not {len(ref_tokens)}"
        for j, (a, b) in enumerate(zip(ref_tokens, tokens)):
            if a != b:
                firsts.append((i, j, a, b, ref_lps[j], lps[j]))
                break
            common = ref_lps[j].keys() & lps[j].keys()
            max_lp_diff = max([max_lp_diff] + [abs(ref_lps[j][t] - lps[j][t]) for t in common])
    assert max_lp_diff < max_lp_gap, f"{label}: log-probs of identical prefixes differ by {max_lp_diff:.4f}"
    tol = max(NEAR_TIE, 4 * max_lp_diff)
    for i, j, a, b, ra, rb in firsts:
        gap_ref = ra[a] - ra.get(b, min(ra.values()))
        gap_got = rb[b] - rb.get(a, min(rb.values()))
        assert gap_ref <= tol and gap_got <= tol, (
            f"{label}: request {i} diverges at output token {j} ({a} vs {b}) where the choice was clear "
            f"(gaps {gap_ref:.4f} / {gap_got:.4f} > {tol:.4f}); ref top {sorted(ra.items(), key=lambda kv: -kv[1])}, "
            f"got top {sorted(rb.items(), key=lambda kv: -kv[1])}"
        )
    most = max(2, len(ref) // 2) if max_diverging is None else max_diverging
    assert len(firsts) <= most, f"{label}: {len(firsts)} of {len(ref)} requests diverge on near-ties"


def to_dicts(token_ids: list[int], logprobs) -> list[dict[int, float]]:  # type: ignore[no-untyped-def]
    """EngineOutput logprobs [(chosen, [(id, lp), ...])] -> the {id: lp} form generate() returns."""
    out = []
    for tok, (chosen, top) in zip(token_ids, logprobs):
        entry = dict(top)
        entry[tok] = chosen
        out.append(entry)
    return out


# ----------------------------------------------------------------------------- (b) graphs vs eager

GRAPH_CASES = {
    "llama-gqa": ("llama", 12, 512),  # arch, max_num_seqs, max_model_len
    "qwen3-hd128": ("qwen3", 10, 512),
    # 8 kv heads x up to 72 rows: on a ~132-SM GPU the largest graph gets 1 KV split and the smaller ones 2, so
    # the smaller graphs need Triton variants (split kernel + reduce) that a warm-up at the largest size never
    # compiled. Run first in the file so no earlier test has compiled them.
    "mha8-splits": ("llama-mha8", 72, 1024),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case,kv_cache_dtype", [("mha8-splits", "auto"), ("llama-gqa", "auto"),
                                                 ("qwen3-hd128", "auto"), ("llama-gqa", "fp8"),
                                                 ("qwen3-hd128", "fp8")])
def test_graph_replay_equals_eager_for_every_batch_size(case, kv_cache_dtype, checkpoint):
    arch, max_num_seqs, max_model_len = GRAPH_CASES[case]
    llm = make_llm(checkpoint(arch), max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                   num_kv_blocks=8 * max_num_seqs + 8, kv_cache_dtype=kv_cache_dtype)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.batch_sizes[-1] == max_num_seqs
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randint(4, 24)) for _ in range(max_num_seqs)]
    # Request i stops after 2 + i tokens, so decode batches shrink by one per step from max_num_seqs to 1:
    # every batch size, every amount of padding, and the carry-over in each graph.
    lengths = [2 + i for i in range(max_num_seqs)]

    replays: collections.Counter[int] = collections.Counter()

    def counting_replay(slot: int, batch_size: int) -> torch.Tensor:
        replays[batch_size] += 1
        return type(graphs).replay(graphs, slot, batch_size)

    graphs.replay = counting_replay  # instance attribute shadows the method
    try:
        with_graphs = generate(llm, prompts, lengths)
    finally:
        del graphs.replay
    assert set(replays) == set(graphs.batch_sizes), f"graphs never replayed: {set(graphs.batch_sizes) - set(replays)}"

    engine.scheduler.reset_prefix_cache()  # the eager pass computes the same prefills, not prefix hits
    runner.graphs = None
    try:
        eager = generate(llm, prompts, lengths)
    finally:
        runner.graphs = graphs
    assert_same_greedy(eager, with_graphs, f"graphs vs eager ({case})")
    assert engine.scheduler.num_free_blocks() == runner.num_blocks - 1


@pytest.mark.gpu
@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "auto"), ("gpt2", "auto"), ("qwen3", "auto"),
                                                 ("llama", "fp8")])
def test_piecewise_graphs_equal_eager_on_mixed_steps(arch, kv_cache_dtype, checkpoint):
    """Steps that mix prefills (whole prompts and chunks) into the decodes: the piecewise graphs (pieces captured
    per token bucket, attention launched between them) give the tokens of the eager forward, over many buckets
    and amounts of padding, and return every block (also with an FP8 KV cache)."""
    llm = make_llm(checkpoint(arch), max_num_seqs=16, max_num_batched_tokens=160, num_kv_blocks=400,
                   kv_cache_dtype=kv_cache_dtype)
    engine, runner = llm.engine, llm.engine.runner
    pieces = runner.piecewise
    assert pieces is not None and pieces.sizes[-1] == 160
    assert all(len(p) == len(pieces.layers) + 1 for p in pieces.pieces.values())
    rng = random.Random(5)
    prompts = [random_prompt(rng, rng.choice([2, 3, 7, 20, 45, 90, 130, 200])) for _ in range(48)]
    lengths = [rng.randint(1, 30) for _ in range(48)]

    buckets: collections.Counter[int] = collections.Counter()

    def counting_replay(slot, num_tokens, padded, meta):  # type: ignore[no-untyped-def]
        assert num_tokens <= padded and meta.max_query_len > 1
        buckets[padded] += 1
        return type(pieces).replay(pieces, slot, num_tokens, padded, meta)

    pieces.replay = counting_replay  # instance attribute shadows the method
    engine.step_log = []
    try:
        with_pieces = generate(llm, prompts, lengths)
    finally:
        del pieces.replay
    steps, engine.step_log = engine.step_log, None
    mixed = [n for seqs, n, _ in steps if n != seqs]
    assert sum(buckets.values()) == len(mixed), "a mixed step did not run the piecewise graphs"
    assert len(buckets) >= 5, f"too few token buckets exercised: {dict(buckets)}"

    engine.scheduler.reset_prefix_cache()
    runner.piecewise = None
    try:
        eager = generate(llm, prompts, lengths)
    finally:
        runner.piecewise = pieces
    assert_same_greedy(eager, with_pieces, f"piecewise graphs vs eager ({arch})")
    assert engine.scheduler.num_free_blocks() == runner.num_blocks - 1


@pytest.mark.gpu
@pytest.mark.parametrize("arch,quantization", [("llama", None), ("qwen3", None), ("gpt2", None), ("llama", "fp8")])
def test_programmatic_dependent_launch_gives_the_tokens_of_plain_launches(arch, quantization, checkpoint, monkeypatch):
    """Triton kernels launched with PDL (each may start while the previous kernel still runs, and waits for
    it in-kernel) compute exactly what plainly launched ones do: the same greedy tokens and log-probs, bit for
    bit, through decode graphs of every batch size (the GEMV at 1-4 rows), piecewise mixed steps and prefills."""
    from tandem.kernels.triton_launch import use_pdl

    if not use_pdl(torch.device("cuda")):
        pytest.skip("PDL needs compute capability >= 9.0")
    rng = random.Random(11)
    prompts = [random_prompt(rng, rng.choice([3, 9, 40, 120])) for _ in range(12)]
    lengths = [2 + 3 * i for i in range(12)]
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("TANDEM_PDL", pdl)
        llm = make_llm(checkpoint(arch), max_num_seqs=12, max_num_batched_tokens=256, quantization=quantization)
        runs[pdl] = generate(llm, prompts, lengths)
        assert llm.engine.scheduler.num_free_blocks() == llm.engine.runner.num_blocks - 1
        llm.shutdown()
        del llm
        gc.collect()
    assert runs["1"] == runs["0"]


@pytest.mark.gpu
@pytest.mark.parametrize("piecewise_max_tokens", [0, None], ids=["eager", "piecewise"])
def test_mixed_steps_compile_no_attention_kernel_after_startup(piecewise_max_tokens, checkpoint):
    """The runner compiles a mixed step's attention variants before the first request: prefills admitted behind
    any number of decodes, at any context length, run without compiling a Triton kernel mid-step, whether the
    attention runs in an eager forward or between piecewise graphs."""
    import tandem.kernels.triton_attention as attention

    kernels = (attention._decode_split_kernel, attention._prefill_kernel)

    def compiled() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    llm = make_llm(checkpoint("llama"), max_num_seqs=24, max_num_batched_tokens=96,
                   piecewise_max_tokens=piecewise_max_tokens, num_kv_blocks=400)
    before = compiled()
    rng = random.Random(3)
    prompts = [random_prompt(rng, rng.choice([1, 5, 33, 150, 300])) for _ in range(40)]
    llm.engine.step_log = []
    generate(llm, prompts, [rng.randint(2, 40) for _ in prompts])
    steps, llm.engine.step_log = llm.engine.step_log, None
    assert sum(1 for seqs, tokens, _ in steps if tokens != seqs and seqs > 1) >= 5  # mixed steps ran
    assert compiled() == before


# ----------------------------------------------------------------------------- (a) parity with transformers


def load_hf(folder: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(DEVICE).eval()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return model(torch.tensor([ids], device=DEVICE)).logits[0].float()  # [len(ids), vocab]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def paged_forward(runner, seqs: list[list[int]], starts: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Computes positions [starts[i], len(seqs[i])) of every sequence in one step of the runner's model on its
    KV cache (sequence i owns a contiguous run of blocks from block 1 on; earlier positions must already be
    cached) and returns the last position's logits, [num_seqs, vocab] float32."""
    dev, bs = runner.kv_cache.device, runner.block_size
    per_seq = runner.max_blocks_per_seq  # fixed, so a sequence's blocks stay put from one call to the next
    assert 1 + len(seqs) * per_seq <= runner.num_blocks and max(map(len, seqs)) <= per_seq * bs
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    block_tables = torch.zeros(len(seqs), runner.max_blocks_per_seq, dtype=torch.int32)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        blocks = [1 + i * per_seq + j for j in range(per_seq)]
        block_tables[i, :per_seq] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(start, len(seq)):
            ids.append(seq[p])
            positions.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
        qsl.append(len(ids))
        seq_lens.append(len(seq))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=block_tables.to(dev),
        max_query_len=max(len(s) - st for s, st in zip(seqs, starts)),
        max_seq_len=max(seq_lens),
    )
    model = runner.model
    hidden = model(torch.tensor(ids, dtype=torch.int32, device=dev), torch.tensor(positions, dtype=torch.int32,
                   device=dev), runner.kv_cache, meta)
    logits = model.compute_logits(hidden[torch.tensor(qsl[1:], device=dev) - 1])
    torch.cuda.synchronize()  # this ran on the default stream; the engine's streams touch the same KV later
    return logits


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "qwen3"])
def test_logits_and_greedy_tokens_match_transformers(arch, checkpoint, record_property):
    folder = checkpoint(arch)
    llm = make_llm(folder, max_num_seqs=4)
    runner = llm.engine.runner
    hf32, hf16 = load_hf(folder, torch.float32), load_hf(folder, torch.bfloat16)  # fp32 is the reference
    rng = random.Random(2)
    seqs = [random_prompt(rng, n) for n in (7, 33, 100)]
    worst = 0.0

    def check(what: str, got: torch.Tensor) -> None:
        nonlocal worst
        for i, seq in enumerate(seqs):
            ref = hf_logits(hf32, seq)[-1]
            err, err_hf16 = relative_error(got[i], ref), relative_error(hf_logits(hf16, seq)[-1], ref)
            worst = max(worst, err)
            assert err < max(2e-2, 2 * err_hf16), (
                f"{arch} {what}, sequence {i} ({len(seq)} tokens): relative logit error {err:.4f} vs transformers "
                f"fp32 (transformers bf16 itself: {err_hf16:.4f})")

    check("varlen prefill", paged_forward(runner, seqs, [0] * len(seqs)))
    for step in range(3):  # one new token per sequence: the decode kernel over the cached context
        for seq in seqs:
            seq.append(int(hf_logits(hf32, seq)[-1].argmax()))
        check(f"decode step {step}", paged_forward(runner, seqs, [len(s) - 1 for s in seqs]))
    # Several new tokens after cached ones: the prefill kernel's prefix-hit / chunked-prefill path.
    check("chunk over cached context", paged_forward(runner, seqs, [len(s) - 5 for s in seqs]))
    record_property("max_relative_logit_error", round(worst, 5))

    # The engine path (scheduler, CUDA graphs, carry-over, GPU sampler), teacher-forced against transformers.
    prompts = [random_prompt(rng, n) for n in (5, 17, 64, 130)]
    for prompt, (tokens, lps) in zip(prompts, generate(llm, prompts, [8] * len(prompts))):
        logits = hf_logits(hf32, prompt + tokens)[len(prompt) - 1 : -1]  # row j predicts tokens[j]
        logprobs = logits.log_softmax(-1)
        for j, tok in enumerate(tokens):
            best = int(logits[j].argmax())
            gap = float(logprobs[j, best] - logprobs[j, tok])
            tol = max(NEAR_TIE, 0.06 * float(logits[j].pow(2).mean().sqrt()))
            assert gap <= tol, f"{arch}: output {j} is {tok}, transformers prefers {best} by {gap:.4f} > {tol:.4f}"
            assert abs(lps[j][tok] - float(logprobs[j, tok])) < 0.1, f"{arch}: logprob of output token {j} is off"
    assert llm.engine.scheduler.num_free_blocks() == runner.num_blocks - 1


# ----------------------------------------------------------------------------- (c) overlap vs sync


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_overlap_and_sync_give_the_same_greedy_tokens(kv_cache_dtype, checkpoint):
    llm = make_llm(checkpoint("llama"), max_num_seqs=8, max_num_batched_tokens=96, num_kv_blocks=256,
                   kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    rng = random.Random(3)
    shared = random_prompt(rng, 70)
    prompts, lengths = [], []
    for i in range(24):
        own = random_prompt(rng, rng.choice([1, 2, 3, 15, 16, 17, 64, 150, 250]))
        prompts.append((shared if i % 3 == 0 else []) + own)
        lengths.append(rng.choice([1, 2, 5, 16, 40]))
    runs = {}
    try:
        for overlap in (False, True):
            engine.overlap = overlap
            engine.scheduler.reset_prefix_cache()
            engine.step_log = []
            runs[overlap] = generate(llm, prompts, lengths)
            steps, engine.step_log = engine.step_log, None
            assert not engine.has_unfinished_requests()
            assert engine.scheduler.num_free_blocks() == engine.runner.num_blocks - 1
            assert max(num_tokens for _, num_tokens, _ in steps) <= 96
            assert any(num_seqs == num_tokens for num_seqs, num_tokens, _ in steps), "no decode-only step"
    finally:
        engine.overlap = llm.config.overlap
    assert_same_greedy(runs[False], runs[True], "overlap vs sync")


# ----------------------------------------------------------------------------- (d) long mixed workload

MIXED = dict(max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=48)  # 47 usable blocks: preemption
ABORTS = [(2, "waiting"), (4, "prefilling"), (10, "decoding"), (25, "decoding"), (31, "prefilling")]
ABORT_ON_ARRIVAL = "r33"


def mixed_requests() -> list[tuple[str, list[int], SamplingParams, int]]:
    """(id, prompt, params, arrival step): three shared-prefix families (prefix hits), prompts longer than the
    64-token step budget (chunked prefill), more KV than the pool holds (preemption), late arrivals."""
    rng = random.Random(4)
    families = [random_prompt(rng, n) for n in (48, 80, 33)]
    out = []
    for i in range(36):
        prompt = (families[i % 4] if i % 4 < 3 else []) + random_prompt(rng, rng.randint(1, 60))
        sampled = i % 11 == 5
        params = SamplingParams(temperature=0.8 if sampled else 0.0, top_k=20 if sampled else 0,
                                top_p=0.9 if sampled else 1.0, seed=i if sampled else None,
                                max_tokens=rng.randint(1, 48), ignore_eos=True, logprobs=2)
        arrival = 0 if i < 20 else 6 if i < 26 else 15 if i < 31 else 30
        out.append((f"r{i}", prompt, params, arrival))
    return out


@pytest.fixture(scope="module")
def mixed_reference(checkpoint) -> dict[str, tuple[list[int], list[dict[int, float]]]]:
    """Greedy outputs of the mixed workload on an engine without pressure: big pool, no chunks, no prefix cache."""
    llm = make_llm(checkpoint("llama"), max_num_seqs=36, num_kv_blocks=36 * 12 + 8, enable_prefix_caching=False)
    reqs = [r for r in mixed_requests() if r[2].temperature == 0.0]
    outs = llm.generate([r[1] for r in reqs], [r[2] for r in reqs], use_tqdm=False)
    result = {r[0]: (o.outputs[0].token_ids, o.outputs[0].logprobs) for r, o in zip(reqs, outs)}
    del llm, outs
    gc.collect()
    return result


def pick_victim(scheduler, kind: str, taken: set[str]) -> str | None:  # type: ignore[no-untyped-def]
    if kind == "waiting":
        pool = list(scheduler.waiting)
    elif kind == "prefilling":
        pool = [r for r in scheduler.running if r.num_computed_tokens < r.num_prompt_tokens]
    else:
        pool = [r for r in scheduler.running if r.num_output_tokens > 0]
    return next((r.request_id for r in pool if r.request_id not in taken), None)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_long_mixed_workload_finishes_everything_and_returns_every_block(overlap, checkpoint, mixed_reference):
    llm = make_llm(checkpoint("llama"), overlap=overlap, **MIXED)
    engine, sched = llm.engine, llm.engine.scheduler
    reqs = mixed_requests()
    arrivals = collections.deque(sorted(reqs, key=lambda r: r[3]))
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    logprobs: dict[str, list] = collections.defaultdict(list)
    finished: dict[str, FinishReason | None] = {}
    aborted: set[str] = set()
    aborts_left = list(ABORTS)
    engine.step_log = []
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][3] <= step:
            rid, prompt, p, _ = arrivals.popleft()
            engine.add_request(rid, prompt, p)
            if rid == ABORT_ON_ARRIVAL:
                engine.abort_request(rid)
                aborted.add(rid)
        for planned in [a for a in aborts_left if a[0] <= step]:
            victim = pick_victim(sched, planned[1], aborted)
            if victim is not None:  # else try again next step
                engine.abort_request(victim)  # possibly while a step that holds it is in flight
                aborted.add(victim)
                aborts_left.remove(planned)
        for out in engine.step():
            rid = out.request_id
            assert out.error is None, out.error
            assert rid not in aborted, f"{rid}: output after its abort"
            assert rid not in finished, f"{rid}: output after it finished"
            tokens[rid] += out.new_token_ids
            logprobs[rid] += out.new_logprobs or []
            if out.finished:
                finished[rid] = out.finish_reason
        step += 1
        assert step < 5000, "the workload does not finish"
    steps, engine.step_log = engine.step_log, None

    assert not aborts_left, f"aborts never found a victim: {aborts_left}"
    for rid, prompt, p, _ in reqs:
        if rid in aborted:
            continue
        assert finished.get(rid) == FinishReason.LENGTH, f"{rid}: finish reason {finished.get(rid)}"
        assert len(tokens[rid]) == p.max_tokens, f"{rid}: {len(tokens[rid])} tokens, expected {p.max_tokens}"
    assert sched.num_free_blocks() == engine.runner.num_blocks - 1, "KV blocks leaked"
    sched.kv_cache_manager.check_invariants()
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the workload never preempted"
    assert stats.prefix_cache_hit_rate > 0, "the workload never hit the prefix cache"
    assert max(n for _, n, _ in steps) <= MIXED["max_num_batched_tokens"]
    assert any(len(prompt) > MIXED["max_num_batched_tokens"] and rid not in aborted for rid, prompt, _, _ in reqs)

    kept = [rid for rid in mixed_reference if rid not in aborted]
    got = [(tokens[rid], to_dicts(tokens[rid], logprobs[rid])) for rid in kept]
    mode = "overlap" if overlap else "sync"
    assert_same_greedy([mixed_reference[rid] for rid in kept], got, f"mixed workload ({mode}) vs an unpressured engine")


# ----------------------------------------------------------------------------- (e) step() returns before the GPU


@pytest.mark.gpu
def test_overlap_step_returns_while_the_gpu_still_computes(record_property):
    """Llama-3.2-1B shape, random weights, 32 sequences: after step() returns in overlap mode the step it just
    launched is still running on the GPU (its d2h_done has not fired and its compute ends after the return),
    and the timeline reports more GPU-busy time than in sync mode."""
    num_seqs = 32
    llm = LLM(model="llama-3.2-1b", load_format="dummy", dtype=DTYPE, device=DEVICE, max_model_len=256,
              max_num_seqs=num_seqs, num_kv_blocks=num_seqs * 16 + 8)
    engine = llm.engine
    rng = random.Random(5)
    prompts = [[rng.randrange(1000, 100000) for _ in range(64)] for _ in range(num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    busy = {}
    try:
        for overlap in (False, True):
            engine.overlap = overlap
            engine.scheduler.reset_prefix_cache()
            assert engine._inflight is None  # start_timeline must not meet a step launched without timing events
            timeline = engine.start_timeline()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{overlap}-{i}", prompt, params)
            step_seconds, gpu_seconds = [], []
            decode_steps = still_running = returned_early = 0
            previous = None  # (handle launched by the previous step(), when that step() returned)
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                returned = time.perf_counter()
                step_seconds.append(returned - start)
                if not overlap:
                    assert engine._inflight is None
                    continue
                if previous is not None:  # waited for by the step() just made; its slot is not reused yet
                    handle, returned_at = previous
                    spans = handle.events.gpu_spans(engine._timeline_base)
                    gpu_start, gpu_end = spans[0][1], spans[-1][2]
                    gpu_seconds.append(gpu_end - gpu_start)
                    if handle.plan.graph_bs is not None:
                        returned_early += returned_at < gpu_end
                handle = engine._inflight
                previous = (handle, returned) if handle is not None else None
                if handle is not None and handle.plan.graph_bs is not None:
                    decode_steps += 1
                    still_running += not handle.events.d2h_done.query()
            engine.stop_timeline()
            busy[overlap] = timeline.gpu_busy_pct()
            assert 0.0 < busy[overlap] <= 100.0
            assert sum(1 for s in timeline.spans if s.lane == "gpu") >= len(step_seconds) - 2
            name = "overlap" if overlap else "sync"
            record_property(f"gpu_busy_pct_{name}", round(busy[overlap], 2))
            record_property(f"step_ms_median_{name}", round(1e3 * statistics.median(step_seconds), 3))
            if overlap:
                record_property("gpu_step_ms_median_overlap", round(1e3 * statistics.median(gpu_seconds), 3))
                assert decode_steps >= 80
                assert still_running >= 0.7 * decode_steps, (
                    f"only {still_running} of {decode_steps} decode steps were still on the GPU when step() returned")
                assert returned_early >= 0.7 * decode_steps, (
                    f"step() returned before the GPU finished only {returned_early} of {decode_steps} decode steps")
    finally:
        engine.overlap = llm.config.overlap
    assert busy[True] > busy[False], f"GPU busy: overlap {busy[True]:.1f}% vs sync {busy[False]:.1f}%"
