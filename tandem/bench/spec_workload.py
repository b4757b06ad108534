"""The `spec` workload: speculative decoding against plain decoding on one engine in one run.

Real acceptance: the embedded SmolLM2 (real weights) with the n-gram proposer on chat prompts whose answers copy
their input (rewrite a paragraph, edit code, extract fields), at batch 1 and 8: tok/s of both passes, their ratio,
and the mean accepted length (1 + accepted drafts per verified sequence).

Machinery at scale (`--spec-acceptance A`, a named shape with random weights, where real acceptance means nothing):
a first pass records each request's greedy tokens; the proposer then offers, per position, the recorded next token
with probability A and a wrong one otherwise, so that a verify step at the shape's real cost accepts what an
A-accurate proposer would (a draft model or an EAGLE-3 head, `--spec-eagle3-head random` for one of the
shape's size, still runs its real compute first). This mode measures the machinery, so every step speculates
(`adaptive` off: the engine does not switch speculation off where it would not pay). Random bf16 weights give nearly flat logits, whose argmax a step's shape (one row or
k + 1 rows per sequence: other GEMM kernels, other rounding) flips, so the recorded tokens would not be the verify
step's; the attention and MLP output projections are therefore zeroed in this mode (every weight is still read and
every kernel still runs, at the same cost), which leaves the residual stream the token's embedding and makes the
greedy tokens a function of the last token alone, the same in every step shape.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from typing import Any

from tandem.scheduler.output import row_stand_ins

PARAGRAPH = ("The committee met on Tuesday to review the budget for the next fiscal year. After a long discussion, "
             "the members agreed to increase funding for public libraries by ten percent, to delay the road "
             "repairs on Main Street until spring, and to hire two additional staff for the community center.")
CODE = ("def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item.price * "
        "item.quantity\n    return total\n\n\ndef average_price(items):\n    if not items:\n        return 0\n"
        "    return total_price(items) / len(items)\n")
RECORD = ("Name: Alice Johnson\nEmail: alice.johnson@example.com\nPhone: 555-0142\nCity: Springfield\n"
          "Occupation: software engineer\nName: Bob Smith\nEmail: bob.smith@example.com\nPhone: 555-0199\n"
          "City: Shelbyville\nOccupation: teacher\n")
TASKS = [
    f"Rewrite the following paragraph exactly, but in the past tense:\n\n{PARAGRAPH}",
    f"Copy this Python code and add a docstring to each function:\n\n{CODE}",
    f"Repeat the following records as a list, one line per field:\n\n{RECORD}",
    f"Repeat the following paragraph word for word:\n\n{PARAGRAPH}",
    f"Rename the variable `total` to `subtotal` in this code and print the whole code:\n\n{CODE}",
    f"Extract the name, email and phone of each person below, in the same format:\n\n{RECORD}",
    f"Fix the spelling and repeat the text:\n\n{PARAGRAPH.replace('the', 'teh')}",
    f"Print this code again, unchanged:\n\n{CODE}",
]


class OracleProposer:
    """Offers each request's recorded greedy continuation, each draft right with probability `acceptance` (a
    wrong token otherwise), keyed by the request's prompt. With an inner proposer (a draft model), that one runs
    first, so each step pays the proposer's real compute, and its tokens are then replaced."""

    def __init__(self, references: dict[tuple[int, ...], tuple[int, list[int]]], acceptance: float,
                 vocab_size: int, inner: Any = None, seed: int = 0) -> None:
        self.references, self.acceptance, self.vocab_size, self.seed = references, acceptance, vocab_size, seed
        self.inner = inner
        self._offers: dict[tuple[int, ...], Any] = {}  # prompt key -> every offered token, on the device

    def propose_all(self, requests: list[tuple[Any, int]]) -> list[list[int]]:
        if self.inner is not None:
            computed = self.inner.propose_all(requests)
            return [self.propose(r.all_token_ids, len(d)) for (r, _), d in zip(requests, computed)]
        return [self.propose(r.all_token_ids, k) for r, k in requests]

    def propose_on_device(self, requests: list[tuple[Any, int]]) -> tuple[list[list[int]], Any] | None:
        """As the inner proposer's propose_on_device (its compute enqueued, nothing awaited), with the recorded
        tokens as host drafts (and no device output to swap in); None where the inner proposer has none."""
        inner = getattr(self.inner, "propose_on_device", None)
        on_device = inner(requests) if inner is not None else None
        if on_device is None:
            return None
        drafts = [self.propose(r.all_token_ids, len(d)) for (r, _), d in zip(requests, on_device[0])]
        return drafts, on_device[1][:0]

    def drafts_ahead(self, sched: Any, ks: list[int], accepted: Any) -> tuple[list[list[int]], Any] | None:
        """As the inner proposer's drafts_ahead (its chain enqueued behind the verify step `sched` in flight),
        with the recorded tokens in its place: where a request's next drafts start depends on the accepted count
        still on the device, so each request's whole offered sequence goes to the device and the drafts are
        gathered there from that count."""
        import torch

        inner = getattr(self.inner, "drafts_ahead", None)
        if inner is None or inner(sched, ks, accepted) is None:
            return None
        width, device = max(ks, default=0), accepted.device
        rows, first = [], []
        for s in sched.scheduled:
            offered, done = self._offered(s.request.all_token_ids, device)
            rows.append(offered)
            first.append(done + 1)  # the output index after the step in flight's last token, none accepted
        length = max(row.shape[0] for row in rows)
        # On the stream the step in flight and the next step's forward run on (the inner proposer's: the target's
        # compute stream), between the accepted counts and the forward that takes the drafts.
        stream = getattr(self.inner, "stream", None)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            table = torch.stack([torch.nn.functional.pad(row, (0, length - row.shape[0])) for row in rows])
            starts = torch.tensor(first, dtype=torch.int64)  # pinned: a pageable copy would wait for the step
            starts = starts.pin_memory() if starts.device != device and torch.cuda.is_available() else starts
            index = (starts.to(device, non_blocking=True)[:, None]
                     + accepted[: len(rows), None] + torch.arange(width, device=device)[None, :])
            tokens = table.gather(1, index.clamp(max=length - 1))
        return [row_stand_ins(g, k, width) for g, k in enumerate(ks)], tokens

    def _offered(self, token_ids: list[int], device: Any) -> tuple[Any, int]:
        """The request's offered token at every output index on the device (propose's, right or wrong as it
        decides per index; made once a request), and how many outputs it has."""
        import torch

        key = tuple(token_ids[:16])
        num_prompt, ref = self.references[key]
        offered = self._offers.get(key)
        if offered is None:
            offered = torch.tensor([self._offer(ref, pos, num_prompt) for pos in range(len(ref))], device=device)
            self._offers[key] = offered
        return offered, len(token_ids) - num_prompt

    def _offer(self, ref: list[int], pos: int, num_prompt: int) -> int:
        right = random.Random(self.seed * 1_000_003 + pos * 7919 + num_prompt).random() < self.acceptance
        return ref[pos] if right else (ref[pos] + 1) % self.vocab_size

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        num_prompt, ref = self.references[tuple(token_ids[:16])]
        done = len(token_ids) - num_prompt
        return [self._offer(ref, pos, num_prompt) for pos in range(done, min(done + max_drafts, len(ref)))]


