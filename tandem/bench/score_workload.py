"""The `score` workload: the same prompts scored (prompt_logprobs=1, no new token) and prefilled with one new token
each, on one engine in one run; prompt tokens/s of both and their ratio."""

from __future__ import annotations

import time
from typing import Any


def run_pass(llm: Any, prompts: list[list[int]], score: bool) -> dict[str, Any]:
    from tandem.sampling_params import SamplingParams

    params = (SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1) if score
              else SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    steps0 = llm.engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_prompt = sum(len(p) for p in prompts)
    if score:  # every prompt token past the first got its score
        scored = sum(len(o.prompt_logprobs or ()) - 1 for o in outs)
        if scored != num_prompt - len(prompts):
            raise RuntimeError(f"scored {scored} prompt tokens, expected {num_prompt - len(prompts)}")
    return {"pass": "score" if score else "prefill", "seconds": seconds, "prompt_tokens": num_prompt,
            "tokens_per_s": num_prompt / seconds, "num_steps": llm.engine.num_steps - steps0,
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def run_score_workload(model: str | None, num_requests: int, prompt_len: int, repeats: int = 2) -> dict[str, Any]:
    """Prefill and score passes, alternated `repeats` times after a warm-up, best of each. The prefix cache is off:
    the passes share their prompts, and a scoring request never takes cache hits anyway."""
    import torch

    from tandem import LLM
    from tandem.bench.workloads import Workload, make_requests

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(max_model_len=prompt_len + 16, enable_prefix_caching=False)
    if model is not None:
        kwargs.update(model=model, load_format="dummy")
    if not cuda:
        kwargs.update(device="cpu", dtype="float32")
    llm = LLM(**kwargs)
    w = Workload("score", model, num_requests, (prompt_len, prompt_len), (1, 1))
    prompts = [p for p, _ in make_requests(w, llm.engine.model_config.vocab_size)]
    warm = prompts[: min(len(prompts), 16)]
    run_pass(llm, warm, score=False)
    run_pass(llm, warm, score=True)
    rows = []
    for _ in range(repeats):
        rows.append(run_pass(llm, prompts, score=False))
        rows.append(run_pass(llm, prompts, score=True))
    best = {name: max((r for r in rows if r["pass"] == name), key=lambda r: r["tokens_per_s"])
            for name in ("prefill", "score")}
    ratio = best["score"]["tokens_per_s"] / best["prefill"]["tokens_per_s"]
    print(f"{'pass':>8} {'prompt tok/s':>13} {'seconds':>8} {'steps':>6}")
    for r in rows:
        print(f"{r['pass']:>8} {r['tokens_per_s']:>13.1f} {r['seconds']:>8.2f} {r['num_steps']:>6}")
    print(f"score / prefill (best of {repeats}): {ratio:.3f}")
    result = {"workload": "score", "model": model or "SmolLM2-135M (embedded)", "num_requests": num_requests,
              "prompt_len": prompt_len, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "date": time.strftime("%Y-%m-%d"), "rows": rows, "prefill_tokens_per_s": best["prefill"]["tokens_per_s"],
              "score_tokens_per_s": best["score"]["tokens_per_s"], "score_vs_prefill": ratio}
    llm.shutdown()
    return result
