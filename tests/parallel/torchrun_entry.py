"""Run under `torch.distributed.run --nproc-per-node 2`: rank 0 prints the greedy tokens as JSON."""

from __future__ import annotations

import json
import sys

from tandem import LLM, SamplingParams


def main() -> None:
    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    # Ranks other than 0 serve rank 0's steps inside the constructor and exit when it stops them.
    llm = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=64, max_model_len=128,
              max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
