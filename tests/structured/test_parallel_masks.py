"""A step's sampled tokens reach the matchers in one call spread over the backend's threads (HostMask.accept_all)
and leave them exactly where one accept per request leaves them; a refused token is counted."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.sampling_params import StructuredOutputParams
from tandem.structured.grammar import GrammarCache
from tandem.structured.matcher import HostMask

VOCAB = 300  # the synthetic vocabulary: token t is chr(t + 32) for the printable ASCII


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_parallel_accept_equals_one_accept_per_request(backend):
    cache = GrammarCache(None, VOCAB, [VOCAB - 1], backend_name=backend)
    try:
        compiled = cache.submit(StructuredOutputParams(regex=r"[a-c]{1,6}(x|yz)")).result()
        rows = 8
        one, batch = [HostMask(compiled) for _ in range(rows)], [HostMask(compiled) for _ in range(rows)]
        bits_one = torch.zeros(rows, (VOCAB + 31) // 32, dtype=torch.int32)
        bits_batch = torch.zeros_like(bits_one)
        rng = random.Random(0)
        for _ in range(6):
            tokens = [ord(rng.choice("abcxy")) - 32 for _ in range(rows)]
            expected = sum(not m.accept(t) for m, t in zip(one, tokens))
            assert HostMask.accept_all(list(zip(batch, tokens)), threaded=True) == expected
            HostMask.fill_rows(bits_one, [(j, m, []) for j, m in enumerate(one)])
            HostMask.fill_rows(bits_batch, [(j, m, []) for j, m in enumerate(batch)])
            assert torch.equal(bits_one, bits_batch)
            assert [m.is_terminated for m in one] == [m.is_terminated for m in batch]
        fresh = [HostMask(compiled) for _ in range(2)]
        assert HostMask.accept_all([(fresh[0], ord("q") - 32), (fresh[1], ord("a") - 32)], threaded=True) == 1
        fresh = [HostMask(compiled) for _ in range(2)]
        assert HostMask.accept_all([(fresh[0], ord("q") - 32), (fresh[1], ord("a") - 32)], threaded=False) == 1
    finally:
        cache.shutdown()
