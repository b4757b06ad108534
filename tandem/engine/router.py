"""ReplicaRouter: which data-parallel engine replica gets a request (prefix-cache affinity, then outstanding tokens)."""

from __future__ import annotations

import multiprocessing as mp
from collections import OrderedDict
from collections.abc import Sequence

AFFINITY_BLOCKS = 16  # a prompt's first 16 full KV blocks decide its affinity (256 tokens at block size 16)
MAX_REMEMBERED_PREFIXES = 65536


class SharedLoad:
    """The work every API process of one server has in flight on each replica, in memory they all map (the
    launcher creates it; the API processes inherit it at spawn): API process i writes only its own row, and
    each sums every row to route. An API process that balances only its own requests leaves the replicas
    uneven by the leftovers of every process's share: on four H200s, eight API processes put a few more than
    1,024 of 4,096 equal requests on one replica, whose fifth wave then ran alone for ~1 s of a 9.7 s pass.

    Rows have one writer each, so no lock: a reader may see a pick of another process a moment late, which
    the next picks even out. A replacement API process clears its row (its predecessor's requests were
    aborted)."""

    def __init__(self, num_clients: int, num_replicas: int) -> None:
        if num_clients < 1 or num_replicas < 1:
            raise ValueError(f"SharedLoad needs >= 1 client and replica, got {num_clients} and {num_replicas}")
        self.num_clients = num_clients
        self.num_replicas = num_replicas
        # [client][replica][requests, tokens], int64, zeroed; "spawn" as the API processes are started.
        self._cells = mp.get_context("spawn").RawArray("q", num_clients * num_replicas * 2)

    def row(self, client: int) -> SharedLoadRow:
        if not 0 <= client < self.num_clients:
            raise ValueError(f"client {client} is not one of the {self.num_clients} API processes")
        return SharedLoadRow(self, client)

    def totals(self) -> tuple[list[int], list[int]]:
        """(requests, tokens) in flight per replica, over every API process."""
        cells = self._cells[:]  # one copy of the whole table
        width = 2 * self.num_replicas
        requests = [sum(cells[c * width + 2 * r] for c in range(self.num_clients)) for r in range(self.num_replicas)]
        tokens = [sum(cells[c * width + 2 * r + 1] for c in range(self.num_clients)) for r in range(self.num_replicas)]
        return requests, tokens


class SharedLoadRow:
    """One API process's row of a SharedLoad: the only one it writes."""

    def __init__(self, load: SharedLoad, client: int) -> None:
        self.load = load
        self._base = client * load.num_replicas * 2

    def add(self, replica: int, requests: int, tokens: int) -> None:
        at = self._base + 2 * replica
        self.load._cells[at] += requests
        self.load._cells[at + 1] += tokens

    def clear(self) -> None:
        for at in range(self._base, self._base + 2 * self.load.num_replicas):
            self.load._cells[at] = 0


class ReplicaRouter:
    """Routes requests over `num_replicas` engines.

    A prompt whose leading full blocks this router has sent before goes to the same replica, where its
    prefix is likely cached, unless that replica holds clearly more requests than the least-loaded one
    (more than `slack` above it); every other request goes to the least-loaded replica. Load is the work
    this API process has in flight on each replica: its tokens (`work`: the most it may generate, as the
    caller tells `pick`, plus its prompt at a discount), then its number of requests. Tokens, not requests:
    with output lengths drawn from 100 to 1024, an equal number of requests can leave one replica with
    more decode steps to run. A replica marked down (dead or hung) gets nothing until it is marked up again.

    Ties go to the replica `first` (then first + 1, ...). Each API process passes its own index: with equal
    shares, one API process's odd request and another's land on different replicas. (With all ties on replica
    0, two API processes holding 1,023 and 1,025 of 2,048 equal requests put 1,025 on replica 0: at 256 in
    flight, a fifth wave of one request's 256 decode steps for that replica alone, ~8% of the pass.) With
    `shared` (its API process's row of the server's SharedLoad) the load it balances is every API process's,
    not its own alone; `load` and `tokens` stay its own.
    """

    def __init__(self, num_replicas: int, block_size: int, slack: int = 8, first: int = 0,
                 shared: SharedLoadRow | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if shared is not None and shared.load.num_replicas != num_replicas:
            raise ValueError(f"the shared load has {shared.load.num_replicas} replicas, the router {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.slack = slack
        self.first = first % num_replicas
        self.load = [0] * num_replicas  # requests in flight
        self.tokens = [0] * num_replicas  # their work in tokens (0 for callers that give none)
        self.up = [True] * num_replicas
        self.shared = shared
        if shared is not None:
            shared.clear()
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica, least recently used first
        self.num_affinity_hits = 0

    def pick(self, prompt_token_ids: Sequence[int], max_new_tokens: int | None = None) -> int:
        """The replica for one request; counts it (and, given max_new_tokens, its `work`) in that replica's
        load until release()."""
        replica = self._choose(prompt_token_ids)
        tokens = work(prompt_token_ids, max_new_tokens)
        self.load[replica] += 1
        self.tokens[replica] += tokens
        if self.shared is not None:
            self.shared.add(replica, 1, tokens)
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
        if self.shared is not None:
            self.shared.add(replica, -1, -tokens)

    def _choose(self, prompt_token_ids: Sequence[int]) -> int:
        if self.num_replicas == 1:
            return 0
        load, tokens = self.shared.load.totals() if self.shared is not None else (self.load, self.tokens)
        # The least-loaded replica that is up (any replica when none is: the caller fails the request).
        up = [r for r in range(self.num_replicas) if self.up[r]] or range(self.num_replicas)
        least = min(up, key=lambda r: (tokens[r], load[r], (r - self.first) % self.num_replicas))
        key = self._prefix_key(prompt_token_ids)
        if key is None:
            return least
        owner = self._owner.get(key)
        if owner is not None and self.up[owner] and load[owner] <= load[least] + self.slack:
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
