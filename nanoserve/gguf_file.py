"""Reading a GGUF file (day 2): its config, tokenizer and tensors, and converting it.

`import_gguf` turns a GGUF of a family nanoserve runs (llama, qwen2, qwen3) into the directory
layout transformers uses:

    config.json  model.safetensors  tokenizer.json  tokenizer_config.json
    chat_template.jinja  generation_config.json

so that one loader (`weights.load_state_dict`) and one tokenizer (`tokenizer.py`) serve both our
converted files and any Llama checkpoint downloaded from the Hub. Dequantizing is left to the
`gguf` package; what a tensor means once it has Hugging Face's name is its family's business
(`nanoserve.models`, whose registry also says which architectures a file may name). The same
reading (`_open_gguf`, `hf_name`, `unpermute_rotary_rows`) serves `models/loader.py`, which
keeps the quantized tensors as the file holds them instead of converting them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from nanoserve.errors import NanoserveError

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --- GGUF -> Hugging Face layout ---


_READERS: dict[tuple, object] = {}  # (path, size, mtime) -> reader: the last two files opened


def _open_gguf(path: Path):
    """A checked `gguf.GGUFReader` for `path`, reused while the file is unchanged: the reader
    parses every metadata field on opening (SmolLM2's 49,152-entry vocabulary takes 4-9 s here),
    and a process that loads, converts and quantizes one file would pay that each time."""
    path = Path(path)
    if path.is_file():
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key in _READERS:
            return _READERS[key]
    reader = _read_gguf(path)
    while len(_READERS) >= 2:
        _READERS.pop(next(iter(_READERS)))
    _READERS[key] = reader
    return reader


def _read_gguf(path: Path):
    import gguf

    if not path.is_file():
        raise NanoserveError(f"{path} does not exist; pass the path of a .gguf file.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise NanoserveError(f"{path} is not a GGUF file (it does not start with 'GGUF'); pass a .gguf file.")
    try:
        reader = gguf.GGUFReader(path)
        for t in reader.tensors:
            t.data.shape  # noqa: B018 -- each tensor's bytes must lie inside the file
    except Exception as e:
        raise NanoserveError(f"{path} is truncated or corrupt ({e}); download it again.") from None
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _round_f32(x: float) -> float:
    """The shortest decimal that is the same float32: GGUF's 9.999999747e-06 -> 1e-05."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K rows, head by head.

    Hugging Face rotates the two halves of a head ([x0..x31 | x32..x63] for head dim 64); llama.cpp
    rotates adjacent pairs, so its converter interleaves the halves: rows (0, 32, 1, 33, ...).
    Reading each head's rows as (pairs, 2) and transposing to (2, pairs) puts the halves back.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # (rows, ...)


_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, names: dict | None = None) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'. `names` are a
    family's own block names (`Family.gguf_names`: Gemma 3's 'ffn_norm' is its
    pre_feedforward_layernorm), read before a Llama's."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    block_names = _BLOCK_NAMES | (names or {})
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{kind}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    raise NanoserveError(f"the GGUF holds a tensor {gguf_name!r} that a Llama model does not have.")


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """Recover Llama 3.1's rope_scaling from the per-frequency factors llama.cpp stores.

    llama.cpp keeps only the factors; Meta's parameters are found by trying the values its
    releases use and keeping the ones that reproduce every factor.
    """
    factors = factors.astype(np.float64)
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / freqs
    factor, low, high = float(factors.max()), 1.0, 4.0
    for old_ctx in (2048, 4096, 8192, 16384, 32768):
        smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
        if np.allclose(1 / ((1 - smooth) / factor + smooth), factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": old_ctx,
            }
    raise NanoserveError("the GGUF's rope_freqs are not Llama 3 RoPE scaling; nanoserve cannot run it.")


def gguf_family(reader):
    """The registered family (`models.registry`) of the file's `general.architecture`; a
    NanoserveError naming the ones nanoserve runs otherwise."""
    from nanoserve.models.registry import family

    return family(_field(reader, "general.architecture"), "the GGUF's architecture")


def gguf_architecture(reader) -> str:
    """The file's `general.architecture`, if nanoserve runs it; otherwise a NanoserveError."""
    return gguf_family(reader).name


def rotary_rows_permuted(reader) -> bool:
    """Whether llama.cpp's converter reordered the file's Q/K rows (`unpermute_rotary_rows`): it
    does for 'llama', whose Hugging Face checkpoints rotate halves while llama.cpp's llama graph
    rotates pairs; a 'qwen2' or 'qwen3' file is run with the halves' rotation (NEOX) and kept
    as it was (`Family.gguf_rotary_permuted`)."""
    return gguf_family(reader).gguf_rotary_permuted


