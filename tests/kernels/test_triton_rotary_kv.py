"""Fused (q/k RMSNorm +) rotary + KV-cache write against RMSNorm, apply_rotary and write_kv_ref."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.reference import write_kv_ref
from tandem.kernels.triton_rotary_kv import rotary_write_kv_triton
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, apply_rotary, rotary_write_kv

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _eager_reference_path(monkeypatch):
    monkeypatch.delenv("TANDEM_FORCE_TRITON", raising=False)  # the reference must not dispatch to Triton


def _case(dtype, num_tokens, num_heads, num_kv_heads, head_dim, norm: bool, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2).to(dtype)
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    rope.cos_sin_cache = rope.cos_sin_cache.to(dtype)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    norms = None
    if norm:
        norms = []
        for s in (1, 2):
            n = RMSNorm(head_dim, 1e-6)
            n.weight.data = (1 + 0.1 * torch.randn(head_dim, generator=torch.Generator().manual_seed(s))).to(dtype)
            norms.append(n)
    page = 4
    num_blocks = max(6, -(-num_tokens // page))  # enough distinct slots for every token
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Distinct slots, one padding token (-1) when there are several tokens.
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1
    return qkv, rope, positions, norms, cache, slots


def _split(qkv, num_heads, num_kv_heads, head_dim):
    t = qkv.shape[0]
    q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(t, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm-rope"])
@pytest.mark.parametrize("shape", [(3, 4, 2, 16), (1, 6, 6, 32), (5, 3, 1, 8)])
def test_fused_matches_reference(shape, norm, dtype):
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    qkv, rope, positions, norms, cache, slots = _case(dtype, num_tokens, num_heads, num_kv_heads, head_dim, norm)
    cos, sin = rope(positions)
    # Reference: separate layers on CPU.
    q, k, v = _split(qkv.clone(), num_heads, num_kv_heads, head_dim)
    if norms:
        q, k = norms[0](q), norms[1](k)
    q_ref, k_ref = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    cache_ref = cache.clone()
    write_kv_ref(k_ref, v, cache_ref[0], cache_ref[1], slots)
    # Fused kernel, in place on a copy of qkv.
    qkv_f = qkv.clone().to(DEVICE)
    q, k, v = _split(qkv_f, num_heads, num_kv_heads, head_dim)
    cache_f = cache.clone().to(DEVICE)
    rotary_write_kv_triton(q, k, v, cos.to(DEVICE), sin.to(DEVICE), cache_f[0], cache_f[1], slots.to(DEVICE),
                           norms[0].weight.to(DEVICE) if norms else None, norms[1].weight.to(DEVICE) if norms else None,
                           1e-6)
    torch.testing.assert_close(q.cpu(), q_ref, **TOL[dtype])
    torch.testing.assert_close(k.cpu(), k_ref, **TOL[dtype])
    torch.testing.assert_close(cache_f.cpu(), cache_ref, **TOL[dtype])  # untouched slots stay bitwise equal


def test_layer_dispatch_forced_triton_matches_cpu_path(monkeypatch):
    qkv, rope, positions, norms, cache, slots = _case(torch.float32, 4, 4, 2, 16, True, seed=3)
    cos, sin = rope(positions)
    q, k, v = _split(qkv.clone(), 4, 2, 16)
    cache_ref = cache.clone()
    q_ref, k_ref = rotary_write_kv(q, k, v, cos, sin, cache_ref[0], cache_ref[1], slots, *norms)
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    qkv_f = qkv.clone()
    q, k, v = _split(qkv_f, 4, 2, 16)
    cache_f = cache.clone()
    q_f, k_f = rotary_write_kv(q, k, v, cos, sin, cache_f[0], cache_f[1], slots, *norms)
    assert q_f.data_ptr() == q.data_ptr()  # in place into qkv
    torch.testing.assert_close(q_f, q_ref, **TOL[torch.float32])
    torch.testing.assert_close(k_f, k_ref, **TOL[torch.float32])
    torch.testing.assert_close(cache_f, cache_ref, **TOL[torch.float32])


@pytest.mark.parametrize("forced", [False, True], ids=["cpu-path", "triton"])
def test_q_out_receives_the_rotated_q_and_q_is_left_alone(monkeypatch, forced):
    # The piecewise graphs' static q buffer: the rotated q goes there, q (a view of qkv) is only read.
    qkv, rope, positions, norms, cache, slots = _case(torch.float32, 5, 4, 2, 16, True, seed=4)
    cos, sin = rope(positions)
    q, k, v = _split(qkv.clone(), 4, 2, 16)
    cache_ref = cache.clone()
    q_ref, k_ref = rotary_write_kv(q, k, v, cos, sin, cache_ref[0], cache_ref[1], slots, *norms)
    if forced:
        monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    qkv_f = qkv.clone()
    q, k, v = _split(qkv_f, 4, 2, 16)
    q_out = torch.full((8, 4, 16), float("nan"))[:5]
    cache_f = cache.clone()
    q_f, k_f = rotary_write_kv(q, k, v, cos, sin, cache_f[0], cache_f[1], slots, *norms, q_out=q_out)
    assert q_f.data_ptr() == q_out.data_ptr()
    torch.testing.assert_close(q_out, q_ref, **TOL[torch.float32])
    torch.testing.assert_close(k_f, k_ref, **TOL[torch.float32])
    torch.testing.assert_close(cache_f, cache_ref, **TOL[torch.float32])
    assert torch.equal(q, _split(qkv, 4, 2, 16)[0])  # the raw q, untouched
    with pytest.raises(ValueError, match="q_out"):
        rotary_write_kv_triton(q, k, v, cos, sin, cache_f[0], cache_f[1], slots, q_out=q_out[:4])


def test_bad_shapes_raise_value_error():
    qkv, rope, positions, _, cache, slots = _case(torch.float32, 2, 4, 2, 16, False)
    cos, sin = rope(positions)
    q, k, v = _split(qkv, 4, 2, 16)
    with pytest.raises(ValueError, match="both"):
        rotary_write_kv_triton(q, k, v, cos, sin, cache[0], cache[1], slots, torch.ones(16), None)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv_triton(q, k, v, cos, sin, cache[0], cache[1], slots[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm-rope"])
def test_bf16_on_gpu_matches_reference(norm):
    num_tokens, num_heads, num_kv_heads, head_dim = 37, 32, 8, 128
    qkv, rope, positions, norms, cache, slots = _case(torch.bfloat16, num_tokens, num_heads, num_kv_heads,
                                                      head_dim, norm)
    cos, sin = rope(positions)
    q, k, v = _split(qkv.clone(), num_heads, num_kv_heads, head_dim)
    if norms:
        q, k = norms[0](q), norms[1](k)
    q_ref, k_ref = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    cache_ref = cache.clone()
    write_kv_ref(k_ref, v, cache_ref[0], cache_ref[1], slots)
    qkv_f = qkv.clone().cuda()
    q, k, v = _split(qkv_f, num_heads, num_kv_heads, head_dim)
    cache_f = cache.clone().cuda()
    rotary_write_kv_triton(q, k, v, cos.cuda(), sin.cuda(), cache_f[0], cache_f[1], slots.cuda(),
                           norms[0].weight.cuda() if norms else None, norms[1].weight.cuda() if norms else None, 1e-6)
    torch.testing.assert_close(q.cpu(), q_ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(cache_f.cpu(), cache_ref, **TOL[torch.bfloat16])
