"""An EngineCore the server tests can make fail from outside its process (it runs in the engine-core process)."""

from __future__ import annotations

import os

from tandem.engine.core import EngineCore

FAULT_DIR_ENV = "TANDEM_TEST_FAULT_DIR"


class FlakyEngineCore(EngineCore):
    """Fails the next N runner launches (a device fault) or N step() calls when a test writes
    <$TANDEM_TEST_FAULT_DIR>/launch or /step holding N."""

    def __init__(self, config) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config)
        self._fault_dir = os.environ[FAULT_DIR_ENV]
        original = self.runner.enqueue

        def enqueue(prepared, drafts=None):  # type: ignore[no-untyped-def]
            if self._take("launch"):
                raise RuntimeError("injected device fault")
            return original(prepared, drafts)

        self.runner.enqueue = enqueue

    def step(self):  # type: ignore[no-untyped-def]
        if self._take("step"):
            raise RuntimeError("injected step crash")
        return super().step()

    def _take(self, name: str) -> bool:
        path = os.path.join(self._fault_dir, name)
        try:
            with open(path) as f:
                left = int(f.read() or 0)
        except FileNotFoundError:
            return False
        if left <= 1:
            os.remove(path)
        else:
            with open(path, "w") as f:
                f.write(str(left - 1))
        return left >= 1
