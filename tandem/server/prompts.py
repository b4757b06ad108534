"""PromptEncoder: tokenization and chat templating with bounded cost, off the event loop when it could be long.

A prompt is refused before it is tokenized when its characters cannot fit the context: no token covers more
than `max_token_chars` characters (the longest token string of the vocabulary), so a text of C characters
needs at least C / max_token_chars tokens. Texts longer than `inline_chars` are tokenized (and chat templates
rendered) in a small thread pool under `timeout_s`; shorter ones inline, where the thread hop would cost more
than the work. HF fast tokenizers release the GIL while they encode, so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from tandem.server.protocol import ApiError

logger = logging.getLogger(__name__)

DEFAULT_TOKENIZE_TIMEOUT_S = 10.0
INLINE_CHARS = 1024  # about a millisecond of encoding; longer texts go to the pool
NUM_THREADS = 2  # a runaway job cannot be stopped, only abandoned: at most this many run at once
# Normalizers that never turn several characters into fewer (the others get a safety factor).
_NON_SHRINKING = {"Replace", "Prepend", "NFC", "NFD", "ByteLevel"}
_SHRINK_MARGIN = 4


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_model_len: int, timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S,
                 inline_chars: int = INLINE_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s
        self.inline_chars = inline_chars
        self.max_token_chars = max_token_chars(tokenizer)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def max_chars(self) -> int | None:
        """Longest text that could still fit the context with one new token (None: no bound known)."""
        if self.max_token_chars is None:
            return None
        return (self.max_model_len - 1) * self.max_token_chars

    def check_chars(self, num_chars: int, param: str) -> None:
        limit = self.max_chars()
        if limit is not None and num_chars > limit:
            raise ApiError(400, f"{param} has {num_chars} characters, at least {-(-num_chars // self.max_token_chars)} "
                                f"tokens; the context holds {self.max_model_len} tokens including at least one new "
                                "token", param=param)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_chars(len(text), param)
        if add_special_tokens:
            return await self._run(len(text), param, self.tokenizer.encode, text)
        return await self._run(len(text), param, self.tokenizer.encode, text, add_special_tokens=False)

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, param: str,
                   **template_kwargs: Any) -> tuple[str, list[int]]:
        """(rendered text, its token ids); the template's own errors become a 400. template_kwargs (e.g. tools)
        go to the chat template."""
        num_chars = sum(len(m["content"] or "") for m in messages) + len(str(template_kwargs or ""))
        self.check_chars(num_chars, param)

        def render() -> tuple[str, list[int]]:
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False, **template_kwargs)
            except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
                raise ApiError(400, f"the chat template rejected messages: {exc}", param=param) from exc
            self.check_chars(len(text), param)
            return text, self.tokenizer.encode(text, add_special_tokens=False)

        # Rendering costs per message too: many short messages go to the pool as one long text does.
        return await self._run(num_chars + 64 * len(messages), param, render)

    async def _run(self, size: int, param: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if size <= self.inline_chars:
            return fn(*args, **kwargs)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="tandem-tokenize")
        future = asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            logger.warning("tokenizing a %d-character %s took over %g s; refused", size, param, self.timeout_s)
            raise ApiError(400, f"{param}: tokenization took longer than {self.timeout_s:g} s; send a shorter "
                                f"{param}", param=param, code="tokenization_timeout") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def max_token_chars(tokenizer: Any) -> int | None:
    """Most characters of text one token can stand for (None where the vocabulary cannot be read).

    A byte-level token string has one character per byte it covers, and a text character is at least one
    byte; a SentencePiece piece has one character per character. Either way its string's length bounds what
    it covers, unless the normalizer can shrink text (NFKC and the like), hence the margin there.
    """
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # no vocabulary to read: no precheck, the time limit still holds
        return None
    if not vocab:
        return None
    longest = max(len(token) for token in vocab)
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    if normalizer is not None and type(normalizer).__name__ not in _NON_SHRINKING:
        longest *= _SHRINK_MARGIN
    return longest
