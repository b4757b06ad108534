"""DataParallelEngine: M engine-core replica processes driven from this one, behind EngineCore's interface.

`LLM(..., data_parallel_size=M)` starts the engine-core processes `tandem serve --data-parallel-size M`
runs (`start_engines`: each a whole engine on its own GPU(s), or all on the CPU) and talks to them over
ZeroMQ with the server's msgspec messages. `add_request` validates the prompt here, so a bad one is a
ValueError at once, and routes it (prefix affinity, then load); `step` sends the queued commands and
returns the outputs every replica has produced since. The replicas step on their own, never waiting for
this process, which only routes, collects and detokenizes. A replica that dies fails only its own
requests (each gets a finished output with `error` naming the replica) and is left out of routing from
then on; the others go on. Once every replica has died, `step` raises RuntimeError and the engine is shut
down. Shutdown (or exit) stops and reaps every replica.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import replace
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.core import check_lora_request, check_new_request
from tandem.engine.messages import (AbortRequest, AddRequest, ClientCommand, EngineBatch, UnloadLoRA, WireStats,
                                   merge_reported)
from tandem.engine.router import ReplicaRouter, work
from tandem.lora_request import LoRARequest
from tandem.outputs import EngineOutput
from tandem.request import FinishReason
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_MS = 1000  # a waiting step wakes this often even when nothing happens (signals, Ctrl-C)
UNBOUNDED_QUEUE = 1 << 30  # offline: every prompt of a generate() call is queued at once, none refused


class DataParallelEngine:
    """M engine-core replicas seen as one engine: add_request / abort_request / step / stats / shutdown."""

    def __init__(self, config: EngineConfig) -> None:
        from tandem.engine.launch import start_engines
        from tandem.models.loader import resolve_source
        from tandem.distributed.ranks import torchrun_rank

        if torchrun_rank() is not None:
            raise ValueError("data_parallel_size > 1 starts its own engine processes; it cannot run under "
                             "torchrun (use torchrun for tensor parallelism only)")
        # A bad model path is a ValueError here, as with one engine; a Hub model downloads once, not M times.
        resolve_source(config)
        self.config = config
        self.data_parallel_size = config.data_parallel_size
        self._model_config: ModelConfig | None = None
        self._failure: str | None = None
        self._closed = False
        # The tokenizer loads here while the replicas load their models (it takes seconds).
        tokenizer: list[Any] = []
        loader = threading.Thread(target=lambda: tokenizer.append(_load_tokenizer(config)), daemon=True)
        loader.start()
        self.engines = start_engines(replace(config, data_parallel_size=1), num_api_servers=1,
                                     data_parallel_size=config.data_parallel_size, max_queue=UNBOUNDED_QUEUE,
                                     log_level="warning")
        self._ctx = zmq.Context()
        try:
            loader.join()
            if not tokenizer:
                raise RuntimeError("the tokenizer could not be loaded")
            if isinstance(tokenizer[0], BaseException):
                raise tokenizer[0]
            self.tokenizer = tokenizer[0]
            info = self.engines.info  # the smallest context any replica allows
            self.max_model_len = info.max_model_len
            self.vocab_size = info.vocab_size
            self.router = ReplicaRouter(config.data_parallel_size, config.block_size)
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.RCVHWM, 0)
            self._pull.bind(self.engines.output_addrs[0])  # every replica's outputs arrive here
            self._pushes: list[zmq.Socket] = []
            for addr in self.engines.input_addrs:
                push = self._ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.SNDHWM, 0)
                push.connect(addr)
                self._pushes.append(push)
        except BaseException:
            self.engines.stop()
            self._ctx.destroy(linger=0)
            raise
        # A dead replica's sentinel becomes readable: a step waits on outputs and deaths at once.
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._sentinels = {r.process.sentinel: i for i, r in enumerate(self.engines.replicas)}
        self._dead: dict[int, str] = {}  # replica -> why it is out
        for fd in self._sentinels:
            self._poller.register(fd, zmq.POLLIN)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineBatch)
        self._outboxes: list[list[ClientCommand]] = [[] for _ in self._pushes]
        self._replica_of: dict[str, int] = {}  # unfinished request id -> its replica
        self._work_of: dict[str, int] = {}  # unfinished request id -> its tokens in the router's load
        self.routed_tokens = [0] * config.data_parallel_size  # work sent to each replica so far (the bench's balance)
        self._replica_stats: list[WireStats | None] = [None] * config.data_parallel_size
        self._checked_loras: dict[int, LoRARequest] = {}  # adapters _check_lora has read, by lora_int_id
        atexit.register(self.shutdown)  # before multiprocessing's own exit hook joins the replicas

    # ---------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> None:
        """Checks everything a replica would refuse (EngineCore.add_request's rules; an adapter's config and shapes
        against the replicas' projections), so a bad prompt is a ValueError here and now, as with one engine;
        then queues the request on its replica, which makes the adapter's copy and pages it in itself."""
        self._check_open()
        # max_model_len is already capped by every replica's KV pool, so the scheduler's pool check holds too.
        check_new_request(request_id, prompt_token_ids, params, self._replica_of, self.vocab_size,
                          self.max_model_len)
        if lora_request is not None:
            self._check_lora(lora_request)
        # Routed by tokens in flight; with no max_tokens a request may run to the context limit.
        max_new = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_token_ids)
        replica = self.router.pick(prompt_token_ids, max_new)
        self._replica_of[request_id] = replica
        self._work_of[request_id] = work(prompt_token_ids, max_new)
        self.routed_tokens[replica] += self._work_of[request_id]
        self._outboxes[replica].append(AddRequest(request_id, list(prompt_token_ids), params, 0, lora_request))

    def _check_lora(self, lora_request: LoRARequest) -> None:
        """ValueError naming the adapter where a replica would refuse it (not a LoRARequest, LoRA off, a rank above
        max_lora_rank, modules or shapes the model lacks); each adapter is read once here."""
        check_lora_request(lora_request, self.config.enable_lora)
        if self._checked_loras.get(lora_request.lora_int_id) == lora_request:
            return
        from tandem.lora.peft import check_modules, load_adapter

        check_modules(load_adapter(lora_request, self.config.max_lora_rank), self.engines.info.lora_modules)
        self._checked_loras[lora_request.lora_int_id] = lora_request

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Checks an adapter as a replica would (ValueError naming it); each replica makes its own host copy when a
        request routed to it first names the adapter."""
        self._check_open()
        self._check_lora(lora_request)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters added or named by a request since they were last removed."""
        return list(self._checked_loras.values())

    def remove_lora(self, lora_int_id: int) -> None:
        """Unloads an adapter on every replica: requests already queued or running with it finish with it."""
        self._check_open()
        self._checked_loras.pop(lora_int_id, None)
        for replica in self.live_replicas:
            self._outboxes[replica].append(UnloadLoRA(lora_int_id))
        self._flush()

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                      stop_reason: int | str | None = None) -> None:
        """Ends a request now; unknown ids are ignored. Sent at once: no step may follow (an exception)."""
        replica = self._replica_of.pop(request_id, None)
        if replica is None or self._closed:
            return
        self.router.release(replica, self._work_of.pop(request_id))
        if replica not in self._dead:
            self._outboxes[replica].append(AbortRequest(request_id, reason.value, stop_reason))
            self._flush()

    def has_unfinished_requests(self) -> bool:
        return bool(self._replica_of)

    def replica_of(self, request_id: str) -> int | None:
        """The replica serving an unfinished request."""
        return self._replica_of.get(request_id)

    # ---------------------------------------------------------------- step

    def step(self) -> list[EngineOutput]:
        """Sends the queued commands, then returns every output that has arrived (waiting for some while
        requests are unfinished). A replica found dead fails its requests (outputs with `error`); raises
        RuntimeError once no replica is left."""
        self._check_open()
        self._flush()
        outputs: list[EngineOutput] = []
        if not self._replica_of:
            return outputs
        while True:
            ready = dict(self._poller.poll(POLL_MS))
            for fd in ready:
                if fd in self._sentinels:
                    self._replica_died(self._sentinels[fd], outputs)
            if self._pull in ready or outputs:
                break
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return outputs
            self._take(self._decoder.decode(frame.buffer), outputs)

    def _take(self, batch: EngineBatch, outputs: list[EngineOutput]) -> None:
        r = batch.engine_index
        if batch.stats is not None:
            self._replica_stats[r] = batch.stats
        for rejection in batch.rejected:  # not expected: add_request checked what the replica checks
            if self._replica_of.pop(rejection.request_id, None) is not None:
                self.router.release(r, self._work_of.pop(rejection.request_id))
                message = f"data-parallel replica {r} refused the request: {rejection.message}"
                outputs.append(EngineOutput(rejection.request_id, [], None, True, FinishReason.ABORT, None, 0, 0,
                                            error=message))
        for out in batch.outputs:
            if out.request_id not in self._replica_of:
                continue  # aborted here meanwhile
            if out.finished:
                self.router.release(self._replica_of.pop(out.request_id), self._work_of.pop(out.request_id))
            if out.error is not None:
                out.error = f"data-parallel replica {r}: {out.error}"
            outputs.append(out)

    def _flush(self) -> None:
        for replica, commands in enumerate(self._outboxes):
            if commands:
                if replica not in self._dead:
                    self._pushes[replica].send(self._encoder.encode(commands), copy=False)
                self._outboxes[replica] = []

    def _replica_died(self, r: int, outputs: list[EngineOutput]) -> None:
        """Fails replica r's requests into `outputs` and routes around it; shuts down if it was the last one."""
        replica = self.engines.replicas[r]
        replica.process.join(1)  # the exit code is there once the sentinel fired
        self._poller.unregister(replica.process.sentinel)
        del self._sentinels[replica.process.sentinel]
        message = f"data-parallel replica {r} (pid {replica.info.pid}) died with exit code {replica.process.exitcode}"
        self._dead[r] = message
        self.router.set_up(r, False)
        self._replica_stats[r] = None
        lost = sorted(rid for rid, owner in self._replica_of.items() if owner == r)
        for rid in lost:
            del self._replica_of[rid]
            self.router.release(r, self._work_of.pop(rid))
            outputs.append(EngineOutput(rid, [], None, True, FinishReason.ABORT, None, 0, 0, error=message))
        if len(self._dead) == self.data_parallel_size:
            self._failure = f"every data-parallel replica has died (the last: {message}); the engine is shut down"
            logger.error("%s", self._failure)
            self.shutdown()
            raise RuntimeError(self._failure)
        logger.error("%s: its %d requests fail; %d replicas go on", message, len(lost),
                     self.data_parallel_size - len(self._dead))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(self._failure or "the data-parallel engine is shut down")

    # ---------------------------------------------------------------- figures, profiling, shutdown

    @property
    def model_config(self) -> ModelConfig:
        """The architecture's numbers (read from the model on first use: the replicas hold the weights)."""
        if self._model_config is None:
            from tandem.models.loader import load_model_config

            self._model_config = load_model_config(self.config)
        return self._model_config

    def stats(self) -> WireStats | None:
        """The live replicas' latest figures merged (None until each has reported)."""
        return merge_reported([s for r, s in enumerate(self._replica_stats) if r not in self._dead])

    @property
    def live_replicas(self) -> list[int]:
        return [r for r in range(self.data_parallel_size) if r not in self._dead]

    def start_timeline(self) -> None:
        raise ValueError("timeline profiling needs data_parallel_size=1: the replicas' GPUs are in other processes")

    @property
    def replica_pids(self) -> list[int]:
        return self.engines.pids

    def shutdown(self) -> None:
        """Stops every replica (each fails what it still holds) and reaps it; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._replica_of.clear()
        self._work_of.clear()
        code = self.engines.stop()
        # Closed after the replicas are gone: their last outputs still find a reader, so none lingers.
        for sock in (*self._pushes, self._pull):
            sock.close(linger=0)
        self._ctx.term()
        logger.debug("data-parallel replicas stopped (exit code %s)", code)

    def __repr__(self) -> str:
        return f"DataParallelEngine(replicas={self.data_parallel_size}, pids={self.replica_pids})"


def _load_tokenizer(config: EngineConfig) -> Any:
    from tandem.models.loader import load_tokenizer

    try:
        return load_tokenizer(config)
    except BaseException as exc:  # handed to the caller's thread
        return exc



