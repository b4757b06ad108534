"""Sampler: greedy rows, top-k/top-p sets, seeded noise that depends only on (seed, position)."""

from __future__ import annotations

import torch

from tandem.runner.sampler import apply_top_k_top_p, exponential_noise, sample


def _params(b: int, temperature: float, top_k: int = 0, top_p: float = 1.0):
    return (torch.full((b,), temperature), torch.full((b,), top_k, dtype=torch.int32), torch.full((b,), top_p))


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 50)
    t, k, p = _params(6, 0.0)
    out = sample(logits, t, k, p, torch.arange(6), torch.zeros(6, dtype=torch.int64), all_greedy=False,
                 any_top_k_top_p=False, num_logprobs=-1)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_and_top_p_keep_the_right_sets():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.5, 1.0]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False, False]
    probs = torch.softmax(logits[1], -1)  # 0.64, 0.23, ...: the first token alone reaches 0.5
    assert probs[0] > 0.5 and torch.isfinite(masked[1]).tolist() == [True, False, False, False, False]
    assert torch.isfinite(masked[2]).all()


def test_noise_is_a_pure_function_of_seed_and_position():
    a = exponential_noise(torch.tensor([7, 7, 8]), torch.tensor([3, 4, 3]), 1000)
    b = exponential_noise(torch.tensor([8, 7]), torch.tensor([3, 3]), 1000)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1])
    # Exp(1): mean 1, and the exponential race picks tokens with their softmax probabilities.
    big = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert abs(big.mean().item() - 1.0) < 0.02


def test_noise_is_never_zero_so_a_masked_token_never_wins():
    # Seed 7 at position 80 hashes vocabulary index 18011 to a 32-bit value that float32 rounded up to 1.0:
    # noise 0, so the race of that token was 0 / 0 = NaN, which won the argmax although the grammar had masked
    # it to -inf (a JSON string past its maxLength, sampled at temperature 1).
    noise = exponential_noise(torch.tensor([7]), torch.tensor([80]), 49152)
    assert noise[0, 18011].item() > 0.0 and noise.min().item() > 0.0 and torch.isfinite(noise).all()
    logits = torch.full((1, 49152), float("-inf"))
    logits[0, [18, 23597]] = torch.tensor([25.76, 25.81])  # the two tokens the grammar allowed
    t, k, p = _params(1, 1.0)
    out = sample(logits, t, k, p, torch.tensor([7]), torch.tensor([80]), all_greedy=False, any_top_k_top_p=False,
                 num_logprobs=-1)
    assert out.token_ids.item() in (18, 23597)


def test_random_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(4000, 3).clone()
    t, k, p = _params(4000, 1.0)
    out = sample(logits, t, k, p, torch.arange(4000), torch.full((4000,), 5), all_greedy=False,
                 any_top_k_top_p=False, num_logprobs=-1)
    freq = torch.bincount(out.token_ids, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_logprobs_of_chosen_and_top_n():
    logits = torch.randn(3, 40)
    t, k, p = _params(3, 0.0)
    out = sample(logits, t, k, p, torch.arange(3), torch.zeros(3, dtype=torch.int64), all_greedy=True,
                 any_top_k_top_p=False, num_logprobs=4)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.max(-1).values)
    assert torch.equal(out.top_ids, ref.topk(4).indices)
