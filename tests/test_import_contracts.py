"""The import contracts of pyproject.toml hold for the tree, and lint-imports does fail on an upward import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (scripts/setup.sh)")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH first: the copy's `tandem` wins over the editable install of this checkout.
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)


def _copy_tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "tandem", tmp_path / "tandem", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "tests").mkdir()
    for name in ("__init__.py", "import_contracts.py"):  # the contract type pyproject.toml names
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    return tmp_path


def test_contracts_hold() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    # a cycle like the ones the layers replaced: a kernel reaching up into a layer
    ("tandem/kernels/triton_kv.py", "from tandem.layers import norm  # noqa: F401", "tandem.kernels is not allowed"),
    # the offline path reaching into the HTTP server
    ("tandem/llm.py", "from tandem.server import app  # noqa: F401", "tandem.llm is not allowed to import tandem.server"),
    # a lazy (function-level) import counts too
    ("tandem/runner/streams.py", "def _f():\n    from tandem.engine import core  # noqa: F401",
     "tandem.runner is not allowed to import tandem.engine"),
    # the scheduler importing torch, however indirectly
    ("tandem/scheduler/output.py", "import torch  # noqa: F401", "tandem.scheduler is not allowed to import torch"),
    # collectives outside tandem.distributed, in either spelling
    ("tandem/layers/norm.py", "import torch.distributed as dist  # noqa: F401",
     "tandem.layers.norm imports torch.distributed"),
    ("tandem/runner/streams.py", "def _f():\n    from torch import distributed  # noqa: F401",
     "tandem.runner.streams imports torch.distributed"),
])
def test_an_upward_import_breaks_the_contracts(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy_tree(tmp_path)
    with open(root / module, "a") as f:
        f.write(f"\n{line}\n")
    result = _lint(root)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout
