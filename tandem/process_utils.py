"""Helpers every long-lived tandem process uses at start: a name for ps/top, and a frozen garbage collector."""

from __future__ import annotations

import gc

from tandem.config import relax_gc


def freeze_gc() -> None:
    """Moves everything allocated at start-up (modules, tokenizer, model objects) out of the collector's
    reach: a full collection then walks only what requests allocate, not a pause of tens of ms; and
    collects young objects in larger, rarer batches from now on (config.GC_GEN0_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    relax_gc()


def set_process_name(name: str) -> None:
    """Names this process for ps/top and /proc/<pid>/comm (Linux; best effort)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
