"""The `structured` workload: the same requests with 0%, 50% and 100% of them under a JSON schema (grammar-forced
drafts off; the grammar warmed by a first full pass, whose figure the 100% row keeps), 100% again with late grammar
rows sitting out switched the other way and with forced drafts on, and with penalties on every request; tokens/s, GPU
busy, grammar-mask time per step and forced drafts accepted per step side by side."""

from __future__ import annotations

import json
import os
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "owner": {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                                                   "admin": {"type": "boolean"}},
                  "required": ["email", "admin"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 50,
                  "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                            "required": ["sku", "qty"], "additionalProperties": False}},
    },
    "required": ["id", "name", "tags", "score", "owner", "items"],
    "additionalProperties": False,
}


def _params(requests: list[tuple[list[int], int]], fraction: float, penalties: bool) -> list[Any]:
    from tandem.sampling_params import SamplingParams, StructuredOutputParams

    spec = StructuredOutputParams(json=json.dumps(SCHEMA))
    every = round(1 / fraction) if fraction > 0 else 0  # 0.5: every other request, spread over the batch
    extra = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1) if penalties else {}
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                           structured_output=spec if every and i % every == 0 else None, **extra)
            for i, (_, n) in enumerate(requests)]


def run_pass(llm: Any, requests: list[tuple[list[int], int]], fraction: float, penalties: bool = False,
             record: bool = True, forced_drafts: bool = False, sit_out: bool | None = None) -> dict[str, Any]:
    """One pass; `sit_out` (None: the engine's setting) says whether a late grammar row sits its step out."""
    engine = llm.engine
    engine.use_forced_drafts(forced_drafts)
    default_sit_out = engine.sit_out
    if sit_out is not None:
        engine.sit_out = sit_out
    sat_out0 = engine.grammar.num_sat_out
    params = _params(requests, fraction, penalties)
    mask_s0, mask_steps0, steps0 = engine.mask_time_s, engine.num_mask_steps, engine.num_steps
    wait_s0 = engine.mask_wait_s
    rejections0 = engine.num_grammar_rejections
    drafted0, accepted0 = engine.forced_draft_tokens, engine.forced_accepted_tokens
    tl = engine.start_timeline() if record else None
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if record:
        engine.stop_timeline()
    row_sit_out = engine.sit_out
    engine.sit_out = default_sit_out
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    mask_steps = engine.num_mask_steps - mask_steps0
    num_steps = max(engine.num_steps - steps0, 1)
    return {"constrained_fraction": fraction, "penalties": penalties, "forced_drafts": forced_drafts,
            "seconds": seconds,
            "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "gpu_busy_pct": tl.gpu_busy_pct() if tl is not None else None,
            "num_steps": engine.num_steps - steps0, "num_mask_steps": mask_steps,
            "mask_ms_per_step": 1000 * (engine.mask_time_s - mask_s0) / mask_steps if mask_steps else 0.0,
            # The engine's thread waiting for the fills (the part of mask_ms_per_step on its critical path).
            "mask_wait_ms_per_step": 1000 * (engine.mask_wait_s - wait_s0) / mask_steps if mask_steps else 0.0,
            "grammar_rejections": engine.num_grammar_rejections - rejections0,
            # Grammar-forced drafts per step (all requests together): proposed, and accepted (tokens for free).
            "forced_drafts_per_step": (engine.forced_draft_tokens - drafted0) / num_steps,
            "forced_accepted_per_step": (engine.forced_accepted_tokens - accepted0) / num_steps,
            # Rows that sat a step out because their grammar row was late (all requests together).
            "sit_out": row_sit_out, "sat_out_per_step": (engine.grammar.num_sat_out - sat_out0) / num_steps,
            "_timeline": tl, "_outputs": [list(o.outputs[0].token_ids) for o in outs]}


def start_matchers(engine: Any) -> int | None:
    """The llguidance start matchers (lineages) the schema's grammar was built into, None for xgrammar."""
    from tandem.sampling_params import StructuredOutputParams
    from tandem.structured.grammar import LLGuidanceStarts

    cache = engine.grammar.cache
    compiled = cache.submit(StructuredOutputParams(json=json.dumps(SCHEMA))).result() if cache is not None else None
    return len(compiled.starts) if isinstance(compiled, LLGuidanceStarts) else None


