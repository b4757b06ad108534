"""SpecController: keeps speculative decoding on only while it pays, from the engine's own measured steps.

Speculating costs more than the rejected rows' compute: a host proposer needs each request's last token, so the
loop collects a step before scheduling the next and the host's share of a step is no longer hidden behind the GPU.
For a large model at batch 1 that share is small and accepted drafts win big; for a small model, whose steps the
host paces, or a large batch, it can cost more than the drafts save. So the engine times both kinds of step: the
seconds per output token of speculating steps and of plain ones (moving averages), with a few plain steps every
`probe_every` while speculating and a few speculating steps every `retry_every` while not, and speculates while
that is the cheaper kind. The outputs are the same either way (speculation is exact); only the speed differs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpecController:
    probe_every: int = 64  # while speculating: steps between plain probes
    probe_len: int = 4  # steps of each probe (either kind)
    retry_every: int = 256  # while plain: steps before speculating is tried again
    alpha: float = 0.2  # weight of a new step in the moving averages
    margin: float = 1.02  # speculation must be this much cheaper per token to stay on
    # Speculating steps (since the mode began) before speculation may go off: enough for the averages, and few
    # enough that a short request does not pay long for a proposer that does not help it.
    decide_after: int = 16
    speculating: bool = True  # the mode (probes aside)
    # Moving averages of (seconds, output tokens) per step of each kind: the cost per token is their ratio (the
    # mean of per-step ratios would overweight steps that accepted nothing).
    spec_avg: tuple[float, float] | None = None
    plain_avg: tuple[float, float] | None = None
    steps: int = 0  # steps in the current mode

    @property
    def spec_cost(self) -> float | None:
        """Seconds per output token of speculating steps."""
        return self.spec_avg[0] / self.spec_avg[1] if self.spec_avg else None

    @property
    def plain_cost(self) -> float | None:
        return self.plain_avg[0] / self.plain_avg[1] if self.plain_avg else None

    def speculate(self) -> bool:
        """Whether the next step speculates: the mode, except during a probe of the other kind."""
        self.steps += 1
        if self.speculating:
            return self.steps % self.probe_every >= self.probe_len
        if self.steps >= self.retry_every:
            return True  # a trial: record() decides whether speculating comes back
        return False

    def record(self, speculated: bool, seconds: float, num_tokens: int) -> None:
        """A step's wall time and the output tokens it produced (steps without tokens are not counted)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        avg = self.spec_avg if speculated else self.plain_avg
        a = self.alpha
        avg = (seconds, float(num_tokens)) if avg is None else ((1 - a) * avg[0] + a * seconds,
                                                                (1 - a) * avg[1] + a * num_tokens)
        if speculated:
            self.spec_avg = avg
        else:
            self.plain_avg = avg
        spec_cost, plain_cost = self.spec_cost, self.plain_cost
        if spec_cost is None or plain_cost is None:
            return
        pays = spec_cost * self.margin < plain_cost
        if self.speculating and not pays and self.steps >= self.decide_after:
            self.speculating, self.steps = False, 0
        elif not self.speculating and self.steps >= self.retry_every + self.probe_len:
            self.speculating, self.steps = pays, 0