def _pass(llm: Any, prompts: list[Any], max_tokens: int, chat: bool) -> dict[str, Any]:
    from tandem.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not chat)
    steps0, drafted0, accepted0 = engine.num_steps, engine.spec_draft_tokens, engine.spec_accepted_tokens
    rows0 = engine.spec_verified_rows
    start = time.perf_counter()
    outs = (llm.chat(prompts, params, use_tqdm=False) if chat else llm.generate(prompts, params, use_tqdm=False))
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rows = engine.spec_verified_rows - rows0
    num_steps = engine.num_steps - steps0
    accepted = engine.spec_accepted_tokens - accepted0
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "num_steps": num_steps, "ms_per_step": 1000 * seconds / max(num_steps, 1),
            "draft_tokens": engine.spec_draft_tokens - drafted0,
            "accepted_tokens": accepted, "verified_rows": rows,
            "mean_accepted_length": 1 + accepted / rows if rows else None,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def _side_by_side(llm: Any, proposer: Any, prompts: list[Any], max_tokens: int, chat: bool) -> dict[str, Any]:
    """Plain, then speculative, on the same engine (the proposer switched off and on); best of two each."""
    engine = llm.engine
    runs: dict[str, dict[str, Any]] = {}
    for _ in range(2):
        for name, active in (("plain", None), ("spec", proposer)):
            engine.proposer = active
            r = _pass(llm, prompts, max_tokens, chat)
            if name not in runs or r["tokens_per_s"] > runs[name]["tokens_per_s"]:
                runs[name] = r
    engine.proposer = proposer
    plain, spec = runs["plain"], runs["spec"]
    same = plain.pop("token_ids") == spec.pop("token_ids")
    return {"batch": len(prompts), "plain": plain, "spec": spec, "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
            "mean_accepted_length": spec["mean_accepted_length"], "same_tokens": same,
            "step_cost_vs_plain": spec["ms_per_step"] / plain["ms_per_step"]}


