"""LogitsState in a verify step: each draft row reads its sequence's penalties and bias with the drafts before it
counted as output, and after the step only the rows the verify kept add their tokens (CPU, against penalties
computed from each row's explicit token history)."""

from __future__ import annotations

import torch

from tandem.request import Request
from tandem.runner.logits_state import LogitsState
from tandem.sampling_params import SamplingParams
from tandem.scheduler.output import ScheduledRequest

V = 32


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams) -> torch.Tensor:
    """The penalties and bias of one row whose request has output `output` so far (vLLM's rules)."""
    x = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    rep = sp.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0).float()
    for token, value in (sp.logit_bias or {}).items():
        x[token] += value
    return x


def request(rid: str, prompt: list[int], output: list[int], sp: SamplingParams) -> Request:
    r = Request(rid, prompt, sp, frozenset(), 128, 0)
    r.output_token_ids = list(output)
    return r


def test_verify_rows_count_the_drafts_before_them_and_keep_only_the_kept_tokens():
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7,
                        logit_bias={3: 1.5})
    a = request("a", [1, 2, 3], [4, 5, 4], sp)  # 2 drafts
    b = request("b", [6, 7], [], SamplingParams(temperature=0.0))  # no logits state, 1 draft
    c = request("c", [8], [9], sp)  # no drafts
    drafts = {"a": [4, 9], "b": [6]}
    scheduled = [ScheduledRequest(a, 6, 3, [4, *drafts["a"]], False, [0], True, 2),
                 ScheduledRequest(b, 2, 2, [7, *drafts["b"]], False, [1], True, 1),
                 ScheduledRequest(c, 2, 1, [9], False, [2], True, 0)]
    # Rows: own rows 0..2, then a's draft rows 3, 4 and b's 5.
    draft_rows = [(0, 3, 2), (1, 5, 1)]
    state = LogitsState(4, V, torch.device("cpu"))
    plan = state.prepare(0, scheduled, True, draft_rows, 6)
    assert plan is not None and plan.num_rows == 6 and plan.verifies
    state.upload(0)
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(0))  # 2 padding rows
    got = logits.clone()
    state.apply(0, got)
    prompt_a, out_a = a.prompt_token_ids, a.output_token_ids
    expected = {0: penalized(logits[0], prompt_a, out_a + drafts["a"], sp),  # after both drafts
                3: penalized(logits[3], prompt_a, out_a, sp),  # draft 0's row: nothing before it
                4: penalized(logits[4], prompt_a, out_a + drafts["a"][:1], sp),
                2: penalized(logits[2], c.prompt_token_ids, c.output_token_ids, sp)}
    for row, want in expected.items():
        torch.testing.assert_close(got[row], want, msg=f"row {row}")
    for row in (1, 5, 6, 7):  # b has no logits state; padding rows are left alone
        assert torch.equal(got[row], logits[row]), row
    # a kept its first draft and the token sampled after it (row 4: the second draft rejected); c its own row.
    sampled = torch.tensor([11, 12, 13, 4, 10, 6])
    keep = torch.tensor([0, 1, 1, 1, 1, 0], dtype=torch.int32)
    state.count(0, sampled, keep)
    row_a, row_c = state.held["a"][1], state.held["c"][1]
    want_a = torch.bincount(torch.tensor(out_a + [4, 10]), minlength=V).int()
    want_c = torch.bincount(torch.tensor(c.output_token_ids + [13]), minlength=V).int()
    assert torch.equal(state.counts[row_a], want_a)
    assert torch.equal(state.counts[row_c], want_c)
