"""LLM: offline batched generation over EngineCore (or its data-parallel replicas), with a progress bar."""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from tqdm.auto import tqdm

from tandem.config import EngineConfig, relaxed_gc
from tandem.detokenizer import IncrementalDetokenizer
from tandem.engine.core import EngineCore, EngineOutput, all_plain_ints
from tandem.outputs import CompletionOutput, RequestOutput, prompt_logprobs_dicts
from tandem.lora_request import LoRARequest
from tandem.request import FinishReason
from tandem.sampling_params import SamplingParams

PromptInput = str | list[int]


@dataclass(slots=True)
class _Sequence:
    """One completion being generated (a prompt with n > 1 has several)."""

    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


class GenerationError(RuntimeError):
    """Some requests of a generate() / chat() call failed in the engine (a failed step, a dead data-parallel
    replica or tensor-parallel rank); the others ran to their end. `outputs` holds every request's result in
    prompt order, as generate() would have returned them: a failed completion has finish_reason "error", the
    message in `error`, and the tokens it had before it failed."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class LLM:
    """`LLM(model=None)` serves the embedded SmolLM2-135M-Instruct; keyword arguments are EngineConfig fields.

    data_parallel_size=M > 1 runs M engine replica processes (DataParallelEngine) and spreads the requests
    over them; with 1 the engine runs in this process.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; valid ones: {sorted(known)}")
        self.config = EngineConfig(model=model, **kwargs)
        self.engine: Any
        if self.config.data_parallel_size > 1:
            from tandem.engine.data_parallel import DataParallelEngine  # ZeroMQ only when there are replicas

            self.engine = DataParallelEngine(self.config)
        else:
            self.engine = EngineCore(self.config)  # in this process, no IPC
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # Start-up objects (modules, weights' Python wrappers, tokenizer) leave the collector's reach, so a
        # full collection during generate() walks only what requests allocate (as the server processes do).
        gc.collect()
        gc.freeze()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers or data-parallel replicas (they also stop when this process exits)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---------------------------------------------------------------- inputs

    def _normalize_prompts(self, prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # type: ignore[arg-type]
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a string, a list of strings or a list of token-id lists")
        return list(prompts)

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and (all_plain_ints(prompt) or all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            if not prompt:
                raise ValueError("the prompt is empty: give at least one token")
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    # ---------------------------------------------------------------- generate

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or a list aligned with the prompts (None: the base model)."""
        items = self._normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"got {len(params_list)} sampling params for {len(items)} prompts")
        loras = _aligned_loras(lora_request, len(items))
        tokenized = [self._tokenize(p) for p in items]  # raises before anything is queued
        return self._run(tokenized, params_list, use_tqdm, loras)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, tokenized: list[tuple[str | None, list[int]]], params_list: list[SamplingParams],
             use_tqdm: bool, loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.engine
        results: list[RequestOutput] = []
        seqs: dict[str, tuple[int, _Sequence]] = {}  # engine request id -> (prompt index, sequence)
        added: list[str] = []
        try:
            for i, ((text, ids), params) in enumerate(zip(tokenized, params_list)):
                request_id = str(next(self._ids))
                results.append(RequestOutput(request_id, text, ids, []))
                for j in range(params.n):
                    sub_id = request_id if params.n == 1 else f"{request_id}-{j}"
                    sub_params = params
                    if params.n > 1 and params.seed is not None:
                        sub_params = _with_seed(params, params.seed + j)
                    lora = None if loras is None else loras[i]
                    if lora is None:
                        engine.add_request(sub_id, ids, sub_params)
                    else:
                        engine.add_request(sub_id, ids, sub_params, lora_request=lora)
                    added.append(sub_id)
                    detok = (IncrementalDetokenizer(self.tokenizer, ids, params)
                             if self.tokenizer is not None else None)
                    seq = _Sequence(j, detok, logprobs=[] if params.logprobs is not None else None)
                    seqs[sub_id] = (i, seq)
        except ValueError:
            for rid in added:
                engine.abort_request(rid)
            raise
        pending = set(seqs)
        bar = tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        start, num_out = time.perf_counter(), 0
        with relaxed_gc():  # the step loop allocates thousands of short-lived objects per step
            try:
                while pending:
                    for out in engine.step():
                        if out.request_id not in pending:
                            continue
                        num_out += len(out.new_token_ids)
                        index, seq = seqs[out.request_id]
                        result = results[index]
                        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
                        if out.finished and out.spec_draft_tokens:  # speculative decoding's totals, over n
                            for key, value in (("spec_draft_tokens", out.spec_draft_tokens),
                                               ("spec_accepted_tokens", out.spec_accepted_tokens)):
                                result.metrics[key] = result.metrics.get(key, 0) + value
                        if out.prompt_logprobs is not None and result.prompt_logprobs is None:
                            result.prompt_logprobs = prompt_logprobs_dicts(result.prompt_token_ids, out.prompt_logprobs)
                        if self._apply(out, seq):
                            pending.discard(out.request_id)
                            bar.update(1)
                            bar.set_postfix_str(f"{num_out / (time.perf_counter() - start):.1f} tok/s")
                    if pending and not engine.has_unfinished_requests():
                        raise RuntimeError(f"engine went idle with {len(pending)} unfinished requests")
                while engine.has_unfinished_requests():  # a step still in flight for requests ended early
                    engine.step()
            finally:
                for rid in pending:
                    engine.abort_request(rid)
                bar.close()
        for _, (i, seq) in sorted(seqs.items(), key=lambda kv: (kv[1][0], kv[1][1].index)):
            text = seq.detok.text if seq.detok is not None else ""
            results[i].outputs.append(
                CompletionOutput(seq.index, text, seq.token_ids, seq.finish_reason, seq.stop_reason, seq.logprobs,
                                 seq.cumulative_logprob if seq.logprobs is not None else None, seq.error)
            )
        for r in results:
            r.finished = True
        errors = [seq.error for _, seq in seqs.values() if seq.error is not None]
        if errors:
            raise GenerationError(f"{len(errors)} of {len(seqs)} requests failed (the others finished; "
                                  f"their outputs are in this error's .outputs): {errors[0]}", results)
        return results

    def _apply(self, out: EngineOutput, seq: _Sequence) -> bool:
        """Adds a step's tokens to a sequence; returns True once it is finished."""
        if out.error is not None:  # the request ends here; generate() raises once the others are done
            if seq.detok is not None:
                seq.detok.flush()
            seq.finish_reason, seq.error = "error", out.error
            return True
        new_tokens = out.new_token_ids
        if seq.logprobs is not None and out.new_logprobs is not None:
            for tok, (chosen, top) in zip(new_tokens, out.new_logprobs):
                entry = dict(top)
                entry[tok] = chosen
                seq.logprobs.append(entry)
                seq.cumulative_logprob += chosen
        seq.token_ids.extend(new_tokens)
        if seq.detok is not None:
            _, stop = seq.detok.update(new_tokens)
            if stop is not None:
                self.engine.abort_request(out.request_id, FinishReason.STOP, stop)
                # Tokens after the one that completed the stop string are not part of the output.
                kept = seq.detok.num_output_tokens
                del seq.token_ids[kept:]
                if seq.logprobs is not None:
                    del seq.logprobs[kept:]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        if out.finished:
            if seq.detok is not None:
                seq.detok.flush()
            seq.finish_reason = str(out.finish_reason) if out.finish_reason is not None else None
            seq.stop_reason = out.stop_reason
            return True
        return False


def _aligned_loras(lora_request: Any, num_prompts: int) -> list[LoRARequest | None] | None:
    """One adapter (or None) per prompt; ValueError for a list of another length or anything not a LoRARequest."""
    if lora_request is None:
        return None
    loras = [lora_request] * num_prompts if isinstance(lora_request, LoRARequest) else lora_request
    if not isinstance(loras, Sequence) or isinstance(loras, str) or len(loras) != num_prompts:
        raise ValueError(f"lora_request must be a LoRARequest or a list of {num_prompts} (one per prompt, None for "
                         "the base model)")
    for lora in loras:
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request entries must be LoRARequest or None, got {type(lora).__name__}")
    return list(loras)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    values = {f: getattr(params, f) for f in SamplingParams.__dataclass_fields__}
    values["seed"] = seed
    return SamplingParams(**values)
