"""Native CPU kernels, compiled from `nanoserve/csrc` on first use (phase 6).

    ext = native()          # the compiled module, or None (and `native_status()` says why)

`torch.utils.cpp_extension.load` builds the C++ source with the machine's compiler into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) the first time a
process asks, which takes one to two minutes on 2 cores, and loads the cached build after that.
If there is no compiler, or the build fails, or `NANOSERVE_NATIVE=0` is set, `native()` is None
and the engine keeps the pure-PyTorch path, which computes the same thing (tests/test_kernels.py
holds the two together). The sources ship with the package (pyproject's package data), so a wheel
builds them as a checkout does.

Which instructions the build may use is `NANOSERVE_ISA`:
* `native` (the default): `-march=native`, everything this CPU has: AVX2 and FMA on an AVX2
  EPYC; AVX-512 with VNNI (so the int8 tiles, `has_tiles`) on an AVX-512 EPYC or an AMX Xeon;
* `avx2`: `-march=x86-64-v3` (AVX2, FMA, F16C, BMI), the paths an AVX2 EPYC's native build takes;
* `avx512`: `-march=x86-64-v4` (AVX-512 F, BW, CD, DQ, VL) without VNNI: the AVX2 kernels and the
  compiler's own AVX-512 loops, no tiles;
* `avx512_vnni`: `-march=x86-64-v4 -mavx512vnni`: every path the source has, tiles included.
The kernels choose their paths from the compiler's macros (`__AVX2__`, `__AVX512VNNI__`), and
quant.kernel_layout asks the build (`has_tiles`), not the CPU; so `NANOSERVE_ISA=avx2`, with
torch's `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2`, runs the AVX2 machine's paths
(split layout, no tiles) on an AVX-512 one. A named ISA this CPU lacks is refused with the
missing flags in `native_status()`, not loaded to die on an illegal instruction.

A build is cached under a name made of what it depends on: the sources' bytes, torch's location,
Python's headers, and the target (the flags, and the compiler's reading of them: for `native`,
this CPU's model and features). Where the package is installed is not part of it: the sources
are copied into the build directory and compiled there, so a checkout and a wheel of the same
source share one build, while an AVX-512 and an AVX2 machine sharing a cache keep one each.

The kernels (csrc/, bound in module.cpp):
* `decode_attention` (paged_attention.cpp): decode attention read in place from the paged
  pools, instead of gathering each row's window into a padded copy (days 58-59);
  `DecodeWindow` + `decode_attention_checked`, the same with the window checked once a step
  and each layer's call checking its pools in O(1) (cache.py);
* `quant_linear`, `dequantize`, `embed_rows` (quant.cpp): products over matrices held as a
  GGUF's Q4_1 or Q8_0 blocks, widened in registers (quant.py, day 60), and with int8
  activations over tiles of 16 rows with AVX512-VNNI where the build has it (`has_tiles`);
  the same three over a K-quant file's other types, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K
  (kquant.cpp: fp32 activations bit for bit gguf's weights, int8 activations llama.cpp's Q8_0 and
  Q8_K arithmetic, AVX2 with a portable fallback);
* `fused_decode` (quant.cpp): a whole Llama or Qwen decode step in one call, its glue in C++
  instead of ~70 torch ops a block (model.Llama.fused_decode, day 61); a matrix may be stacked
  from parts of different types, and Qwen2's QKV biases and Qwen3's per-head norms ride along;
* `apply_token_bitmask` (mask.cpp): a grammar's token mask (one bit a token, llguidance's layout)
  written into rows of the logits as -inf, in place (grammar.py, structured output).
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [
    _CSRC / name for name in ("module.cpp", "paged_attention.cpp", "quant.cpp", "kquant.cpp", "mask.cpp")
]
_HEADERS = [_CSRC / "nanoserve.h"]
_lock = threading.Lock()
_ext = None
_status: str | None = None  # None: not tried yet

# NANOSERVE_ISA: the compiler flags of each choice, and the /proc/cpuinfo flags its code needs
_V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}  # x86-64-v3 (abm: lzcnt)
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ISAS = {
    "native": (["-march=native"], set()),
    "avx2": (["-march=x86-64-v3"], _V3),
    "avx512": (["-march=x86-64-v4"], _V4),
    "avx512_vnni": (["-march=x86-64-v4", "-mavx512vnni"], _V4 | {"avx512_vnni"}),
}


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
        refused = isa_refusal()
        if refused is not None:
            import warnings

            _status = f"unavailable ({refused})"
            warnings.warn(
                f"nanoserve: {refused}; the PyTorch path runs instead", RuntimeWarning, stacklevel=2
            )
            return None
        try:
            _ext = _build()
            _status = "built"
        except Exception as e:  # no compiler, no headers, a failed build: the PyTorch path it is
            _status = f"unavailable ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"
            _ext = None
    return _ext


def target_isa() -> str:
    """The NANOSERVE_ISA this process builds for ("native" unless set)."""
    return os.environ.get("NANOSERVE_ISA", "native").strip().lower() or "native"


def isa_refusal() -> str | None:
    """Why NANOSERVE_ISA cannot be built or run here (a sentence), or None when it can."""
    name = target_isa()
    if name not in ISAS:
        return f"NANOSERVE_ISA={name!r} is not one of {', '.join(ISAS)}"
    have = _cpu_flags()
    missing = sorted(ISAS[name][1] - have) if have is not None else []
    if missing:
        return f"NANOSERVE_ISA={name} needs {', '.join(missing)}, which this CPU lacks"
    return None


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags as Linux names them, or None where /proc/cpuinfo has none (then a
    named ISA is trusted)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next(
        (set(ln.split(":", 1)[1].split()) for ln in text.splitlines() if ln.startswith("flags")), None
    )


def _target(flags: list[str]) -> tuple[str, str]:
    """What the compiler makes of `flags` (its driver's dry run: for -march=native, the CPU model
    and every feature switch it detected), and the CPU model named there ('' if none)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        r = subprocess.run(
            [cxx, *flags, "-###", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, timeout=60
        )
        text = r.stdout + r.stderr
    except (OSError, subprocess.SubprocessError):  # no compiler: the build will say so
        return "", ""
    found = re.findall(r'-march=["\']?([\w.-]+)|"-target-cpu" "([\w.-]+)"', text)  # gcc's, clang's
    cpus = [c for pair in found for c in pair if c and c != "native"]
    return text, cpus[-1] if cpus else ""


def build_name() -> str:
    """The extension's name, made of what the build depends on (the module doc): the sources,
    torch, Python's headers and the target, e.g. nanoserve_avx2_<hash> or, for native,
    nanoserve_native_<the compiler's CPU model>_<hash>."""
    import hashlib
    import sysconfig

    import torch

    name = target_isa()
    flags = ISAS.get(name, ISAS["native"])[0]
    target, cpu = _target(flags)
    h = hashlib.sha256()
    for p in _SOURCES + _HEADERS:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(f"{torch.__file__}|{torch.__version__}|{sysconfig.get_paths()['include']}".encode())
    h.update(" ".join(_cflags(flags)).encode() + b"\0" + target.encode())
    if name == "native" and not target:  # the compiler said nothing: key by the CPU's own flags
        h.update(" ".join(sorted(_cpu_flags() or ())).encode())
    label = name if name != "native" or not cpu else f"native_{re.sub(r'[^0-9A-Za-z]', '_', cpu)}"
    return f"nanoserve_{label}_{h.hexdigest()[:12]}"


def build_location() -> tuple[str, Path]:
    """The extension's name (`build_name`) and its build directory in torch's extension cache."""
    from torch.utils.cpp_extension import _get_build_directory

    name = build_name()
    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    return name, build_dir


def _cflags(isa_flags: list[str]) -> list[str]:
    return ["-O3", *isa_flags, "-fopenmp"]


def _copy_sources(build_dir: Path) -> list[Path]:
    """The sources copied into build_dir/src, each written only when its bytes differ (an
    unchanged file keeps its mtime, so ninja finds the build up to date)."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    out = []
    for p in _SOURCES + _HEADERS:
        dst, data = src / p.name, p.read_bytes()
        if not dst.exists() or dst.read_bytes() != data:
            tmp = dst.with_suffix(dst.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(dst)
        out.append(dst)
    return out[: len(_SOURCES)]


def _build():
    """torch's JIT build, made safe to share: the build directory is named by what the build
    depends on (so two checkouts, venvs or CPUs never rewrite each other's build.ninja and
    rebuild in turn), and the build runs under an flock on that directory. torch guards a build
    with a plain `lock` file and waits for it to vanish, forever: a process killed mid-build
    (Ctrl-C during the first boot's minute of compiling) used to leave every later start of
    nanoserve hanging. The flock dies with its process; whoever holds it knows no other nanoserve
    is building here, so a `lock` file it finds is stale and is removed."""
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
        sources = _copy_sources(build_dir)
        return load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=_cflags(ISAS[target_isa()][0]),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def native_status() -> str:
    native()
    return _status or "not tried"
