"""ReplicaRouter: which data-parallel engine replica gets a request (prefix-cache affinity, then outstanding tokens)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

AFFINITY_BLOCKS = 16  # a prompt's first 16 full KV blocks decide its affinity (256 tokens at block size 16)
MAX_REMEMBERED_PREFIXES = 65536


class ReplicaRouter:
    """Routes requests over `num_replicas` engines.

    A prompt whose leading full blocks this router has sent before goes to the same replica, where its
    prefix is likely cached, unless that replica holds clearly more requests than the least-loaded one
    (more than `slack` above it); every other request goes to the least-loaded replica. Load is the work
    this API process has in flight on each replica: its tokens (`work`: the most it may generate, as the
    caller tells `pick`, plus its prompt at a discount), then its number of requests. Tokens, not requests:
    with output lengths drawn from 100 to 1024, an equal number of requests can leave one replica with
    more decode steps to run. A replica marked down (dead or hung) gets nothing until it is marked up again.

    Ties go to the replica `first` (then first + 1, ...). Each API process routes only its own requests, so
    each passes its own index: with equal shares, one API process's odd request and another's land on
    different replicas. (With all ties on replica 0, two API processes holding 1,023 and 1,025 of 2,048
    equal requests put 1,025 on replica 0: at 256 in flight, a fifth wave of one request's 256 decode steps
    for that replica alone, ~8% of the pass.)
    """

    def __init__(self, num_replicas: int, block_size: int, slack: int = 8, first: int = 0) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.slack = slack
        self.first = first % num_replicas
        self.load = [0] * num_replicas  # requests in flight
        self.tokens = [0] * num_replicas  # their work in tokens (0 for callers that give none)
        self.up = [True] * num_replicas
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica, least recently used first
        self.num_affinity_hits = 0

    def pick(self, prompt_token_ids: Sequence[int], max_new_tokens: int | None = None) -> int:
        """The replica for one request; counts it (and, given max_new_tokens, its `work`) in that replica's
        load until release()."""
        replica = self._choose(prompt_token_ids)
        self.load[replica] += 1
        self.tokens[replica] += work(prompt_token_ids, max_new_tokens)
        return replica

    @property
    def num_up(self) -> int:
        return sum(self.up)

    def set_up(self, replica: int, up: bool) -> None:
        self.up[replica] = up

    def release(self, replica: int, tokens: int = 0) -> None:
        """The request is done; `tokens` is the work pick() counted for it."""
        self.load[replica] -= 1
        self.tokens[replica] -= tokens
        assert self.load[replica] >= 0 and self.tokens[replica] >= 0, "a request was released twice"

    def _least_loaded(self) -> int:
        """The least-loaded replica that is up (any replica when none is: the caller fails the request)."""
        up = [r for r in range(self.num_replicas) if self.up[r]] or range(self.num_replicas)
        return min(up, key=lambda r: (self.tokens[r], self.load[r], (r - self.first) % self.num_replicas))

    def _choose(self, prompt_token_ids: Sequence[int]) -> int:
        if self.num_replicas == 1:
            return 0
        least = self._least_loaded()
        key = self._prefix_key(prompt_token_ids)
        if key is None:
            return least
        owner = self._owner.get(key)
        if owner is not None and self.up[owner] and self.load[owner] <= self.load[least] + self.slack:
            self._owner.move_to_end(key)
            self.num_affinity_hits += 1
            return owner
        self._owner[key] = least
        self._owner.move_to_end(key)
        if len(self._owner) > MAX_REMEMBERED_PREFIXES:
            self._owner.popitem(last=False)
        return least

    def _prefix_key(self, prompt_token_ids: Sequence[int]) -> int | None:
        # The last prompt token is always computed (never a cache hit), so only blocks before it count.
        num_blocks = min((len(prompt_token_ids) - 1) // self.block_size, AFFINITY_BLOCKS)
        if num_blocks < 1:
            return None
        return hash(tuple(prompt_token_ids[: num_blocks * self.block_size]))


PROMPT_TOKENS_PER_WORK = 8  # prompt tokens that weigh as much as one generated token (see work())


def work(prompt_token_ids: Sequence[int], max_new_tokens: int | None) -> int:
    """A request's work for routing, in generated tokens (0 when max_new_tokens is not given): each one
    takes a slot in up to max_new_tokens decode steps, while its prompt is computed in large prefill chunks,
    many tokens per step, so a prompt token counts 1/8. (A decode-step model of nano fitted to 2xH200:
    weighting by outputs routes 1-2% better than by requests or by prompt + output.)"""
    if max_new_tokens is None:
        return 0
    return max_new_tokens + len(prompt_token_ids) // PROMPT_TOKENS_PER_WORK
