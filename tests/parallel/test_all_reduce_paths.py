"""Which all-reduce path a message takes: peer-to-peer one-shot for small, two-shot for medium, NCCL beyond."""

from __future__ import annotations

import pytest
import torch

from tandem.distributed.all_reduce import ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES, choose_path, create_symmetric_all_reduce


@pytest.mark.parametrize("world", sorted(ONE_SHOT_MAX_BYTES))
def test_paths_by_size(world: int) -> None:
    one, two = ONE_SHOT_MAX_BYTES[world], TWO_SHOT_MAX_BYTES[world]
    assert one < two
    assert choose_path(2 * 4096, world) == "one_shot"  # a batch-1 decode message of a 4096-wide model
    assert choose_path(one, world) == "one_shot"
    assert choose_path(one + 2, world) == "two_shot"
    assert choose_path(two, world) == "two_shot"
    assert choose_path(two + 2, world) == "nccl"


def test_thresholds_can_be_given() -> None:
    assert choose_path(1024, 2, one_shot_max=0) == "two_shot"
    assert choose_path(1024, 2, one_shot_max=0, two_shot_max=0) == "nccl"
    assert choose_path(1024, 3) == "nccl"  # a world size the kernels do not take


def test_cpu_groups_use_the_collective_library_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert create_symmetric_all_reduce(None, torch.device("cpu"), torch.float32, 1 << 20) is None
