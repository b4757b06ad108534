"""The decode kernel with fused rotary (NewTokens) against rotary_write_kv_triton followed by the plain decode
kernel: same outputs, same cache writes, raw q/k/v untouched (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.triton_attention import NewTokens, paged_decode_attention
from tandem.kernels.triton_rotary_kv import rotary_write_kv_triton
from tandem.layers.rotary import apply_rotary
from tests.sweeps import pairwise

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_step(seq_lens, *, group, head_dim, page, dtype, num_kv_heads=2, seed=0, device=DEVICE):
    """A decode step: each row's context (its new token last) in scattered pages, the new token's raw q/k/v
    rows in one fused qkv buffer, cos/sin of its position, and its cache slot (-1 for seq_len 0 rows)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    blocks_per_seq = [-(-n // page) for n in seq_lens]
    max_blocks = max(blocks_per_seq + [1]) + 1
    num_blocks = 2 + 2 * sum(blocks_per_seq)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    slots = torch.full((batch,), -1, dtype=torch.int64)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        if seq_lens[i]:
            last = seq_lens[i] - 1
            slots[i] = int(tables[i, last // page]) * page + last % page
    kv = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_heads = num_kv_heads * group
    qkv = torch.randn(batch, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(batch, head_dim // 2, generator=gen) * 6.0
    q_w = (1.0 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_w = (1.0 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    to = dict(device=device)
    return dict(kv=kv.to(**to), qkv=qkv.to(**to), tables=tables.to(**to), slots=slots.to(**to),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                cos=angles.cos().to(dtype).to(**to), sin=angles.sin().to(dtype).to(**to),
                q_w=q_w.to(**to), k_w=k_w.to(**to), num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim)


def split_qkv(qkv, st):
    h, kvh, d = st["num_heads"], st["num_kv_heads"], st["head_dim"]
    b = qkv.shape[0]
    q = qkv[:, : h * d].view(b, h, d)
    k = qkv[:, h * d : (h + kvh) * d].view(b, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(b, kvh, d)
    return q, k, v


def run_both(st, *, norm, num_splits, order=None, one_tile_programs=None):
    """(fused output, fused cache, unfused output, unfused cache, raw qkv after the fused call); one_tile_programs
    for the fused call only."""
    weights = (st["q_w"], st["k_w"]) if norm else (None, None)
    scale = st["head_dim"] ** -0.5
    kv_ref = st["kv"].clone()
    qkv_ref = st["qkv"].clone()
    q, k, v = split_qkv(qkv_ref, st)
    rotary_write_kv_triton(q, k, v, st["cos"], st["sin"], kv_ref[0], kv_ref[1], st["slots"], *weights, eps=1e-6)
    ref = paged_decode_attention(q, kv_ref[0], kv_ref[1], st["tables"], st["seq_lens"], scale,
                                 num_splits=num_splits, order=order)
    kv = st["kv"].clone()
    qkv = st["qkv"].clone()
    q, k, v = split_qkv(qkv, st)
    new = NewTokens(k, v, st["cos"], st["sin"], st["slots"], *weights, eps=1e-6)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kv[0], kv[1], st["tables"], st["seq_lens"], scale, out, num_splits=num_splits,
                           order=order, new_tokens=new, one_tile_programs=one_tile_programs)
    return out, kv, ref, kv_ref, qkv


# Every pair of (splits, shape, norm, dtype) values; the cross product on a GPU or with TANDEM_FULL_SWEEPS=1.
@pytest.mark.parametrize("num_splits,group,head_dim,norm,dtype",
                         pairwise([1, 3, 16], [(1, 64), (4, 128), (2, 80)], [False, True],
                                  [torch.float32, torch.float16]),
                         ids=lambda v: ("qk_norm+rope" if v else "rope") if isinstance(v, bool) else str(v))
def test_fused_rotary_decode_equals_rotary_then_decode(dtype, norm, group, head_dim, num_splits):
    # Contexts across page boundaries, a new token first in its page (17, 33), one-token contexts, padding rows.
    seq_lens = [17, 0, 1, 70, 33, 5, 0, 129]
    st = make_step(seq_lens, group=group, head_dim=head_dim, page=16, dtype=dtype)
    out, kv, ref, kv_ref, qkv = run_both(st, norm=norm, num_splits=num_splits)
    assert not torch.isnan(out).any()
    # Without the norm every rounding matches; the norm's sum of squares may add up in another order.
    tol = TOL[dtype] if norm else dict(atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=1e-6)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(kv, kv_ref, **(TOL[dtype] if norm else dict(atol=0, rtol=0)))
    assert torch.equal(qkv, st["qkv"])  # the raw projections are left as they were
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[6], torch.zeros_like(out[6]))


@pytest.mark.parametrize("one_tile_programs", [0, 28])
def test_fused_rotary_decode_with_two_tile_shares(one_tile_programs):
    # The new token lands in whichever share holds the last position, also when a sequence takes two tiles a share
    # and leaves the trailing splits empty: every sequence at 0, at 28 (over 7 rows x 2 kv heads: more than 2
    # tiles) the 129 tokens' 3 tiles of 64 (fp32), in 2 shares.
    st = make_step([17, 0, 1, 70, 33, 5, 129], group=4, head_dim=64, page=16, dtype=torch.float32)
    out, kv, ref, kv_ref, _ = run_both(st, norm=True, num_splits=16, one_tile_programs=one_tile_programs)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(kv, kv_ref, **TOL[torch.float32])
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_fused_rotary_decode_program_order_changes_no_result():
    st = make_step([40, 3, 90, 1], group=4, head_dim=64, page=16, dtype=torch.float32)
    order = torch.tensor([2, 0, 1, 3], dtype=torch.int32, device=DEVICE)
    plain = run_both(st, norm=False, num_splits=4)
    ordered = run_both(st, norm=False, num_splits=4, order=order)
    assert torch.equal(plain[0], ordered[0]) and torch.equal(plain[1], ordered[1])


def test_new_tokens_are_checked():
    st = make_step([5, 9], group=1, head_dim=64, page=16, dtype=torch.float32)
    q, k, v = split_qkv(st["qkv"], st)
    args = (q, st["kv"][0], st["kv"][1], st["tables"], st["seq_lens"], 0.125)
    with pytest.raises(ValueError, match="new k"):
        paged_decode_attention(*args, new_tokens=NewTokens(k[:1], v[:1], st["cos"], st["sin"], st["slots"]))
    with pytest.raises(ValueError, match="partial rotary"):
        paged_decode_attention(*args, new_tokens=NewTokens(k, v, st["cos"][:, :8], st["sin"][:, :8], st["slots"]))
    with pytest.raises(ValueError, match="both q and k norm"):
        paged_decode_attention(*args, new_tokens=NewTokens(k, v, st["cos"], st["sin"], st["slots"], st["q_w"]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("group,num_kv_heads,batch", [(1, 32, 1), (4, 8, 32), (2, 8, 3)])
def test_gpu_fused_rotary_decode_bf16(group, num_kv_heads, batch):
    """Llama-2-7B (bs1, many splits), Llama-3-8B (batch 32, one split) and Qwen3-like shapes in bf16 with
    contexts up to 2k: the fused kernel equals rotary_write_kv + decode, and writes the cache as torch's
    apply_rotary rounds."""
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 2048, (batch,), generator=gen).tolist()
    st = make_step(seq_lens, group=group, head_dim=128, page=16, dtype=torch.bfloat16, num_kv_heads=num_kv_heads)
    for norm in (False, True):
        out, kv, ref, kv_ref, qkv = run_both(st, norm=norm, num_splits=None)
        torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
        # rotary_write_kv_triton's products may be contracted into bf16 FMAs by the compiler (a last-bit
        # difference); without the norm, the fused kernel's k equals torch's apply_rotary in bf16 exactly.
        torch.testing.assert_close(kv, kv_ref, atol=2**-5, rtol=2**-7)
        assert torch.equal(qkv, st["qkv"])
        if not norm:
            _, k, v = split_qkv(st["qkv"], st)
            rows = st["slots"] >= 0
            slots = st["slots"][rows]
            cached_k = kv[0].flatten(0, 1)[slots]
            assert torch.equal(cached_k, apply_rotary(k[rows], st["cos"][rows, None], st["sin"][rows, None]))
            assert torch.equal(kv[1].flatten(0, 1)[slots], v[rows])


_COMPILE_SM90 = r"""
import json, re, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_attention import _decode_split_kernel as kernel, _merge_tile

ptr_types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
             "order_ptr": "*i32", "out_ptr": "*bf16", "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "counts_ptr": "*i32",
             "new_k_ptr": "*bf16", "new_v_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "qw_ptr": "*bf16",
             "kw_ptr": "*bf16", "slot_ptr": "*i64", "oscale_ptr": "*fp32"}
unit = ("stride_d", "stride_qd", "stride_od")  # Triton specializes strides of 1 to constants
out = {}
for group, block_n, stages, rotary, direct, fp8, kv8 in (
        (1, 64, 2, True, False, False, False), (4, 128, 3, True, True, False, False),
        (4, 128, 3, False, True, False, False), (2, 64, 3, False, False, False, False),
        (4, 128, 3, True, True, True, False), (2, 64, 3, False, False, True, False),
        (4, 128, 5, True, True, True, True), (2, 64, 3, False, False, False, True), (1, 128, 2, True, True, False, True)):
    merge_g, merge_s = _merge_tile(group, 128, 32)
    consts = dict(GROUP=group, BLOCK_G=1 if group == 1 else 16, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_N=block_n,
                  MERGE_G=merge_g, MERGE_S=merge_s, USE_DOT=group > 1, DOT_PRECISION="tf32", DIRECT_OUT=direct,
                  USE_PDL=2, KV_HEADS=8, HAS_ORDER=True, ROTARY=rotary, HAS_NORM=rotary and group == 4, LINES=2,
                  FP8_OUT=fp8, KV_FP8=kv8, KV_DT=tl.float16, ONE_TILE_PROGRAMS=264, **{u: 1 for u in unit})
    types = {**ptr_types, "out_ptr": "*fp8e4nv" if fp8 else "*bf16"}
    if kv8:
        types.update(k_ptr="*fp8e4nv", v_ptr="*fp8e4nv")
    sig = {a: types.get(a, "constexpr" if a in consts else "fp32" if a in ("eps", "qk_scale") else "i32")
           for a in kernel.arg_names}
    div = [i for i, a in enumerate(kernel.arg_names) if a in ptr_types or (a.startswith("stride") and a not in unit)]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages}).asm
    ptx = asm["ptx"]
    # Every instruction word in program order (the L2 prefetch sits inside an inline-asm block).
    words = [w for l in ptx.splitlines() for w in l.split("//")[0].replace("{", " ").replace(";", "; ").split()]
    ops = [w for w in words if w.startswith(("ld.", "st.", "atom.", "red.", "griddepcontrol", "prefetch"))]
    # The KV tile buffers in shared memory (how many tiles of K, of V the pipeline holds).
    buffers = [int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x128x", asm["ttgir"])]
    out[f"group{group}-fp8{fp8}-kvfp8{kv8}-rotary{rotary}-direct{direct}"] = {"ops": ops, "buffers": buffers}
json.dump(out, sys.stdout)
"""


def test_decode_kernel_compiles_for_sm90_and_reads_its_first_tile_before_the_wait():
    """On Hopper the decode kernel (plain and with fused rotary, split and direct, bf16 and FP8 KV cache) keeps
    nothing in local memory;
    before the wait for the previous kernel it reads its first KV tile (with fused rotary into registers: 128-bit
    loads, as many as the tile's K and V need; without, a prefetch into L2) and writes nothing (no store, no
    atomic), as the PDL contract requires; the split variants count in with an atomic after it."""
    from tests.kernels.sm90 import compile_sm90

    for variant, got in compile_sm90(_COMPILE_SM90).items():
        ops = got["ops"]
        if variant.startswith("group4") and "kvfp8True" in variant:  # 5 stages (_decode_stages): two of each
            assert got["buffers"] == [2, 2], (variant, got["buffers"])
        assert not any(op.startswith(("ld.local", "st.local")) for op in ops), variant
        wait = ops.index("griddepcontrol.wait;")
        before = ops[:wait]
        if "rotaryTrue" in variant:
            block_n = 64 if variant.startswith("group1") and "kvfp8False" in variant else 128
            elem = 1 if "kvfp8True" in variant else 2
            wide = [op for op in before if op.startswith("ld.global") and op.endswith(".v4.b32")]
            assert len(wide) == 2 * block_n * 128 * elem // 16 // 128, (variant, before)  # 4 warps of 32 threads
        else:
            assert any(op.startswith("prefetch.global.L2") for op in before), (variant, before)
        assert not any(op.startswith(("st.global", "atom.", "red.")) for op in before), (variant, before)
        atomics = [op for op in ops[wait:] if op.startswith("atom.")]
        assert (atomics != []) == variant.endswith("directFalse"), (variant, atomics)


def test_fuses_decode_rotary_where_the_decode_grid_fits_one_wave(monkeypatch):
    from tandem.kernels import ops
    from tandem.layers.norm import RMSNorm

    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    q, cos = torch.zeros(4, 8, 64), torch.zeros(4, 32)
    k = torch.zeros(4, 2, 64)
    assert ops.fuses_decode_rotary(q, k, cos, None, None)
    assert ops.fuses_decode_rotary(torch.zeros(32, 32, 64), torch.zeros(32, 8, 64), cos, None, None)  # 256 programs
    wide = torch.zeros(256, 8, 64)  # 2048 programs: several waves on 132 SMs (the interpreter's count)
    assert not ops.fuses_decode_rotary(torch.zeros(256, 32, 64), wide, cos, None, None)
    monkeypatch.setenv("TANDEM_DECODE_ROTARY", "1")
    assert ops.fuses_decode_rotary(torch.zeros(256, 32, 64), wide, cos, None, None)
    monkeypatch.delenv("TANDEM_DECODE_ROTARY")
    assert not ops.fuses_decode_rotary(q, k, torch.zeros(4, 16), None, None)  # partial rotary
    assert ops.fuses_decode_rotary(q, k, cos, RMSNorm(64, 1e-6), RMSNorm(64, 1e-6))
    assert not ops.fuses_decode_rotary(q, k, cos, RMSNorm(64, 1e-6), RMSNorm(64, 1e-5))
    assert not ops.fuses_decode_rotary(q, k, cos, RMSNorm(64, 1e-6), None)
    monkeypatch.setenv("TANDEM_DECODE_ROTARY", "0")
    assert not ops.fuses_decode_rotary(q, k, cos, None, None)


def test_decode_fp8_groups_where_o_proj_runs_the_w8a8_gemm(monkeypatch):
    """The decode attention writes FP8 rows for o_proj only where o_proj would quantize rows for its W8A8 GEMM
    (2 to W8A8_MAX_M rows on Triton) and a kv head's group of columns fills whole FP8 K tiles."""
    from tandem.kernels import ops
    from tandem.kernels.fp8 import W8A8_MAX_M

    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    assert ops.decode_fp8_groups(torch.zeros(8, 32, 128), 8)  # groups of 4 heads x 128
    assert ops.decode_fp8_groups(torch.zeros(W8A8_MAX_M, 8, 64), 8)  # one head of 64 a group
    assert not ops.decode_fp8_groups(torch.zeros(1, 32, 128), 8)  # one row: the GEMV takes bf16 rows
    assert not ops.decode_fp8_groups(torch.zeros(W8A8_MAX_M + 1, 32, 128), 8)  # _scaled_mm scales whole rows
    assert not ops.decode_fp8_groups(torch.zeros(8, 8, 80), 8)  # 80 columns: no K tile of >= 32 fits
    monkeypatch.setenv("TANDEM_DECODE_FP8_OUT", "0")
    assert not ops.decode_fp8_groups(torch.zeros(8, 32, 128), 8)
    monkeypatch.setenv("TANDEM_DECODE_FP8_OUT", "1")
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "0")
    assert not ops.decode_fp8_groups(torch.zeros(8, 32, 128), 8)  # CPU references
