"""Triton's process-wide cache key, hashed on a thread while the process imports torch (issue 48, item 5).

Before its first compile or cache lookup in a process, Triton hashes its own sources and its libtriton
(`triton.runtime.cache.triton_key`, kept for the process): 0.8 s of a boot's `init` phase on an H200 host
(a cProfile of a cold boot), on a warm Triton cache too, where every kernel is a lookup. `start()` hashes it
on a daemon thread as the engine's process starts, beside `import torch` (5 s there): Triton imports no
torch, and the file reads and sha256 release the GIL. `wait()` (kernels.compile_ahead, before a boot's first
launch) joins it, so the boot never hashes it a second time beside it. Torch-free.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)
_thread: threading.Thread | None = None


def start() -> None:
    """Hash Triton's key on a thread (once a process; nothing without Triton)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_hash, name="triton-key", daemon=True)
        _thread.start()


def wait() -> None:
    """Until start()'s hash is done (at once if it never started)."""
    if _thread is not None:
        _thread.join()


def _hash() -> None:
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception as e:  # noqa: BLE001 - Triton's first compile hashes it then, as without this
        log.debug("Triton's key not hashed ahead: %s", e)
