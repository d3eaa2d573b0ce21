"""Day 64's tables: what a second model family changes, measured on tiny models and real files.

Three CSVs, written next to this file:

* `day-64-families.csv`: one row per family of the forward nanoserve runs (Llama, a Llama with
  `attention_bias`, Qwen2, Qwen3), each a tiny random-weight model built with transformers' own
  config and model classes (`tiny_family`: 3 blocks, hidden 64, 8 query heads over 2 K/V heads
  of 8, vocabulary 256; norms drawn from U(0.5, 1.5) and biases from N(0, 0.5), so that neither
  can hide). Per row: the `LlamaConfig` flags the family sets, the tensors a block holds beyond a
  Llama's and their parameters, the model's parameters, the largest |logit| transformers gives
  (`logits_max_abs`, for scale), whether our prefill logits match transformers' (`matches_hf`,
  within `TOL`) and by how much (`max_diff_hf`, a rounding-sized
  figure that differs between CPUs: not compared), and what the logits move by when the
  family's extra tensors are made inert (biases zeroed, query/key norm weights set to 1).
* `day-64-models.csv`: the two real models the engine runs, SmolLM2-135M (llama) and
  Qwen2.5-Coder-0.5B (qwen2), read from the converted directories' config and safetensors
  header (no weights loaded): blocks, heads, parameters, and how many of them are biases.
* `day-64-tokens.csv`: a few strings (numbers, code, upper-case contractions, Japanese, an accent
  written two ways) encoded by both models' tokenizers: characters and tokens each way.

The notebook calls `tiny_family`, `family_row`, `model_row` and `token_rows` itself.

    python days/day64/familybench.py                 # writes the three CSVs here
    python days/day64/familybench.py --out /tmp/d64  # elsewhere
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
import time
import warnings
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.fetch import fetch_default_model, fetch_named_model
from nanoserve.models import load_model, model_weight_bytes
from nanoserve.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
QWEN = "qwen2.5-coder-0.5b-instruct"
TOL = 1e-4  # our logits against transformers' on a tiny model: fp32 sums in another order
SEED = 64
IDS = list(range(3, 60))  # 57 prompt tokens of the tiny models' 256
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# family -> (transformers config class, model class, overrides of TINY)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama+bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
}
EXTRAS = ("qkv_bias", "o_bias", "q_norm", "k_norm")  # a Block's tensors beyond a Llama's
TEXTS = {  # label -> string, for the tokenizers
    "number": "x = 1234567 + 89",
    "code": "def area(r):\n    return 3.14159 * r ** 2\n",
    "contractions": "I'M HERE, YOU'RE THERE",
    # "the weather in Tokyo is sunny"
    "Japanese": "\u6771\u4eac\u306e\u5929\u6c17\u306f\u6674\u308c\u3067\u3059",
    "cafe NFC": "caf\u00e9",  # é as one code point
    "cafe NFD": "cafe\u0301",  # e + a combining acute accent: the same text after NFC
}


# --- the forward: tiny models of each family, held to transformers ---


def tiny_family(family: str, path: Path, seed: int = SEED):
    """A random-weight checkpoint of `family` written to `path` (config.json, model.safetensors,
    an empty tokenizer.json: the tiny models take ids); returns transformers' model of it."""
    import transformers
    from safetensors.torch import save_file

    cfg_cls, model_cls, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **overrides})
    hf = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norm weights start at 1, biases at 0: neither may hide
            elif name.endswith(".bias"):
                p.normal_(0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, path / "model.safetensors")
    (path / "tokenizer.json").write_text("{}")
    return hf


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Our model's logits at every position of `ids`, one prefill through a contiguous cache."""
    cache = ContiguousKVCache(model.cfg, len(ids), dtype=model.dtype)
    positions = torch.arange(len(ids))
    cache.begin(positions)
    with torch.inference_mode():
        return model(torch.tensor(ids), positions, cache)  # (N, vocab)


