"""A tensor-parallel rank's life: joining the ranks (rank 0 spawns the others, or torchrun starts them all) and, on
ranks 1..N-1, the loop that replays rank 0's steps through this rank's own ModelRunner."""

from __future__ import annotations

import functools
import logging
import time

import torch

from tandem.config import EngineConfig, ParallelConfig
from tandem.distributed.launch import exit_worker, start_tensor_parallel
from tandem.distributed.ranks import TensorParallelGroup
from tandem.layers.parallel import check_tp_shape
from tandem.models.loader import load_model_config
from tandem.runner.model_runner import ModelRunner, SideOutputs
from tandem.runner.step_plan import StepPlan

logger = logging.getLogger(__name__)


def start_ranks(config: EngineConfig, side: SideOutputs | None = None) -> TensorParallelGroup | None:
    """Rank 0's (or, under torchrun, every rank's) start: None for one rank. A model that cannot be split is a
    ValueError here, before any process starts. Spawned ranks get `side` too: their forwards copy the same hidden
    states (whose sums over the ranks are collectives every rank joins)."""
    size = config.tensor_parallel_size
    if size > 1:
        check_tp_shape(load_model_config(config), ParallelConfig(0, size, config.enable_expert_parallel))
    return start_tensor_parallel(config, functools.partial(worker_main, side=side))


def engine_runner(config: EngineConfig, side: SideOutputs | None = None) -> ModelRunner:
    """The engine's runner: rank 0's, after spawning ranks 1..N-1 for tensor parallelism. Under torchrun every process
    calls this, and on ranks other than 0 it never returns: the process serves rank 0's steps, then ends. `side`:
    what an EAGLE-3 head needs besides the tokens (the head itself runs on rank 0; every rank copies the hidden
    states)."""
    group = start_ranks(config, side)
    if group is not None and group.rank != 0:
        worker_main(config, group, side)
        exit_worker()
    try:
        return ModelRunner(config, group, side)
    except BaseException:
        if group is not None:
            group.abort()
        raise


def worker_main(config: EngineConfig, group: TensorParallelGroup, side: SideOutputs | None = None) -> None:
    """Ranks 1..N-1: build this rank's runner, then replay rank 0's steps until it says stop or goes away."""
    worker = RankWorker(ModelRunner(config, group, side), group)
    try:
        worker.serve()
    except Exception:
        # Rank 0 gone (its socket closed) or this rank failed: rank 0 sees this process exit.
        logger.exception("tensor-parallel rank %d stops", group.rank)
        exit_worker(1)
    # Rank 0 said stop and is doing the same: finish this GPU's work, release the graphs, destroy the group.
    worker.runner.shutdown()


class RankWorker:
    """Replays rank 0's steps on this rank, and records their GPU spans for rank 0's timeline when asked."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup) -> None:
        self.runner, self.group = runner, group
        self._span_pending: list[int | None] = [None, None]  # timed step per slot whose span is not read yet
        self._span_base: tuple[object, float] = (None, 0.0)
        self._spans: list[tuple[int, float, float]] = []

    def serve(self) -> None:
        while True:
            fields = self.group.recv_step()
            if fields is None:
                return
            if isinstance(fields, str):  # between steps: "report" (GPU spans) or "bench" (an all-reduce timing, done)
                if fields == "report":
                    self.group.send_spans(self.take_spans())
                elif fields == "bytes" and self.runner.lora is not None:  # LoRA page-ins for the next step
                    self.runner.lora.stage_message(self.group.received)
                continue
            self.launch(StepPlan.from_fields(fields))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> None:
        """Rank 0's step, received into this rank's slot buffers, launched without the D2H of tokens."""
        runner = self.runner
        if plan.step_index != runner.step_index or plan.slot != runner.step_index % 2:
            raise RuntimeError(f"tensor-parallel rank {runner.parallel.rank} expected step {runner.step_index}, "
                               f"got step {plan.step_index} (slot {plan.slot})")
        if plan.timing != runner.timing:
            self._set_timing(plan.timing)
        # This rank's own GPU must be done with the slot's previous step before its buffers are rewritten
        # (rank 0 has the same guarantee from its wait on that step).
        events = runner.events[plan.slot]
        if runner.tp.timed_out is not None:
            events.d2h_done.synchronize()  # after compute_done: the flag's copy too
        else:
            events.compute_done.synchronize()
        runner.check_all_reduce_timeout()  # raises: the worker leaves, and rank 0 fails the group
        self._record_span(plan.slot)
        prompt_rows = runner.prompt_logprobs.receive(plan.slot, plan.prompt_rows, plan.prompt_top_k)
        self.group.recv_payload(plan.regions(runner.buffers[plan.slot]) + prompt_rows)
        runner.enqueue_plan(plan, download=False)
        if runner.timing:
            self._span_pending[plan.slot] = plan.step_index
        runner.step_index += 1

    # ---------------------------------------------------------------- GPU spans (timeline)

    def _set_timing(self, enabled: bool) -> None:
        """New events for the timeline; the old ones may still guard in-flight steps, so drain first."""
        runner = self.runner
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        for slot in (0, 1):
            self._record_span(slot)
        runner.set_timing(enabled)
        if enabled and runner.device.type == "cuda":
            base = torch.cuda.Event(enable_timing=True)
            base.record(runner.streams.compute)
            base.synchronize()
            self._span_base = (base, time.perf_counter())

    def _record_span(self, slot: int) -> None:
        """The GPU span of the slot's last timed step, whose compute_done has already fired."""
        step = self._span_pending[slot]
        if step is None:
            return
        self._span_pending[slot] = None
        ev = self.runner.events[slot]
        if self.runner.device.type != "cuda":
            self._spans.append((step, ev.compute_start.time, ev.compute_done.time))  # type: ignore[attr-defined]
            return
        base_event, base_time = self._span_base
        self._spans.append((step, base_time + base_event.elapsed_time(ev.compute_start) / 1000.0,  # type: ignore
                            base_time + base_event.elapsed_time(ev.compute_done) / 1000.0))  # type: ignore

    def take_spans(self) -> list[tuple[int, float, float]]:
        """(step, start, end) of every timed step so far, waiting for the last ones to finish."""
        for slot in (0, 1):
            if self._span_pending[slot] is not None:
                self.runner.events[slot].compute_done.synchronize()
                self._record_span(slot)
        spans, self._spans = self._spans, []
        return spans
