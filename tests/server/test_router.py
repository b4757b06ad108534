"""ReplicaRouter: least-loaded placement, prefix-cache affinity, and the load slack that overrides it."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest

from tandem.engine.router import ReplicaRouter, SharedLoad, SharedLoadRow

PREFIX = list(range(100, 164))  # 4 full blocks of 16


def test_least_loaded_without_a_prefix():
    r = ReplicaRouter(3, block_size=16)
    picks = [r.pick([1, 2, 3]) for _ in range(6)]  # too short for a full block: no affinity
    assert sorted(picks) == [0, 0, 1, 1, 2, 2] and r.load == [2, 2, 2]
    r.release(1)
    r.release(1)
    assert r.pick([4]) == 1


def test_same_prefix_goes_to_the_same_replica_until_it_is_much_busier():
    r = ReplicaRouter(2, block_size=16, slack=2)
    first = r.pick(PREFIX + [1])
    picks = [r.pick(PREFIX + [i]) for i in range(2, 5)]
    # Two followers join it; the third would put it 3 above the idle replica (slack 2): it goes there.
    assert picks == [first, first, 1 - first] and r.num_affinity_hits == 2
    assert r.load[first] == 3 and r.load[1 - first] == 1
    assert r.pick(PREFIX + [9]) == 1 - first  # the prefix now lives there too: affinity follows it
    assert r.load == ([3, 2] if first == 0 else [2, 3])
    other = r.pick(list(range(500, 564)) + [7])  # a new prefix: the least-loaded replica
    assert other == 1 - first


def test_affinity_ignores_what_follows_the_first_blocks_and_the_last_token():
    r = ReplicaRouter(4, block_size=16)
    a = r.pick(PREFIX + list(range(300)))  # 16+ blocks: only the first 16 count
    assert r.pick(PREFIX + list(range(300)) + [9]) == a
    b = r.pick(list(range(16)))  # 16 tokens: the last one is computed anyway, so no full block counts
    assert r._prefix_key(list(range(16))) is None and b != a


def test_release_twice_is_a_bug():
    r = ReplicaRouter(2, block_size=16)
    i = r.pick([1])
    r.release(i)
    with pytest.raises(AssertionError):
        r.release(i)
    with pytest.raises(ValueError):
        ReplicaRouter(0, block_size=16)


def test_least_loaded_counts_tokens_not_requests():
    r = ReplicaRouter(2, block_size=16)
    assert r.pick([1] * 16, max_new_tokens=1000) == 0  # work 1000 + 16 // 8 on replica 0
    # Short requests go to replica 1 until it holds as much work, however many requests that takes.
    picks = [r.pick([1, 2], max_new_tokens=100) for _ in range(10)]
    assert picks == [1] * 10 and r.tokens == [1002, 1000] and r.load == [1, 10]
    assert r.pick([1, 2], max_new_tokens=100) == 1
    r.release(0, 1002)
    assert r.tokens[0] == 0 and r.pick([3], max_new_tokens=5) == 0


def test_tokens_balance_a_random_workload_better_than_counts():
    """nano's distribution (256 requests, prompts and outputs of 100-1024 tokens) over two replicas: the
    busiest replica's generated tokens over the mean, averaged over seeds."""
    import random

    excess_tokens = excess_counts = 0.0
    for seed in range(10):
        rng = random.Random(seed)
        by_tokens, by_count = ReplicaRouter(2, block_size=16), ReplicaRouter(2, block_size=16)
        out_tokens, out_counts = [0, 0], [0, 0]
        for _ in range(256):
            prompt, n = [7] * 15, rng.randint(100, 1024)  # under one block: no affinity
            out_tokens[by_tokens.pick(prompt, n)] += n
            out_counts[by_count.pick(prompt)] += n
        mean = sum(out_tokens) / 2
        excess_tokens += max(out_tokens) / mean - 1
        excess_counts += max(out_counts) / mean - 1
    assert excess_tokens / 10 < 0.005 and excess_tokens < excess_counts / 3, (excess_tokens, excess_counts)


