"""Compiling Triton kernels for Hopper without a GPU, in a fresh process, to read their PTX in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_sm90(script: str) -> object:
    """Runs `script` (which compiles kernels with GPUTarget("cuda", 90, 32) and prints JSON) in a fresh process
    and returns what it printed: TRITON_INTERPRET=1 in this process turns triton.language's own helpers into
    interpreted functions. Skips the test when this Triton build has no ptxas for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"no ptxas for sm90 in this Triton build: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)
