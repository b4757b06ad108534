"""Piecewise CUDA graphs, the parts that run without a GPU: the attention split that capture relies on, the
token buckets, and the config. (Capture and replay themselves: tests/gpu/test_gpu_engine.py.)

Under `split_at_attention` every Attention.attend goes to the split, which here does at once what a replay
does between two pieces: q in one static buffer (written there by the rotary kernel through q_out, or
copied), the real attention written into one static output buffer that the model reads on. Logits must not
change, for every architecture, on a step that mixes a prefill, a chunk and decodes.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.config import EngineConfig
from tandem.kernels import ops
from tandem.layers.attention import Attention, split_at_attention
from tandem.models.loader import load_model_and_tokenizer
from tandem.runner.cuda_graphs import piecewise_sizes
from tests.models.paged_kv import PagedKV, Seq
from tests.parallel.tiny_models import FAMILIES, tiny_config


class EagerSplit:
    """What PiecewiseGraphs does around one attention call, without graphs."""

    def __init__(self, meta, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
        self.meta = meta
        self.max_tokens = max_tokens
        self.q_buf: torch.Tensor | None = None
        self.out_buf: torch.Tensor | None = None
        self.calls: list[Attention] = []
        self.copies = 0  # calls whose q was not in the static buffer already

    def q_out(self, q: torch.Tensor) -> torch.Tensor:
        if self.q_buf is None:
            self.q_buf = torch.full((self.max_tokens, *q.shape[1:]), float("nan"), dtype=q.dtype)
            self.out_buf = torch.full_like(self.q_buf, float("nan"))  # rows past n are never read
        return self.q_buf[: q.shape[0]]

    def __call__(self, layer: Attention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        if q.data_ptr() != self.q_out(q).data_ptr():
            self.q_buf[:n].copy_(q)  # type: ignore[index]
            self.copies += 1
        self.calls.append(layer)
        out = self.out_buf[:n]  # type: ignore[index]
        result = ops.paged_attention(self.q_buf[:n], k_cache, v_cache, self.meta, layer.scale, out)
        assert result.data_ptr() == out.data_ptr()
        return out


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config(request.param)).float().save_pretrained(folder)
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32")
    model, mc, _ = load_model_and_tokenizer(config, torch.device("cpu"), torch.float32, load_tokenizer=False)
    return model.eval(), mc


def mixed_step(mc, seed: int):  # type: ignore[no-untyped-def]
    """KV of three sequences, then one step with a decode, a chunk of a long prompt and a new prompt."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(3, mc.vocab_size, (n,), generator=gen).tolist() for n in (9, 30, 6)]
    kv = PagedKV(mc, num_blocks=64, block_size=4, seed=seed)
    seqs = [Seq(tokens[0]), Seq(tokens[1]), Seq(tokens[2])]
    return kv, seqs


@torch.inference_mode()
def test_split_attention_gives_the_model_the_same_logits(family_model):
    model, mc = family_model
    results = []
    for split in (False, True):
        kv, seqs = mixed_step(mc, seed=3)
        ctx = kv.step(seqs[:2], [8, 12])  # context: 8 tokens of seq 0, 12 of seq 1
        model(ctx.input_ids, ctx.positions, kv.kv_cache, ctx.meta)
        step = kv.step(seqs, [1, 10, 6])  # decode, chunk, whole new prompt: 17 tokens
        splitter = EagerSplit(step.meta, max_tokens=32)
        if split:
            with split_at_attention(splitter):
                hidden = model(step.input_ids, step.positions, kv.kv_cache, step.meta)
            assert splitter.calls == [m for m in model.modules() if isinstance(m, Attention)]
            assert len(splitter.calls) == mc.num_layers
            # Rotary models hand attention its q in the static buffer already; GPT-2 (no rotary) copies it.
            assert splitter.copies == (mc.num_layers if mc.architecture == "gpt2" else 0)
        else:
            hidden = model(step.input_ids, step.positions, kv.kv_cache, step.meta)
        results.append(model.compute_logits(hidden[step.last_token_idx]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_split_is_scoped_and_not_nested():
    def boom(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("called")

    with pytest.raises(RuntimeError, match="already split"):
        with split_at_attention(boom):
            with split_at_attention(boom):
                pass
    with pytest.raises(ValueError):
        with split_at_attention(boom):
            raise ValueError("inside")
    from tandem.layers import attention

    assert attention._split is None  # cleared on the way out, whatever happened inside


def test_piecewise_buckets_cover_every_token_count_with_little_padding():
    for max_tokens in (1, 5, 8, 100, 512, 2048):
        sizes = piecewise_sizes(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens
        for n in range(1, max_tokens + 1):
            bucket = next(s for s in sizes if s >= n)
            assert bucket - n < 8 or bucket <= 1.25 * n, (max_tokens, n, bucket)


def test_piecewise_max_tokens_is_validated():
    assert EngineConfig(piecewise_max_tokens=0).piecewise_max_tokens == 0
    with pytest.raises(ValueError, match="piecewise_max_tokens"):
        EngineConfig(piecewise_max_tokens=-1)
