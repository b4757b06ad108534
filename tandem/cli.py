"""`tandem generate | serve | bench | profile`: the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tandem.engine_args import add_engine_args, engine_kwargs

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "Name three prime numbers.",
]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--logit-bias", type=json.loads, default=None, help='JSON object {"token id": bias}')
    g.add_argument("--allowed-token-ids", type=json.loads, default=None, help="JSON list of token ids")
    g.add_argument("--bad-words", action="append", default=None)
    g.add_argument("--json-schema", default=None, help="constrain the output to this JSON schema (JSON text)")
    g.add_argument("--regex", default=None, help="constrain the output to this regular expression")


def structured_output_arg(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tandem.sampling_params import StructuredOutputParams

    if args.json_schema is not None:
        return StructuredOutputParams(json=args.json_schema)
    if args.regex is not None:
        return StructuredOutputParams(regex=args.regex)
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs, seed=args.sample_seed,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_p=args.min_p,
        logit_bias={int(k): v for k, v in args.logit_bias.items()} if args.logit_bias else None,
        allowed_token_ids=args.allowed_token_ids, bad_words=args.bad_words,
        structured_output=structured_output_arg(args),
    )
    kwargs = engine_kwargs(args)
    lora = None
    if args.lora is not None:  # every prompt under this adapter (LoRA switched on for it)
        from tandem import LoRARequest

        kwargs["enable_lora"] = True
        lora = LoRARequest(os.path.basename(os.path.normpath(args.lora)) or args.lora, 1, args.lora)
    llm = LLM(**kwargs)
    prompts = args.prompt or DEFAULT_PROMPTS
    # The built-in prompts are questions: wrap them in the chat template when the model has one.
    chat = args.chat if args.chat is not None else (
        not args.prompt and bool(getattr(llm.tokenizer, "chat_template", None)))
    start = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, lora_request=lora)
    else:
        outputs = llm.generate(prompts, params, lora_request=lora)
    seconds = time.perf_counter() - start
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        print(f"--- {prompt!r}\n{c.text!r}  [{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    dp = llm.config.data_parallel_size
    where = llm.engine.runner.device if dp == 1 else f"{dp} replicas, device {llm.config.device}"
    print(f"\n{len(outputs)} requests, {num_generated} generated tokens in {seconds:.2f} s: "
          f"{num_generated / seconds:.1f} tok/s ({where}, {llm.config.resolved_dtype()})")
    llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions offline and print them with tokens/s")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in prompts")
    gen.add_argument("--data-parallel-size", type=int, default=1,
                     help="engine replicas (processes), each on its own GPU(s) (x --tensor-parallel-size)")
    gen.add_argument("--lora", default=None, metavar="PATH",
                     help="run every prompt under this LoRA adapter (a PEFT folder or Hugging Face Hub id; turns on "
                          "--enable-lora)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap each prompt in the chat template (default: for the built-in prompts only)")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from tandem.server.launcher import add_serve_args, serve_main

        add_serve_args(serve)
        serve.set_defaults(func=serve_main)
    except ImportError as exc:  # server packages missing: say so before argparse trips on serve's options
        args = sys.argv[1:] if argv is None else argv
        if args[:1] == ["serve"]:
            sys.exit(f"tandem serve needs its server packages (pip install -r requirements.txt): {exc}")

    from tandem.bench.offline import add_bench_args, add_profile_args

    add_bench_args(sub, add_engine_args)
    add_profile_args(sub, add_engine_args)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
