"""Runs a tandem CLI command and prints every Triton kernel compiled during it, with the time since start
and the tandem call site: to find kernels that compile inside a timed run instead of at warm-up.

    python scripts/trace_compiles.py bench --workload seed-async --quantization fp8 --no-peers
"""

from __future__ import annotations

import sys
import time
import traceback

from triton import knobs

from tandem.cli import main

T0 = time.perf_counter()


def _hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's keyword names)
    site = [f"{f.filename.split('tandem/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()
            if "/tandem/" in f.filename and "trace_compiles" not in f.filename][-3:]
    consts = {k: v for k, v in compile["constants"].items() if not str(k).startswith("(")}
    print(f"[compile {time.perf_counter() - T0:7.1f} s] {fn.name} {consts} <- {' <- '.join(reversed(site))}",
          flush=True)
    return None


if __name__ == "__main__":
    knobs.runtime.jit_post_compile_hook = _hook
    sys.exit(main(sys.argv[1:]))
