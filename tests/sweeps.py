"""Parameter sweeps for the interpreted (CPU) kernel tests: every pair of values of any two axes runs together; the
full cross product runs on a GPU, where kernels are compiled, or with TANDEM_FULL_SWEEPS=1."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import torch

FULL_SWEEPS_ENV = "TANDEM_FULL_SWEEPS"


def full_sweeps() -> bool:
    """True on a GPU or with TANDEM_FULL_SWEEPS=1: the cross product is cheap there, or asked for."""
    return torch.cuda.is_available() or os.environ.get(FULL_SWEEPS_ENV) == "1"


def pairwise(*axes: Sequence[Any], full: bool | None = None) -> list[tuple[Any, ...]]:
    """Rows for one `pytest.mark.parametrize`: a value of an axis may be a tuple of several arguments (flattened
    into the row). Without `full`, a greedy covering subset of the cross product in its order: each row is the
    first that covers the most value pairs not yet covered (3 x 3 x 2 x 2: 9 rows instead of 36)."""
    if any(len(axis) == 0 for axis in axes):
        raise ValueError("every axis needs at least one value")
    if full is None:
        full = full_sweeps()
    product = list(itertools.product(*(range(len(axis)) for axis in axes)))
    rows = product if full or len(axes) < 3 else _covering(product, len(axes))
    return [_flatten(tuple(axes[a][i] for a, i in enumerate(row))) for row in rows]


def _pairs(row: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(range(len(row)), 2)}


def _covering(product: list[tuple[int, ...]], num_axes: int) -> list[tuple[int, ...]]:
    uncovered = set().union(*(_pairs(row) for row in product))
    chosen: list[tuple[int, ...]] = []
    while uncovered:
        best = max(product, key=lambda row: len(_pairs(row) & uncovered))  # max keeps the first of equals
        chosen.append(best)
        uncovered -= _pairs(best)
    return sorted(chosen)  # in the cross product's order, so the ids read as before


def _flatten(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v for value in row for v in (value if isinstance(value, tuple) else (value,)))
