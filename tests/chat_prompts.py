"""The 16 chat prompts that hold tandem's fp32 greedy text to transformers' on the embedded SmolLM2 GGUF: on the
CPU against transformers (tests/engine/test_generate.py) and on the GPU against tandem's own CPU run
(tests/gpu/test_real_weights.py)."""

from __future__ import annotations

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
    "Explain why the sky is blue in one sentence.", "What is 12 times 12?", "Give me a synonym for happy.",
    "What does a CPU do?", "Translate 'good morning' into Spanish.", "List the days of the week.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Describe a cat in five words.",
    "What is photosynthesis?", "Suggest a name for a pet goldfish.", "How many legs does a spider have?",
    "Write one sentence about autumn.",
]
MAX_TOKENS = 32
SYSTEM = "You are a concise, helpful assistant. Answer in one or two sentences."


def chat_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def stop_ids(tokenizer) -> set[int]:
    """The tokens that end a chat reply of the embedded model: eos and <|im_end|>."""
    return {tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>"])}


def until_stop(ids: list[int], stops: set[int]) -> list[int]:
    """ids up to and including the first stop token."""
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1]
    return ids
