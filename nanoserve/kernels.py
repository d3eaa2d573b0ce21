"""Native CPU kernels, compiled from `nanoserve/csrc` on first use (phase 6).

    ext = native()          # the compiled module, or None (and `native_status()` says why)

`torch.utils.cpp_extension.load` builds the C++ source with the machine's compiler into
torch's extension cache (~/.cache/torch_extensions) the first time a process asks, which takes
about a minute on 2 cores, and loads the cached build after that. `-march=native` lets the
compiler use whatever vector instructions this CPU has: the build is for this machine, which
is why it is built here and not shipped. If there is no compiler, or the build fails, or
`NANOSERVE_NATIVE=0` is set, `native()` is None and the engine keeps the pure-PyTorch path,
which computes the same thing (tests/test_kernels.py holds the two together).

The one kernel so far is `decode_attention` (csrc/paged_attention.cpp): decode attention read
in place from the paged pools, instead of gathering each row's window into a padded copy.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_SOURCES = [Path(__file__).with_name("csrc") / "paged_attention.cpp"]
_lock = threading.Lock()
_ext = None
_status: str | None = None  # None: not tried yet


def native():
    """The compiled kernels, or None when they cannot be had here (see `native_status`)."""
    global _ext, _status
    if _status is not None:
        return _ext
    with _lock:
        if _status is not None:
            return _ext
        if os.environ.get("NANOSERVE_NATIVE", "1") == "0":
            _status = "off (NANOSERVE_NATIVE=0)"
            return None
        try:
            import hashlib

            from torch.utils.cpp_extension import load

            # named by its source, so checkouts with different kernels never rebuild each other's
            digest = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:12]
            _ext = load(
                name=f"nanoserve_native_{digest}",
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            _status = "built"
        except Exception as e:  # no compiler, no headers, a failed build: the PyTorch path it is
            _status = f"unavailable ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"
            _ext = None
    return _ext


def native_status() -> str:
    native()
    return _status or "not tried"
