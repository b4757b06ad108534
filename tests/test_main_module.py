"""`python -m tandem` behaves like the `tandem` script: help, and usage + exit 2 on a wrong subcommand."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_python_m_tandem_help_lists_subcommands():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: tandem")
    for command in ("generate", "serve", "bench", "profile"):
        assert command in r.stdout


def test_python_m_tandem_unknown_subcommand_prints_usage_and_exits_2():
    r = _run("bogus")
    assert r.returncode == 2
    assert r.stderr.startswith("usage: tandem")
    assert "invalid choice: 'bogus'" in r.stderr
    assert r.stdout == ""
