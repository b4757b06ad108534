"""The two-stage greedy argmax against torch.argmax (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.triton_argmax import ARGMAX_BLOCK, argmax_rows_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 100), (3, 2 * ARGMAX_BLOCK + 7), (5, ARGMAX_BLOCK)])
def test_argmax_rows_equals_torch(rows, vocab, dtype):
    """First index on ties (within and across chunks), the first NaN over +inf, all -inf rows, a masked
    last chunk: the same ids as torch.argmax."""
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen).to(dtype)
    if rows >= 3:
        x[0, vocab - 1] = x[0, 3] = 50.0  # a tie across chunks: the first wins
        x[1] = float("-inf")  # every value -inf: index 0
        x[2, 5] = float("inf")
        x[2, vocab - 2] = float("nan")  # NaN beats +inf, as in torch
        if rows >= 5:
            x[4, 7] = x[4, 9] = float("nan")  # the first NaN
    x = x.to(DEVICE)
    got = argmax_rows_triton(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(dim=-1))
    strided = torch.cat([x, x], dim=1)[:, :vocab]  # rows with a larger stride
    assert torch.equal(argmax_rows_triton(strided), x.argmax(dim=-1))


def test_sampler_greedy_uses_it(monkeypatch):
    """Greedy sampling goes through the Triton argmax where Triton runs (forced on the CPU here)."""
    from tandem.kernels import triton_argmax
    from tandem.runner import sampler

    calls = []
    real = triton_argmax.argmax_rows_triton
    monkeypatch.setattr(triton_argmax, "argmax_rows_triton", lambda x: calls.append(1) or real(x))
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert torch.equal(sampler.argmax_rows(x), x.argmax(dim=-1)) and calls
