"""Draft-model proposer: a smaller model with the target's vocabulary decodes each request's drafts greedily, in an
EngineCore of its own (its own paged KV cache with prefix caching, so a request's tokens are computed once across
rounds; its decode steps replay CUDA graphs)."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tandem.config import EngineConfig, SpeculativeConfig
from tandem.request import Request
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.core import EngineCore

logger = logging.getLogger(__name__)


def draft_engine_config(target: EngineConfig, spec: SpeculativeConfig, max_model_len: int) -> EngineConfig:
    """The draft engine's config: the target's device, dtype, block size and graphs; sync steps; at most
    disable_by_batch_size requests (the most that ever get drafts) with a KV pool that holds them whole."""
    assert spec.model is not None
    seqs = min(spec.disable_by_batch_size, target.max_num_seqs)
    blocks = spec.num_kv_blocks or seqs * math.ceil(max_model_len / target.block_size) + 1
    return replace(target, model=spec.model, tokenizer=None, revision=None, hf_overrides={},
                   load_format="dummy" if target.load_format == "dummy" else "auto", max_model_len=max_model_len,
                   max_num_seqs=seqs, num_kv_blocks=blocks, overlap=False, enable_prefix_caching=True,
                   tensor_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False,
                   quantization=None, quantize_lm_head=False, speculative_config=None, enable_lora=False,
                   structured_forced_drafts=False)


class DraftModelProposer:
    """Proposes by running the draft engine: each round adds every request's known tokens as a prompt asking for
    its number of drafts (prefix caching skips what earlier rounds computed) and steps until all are done."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._round = 0

    def check_vocabulary(self, vocab_size: int, tokenizer: Any) -> None:
        """ValueError when the draft model's vocabulary is not the target's (size, and the token strings where
        both have a tokenizer)."""
        draft = self.engine
        if draft.model_config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.model has a vocabulary of {draft.model_config.vocab_size} tokens, "
                             f"the target model {vocab_size}: a draft model must share the target's vocabulary")
        if tokenizer is not None and draft.tokenizer is not None and tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ValueError("speculative_config.model's tokenizer maps tokens to other ids than the target's: a draft "
                             "model must share the target's vocabulary")

    def propose_all(self, requests: list[tuple[Request, int]]) -> list[list[int]]:
        engine = self.engine
        self._round += 1
        ids: list[str | None] = []
        params_by_k: dict[int, SamplingParams] = {}
        limit = engine.max_model_len
        for request, k in requests:
            k = min(k, limit - len(request.all_token_ids))
            if k <= 0:
                ids.append(None)
                continue
            rid = f"{request.request_id}#{self._round}"
            params = params_by_k.get(k)
            if params is None:
                params = params_by_k[k] = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
            engine.add_request(rid, request.all_token_ids, params)
            ids.append(rid)
        drafts: dict[str, list[int]] = {rid: [] for rid in ids if rid is not None}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.error is not None:
                    raise RuntimeError(f"the draft model failed: {out.error}")
                drafts[out.request_id].extend(out.new_token_ids)
        return [drafts[rid] if rid is not None else [] for rid in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()
