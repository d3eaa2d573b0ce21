"""glibc's malloc told to keep the memory a step frees (phase 6; `EngineConfig.keep_freed_memory`).

A CPU prefill step allocates tensors of megabytes (a 512-token step of Qwen2.5-0.5B: the MLP's
512 x 9,728 fp32 output alone is 20 MB) and frees them before the next layer asks for the same
sizes again. glibc serves a request above its mmap threshold with a fresh mapping, and gives a
heap top above its trim threshold back to the OS; either way the next step's tensors land on
pages the kernel has to fault in one 4 KB page at a time, zeroed. Measured on the 2-core EPYC
(`/tmp` script; the prefill of 512 random tokens through the default Qwen path, one process per
setting): ~240,000 minor page faults a step with glibc's defaults, 9 with the settings below,
and the step 1.86 -> 1.33 s.

`keep_freed_memory()` raises the mmap threshold to glibc's ceiling (32 MB on 64-bit; a tensor
above it is still mapped and unmapped), and the trim threshold and top pad so that freed memory
stays in the process for the next step. The cost is memory held: what a step's tensors peaked
at stays resident (glibc still trims above 1 GB): the Qwen process of tests/test_malloc.py
peaked at 2.56 GB resident against 2.42 GB with the defaults. The CLI turns it on (`nanoserve serve`,
`generate`, `chat`); a library user's process keeps glibc's defaults unless its config asks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 2**30
TOP_PAD = 64 * 2**20

_state: str | None = None  # what keep_freed_memory() did, once it has run


def keep_freed_memory() -> str:
    """Set glibc's thresholds (once a process); returns what was done: 'kept' or why not."""
    global _state
    if _state is not None:
        return _state
    if not sys.platform.startswith("linux"):
        _state = f"not glibc ({sys.platform})"
        return _state
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _state = "not glibc (no mallopt)"
        return _state
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    done.append(mallopt(M_TOP_PAD, TOP_PAD))
    _state = "kept" if all(done) else "refused by mallopt"
    return _state