def test_api_processes_break_ties_on_different_replicas():
    """Two API processes route their own shares of 2,048 equal requests (1,023 and 1,025): each gives its
    odd request to its own first replica, so the replicas end with 1,024 each, not 1,025 and 1,023 (a
    fifth wave for one replica alone)."""
    totals = [0, 0]
    for index, share in enumerate((1023, 1025)):
        router = ReplicaRouter(2, block_size=16, first=index)
        for _ in range(share):
            totals[router.pick([15496, 11, 995], max_new_tokens=256)] += 1
    assert totals == [1024, 1024]
    same_first = [0, 0]
    for share in (1023, 1025):
        router = ReplicaRouter(2, block_size=16)
        for _ in range(share):
            same_first[router.pick([15496, 11, 995], max_new_tokens=256)] += 1
    assert same_first == [1025, 1023]
    assert ReplicaRouter(3, block_size=16, first=4).pick([1]) == 1  # first is taken modulo the replicas


def _uneven_shares_routed(shared: SharedLoad | None, seed: int = 3) -> list[int]:
    """Eight API processes over four replicas, taking 4,096 equal requests in shares of different sizes, in an
    interleaved order (as connections arrive): how many each replica gets."""
    rng = random.Random(seed)
    shares = [300, 301, 702, 499, 905, 897, 250, 242]
    routers = [ReplicaRouter(4, block_size=16, first=i, shared=shared.row(i) if shared else None)
               for i in range(len(shares))]
    arrivals = [i for i, n in enumerate(shares) for _ in range(n)]
    rng.shuffle(arrivals)
    totals = [0] * 4
    for i in arrivals:
        totals[routers[i].pick([15496, 11, 995, 318, 257], max_new_tokens=256)] += 1
    return totals


def test_api_processes_balance_every_request_with_a_shared_load():
    """Alone, each API process evens out only its own share, and the leftovers of eight shares put more than
    1,024 of 4,096 equal requests on some replica (a fifth wave it runs alone). Sharing their loads, the
    replicas get 1,024 each; released requests leave every row at zero."""
    alone = _uneven_shares_routed(None)
    assert sum(alone) == 4096 and max(alone) > 1024
    shared = SharedLoad(8, 4)
    assert _uneven_shares_routed(shared) == [1024] * 4
    assert shared.totals() == ([1024] * 4, [1024 * 256] * 4)

    router = ReplicaRouter(4, block_size=16, first=1, shared=shared.row(1))  # a replacement API process 1
    requests, _ = shared.totals()
    assert sum(requests) < 4096  # its predecessor's row was cleared: those requests were aborted
    replica = router.pick([1, 2, 3], max_new_tokens=10)
    router.release(replica, tokens=10)
    assert router.load == [0] * 4 and sum(shared.totals()[0]) == sum(requests)
    with pytest.raises(ValueError, match="replicas"):
        ReplicaRouter(2, block_size=16, shared=shared.row(0))
    with pytest.raises(ValueError, match="API processes"):
        shared.row(8)


def _pick_in_child(row: SharedLoadRow, picks: int) -> None:
    router = ReplicaRouter(2, block_size=16, shared=row)
    for _ in range(picks):
        router.pick([7, 8, 9], max_new_tokens=100)


def test_a_spawned_api_process_writes_the_shared_load():
    """The launcher's SharedLoad reaches API processes started with "spawn": what one picks, the others see."""
    shared = SharedLoad(2, 2)
    child = mp.get_context("spawn").Process(target=_pick_in_child, args=(shared.row(1), 3))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert shared.totals() == ([2, 1], [200, 100])
    router = ReplicaRouter(2, block_size=16, shared=shared.row(0))
    assert router.pick([7, 8, 9], max_new_tokens=100) == 1  # the child's picks count
