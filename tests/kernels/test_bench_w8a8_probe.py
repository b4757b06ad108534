"""The probe kernels of scripts/bench_w8a8_layout.py (its weight-stream variants and the plain read) compute what
they claim, so the bandwidth they report is of a correct GEMM (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import functools
import operator
import sys
from pathlib import Path

import pytest
import torch

from tandem.layers.quantization import quantize_activation_per_token, quantize_weight_fp8

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_w8a8_layout as probe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m: int, n: int, k: int):
    gen = torch.Generator().manual_seed(m + n + k)
    w, s = quantize_weight_fp8((torch.randn(n, k, generator=gen) * 0.02).to(DEVICE))
    xq, xs = quantize_activation_per_token(torch.randn(m, k, generator=gen).to(DEVICE))
    xs = xs.reshape(-1).contiguous()
    ref = (xq.float() * xs[:, None]) @ (w.float() * s).t()
    return w, s, xq, xs, ref


@pytest.mark.parametrize("layout", list(probe.LAYOUTS))
@pytest.mark.parametrize("split", [1, 2])
def test_probe_layouts_match_the_reference(layout, split):
    m, n, k = 5, 128, 512
    w, s, xq, xs, ref = _operands(m, n, k)
    ws = torch.zeros(split * m * n, device=DEVICE)
    tile = {"BLOCK_N": 64, "BLOCK_K": 128, "num_stages": 3, "SPLIT_K": split}
    for call in probe.probe_calls(layout, [(w, s)], xq, xs, tile, ws):
        call()
    torch.testing.assert_close(ws.view(split, m, n).sum(0), ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("flatten", [0, 1])
def test_persistent_probe_matches_the_reference(flatten):
    m, n, k = 5, 128, 512
    w, s, xq, xs, ref = _operands(m, n, k)
    out = torch.zeros(m, n, device=DEVICE, dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    tile = {"BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 3, "flatten": flatten}
    for call in probe.persistent_calls([(w, s)], xq, xs, tile, out, programs=3):  # 4 tiles over 3 programs
        call()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_read_probe_reads_every_word():
    w, s, *_ = _operands(2, 64, 512)
    out = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    for call in probe.read_calls([(w, s)], 3, out):  # shares of whole 1,024-word blocks, the last one short
        call()
    expect = functools.reduce(operator.xor, w.view(torch.int32).view(-1).tolist())
    assert functools.reduce(operator.xor, out.tolist()) == expect


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_gpu_probes_at_gate_up_shape():
    """On the GPU, at Llama-3-8B's gate_up shape and 32 rows (the tiles the benchmark times): every fetch form, the
    persistent kernel with and without the flattened pipeline, against fp32 math. Hopper's FP8 tensor cores add
    with fewer mantissa bits than fp32, so over K = 4,096 the sums drift ~1e-3 relative (1.3e-3 measured)."""
    m, n, k = 32, 28672, 4096
    w, s, xq, xs, ref = _operands(m, n, k)

    def rel(got: torch.Tensor) -> float:
        return ((got.float() - ref).norm() / ref.norm()).item()

    for layout in probe.LAYOUTS:
        for bk, split in ((128, 1), (256, 2)):
            ws = torch.zeros(split * m * n, device=DEVICE)
            tile = {"BLOCK_N": 64, "BLOCK_K": bk, "num_stages": 4, "SPLIT_K": split}
            for call in probe.probe_calls(layout, [(w, s)], xq, xs, tile, ws):
                call()
            assert rel(ws.view(split, m, n).sum(0)) < 1e-2, (layout, bk, split)
    for flatten in (0, 1):
        out = torch.zeros(m, n, device=DEVICE, dtype=torch.bfloat16)
        tile = {"BLOCK_N": 64, "BLOCK_K": 128, "num_stages": 4, "flatten": flatten}
        for call in probe.persistent_calls([(w, s)], xq, xs, tile, out, programs=264):
            call()
        assert rel(out) < 1e-2, flatten