def _zero_residual_branches(model: Any) -> None:
    """Zeroes every attention and MLP output projection in place (see the module docstring)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()


def random_eagle3_folder(model: str, folder: str) -> str:
    """Writes into `folder` only an EAGLE-3 head's config.json for the named shape `model` (the published
    Llama-3.1-8B head's layout: one layer of the target's width, a 32000-token draft vocabulary); with dummy
    weights the engine draws the head's weights at random."""
    import json

    from tandem.config import EngineConfig
    from tandem.models.loader import load_model_config

    target = load_model_config(EngineConfig(model=model, load_format="dummy"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": target.hidden_size,
              "intermediate_size": target.intermediate_size, "num_attention_heads": target.num_heads,
              "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim, "num_hidden_layers": 1,
              "vocab_size": target.vocab_size, "draft_vocab_size": min(32000, target.vocab_size),
              "rms_norm_eps": target.norm_eps, "rope_theta": target.rope_theta,
              "max_position_embeddings": target.max_position_embeddings}
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    return folder


def run_spec_workload(model: str | None, k: int, acceptance: list[float] | None, batch_sizes: list[int],
                      max_tokens: int, draft_model: str | None = None, eagle3_head: str | None = None
                      ) -> dict[str, Any]:
    import torch

    from tandem import LLM
    from tandem.bench.workloads import Workload, make_requests

    cuda = torch.cuda.is_available()
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 5}
    if draft_model is not None:
        spec = {"method": "draft_model", "num_speculative_tokens": k, "model": draft_model}
    if eagle3_head is not None:
        if eagle3_head == "random" and model is None:
            raise ValueError("--spec-eagle3-head random needs --spec-model, a named shape with random weights")
        head = eagle3_head
        if eagle3_head == "random":  # a config.json only: the engine draws the weights (dummy load format)
            head = random_eagle3_folder(model, tempfile.mkdtemp(prefix="tandem-eagle3-"))
        spec = {"method": "eagle3", "num_speculative_tokens": k, "model": head}
    if acceptance is not None:  # the machinery's cost: every step speculates (SpecController off)
        spec["adaptive"] = False
    kwargs: dict[str, Any] = dict(max_num_seqs=max(batch_sizes), max_model_len=2048, speculative_config=spec)
    if model is not None:
        kwargs.update(model=model, load_format="dummy")
    if not cuda:
        kwargs.update(device="cpu", dtype="float32")
    llm = LLM(**kwargs)
    proposer = llm.engine.proposer
    rows: list[dict[str, Any]] = []
    if acceptance is None:  # real weights, real acceptance
        for b in batch_sizes:
            prompts = [[{"role": "user", "content": TASKS[i % len(TASKS)]}] for i in range(b)]
            _side_by_side(llm, proposer, prompts[:1], 8, chat=True)  # warm-up
            rows.append({"proposer": spec["method"], "k": k,
                         **_side_by_side(llm, proposer, prompts, max_tokens, True)})
    else:
        vocab = llm.engine.model_config.vocab_size
        _zero_residual_branches(llm.engine.runner.model)
        for b in batch_sizes:
            w = Workload("spec", model, b, (128, 128), (max_tokens, max_tokens))
            prompts = [p for p, _ in make_requests(w, vocab)]
            llm.engine.proposer = None
            ref = _pass(llm, prompts, max_tokens, chat=False)
            references = {tuple(p[:16]): (len(p), out) for p, out in zip(prompts, ref["token_ids"])}
            for a in acceptance:
                inner = proposer if draft_model is not None or eagle3_head is not None else None
                oracle = OracleProposer(references, a, vocab, inner)
                rows.append({"proposer": f"{spec['method']} A={a}", "k": k, "acceptance": a,
                             **_side_by_side(llm, oracle, prompts, max_tokens, chat=False)})
    print(f"{'proposer':>18} {'k':>2} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
          f"{'acc. len':>8} {'step cost':>9} {'same':>5}")
    for r in rows:
        acc = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        print(f"{r['proposer']:>18} {r['k']:>2} {r['batch']:>5} {r['plain']['tokens_per_s']:>11.1f} "
              f"{r['spec']['tokens_per_s']:>10.1f} {r['speedup']:>7.2f} {acc:>8} {r['step_cost_vs_plain']:>9.2f} "
              f"{str(r['same_tokens']):>5}")
    result = {"workload": "spec", "model": model or "SmolLM2-135M (embedded)", "k": k, "draft_model": draft_model,
              "eagle3_head": eagle3_head,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "date": time.strftime("%Y-%m-%d"),
              "max_tokens": max_tokens, "rows": rows}
    llm.shutdown()
    if eagle3_head == "random":
        shutil.rmtree(spec["model"], ignore_errors=True)
    return result
