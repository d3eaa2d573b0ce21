"""Native CPU kernels, compiled from `nanoserve/csrc` on first use (phase 6).

    ext = native()          # the compiled module, or None (and `native_status()` says why)

`torch.utils.cpp_extension.load` builds the C++ source with the machine's compiler into
torch's extension cache (~/.cache/torch_extensions) the first time a process asks, which takes
about a minute on 2 cores, and loads the cached build after that. `-march=native` lets the
compiler use whatever vector instructions this CPU has: the build is for this machine, which
is why it is built here and not shipped. If there is no compiler, or the build fails, or
`NANOSERVE_NATIVE=0` is set, `native()` is None and the engine keeps the pure-PyTorch path,
which computes the same thing (tests/test_kernels.py holds the two together).

The kernels (csrc/, bound in module.cpp):
* `decode_attention` (paged_attention.cpp): decode attention read in place from the paged
  pools, instead of gathering each row's window into a padded copy (days 58-59);
* `quant_linear`, `dequantize`, `embed_rows` (quant.cpp): products over matrices held as a
  GGUF's Q4_1 or Q8_0 blocks, widened in registers (quant.py, day 60), and with int8
  activations over tiles of 16 rows with AVX512-VNNI where the CPU has it (`has_tiles`);
* `fused_decode` (quant.cpp): a whole Llama decode step in one call, its glue in C++ instead of
  ~70 torch ops a block (model.Llama.fused_decode, day 61).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / name for name in ("module.cpp", "paged_attention.cpp", "quant.cpp")]
_HEADERS = [_CSRC / "nanoserve.h"]
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
            _ext = _build()
            _status = "built"
        except Exception as e:  # no compiler, no headers, a failed build: the PyTorch path it is
            _status = f"unavailable ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"
            _ext = None
    return _ext


def build_location() -> tuple[str, Path]:
    """The extension's name and build directory: named by the kernel's source and by this
    environment (torch's path and the interpreter's prefix)."""
    import hashlib
    import sys

    import torch
    from torch.utils.cpp_extension import _get_build_directory

    h = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS))
    h.update(f"{torch.__file__}|{sys.prefix}".encode())
    name = f"nanoserve_native_{h.hexdigest()[:12]}"
    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    return name, build_dir


def _build():
    """torch's JIT build, made safe to share: the build directory is named by the source and by
    this environment (torch's path, so two checkouts or venvs never rewrite each other's
    build.ninja and rebuild in turn), and the build runs under an flock on that directory. torch
    guards a build with a plain `lock` file and waits for it to vanish, forever: a process killed
    mid-build (Ctrl-C during the first boot's minute of compiling) used to leave every later
    start of nanoserve hanging. The flock dies with its process; whoever holds it knows no other
    nanoserve is building here, so a `lock` file it finds is stale and is removed."""
    from torch.utils.cpp_extension import load

    name, build_dir = build_location()
    with open(build_dir / "nanoserve.flock", "w") as held:
        try:
            import fcntl

            fcntl.flock(held, fcntl.LOCK_EX)  # released by the OS if this process dies
        except ImportError:  # no flock (not POSIX): torch's own lock alone
            pass
        else:
            (build_dir / "lock").unlink(missing_ok=True)
        return load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def native_status() -> str:
    native()
    return _status or "not tried"