def make_inert(model) -> str:
    """Turn the family's extra tensors into no-ops (biases to 0, norm weights to 1), in place;
    returns what was changed ('' for a plain Llama)."""
    done = []
    for b in model.blocks:
        for name in EXTRAS:
            w = getattr(b, name)
            if w is not None:
                w.fill_(1.0 if name.endswith("norm") else 0.0)
                done.append(name)
    return "+".join(dict.fromkeys(done))


def family_row(family: str, folder: Path, seed: int = SEED) -> dict:
    """One row of day-64-families.csv: build the tiny model, load it, compare, make it inert."""
    hf = tiny_family(family, folder / family, seed)
    ours = load_model(folder / family)
    cfg, block = ours.cfg, ours.blocks[0]
    extras = [n for n in EXTRAS if getattr(block, n) is not None]
    params = model_weight_bytes(ours) // 4  # fp32
    assert params == sum(p.numel() for p in hf.parameters()), family
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    logits = prefill_logits(ours, IDS)
    diff = (logits - ref).abs().max().item()
    inert = make_inert(ours)
    moved = (prefill_logits(ours, IDS) - logits).abs().max().item() if inert else 0.0
    return {
        "family": family,
        "model_type": cfg.family,
        "hf_class": FAMILIES[family][1],
        "qkv_bias": cfg.qkv_bias,
        "o_bias": cfg.o_bias,
        "qk_norm": cfg.qk_norm,
        "extra_per_block": "+".join(extras) or "-",
        "extra_params_per_block": sum(getattr(block, n).numel() for n in extras),
        "params": params,
        "logits_max_abs": f"{ref.abs().max().item():.3f}",
        "matches_hf": diff < TOL,
        "max_diff_hf": f"{diff:.0e}",  # rounding: differs between CPUs, not compared
        "inert": inert or "-",
        "logits_moved": f"{moved:.3f}" if inert else "-",
    }


def family_rows(seed: int = SEED) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="day64-") as tmp:
        return [family_row(f, Path(tmp), seed) for f in FAMILIES]


# --- the real models, from their config and safetensors header ---


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape from a .safetensors file's JSON header, without reading a weight:
    8 bytes of little-endian header length, then the header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def model_row(name: str, model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = safetensors_shapes(model_dir / "model.safetensors")
    count = lambda keep: sum(torch.Size(s).numel() for k, s in shapes.items() if keep(k))
    return {
        "model": name,
        "model_type": cfg["model_type"],
        "blocks": cfg["num_hidden_layers"],
        "hidden": cfg["hidden_size"],
        "heads": cfg["num_attention_heads"],
        "kv_heads": cfg["num_key_value_heads"],
        "vocab": cfg["vocab_size"],
        "tied_head": cfg.get("tie_word_embeddings", False),
        "params": count(lambda k: True),
        "bias_params": count(lambda k: k.endswith(".bias")),
        "bias_tensors": sum(k.endswith(".bias") for k in shapes),
    }


def model_rows() -> list[dict]:
    return [
        model_row("SmolLM2-135M-Instruct", fetch_default_model()),
        model_row("Qwen2.5-Coder-0.5B-Instruct", fetch_named_model(QWEN)),
    ]


# --- the tokenizers ---


def token_rows(smollm: Tokenizer, qwen: Tokenizer, texts: dict[str, str] = TEXTS) -> list[dict]:
    return [
        {
            "text": label,
            "chars": len(text),
            "smollm2_tokens": len(smollm.encode(text)),
            "qwen2_tokens": len(qwen.encode(text)),
        }
        for label, text in texts.items()
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", default=str(HERE), help="folder for the CSVs")
    args = ap.parse_args(argv)
    print(cpu_line())
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # transformers' import warns about tqdm's notebook widgets
        warnings.simplefilter("ignore")
        tables = {"day-64-families.csv": family_rows(args.seed)}
    tables["day-64-models.csv"] = model_rows()
    smollm = Tokenizer.from_dir(fetch_default_model())
    qwen = Tokenizer.from_dir(fetch_named_model(QWEN))
    tables["day-64-tokens.csv"] = token_rows(smollm, qwen)
    for name, rows in tables.items():
        write_csv(rows, Path(args.out) / name)
        print(name)
        for row in rows:
            print("  ", row)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