def run_structured_workload(model: str | None, num_requests: int, prompt_len: int, output_len: int,
                            plot_dir: str | None = None, backends: list[str] | None = None) -> dict[str, Any]:
    """The passes on one engine: 0% constrained, then 50% and 100% for each grammar backend in `backends`
    (default: this process's, TANDEM_STRUCTURED_BACKEND) with grammar-forced drafts off, and 100% with them on;
    then penalties on every request."""
    import torch

    from tandem import LLM
    from tandem.bench.workloads import Workload, make_requests
    from tandem.structured.grammar import backend

    backends = backends or [backend()]
    cuda = torch.cuda.is_available()
    # Forced drafts allowed (off by default), then switched on or off per pass.
    kwargs: dict[str, Any] = dict(max_num_seqs=num_requests, max_model_len=prompt_len + output_len + 16,
                                  structured_forced_drafts=True)
    if model is not None:
        kwargs.update(model=model, load_format="dummy")
    if not cuda:
        kwargs.update(device="cpu", dtype="float32")
    llm = LLM(**kwargs)
    engine = llm.engine
    w = Workload("structured", model, num_requests, (prompt_len, prompt_len), (output_len, output_len))
    requests = make_requests(w, engine.model_config.vocab_size)
    warm = [(p, 8) for p, _ in requests[:8]]
    run_pass(llm, warm, 0.0, record=False)  # kernels and graphs
    run_pass(llm, warm, 0.0, penalties=True, record=False)
    rows = [run_pass(llm, requests, 0.0)]
    for name in backends:
        engine.use_structured_backend(name)
        run_pass(llm, warm, 1.0, record=False)  # the schema's compiled grammar
        run_pass(llm, warm, 1.0, record=False, forced_drafts=True)
        # The schema's first full pass: its start matchers (lineages) build their lexer states as the requests reach
        # new grammar states, tens of milliseconds in some early steps. The passes below see the grammar warm, as a
        # server does once a schema has served a few requests; this one's figure is kept beside the 100% row.
        cold = run_pass(llm, requests, 1.0, record=False)
        for fraction in (0.5, 1.0):
            rows.append({**run_pass(llm, requests, fraction), "backend": name})
        rows[-1]["cold_tokens_per_s"] = cold["tokens_per_s"]
        # 100% again with late rows sitting out switched the other way: the same tokens, one step later.
        other = run_pass(llm, requests, 1.0, sit_out=not engine.sit_out)
        other["same_tokens_as_sit_out_flipped"] = other["_outputs"] == rows[-1]["_outputs"]
        rows.append({**other, "backend": name})
        on = run_pass(llm, requests, 1.0, forced_drafts=True)
        on["start_matchers"] = start_matchers(engine)
        # Exact on the CPU in fp32; in bf16 a verify row's logits may differ from a decode row's in the last bit.
        on["same_tokens_as_forced_off"] = on["_outputs"] == rows[-2]["_outputs"]
        rows.append({**on, "backend": name})
    rows.append(run_pass(llm, requests, 0.0, penalties=True))
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_unconstrained"] = r["tokens_per_s"] / base
        if "cold_tokens_per_s" in r:
            r["cold_vs_unconstrained"] = r["cold_tokens_per_s"] / base
    print(f"{'constrained':>11} {'backend':>10} {'forced':>6} {'sit out':>7} {'penalties':>9} {'tok/s':>10} "
          f"{'x base':>7} {'gpu busy':>8} {'mask ms/step':>12} {'mask wait':>9} {'accepted/step':>13} "
          f"{'sat out/step':>12} {'rejected':>8}")
    for r in rows:
        busy = f"{r['gpu_busy_pct']:.1f}%" if r["gpu_busy_pct"] is not None else "-"
        mode = "on" if r["forced_drafts"] else "off"
        print(f"{r['constrained_fraction']:>10.0%} {r.get('backend', '-'):>10} {mode:>6} "
              f"{'on' if r['sit_out'] else 'off':>7} {str(r['penalties']):>9} "
              f"{r['tokens_per_s']:>10.1f} {r['vs_unconstrained']:>7.3f} {busy:>8} "
              f"{r['mask_ms_per_step']:>12.3f} {r['mask_wait_ms_per_step']:>9.3f} {r['forced_accepted_per_step']:>13.2f} "
              f"{r['sat_out_per_step']:>12.2f} {r['grammar_rejections']:>8}")
    for r in rows:
        if "cold_vs_unconstrained" in r:
            print(f"{r['backend']}: 100% constrained on the schema's first full pass (its grammar cold): "
                  f"{r['cold_tokens_per_s']:.1f} tok/s, {r['cold_vs_unconstrained']:.3f}x")
        if r.get("start_matchers"):
            print(f"{r['backend']}: the schema's grammar holds {r['start_matchers']} start matchers (lineages)")
    if plot_dir:
        from tandem.profiling.timeline import plot_timelines

        os.makedirs(plot_dir, exist_ok=True)
        png = os.path.join(plot_dir, "timeline-structured.png")
        half = [r for r in rows if r["constrained_fraction"] == 0.5]
        forced = [r for r in rows if r["forced_drafts"]]
        plot_timelines({"0% constrained": rows[0]["_timeline"],
                        **{f"50% constrained, {r['backend']}": r["_timeline"] for r in half},
                        **{f"100% constrained, forced drafts, {r['backend']}": r["_timeline"] for r in forced}},
                       png, max_seconds=0.06, start_frac=0.5)
        half[0]["_timeline"].to_chrome_trace(os.path.join(plot_dir, "trace-structured-50.json"), "50% constrained")
        print(f"wrote {png}")
    result = {"workload": "structured", "model": model or "SmolLM2-135M (embedded)", "num_requests": num_requests,
              "structured_backends": backends, "prompt_len": prompt_len, "output_len": output_len,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "date": time.strftime("%Y-%m-%d"),
              "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}
    llm.shutdown()
    return result