def _config(reader, shapes: dict[str, tuple], dtype: torch.dtype) -> dict:
    fam = gguf_family(reader)
    arch = fam.name

    def get(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise NanoserveError(
                f"the GGUF lacks '{arch}.{key}', which a {arch} model needs; use a complete file."
            )
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    # The embedding's rows are the model's vocabulary, which may exceed the tokenizer's (padding).
    vocab = shapes.get("token_embd.weight", [len(_field(reader, "tokenizer.ggml.tokens") or [])])[0]
    config = {
        "architectures": [fam.hf_architecture],
        "model_type": arch,
        "vocab_size": int(get("vocab_size", vocab)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _round_f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _round_f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": "blk.0.attn_q.bias" in shapes,  # qwen2's are implied by its type
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "tie_word_embeddings": "output.weight" not in shapes,
        "use_cache": True,
        "torch_dtype": DTYPE_NAMES[dtype],
    }
    for key in ("bos", "eos", "padding"):
        config[f"{key[:3]}_token_id"] = _field(reader, f"tokenizer.ggml.{key}_token_id")
    if fam.gguf_config is not None:  # what this family's config.json holds beyond a Llama's
        config.update(fam.gguf_config(get))
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _round_f32(get("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise NanoserveError(f"the GGUF's RoPE scaling is {kind!r}; nanoserve knows linear and llama3 only.")
    return config


def _state_dict(reader, config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    fam = gguf_family(reader)
    permuted = fam.gguf_rotary_permuted
    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)  # numpy float32, (rows, cols) as Hugging Face has them
        if t.name == "rope_freqs.weight":
            config["rope_scaling"] = _llama3_rope_scaling(w, config["head_dim"], config["rope_theta"])
            continue
        w = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the reader's map is read-only
        if permuted and ".attn_q." in t.name:  # weights and biases alike
            w = unpermute_rotary_rows(w, heads)
        elif permuted and ".attn_k." in t.name:
            w = unpermute_rotary_rows(w, kv_heads)
        if fam.gguf_norm_shift and t.name.endswith("norm.weight"):  # the gain back to Gemma's w
            w = w - fam.gguf_norm_shift
        out[hf_name(t.name, fam.gguf_names)] = w.to(dtype).contiguous()
    return out


def _tokenizer_files(reader, config: dict):
    """tokenizer.json (as a `tokenizers.Tokenizer`) and tokenizer_config.json from the GGUF."""
    from nanoserve.tokenizer import bpe_from_vocab, spm_from_vocab

    model = _field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise NanoserveError(
            f"the GGUF's tokenizer is {model!r}; nanoserve converts 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece BPE)."
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    # llama.cpp puts BOS in front of a SentencePiece prompt unless the file says not to.
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    bos_id = config["bos_token_id"] if add_bos else None
    if model == "gpt2":
        backend = bpe_from_vocab(
            tokens,
            token_types,
            _field(reader, "tokenizer.ggml.merges") or [],
            pre=_field(reader, "tokenizer.ggml.pre", "default"),
            bos_id=bos_id,
        )
    else:
        scores = _field(reader, "tokenizer.ggml.scores")
        if scores is None:
            raise NanoserveError(
                "the GGUF's SentencePiece vocabulary has no tokenizer.ggml.scores, which decide its "
                "merges; re-convert the model with llama.cpp's convert_hf_to_gguf.py."
            )
        backend = spm_from_vocab(
            tokens,
            scores,
            token_types,
            bos_id=bos_id,
            # absent: llama.cpp's default for SentencePiece, a space in front of the text
            add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
        )
    # PreTrainedTokenizerFast makes transformers' AutoTokenizer take tokenizer.json as written.
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= i < len(tokens):
            tokenizer_config[f"{name}_token"] = tokens[i]
    tokenizer_config |= {
        "add_bos_token": add_bos,
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    return backend, tokenizer_config


def _generation_config(reader, config: dict) -> dict:
    # Chat models end a turn with EOT (Llama 3's <|eot_id|>) as well as EOS: stop on all of them.
    eos = [config["eos_token_id"]] + [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": config["pad_token_id"],
    }


def import_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32, progress=None
) -> Path:
    """Convert a GGUF of a family nanoserve runs into a Hugging Face-layout directory at `out_dir`.

    Everything is written into a temporary sibling that is renamed into place at the end, so an
    interrupted conversion never leaves a directory that looks finished.
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPE_NAMES:
        raise NanoserveError(f"cannot store weights as {dtype}; choose one of {list(DTYPE_NAMES.values())}.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise NanoserveError(f"{out_dir} exists and is not empty; remove it or choose another output path.")
    reader = _open_gguf(gguf_path)
    config = _config(reader, {t.name: t.data.shape for t in reader.tensors}, dtype)
    tokenizer, tokenizer_config = _tokenizer_files(reader, config)
    if progress:
        progress(f"dequantizing {len(reader.tensors)} tensors to {DTYPE_NAMES[dtype]}")
    state = _state_dict(reader, config, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        files = {
            "config.json": config,
            "tokenizer_config.json": tokenizer_config,
            "generation_config.json": _generation_config(reader, config),
        }
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        template = _field(reader, "tokenizer.chat_template")
        if template:
            (tmp / "chat_template.jinja").write_text(template)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename will not replace a directory otherwise
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
