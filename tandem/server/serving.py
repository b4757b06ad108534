"""OpenAIServing: validates completion / chat bodies, runs them on the AsyncEngine, writes OpenAI responses."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from tandem.engine.client import AsyncEngine, EngineUnavailableError, QueueFullError
from tandem.lora_request import LoRARequest
from tandem.sampling_params import SamplingParams, StructuredOutputParams
from tandem.server import protocol as p
from tandem.server import tool_calls as tc
from tandem.server.adapters import ServedAdapters
from tandem.server.generation import Delta, Generation, Prompt, _param_of
from tandem.server.metrics import ServerMetrics
from tandem.server.prompts import PromptEncoder
from tandem.server.protocol import ApiError, parse_body
from tandem.structured.grammar import validate as validate_structured
from tandem.server.security import public_message

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions; chat defaults to the context


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, metrics: ServerMetrics, model_names: list[str],
                 max_model_len: int, vocab_size: int, tool_call_parser: str | None = None,
                 adapters: ServedAdapters | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model_names = model_names  # the first is the served name; the others are accepted aliases
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.encoder = PromptEncoder(tokenizer, max_model_len) if tokenizer is not None else None
        self._token_strings: dict[int, str] = {}
        self.tool_parser = tc.pick_parser(tokenizer, tool_call_parser)
        self.adapters = adapters or ServedAdapters(False, model_names, {}, 0)

    # ---- endpoints -------------------------------------------------------------------------

    async def completions(self, raw: bytes, http_request: Request) -> Response:
        arrival = time.monotonic()
        body = parse_body(p.CompletionRequest, raw)
        lora = self.adapters.resolve(body.model)
        prompts = await self._completion_prompts(body.prompt)
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = self._params(body, max_tokens, "max_tokens", body.logprobs, prompt_logprobs=_echo_k(body, max_tokens))
        gen = await self._start(p.random_id("cmpl"), prompts, body.n, params, arrival, "prompt", "max_tokens", lora)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(self._completion_stream(gen, include_usage))
        await collect(gen, http_request)
        choices = []
        for c in gen.choices:
            prompt = gen.prompts[c.prompt_index]
            text, entries = c.text, c.logprobs
            if body.echo:  # the prompt first: its text, and each of its tokens' logprobs (the first has none)
                text = self._prompt_text(prompt) + text
                entries = echo_entries(prompt.token_ids, c.prompt_logprobs or [], body.logprobs or 0) + entries
            choices.append(p.CompletionChoice(
                index=c.index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                token_ids=c.token_ids if self.tokenizer is None else None,
                logprobs=self._completion_logprobs(entries) if params.logprobs is not None else None,
                prompt_logprobs=(self._prompt_logprobs_body(prompt.token_ids, c.prompt_logprobs, body.prompt_logprobs)
                                 if body.prompt_logprobs is not None else None)))
        return json_response(p.CompletionResponse(id=gen.request_id, created=gen.created, model=gen.model,
                                                  choices=choices, usage=gen.usage(),
                                                  metrics=gen.server_metrics()))

    async def chat(self, raw: bytes, http_request: Request) -> Response:
        arrival = time.monotonic()
        body = parse_body(p.ChatCompletionRequest, raw)
        lora = self.adapters.resolve(body.model)
        prompts = [await self._chat_prompt(body)]
        if body.max_completion_tokens is not None:
            max_tokens, max_param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = body.max_tokens, "max_tokens"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        mode = body.tool_mode()
        tool_spec = self._tool_constraint(body, mode)
        params = self._params(body, max_tokens, max_param, logprobs, tool_spec, body.prompt_logprobs)
        gen = await self._start(p.random_id("chatcmpl"), prompts, body.n, params, arrival, "messages", max_param,
                                lora)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            if mode != "none":
                return sse_response(self._chat_tool_stream(gen, include_usage, body, mode))
            return sse_response(self._chat_stream(gen, include_usage, body.logprobs))
        await collect(gen, http_request)
        choices = []
        for c in gen.choices:
            content, calls, finish = self._tool_result(body, mode, c.text, c.finish_reason)
            message = p.ChatResponseMessage(content=content, tool_calls=[
                p.ToolCall(id=tc.call_id(), function=p.FunctionCall(name=call.name, arguments=call.arguments))
                for call in calls])
            choices.append(p.ChatChoice(index=c.index, message=message, finish_reason=finish,
                                        stop_reason=c.stop_reason,
                                        logprobs=self._chat_logprobs(c.logprobs) if body.logprobs else None))
        prompt_logprobs = None
        if body.prompt_logprobs is not None:  # one prompt: every choice scored it alike
            prompt_logprobs = self._prompt_logprobs_body(prompts[0].token_ids, gen.choices[0].prompt_logprobs,
                                                         body.prompt_logprobs)
        return json_response(p.ChatCompletionResponse(id=gen.request_id, created=gen.created,
                                                      model=gen.model, choices=choices, usage=gen.usage(),
                                                      metrics=gen.server_metrics(), prompt_logprobs=prompt_logprobs))

    def models(self) -> p.ModelList:
        base = self.model_names[0]
        cards = [p.ModelCard(id=base, max_model_len=self.max_model_len)]
        cards += [p.ModelCard(id=name, max_model_len=self.max_model_len, root=lora.lora_path, parent=base)
                  for name, lora in self.adapters.by_name.items()]
        return p.ModelList(data=cards)

    def load_lora_adapter(self, raw: bytes) -> Response:
        """load_inplace: the adapter replaces the one served under lora_name (requests running with that one finish
        with it; new ones get this one, read from its folder again even where the path is the same)."""
        body = parse_body(p.LoadLoRAAdapterRequest, raw)
        try:
            _, replaced = self.adapters.load(body.lora_name, body.lora_path, inplace=body.load_inplace)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="lora_path") from exc
        if replaced is not None:
            self.engine.unload_lora(replaced.lora_int_id)
        return json_response(p.ModelCard(id=body.lora_name, max_model_len=self.max_model_len, root=body.lora_path,
                                         parent=self.model_names[0]))

    def unload_lora_adapter(self, raw: bytes) -> Response:
        """Requests already running with the adapter finish with it; new ones naming it get 404."""
        body = parse_body(p.UnloadLoRAAdapterRequest, raw)
        lora = self.adapters.unload(body.lora_name)
        self.engine.unload_lora(lora.lora_int_id)
        return json_response(p.ModelCard(id=lora.lora_name, root=lora.lora_path, parent=self.model_names[0]))

    # ---- request -> engine requests -----------------------------------------------------------

    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
        if isinstance(prompt, str):
            return [Prompt(prompt, await self._encode(prompt))]
        if not prompt:
            raise ApiError(400, "prompt must not be an empty list", param="prompt")
        if isinstance(prompt[0], str):
            if self.encoder is not None:  # refuse an over-long text before tokenizing any of them
                for text in prompt:
                    self.encoder.check_chars(len(text), "prompt")
            return [Prompt(text, await self._encode(text)) for text in prompt]
        if isinstance(prompt[0], int):
            return [self._token_prompt(prompt)]
        return [self._token_prompt(ids) for ids in prompt]

    async def _encode(self, text: str) -> list[int]:
        if self.encoder is None:
            raise ApiError(400, "prompt: this model has no tokenizer; send the prompt as token ids", param="prompt")
        return await self.encoder.encode(text, "prompt")

    def _token_prompt(self, token_ids: list[int]) -> Prompt:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param="prompt")
        return Prompt(None, list(token_ids))

    async def _chat_prompt(self, body: p.ChatCompletionRequest) -> Prompt:
        if not body.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        if self.encoder is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        template = str(self.tokenizer.chat_template)
        renders_tools = "tool_calls" in template
        messages = []
        for m in body.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                calls = [call.model_dump() for call in m.tool_calls]
                if renders_tools:
                    for call in calls:
                        try:
                            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
                        except json.JSONDecodeError:
                            pass
                    msg["tool_calls"] = calls
                else:  # a template that knows no tool calls sees them as the model writes them
                    msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + tc.hermes_text(calls)
            messages.append(msg)
        kwargs: dict[str, Any] = {}
        if body.tool_mode() != "none":
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
            if "tools" in template:
                kwargs["tools"] = tools
            else:  # the tools go in as a system message in the Hermes style
                system = tc.tools_system_text(tools)
                if messages and messages[0]["role"] == "system":
                    messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + system}
                else:
                    messages.insert(0, {"role": "system", "content": system})
        text, token_ids = await self.encoder.chat(messages, body.add_generation_prompt, "messages", **kwargs)
        return Prompt(text, token_ids)

    def _params(self, body: p.SamplingFields, max_tokens: int | None, max_param: str,
                logprobs: int | None, structured: StructuredOutputParams | None = None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k is None else body.top_k,
                max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop,
                stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, seed=body.seed,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=body.n,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                min_p=body.min_p or 0.0,
                logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
                allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
                structured_output=structured or structured_output_of(body))
            for name in ("logit_bias", "allowed_token_ids"):
                outside = [t for t in (getattr(params, name) or ()) if t >= self.vocab_size]
                if outside:
                    raise ValueError(f"{name} names token ids outside the vocabulary [0, {self.vocab_size}): "
                                     f"{outside[:5]}")
            if body.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer, and this model has none; use stop_token_ids")
        except ValueError as exc:
            message, param = str(exc), _param_of(str(exc))
            if param == "max_tokens":
                param = max_param
                message = message.replace("max_tokens", max_param, 1)
            elif param == "logprobs" and isinstance(body, p.ChatCompletionRequest):
                param = "top_logprobs"
                message = message.replace("logprobs", "top_logprobs", 1)
            raise ApiError(400, message, param=param) from exc
        return params

    # ---- tools -------------------------------------------------------------------------------

    def _tool_constraint(self, body: p.ChatCompletionRequest, mode: str) -> StructuredOutputParams | None:
        """The grammar that enforces tool_choice "required" or a named function (None otherwise)."""
        if mode not in ("required", "named"):
            return None
        if structured_output_of(body) is not None:
            raise ApiError(400, "tool_choice required or a named function cannot be combined with "
                                "response_format or guided decoding", param="tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        if mode == "named":
            name = body.tool_choice.function.name  # type: ignore[union-attr]
            schema = tc.function_parameters(next(t for t in tools if t["function"]["name"] == name))
        else:
            schema = tc.required_schema(tools, body.parallel_tool_calls)
        spec = StructuredOutputParams(json=json.dumps(schema))
        try:
            validate_structured(spec)
        except ValueError as exc:
            raise ApiError(400, f"tools: a function's parameters do not compile: {exc}", param="tools") from exc
        return spec

    def _tool_result(self, body: p.ChatCompletionRequest, mode: str, text: str,
                     finish_reason: str | None) -> tuple[str | None, list[tc.ParsedCall], str | None]:
        """(content, tool calls, finish_reason) of one finished choice. An output cut by max_tokens keeps its
        finish_reason "length" and returns the calls completed before the cut (none for a named function, whose
        one call is the cut one)."""
        cut = finish_reason == "length"
        if mode == "none" or finish_reason not in ("stop", None, "length") or (cut and mode == "named"):
            return text, [], finish_reason
        if mode == "named":
            return None, [tc.ParsedCall(body.tool_choice.function.name, text)], "tool_calls"  # type: ignore[union-attr]
        if mode == "required":
            if cut:
                calls = tc.array_prefix_calls(text)
                return (None, calls, finish_reason) if calls else (text, [], finish_reason)
            return None, tc.parse_required(text), "tool_calls"
        content, calls = (tc.calls_before_cut if cut else tc.parse_tool_calls)(self.tool_parser, text)
        names = {t.function.name for t in body.tools or []}
        if not calls or any(c.name not in names for c in calls):
            return text, [], finish_reason
        if not body.parallel_tool_calls:
            calls = calls[:1]
        return content, calls, finish_reason if cut else "tool_calls"

    def _check_lengths(self, prompts: list[Prompt], max_tokens: int | None, prompt_param: str,
                       max_param: str) -> None:
        for prompt in prompts:
            num = len(prompt.token_ids)
            if num == 0:
                raise ApiError(400, f"{prompt_param} must not be empty", param=prompt_param)
            if num >= self.max_model_len:
                raise ApiError(400, f"{prompt_param} is {num} tokens; the context holds {self.max_model_len} "
                                    "tokens including at least one new token", param=prompt_param)
            if max_tokens is not None and num + max_tokens > self.max_model_len:
                raise ApiError(400, f"{max_param} ({max_tokens}) + prompt tokens ({num}) exceed the context of "
                                    f"{self.max_model_len} tokens", param=max_param)

    async def _start(self, request_id: str, prompts: list[Prompt], n: int, params: SamplingParams,
                     arrival: float, prompt_param: str, max_param: str, lora: LoRARequest | None = None) -> Generation:
        self._check_lengths(prompts, params.max_tokens, prompt_param, max_param)
        num_requests = n * len(prompts)
        if num_requests > self.engine.max_queue:
            raise ApiError(400, f"n x prompts = {num_requests} exceeds the server's queue of "
                                f"{self.engine.max_queue} requests", param="n")
        try:
            gen = Generation(self.engine, self.tokenizer, self.metrics, request_id, prompts, n, params, arrival, lora,
                             model=self.model_names[0] if lora is None else lora.lora_name)
        except QueueFullError as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="queue_full") from exc
        except EngineUnavailableError as exc:
            raise ApiError(503, str(exc), type="server_error", code="unavailable") from exc
        try:
            await gen.wait_accepted()
        except BaseException:
            gen.abort_unfinished()
            raise
        return gen

    # ---- engine outputs -> OpenAI bodies -------------------------------------------------------

    # Stream chunks are built as dicts and encoded by orjson: at tens of thousands of chunks per second
    # per process, pydantic models per chunk cost more than the rest of the stream path together.
    async def _completion_stream(self, gen: Generation, include_usage: bool) -> AsyncIterator[bytes | str]:
        head = {"id": gen.request_id, "object": "text_completion", "created": gen.created,
                "model": gen.model}
        has_tokenizer = self.tokenizer is not None
        try:
            while not gen.done:
                deltas = await gen.next_batch()
                for index, d in sorted(deltas.items()):
                    if d.empty(text_only=has_tokenizer):
                        continue
                    lp = self._completion_logprobs(d.logprobs).model_dump() if d.logprobs else None
                    choice = {"index": index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason,
                              "stop_reason": d.stop_reason, "token_ids": None if has_tokenizer else d.token_ids}
                    yield sse_dict({**head, "choices": [choice], "usage": None, "metrics": None})
            async for event in self._stream_end(gen, include_usage, p.CompletionChunk):
                yield event
        finally:
            gen.abort_unfinished()

    async def _chat_stream(self, gen: Generation, include_usage: bool, logprobs: bool) -> AsyncIterator[bytes | str]:
        head = {"id": gen.request_id, "object": "chat.completion.chunk", "created": gen.created,
                "model": gen.model}

        def chunk(index: int, delta: dict[str, str | None], d: Delta | None = None) -> bytes:
            lp = self._chat_logprobs(d.logprobs).model_dump() if d is not None and logprobs and d.logprobs else None
            choice = {"index": index, "delta": delta, "logprobs": lp,
                      "finish_reason": d.finish_reason if d else None, "stop_reason": d.stop_reason if d else None}
            return sse_dict({**head, "choices": [choice], "usage": None, "metrics": None})

        try:
            for c in gen.choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            while not gen.done:
                deltas = await gen.next_batch()
                for index, d in sorted(deltas.items()):
                    if not d.empty(text_only=True):
                        yield chunk(index, {"role": None, "content": d.text}, d)
            async for event in self._stream_end(gen, include_usage, p.ChatCompletionChunk):
                yield event
        finally:
            gen.abort_unfinished()

    async def _chat_tool_stream(self, gen: Generation, include_usage: bool, body: p.ChatCompletionRequest,
                                mode: str) -> AsyncIterator[bytes | str]:
        """Chat streaming with tools, as OpenAI streams calls: a delta with the call's id and name (arguments
        ""), then deltas of the arguments. A named function streams its arguments as they are generated; auto
        streams content until the model's call marker, then holds the rest back and sends the parsed calls at
        the end; required sends its calls at the end (the grammar's array is parsed whole)."""
        head = {"id": gen.request_id, "object": "chat.completion.chunk", "created": gen.created,
                "model": gen.model}

        def chunk(index: int, delta: dict[str, Any], finish: str | None = None, stop: int | str | None = None) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": stop}
            return sse_dict({**head, "choices": [choice], "usage": None, "metrics": None})

        def call_chunks(index: int, calls: list[tc.ParsedCall]) -> list[bytes]:
            out = []
            for i, call in enumerate(calls):
                out.append(chunk(index, {"tool_calls": [{"index": i, "id": tc.call_id(), "type": "function",
                                                         "function": {"name": call.name, "arguments": ""}}]}))
                out.append(chunk(index, {"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}))
            return out

        marker = tc.start_marker(self.tool_parser)
        sent = dict.fromkeys((c.index for c in gen.choices), 0)  # content characters already streamed (auto)
        try:
            for c in gen.choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
                if mode == "named":
                    yield chunk(c.index, {"tool_calls": [{"index": 0, "id": tc.call_id(), "type": "function",
                                                          "function": {"name": body.tool_choice.function.name,  # type: ignore[union-attr]
                                                                       "arguments": ""}}]})
            while not gen.done:
                deltas = await gen.next_batch()
                for index, d in sorted(deltas.items()):
                    choice = gen.choices[index]
                    if mode == "named" and d.text:
                        yield chunk(index, {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]})
                    elif mode == "auto":
                        text = choice.text
                        cut = text.find(marker)
                        if cut < 0:  # hold back a tail that may be the start of the marker
                            cut = len(text)
                            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                                if marker.startswith(text[-k:]):
                                    cut = len(text) - k
                                    break
                        if self.tool_parser == "llama3_json" and not text[:cut].strip():
                            cut = 0  # a call in this format is the whole output
                        if cut > sent[index]:
                            yield chunk(index, {"content": text[sent[index]:cut]})
                            sent[index] = cut
                    if d.finish_reason is not None:
                        content, calls, finish = self._tool_result(body, mode, choice.text, d.finish_reason)
                        if mode == "named":
                            yield chunk(index, {}, finish, d.stop_reason)
                            continue
                        if calls:
                            for event in call_chunks(index, calls):
                                yield event
                        elif choice.text[sent[index]:]:
                            yield chunk(index, {"content": choice.text[sent[index]:]})
                        yield chunk(index, {}, finish, d.stop_reason)
            async for event in self._stream_end(gen, include_usage, p.ChatCompletionChunk):
                yield event
        finally:
            gen.abort_unfinished()

    async def _stream_end(self, gen: Generation, include_usage: bool, chunk_type: type[BaseModel]) -> AsyncIterator[str]:
        if gen.error is not None:
            body = p.error_body(public_message(gen.error), type="server_error", code=gen.error_status)
            yield f"data: {json.dumps(body)}\n\n"
        elif include_usage:
            yield sse(chunk_type(id=gen.request_id, created=gen.created, model=gen.model, choices=[],
                                 usage=gen.usage(), metrics=gen.server_metrics()))
        yield "data: [DONE]\n\n"

    def _token_string(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>")
            self._token_strings[token_id] = text
        return text

    def _completion_logprobs(self, entries: list) -> p.CompletionLogprobs:
        """OpenAI's legacy logprobs block; an entry's logprob and top are None for an echoed prompt's first token."""
        out = p.CompletionLogprobs()
        offset = 0
        for token_id, logprob, top in entries:
            token = self._token_string(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(None if top is None else self._top_strings(top))
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _top_strings(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """{token text: logprob} of the top n, most likely first; tokens that decode alike keep the likeliest."""
        out: dict[str, float] = {}
        for t, lp in top:
            out.setdefault(self._token_string(t), lp)
        return out

    def _prompt_text(self, prompt: Prompt) -> str:
        """The prompt as echoed: its own text, or its token ids decoded."""
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    def _prompt_logprobs_body(self, token_ids: list[int], entries: list | None, k: int) -> p.PromptLogprobsBody:
        """vLLM's prompt_logprobs: None for the first token, then per token the token itself (first) and the top k,
        keyed by token id, each with its logprob, rank (where known) and decoded text."""
        body: p.PromptLogprobsBody = [None]
        for token, (logprob, top) in zip(token_ids[1:], entries or []):
            ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(top[:k], 1)}
            entry = {str(token): p.PromptLogprob(logprob=logprob, rank=ranked.get(token, (0.0, None))[1],
                                                 decoded_token=self._token_string(token))}
            for t, (lp, rank) in ranked.items():
                if t != token:
                    entry[str(t)] = p.PromptLogprob(logprob=lp, rank=rank, decoded_token=self._token_string(t))
            body.append(entry)
        return body

    def _chat_logprobs(self, entries: list) -> p.ChatLogprobs:
        def top_entry(token_id: int, logprob: float) -> p.TopLogprob:
            token = self._token_string(token_id)
            return p.TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        content = []
        for token_id, logprob, top in entries:
            entry = top_entry(token_id, logprob)
            content.append(p.ChatTokenLogprob(token=entry.token, logprob=logprob, bytes=entry.bytes,
                                              top_logprobs=[top_entry(t, lp) for t, lp in top]))
        return p.ChatLogprobs(content=content)


# ---- helpers -----------------------------------------------------------------------------------


def _echo_k(body: p.CompletionRequest, max_tokens: int) -> int | None:
    """The prompt_logprobs a completion request needs: its own, the logprobs of an echoed prompt, or 0 where an
    echo without logprobs generates nothing (max_tokens 0), which is scoring all the same."""
    k = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        k = max(k or 0, body.logprobs)
    if body.echo and max_tokens == 0 and k is None:
        k = 0
    return k


def echo_entries(token_ids: list[int], prompt_logprobs: list, num_top: int) -> list:
    """An echoed prompt's logprob entries (token id, logprob, top n), as generated tokens have them: the first
    token's logprob and top are None (nothing precedes it)."""
    entries: list = [(token_ids[0], None, None)]
    entries.extend((token, logprob, top[:num_top]) for token, (logprob, top) in zip(token_ids[1:], prompt_logprobs))
    return entries


def structured_output_of(body: p.SamplingFields) -> StructuredOutputParams | None:
    """The body's output constraint, checked to compile (ApiError 400 naming the field when it does not)."""
    spec, param = None, None
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        spec, param = StructuredOutputParams(json_object=True), "response_format"
    elif rf is not None and rf.type == "json_schema":
        spec, param = StructuredOutputParams(json=json.dumps(rf.json_schema.schema_)), "response_format"  # type: ignore[union-attr]
    elif body.guided_json is not None:
        text = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
        spec, param = StructuredOutputParams(json=text), "guided_json"
    elif body.guided_regex is not None:
        spec, param = StructuredOutputParams(regex=body.guided_regex), "guided_regex"
    elif body.guided_choice is not None:
        spec, param = StructuredOutputParams(choice=tuple(body.guided_choice)), "guided_choice"
    elif body.guided_grammar is not None:
        spec, param = StructuredOutputParams(grammar=body.guided_grammar), "guided_grammar"
    if spec is None:
        return None
    try:
        validate_structured(spec)
    except ValueError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from exc
    return spec



async def collect(gen: Generation, http_request: Request) -> None:
    """Runs a non-streaming generation to the end; a client that disconnects first aborts it."""
    runner = asyncio.ensure_future(gen.run_to_completion())
    watcher = asyncio.ensure_future(_wait_disconnect(http_request))
    try:
        await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not runner.done():
            runner.cancel()
        gen.abort_unfinished()
    if not runner.done() or runner.cancelled():
        raise ApiError(499, "client disconnected", type="client_closed")
    runner.result()
    if gen.error is not None:
        raise ApiError(gen.error_status, gen.error, type="server_error", code=gen.error_status)


async def _wait_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_dict(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def sse_response(events: AsyncIterator[bytes | str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def json_response(body: BaseModel) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"))
