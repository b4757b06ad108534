"""What round-to-nearest 4- and 8-bit weights cost in accuracy on the embedded SmolLM2-135M, on the CPU in fp32.

    python scripts/int_accuracy.py --out benchmarks/results/cpu/int-accuracy-smollm2.json [--variants int8,int4,...]

The reference is the model as it loads (the GGUF's Q4_1 blocks dequantized to fp32: the full-precision model
here). Each variant (`--quantization int8` / `int4`, and each with `--quantize-lm-head`: the tied embedding's
copy in the same codes) answers the 16 chat prompts of tests/chat_prompts.py with 32 greedy tokens, and scores the
reference's answers token by token (prompt_logprobs, teacher-forced). Reported per variant, as the FP8 report of
tests/gpu/test_fp8.py states them: the share of greedy tokens equal to the reference's, the agreeing prefix, the
requests answered identically, and the mean and largest |log-prob difference| of the reference's tokens.
SmolLM2's 576 input columns take groups of 64 (its 1,536-column down projection 128): rtn_group_size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem import LLM, SamplingParams  # noqa: E402
from tests.chat_prompts import MAX_TOKENS, QUESTIONS, chat_messages  # noqa: E402

VARIANTS = {"int8": ("int8", False), "int8 + int8 lm_head": ("int8", True), "int4": ("int4", False),
            "int4 + int4 lm_head": ("int4", True)}


def make_llm(quantization: str | None, lm_head: bool) -> LLM:
    return LLM(device="cpu", dtype="float32", quantization=quantization, quantize_lm_head=lm_head, max_model_len=512,
               max_num_seqs=len(QUESTIONS), seed=0)


def answers(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids) of every chat prompt."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.chat([chat_messages(q) for q in QUESTIONS], greedy, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]


def scored(llm: LLM, runs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """The log-probability llm gives each token of each answer, after its prompt and the answer before it."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outs = llm.generate([prompt + tokens for prompt, tokens in runs], params, use_tqdm=False)
    return [[entry[token] for entry, token in zip(o.prompt_logprobs[len(prompt):], tokens)]
            for o, (prompt, tokens) in zip(outs, runs)]


def compare(ref: list[tuple[list[int], list[int]]], got: list[tuple[list[int], list[int]]],
            ref_lp: list[list[float]], got_lp: list[list[float]]) -> dict[str, float]:
    same = [sum(a == b for a, b in zip(r[1], g[1])) / len(r[1]) for r, g in zip(ref, got)]
    prefix = [next((j for j, (a, b) in enumerate(zip(r[1], g[1])) if a != b), len(r[1])) / len(r[1])
              for r, g in zip(ref, got)]
    diffs = [abs(a - b) for ra, ga in zip(ref_lp, got_lp) for a, b in zip(ra, ga)]
    return {"greedy_token_agreement": sum(same) / len(same), "agreeing_prefix_fraction": sum(prefix) / len(prefix),
            "identical_requests": sum(p == 1.0 for p in prefix), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "max_abs_logprob_diff": max(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON report path")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    args = parser.parse_args()
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        sys.exit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    start = time.time()
    reference = make_llm(None, False)
    try:
        ref = answers(reference)
        ref_lp = scored(reference, ref)
    finally:
        reference.shutdown()
    stats = {}
    for name in names:
        llm = make_llm(*VARIANTS[name])
        try:
            stats[name] = compare(ref, answers(llm), ref_lp, scored(llm, ref))
        finally:
            llm.shutdown()
        print(f"{name:>22}: " + ", ".join(f"{k} {v:.3f}" for k, v in stats[name].items()), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"record": {"date": time.strftime("%Y-%m-%d"), "commit": commit or "unknown", "gpu": "cpu",
                         "device": "cpu", "workload": "int-accuracy-smollm2",
                         "command": "python scripts/int_accuracy.py" + (f" --variants {args.variants}"
                                                                       if args.variants != ",".join(VARIANTS) else "")},
              "model": "SmolLM2-135M-Instruct (the embedded GGUF's Q4_1 blocks dequantized to fp32: the reference), "
                       "fp32 on the CPU; variants: round-to-nearest integer codes at load",
              "prompts": len(QUESTIONS), "new_tokens": MAX_TOKENS, "seconds": round(time.time() - start, 1),
              "variants": stats}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
