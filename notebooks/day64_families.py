# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Day 64 — A second model family: Qwen2 and Qwen3 beside Llama
#
# Until today every model the engine could load was a Llama under another name: SmolLM2 says
# `"model_type": "llama"` in its config, and the Mistral checkpoints it accepts load into the
# same `Llama` class with nothing added. Qwen is the first family whose *forward* is different,
# and it is worth running because its small models are good: Qwen2.5-Coder-0.5B-Instruct writes
# working code at 0.5B.
#
# A family is a set of small decisions that together make a checkpoint mean something. The day
# goes through the four places where such decisions live, each held to an outside reference, and
# the places where none live:
#
# 1. the config: what `LlamaConfig` reads from `config.json` (`qkv_bias`, `o_bias`, `qk_norm`,
#    `family`),
# 2. the forward: one block written out by hand for four families, then four tiny random models
#    built with transformers' own classes and held to transformers' logits, and each family's
#    extra tensors made inert to see what they are worth (`days/day64/familybench.py`),
# 3. the loader: a `qwen2` GGUF's Q/K rows are stored as the checkpoint had them, and what the
#    Llama rule does to them,
# 4. the tokenizer: Qwen's pre-tokenizer against SmolLM2's, on numbers, code and accents,
# 5. the real model: Qwen2.5-Coder-0.5B-Instruct answering through the engine, held to
#    transformers' own GGUF loader on the same file,
# 6. what did not change: the paged cache, the scheduler and the server,
# 7. the diagram.

# %%
import contextlib
import io
import json
import re
import struct
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import matplotlib
import torch
import torch.nn.functional as F

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from gguf.quants import dequantize
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, engine_config, read_csv
from nanoserve import gguf_file, kquants
from nanoserve.bench import cpu_line
from nanoserve.contiguous import ContiguousKVCache, causal_attention
from nanoserve.engine import Engine
from nanoserve.fetch import fetch_default_gguf, fetch_default_model, fetch_named_gguf, fetch_named_model
from nanoserve.models import LlamaConfig, apply_rope, linear, load_model, model_weight_bytes, rms_norm
from nanoserve.sampling import SamplingParams
from nanoserve.status import boot_line
from nanoserve.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT, Tokenizer

sys.path.insert(0, str(REPO / "days" / "day64"))
with warnings.catch_warnings():  # transformers' import warns about tqdm's notebook widgets
    warnings.simplefilter("ignore")
    import familybench  # the day's script: the notebook calls its functions and reads its tables
    import transformers

transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)
print(cpu_line())
SMOL_DIR, QWEN_DIR = fetch_default_model(), fetch_named_model(familybench.QWEN)
SMOL_GGUF, QWEN_GGUF = fetch_default_gguf(), fetch_named_gguf(familybench.QWEN)
WORK = Path(tempfile.mkdtemp(prefix="day64-"))


# %% [markdown]
# ## 1. A family, as the config says it
#
# Four tiny checkpoints, written the way a real one is (`config.json` and `model.safetensors`)
# by `familybench.tiny_family` with transformers' own config and model classes: a Llama, a Llama
# with `attention_bias`, a Qwen2 and a Qwen3. Each has 3 blocks, hidden size 64, 8 query heads
# over 2 K/V heads of 8 dimensions, and a vocabulary of 256. Their norm weights are drawn from
# U(0.5, 1.5) and their biases from N(0, 0.5) instead of starting at 1 and 0, so a loader that
# skipped one could not get away with it.
#
# `LlamaConfig.from_dir` reads each `config.json` and turns the family into three switches:

# %%
hf_models = {}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for fam in familybench.FAMILIES:
        hf_models[fam] = familybench.tiny_family(fam, WORK / fam)

head = ("checkpoint", "model_type", "attention_bias", "->", "qkv_bias", "o_bias", "qk_norm", "family")
line = "{:<11} {:<10} {:<15} {:<2} {:<9} {:<7} {:<8} {}"
print(line.format(*head))
for fam in familybench.FAMILIES:
    raw = json.loads((WORK / fam / "config.json").read_text())
    c = LlamaConfig.from_dir(WORK / fam)
    bias = str(raw.get("attention_bias", "-"))
    flags = map(str, (c.qkv_bias, c.o_bias, c.qk_norm))
    print(line.format(fam, raw["model_type"], bias, "->", *flags, c.family))

# %% [markdown]
# The config alone does not say where the biases go. The tiny Qwen2's `config.json`, as
# transformers writes it, has no `attention_bias` at all (the `-`), and transformers'
# `Qwen2Attention` does not read one: it always builds Q, K and V with a bias and O without.
# The `qwen2` family encodes that fact: `from_dict` asks the registry
# (`nanoserve/models/registry.py`) for the family `model_type` names, and `models/qwen.py`'s
# switches give a `qwen2` Q, K and V biases and no O bias whatever `attention_bias` says (the real
# model's config in section 4 says it is true); for a Llama (and a Qwen3)
# `attention_bias` puts a bias on all four projections, O included. The Qwen3 switch is the model
# type itself: every Qwen3 block has its query and key norms.
#
# Here is what those switches add to a block, as transformers names the tensors (block 0 of each
# tiny model, beyond what a Llama block holds):

# %%
plain = {n for n, _ in hf_models["llama"].model.layers[0].named_parameters()}
for fam, hf in hf_models.items():
    extra = [(n, tuple(p.shape)) for n, p in hf.model.layers[0].named_parameters() if n not in plain]
    print(f"{fam:<11}", ", ".join(f"{n} {s}" for n, s in extra) or "(nothing: the reference)")

# %% [markdown]
# Our `Block` keeps Q, K and V in one fused matrix `qkv`, so the three biases become one
# vector `qkv_bias` of 64 + 16 + 16 = 96, stacked in the same order as the matrix's rows. O's bias
# is `o_bias` (64). Qwen3's `q_norm` and `k_norm` are 8 numbers each, one weight per dimension of a
# head, shared by all heads.
#
# ## 2. One block, by hand
#
# The whole difference between the families is inside attention, before the rotation and after
# the output projection. Written out, with the three optional steps marked:

# %%
def block_by_hand(blk, x, cos, sin, positions):
    """One decoder block of any of the four families, from its tensors."""
    cfg, n = blk.cfg, x.shape[0]
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    h = rms_norm(x, blk.input_norm, eps)
    qkv = linear(h, blk.qkv)  # (N, (nh + 2 nkv) hd)
    if blk.qkv_bias is not None:  # Qwen2; a Llama with attention_bias
        qkv = qkv + blk.qkv_bias
    q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = q.view(n, nh, hd), k.view(n, nkv, hd), v.view(n, nkv, hd)
    if blk.q_norm is not None:  # Qwen3: each head's query and key scaled to RMS 1, over hd
        q, k = rms_norm(q, blk.q_norm, eps), rms_norm(k, blk.k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    a = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), positions)  # (N, nh, hd)
    out = linear(a.reshape(n, nh * hd), blk.o)
    if blk.o_bias is not None:  # a Llama with attention_bias only
        out = out + blk.o_bias
    x = x + out
    h = rms_norm(x, blk.post_norm, eps)
    gate, up = linear(h, blk.gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, blk.down)


ids = familybench.IDS
positions = torch.arange(len(ids))
ours = {fam: load_model(WORK / fam) for fam in familybench.FAMILIES}
for fam, m in ours.items():
    blk = m.blocks[0]
    x = m.embed[torch.tensor(ids)]  # (57, 64)
    cos, sin = m.cos[positions].unsqueeze(1), m.sin[positions].unsqueeze(1)
    cache = ContiguousKVCache(m.cfg, len(ids))
    cache.begin(positions)
    with torch.inference_mode():
        want, got = blk(x, cos, sin, cache), block_by_hand(blk, x, cos, sin, positions)
    d = (got - want).abs().max().item()
    print(f"{fam:<11} block 0 by hand against Block.forward: max |difference| {d:.1e}")
    assert d < 1e-5

# %% [markdown]
# (Differences this small are printed in e-notation and masked when the notebook is checked:
# they come from sums taken in another order, and their digits differ between CPUs. The `assert`
# under each holds the bound.)
#
# The hand-written block equals `Block.forward` to the last bit for all four, on this machine.
# Two details in it are the family's whole definition, and both are easy to get subtly wrong:
#
# * **The bias goes before the rotation.** A bias on K is added to every key before RoPE turns
#   it by its position, so it is rotated too; adding it afterwards would give every position the
#   same unrotated offset.
# * **Qwen3's norm is per head, over `head_dim`.** Each query head's 8 numbers are scaled to RMS 1
#   and then multiplied by the shared `q_norm` weights. Normalizing the whole 64-wide query row
#   at once would be another model. The norm also comes before the rotation, which is why the
#   engine's one `apply_rope` call over Q and K together stays as it was.
#
# ## 3. Whole models, held to transformers
#
# `familybench.family_row` loads each tiny checkpoint with `load_model`, runs one prefill of the
# 57 token ids 3..59 and compares every position's logits with transformers' model of the same
# checkpoint. Then it makes the family's extra tensors inert (biases to 0, norm weights to 1: the
# values a freshly built model starts with) and measures how far the logits move. That second
# number is the point of the randomized biases and norms: it shows that the first comparison
# would have caught a loader that dropped them.

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rows = [familybench.family_row(fam, WORK / "rows") for fam in familybench.FAMILIES]
CSV_FAMILIES = read_csv(familybench.HERE / "day-64-families.csv")
shown = ["family", "extra_per_block", "extra_params_per_block", "params", "logits_max_abs", "matches_hf"]
shown += ["inert", "logits_moved"]
print(" | ".join(shown))
for r in rows:
    print(" | ".join(str(r[c]) for c in shown))
for r in rows:
    d = float(r["max_diff_hf"])
    print(f"{r['family']:<11} max |ours - transformers| {d:.0e} (tolerance {familybench.TOL:.0e})")
for r, want in zip(rows, CSV_FAMILIES):
    assert all(str(r[c]) == want[c] for c in want if c != "max_diff_hf"), (r, want)
assert all(r["matches_hf"] for r in rows)
assert all(float(r["logits_moved"]) > 100 * familybench.TOL for r in rows if r["inert"] != "-")

# %% [markdown]
# All four match transformers within 1e-4; on the machine that wrote the CSV, to the last bit
# (`max_diff_hf` 0e+00). The extra tensors are a sliver of each model, 96 parameters a block for
# Qwen2 and 16 for Qwen3, in models of 156,384 and 156,144 parameters, but making them inert moves
# the logits by 1.004 for the Llama with biases, 0.989 for Qwen2 and 0.146 for Qwen3, on logits
# whose largest magnitude is 0.488 to 0.705: more than a thousand times the tolerance. The norms
# move them least because a norm weight of 1 is not far from U(0.5, 1.5), while a bias of 0 is far
# from N(0, 0.5). The rows equal `days/day64/day-64-families.csv` in every column but that
# rounding one.
#
# ## 4. The loader: a `qwen2` GGUF keeps its Q/K rows as they were
#
# Day 2's converter undoes a reordering llama.cpp's own converter applies to Llama checkpoints:
# a Hugging Face Llama rotates the two halves of each head (dimension i with i + 32), llama.cpp's
# `llama` graph rotates adjacent pairs (2i with 2i + 1), so the converter interleaves the rows of
# Q and K to match, and `unpermute_rotary_rows` puts them back. For `qwen2`, llama.cpp's graph
# rotates halves, as Hugging Face does, and its converter leaves the rows alone. Which rule applies
# is written in the first metadata field of every GGUF, `general.architecture`, which can be read
# by hand: 4 bytes of magic, a uint32 version, two uint64 counts, then key/value pairs, each key a
# uint64 length and its bytes, each value a uint32 type (8 is a string) and the value.

# %%
def first_field(path):
    with open(path, "rb") as f:
        magic, version, n_tensors, n_fields = struct.unpack("<4sIQQ", f.read(24))
        (key_len,) = struct.unpack("<Q", f.read(8))
        key = f.read(key_len).decode()
        kind, value_len = struct.unpack("<IQ", f.read(12))
        assert kind == 8  # a string
        return magic, version, n_tensors, n_fields, key, f.read(value_len).decode()


for path in (SMOL_GGUF, QWEN_GGUF):
    magic, version, n_tensors, n_fields, key, arch = first_field(path)
    print(f"{path.name}: {magic} v{version}, {n_tensors} tensors, {n_fields} fields; first: {key} = {arch!r}")

t0 = time.perf_counter()
reader = gguf_file._open_gguf(QWEN_GGUF)  # parses every field, the vocabulary's among them
vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
print(f"opened {QWEN_GGUF.name} with gguf's reader in {time.perf_counter() - t0:.1f} s ({vocab:,} tokens)")
arch, permuted = gguf_file.gguf_architecture(reader), gguf_file.rotary_rows_permuted(reader)
print(f"architecture: {arch}   Q/K rows permuted: {permuted}")
print("tensor types:", dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items())))
f32 = [t.name for t in reader.tensors if t.tensor_type.name == "F32"]
norms, biases = sum(n.endswith("norm.weight") for n in f32), sum(n.endswith(".bias") for n in f32)
print(f"F32: {norms} norms + {biases} biases = {len(f32)}")
assert norms + biases == len(f32)
attn0 = [t.name[6:] for t in reader.tensors if t.name.startswith("blk.0.attn")]
print("block 0:", ", ".join(attn0))
assert first_field(QWEN_GGUF)[5] == gguf_file.gguf_architecture(reader) == "qwen2"
assert first_field(SMOL_GGUF)[5] == "llama" and not gguf_file.rotary_rows_permuted(reader)

# %% [markdown]
# The file's block 0 carries three attention biases, `attn_q.bias`, `attn_k.bias` and
# `attn_v.bias`, and no `attn_output.bias`: Qwen2's layout. It mixes five tensor types (Q4_K_M is
# a recipe, not one type). The 121 F32 ones are the 49 norms and the 72 biases, which stay full
# precision; yesterday's K-quant super-blocks are the Q4_K and Q6_K. Today the engine runs the
# conversion to fp32 that `fetch_named_model` made once, widening every type with `gguf`'s
# `dequantize`, the path transformers' loader takes too.
#
# The model, loaded (the first of the two loads of the 0.5B model in this notebook), and its
# block 0 Q rows against the file's tensor widened twice, by `gguf` and by yesterday's
# `kquants.dequantize`: the same numbers, in the same order.

# %%
t0 = time.perf_counter()
qwen = load_model(QWEN_DIR)
print(f"Qwen2.5-Coder-0.5B-Instruct, fp32, loaded in {time.perf_counter() - t0:.1f} s")
qcfg = qwen.cfg
tok = Tokenizer.from_dir(QWEN_DIR)
print(
    f"{qcfg.family}: {qcfg.num_layers} blocks, hidden {qcfg.hidden_size}, {qcfg.num_heads} query heads "
    f"over {qcfg.num_kv_heads} K/V heads of {qcfg.head_dim}, MLP {qcfg.intermediate_size}, "
    f"vocabulary {qcfg.vocab_size:,}"
)
raw_bias = json.loads((QWEN_DIR / "config.json").read_text())["attention_bias"]
flags = f"qkv_bias {qcfg.qkv_bias}, o_bias {qcfg.o_bias}, qk_norm {qcfg.qk_norm}"
print(f"config.json attention_bias {raw_bias} -> {flags}")
assert raw_bias and qcfg.qkv_bias and not qcfg.o_bias
MODELS = familybench.model_rows()  # from the two converted directories' safetensors headers
assert as_text(MODELS) == read_csv(familybench.HERE / "day-64-models.csv")
for r in MODELS:
    print(
        f"{r['model']:<28} {r['model_type']:<6} {r['params']:>12,} parameters, vocabulary {r['vocab']:,}, "
        f"{r['bias_tensors']} bias tensors holding {r['bias_params']:,}, tied head {r['tied_head']}"
    )
assert model_weight_bytes(qwen) // 4 == MODELS[1]["params"]
for name in ("token_embd.weight", "output.weight"):
    t = reader.tensors[[t.name for t in reader.tensors].index(name)]
    print(f"{name:<18} {t.tensor_type.name:<5} {[int(d) for d in t.shape]}")
Q, KV = qcfg.num_heads * qcfg.head_dim, qcfg.num_kv_heads * qcfg.head_dim  # 896, 128 rows
tensors = {t.name: t for t in reader.tensors}
blk0 = qwen.blocks[0]
for name, ours_rows in (("attn_q.weight", blk0.qkv[:Q]), ("attn_q.bias", blk0.qkv_bias[:Q])):
    t = tensors["blk.0." + name]
    as_file = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(ours_rows.shape)
    same = torch.equal(as_file, ours_rows)
    print(f"blk.0.{name:<14} {t.tensor_type.name:<4} equal to our rows as the file lies: {same}")
    assert same
t = tensors["blk.0.attn_q.weight"]
kind = t.tensor_type.name.lower()
by_kquants = kquants.dequantize(torch.from_numpy(t.data.copy()), kind, (Q, qcfg.hidden_size))
same = torch.equal(by_kquants, blk0.qkv[:Q])
print(f"blk.0.attn_q.weight through yesterday's kquants.dequantize ({kind}): equal to our rows: {same}")
assert same

# %% [markdown]
# Now the mistake the Llama rule would make here. A loader that treated every GGUF as a `llama`
# one would pass Q's and K's rows, weights and biases, through `unpermute_rotary_rows`. The
# shapes all fit and nothing complains. The prompt below is the one section 6 uses; the right
# logits first, then the wrong ones, then the right weights put back.

# %%
chat = [{"role": "user", "content": "Write a Python expression that reverses the string s."}]
prompt = tok.encode_chat(chat)
right = familybench.prefill_logits(qwen, prompt)  # (40, 151936)


def unpermute_rows(model, which):
    """What `_state_dict` would do to a 'llama' file: rows of Q (and K) back from pairs to halves."""
    with torch.no_grad():
        for b in model.blocks:
            for start, size, heads in [(0, Q, qcfg.num_heads), (Q, KV, qcfg.num_kv_heads)][: len(which)]:
                for w in (b.qkv, b.qkv_bias):
                    rows = w[start : start + size].clone()
                    w[start : start + size] = gguf_file.unpermute_rotary_rows(rows, heads)


saved = [(b.qkv.clone(), b.qkv_bias.clone()) for b in qwen.blocks]
wrong = {}
for which in (("Q",), ("Q", "K")):
    unpermute_rows(qwen, which)
    wrong[which] = familybench.prefill_logits(qwen, prompt)
    with torch.no_grad():
        for b, (w, bias) in zip(qwen.blocks, saved):
            b.qkv.copy_(w)
            b.qkv_bias.copy_(bias)
assert torch.equal(familybench.prefill_logits(qwen, prompt), right)
del saved

print(f"right logits: {len(prompt)} positions, from {right.min():.1f} to {right.max():.1f}")
wrong_diff = {}
for which, logits in wrong.items():
    wrong_diff[which] = (logits - right).abs().max().item()
    same = (logits.argmax(-1) == right.argmax(-1)).sum().item()
    print(
        f"{' and '.join(which)} rows unpermuted: max |difference| {wrong_diff[which]:.1f}; "
        f"the top token agrees at {same} of {len(prompt)} positions"
    )
assert min(wrong_diff.values()) > 10

# %% [markdown]
# Either way the model is broken: logits off by more than 20 on a range of about 60. With only Q's
# rows reordered the top token survives at 7 of the 40 positions; with Q's and K's, at 25, which
# is still a different model. Reordering both does less damage than Q alone, but not because the
# two cancel. Attention scores depend on which of a head's dimensions are rotated together and
# at which frequency; permuting Q and K the same way keeps their dot product at distance zero
# and changes it at every other distance. The check that caught it is the one section 6 holds
# the right model to.
#
# ## 5. The tokenizer
#
# Both models' tokenizers are byte-level BPE, and both cut numbers into single digits before
# merging. What differs is the rule that splits text into pieces before merging, and a
# normalization step. SmolLM2's tokenizer splits digits apart and then applies GPT-2's regex;
# Qwen's applies a regex of Llama 3's kind, after normalizing the text to Unicode NFC. As the two
# `tokenizer.json` files say, and as the GGUF names Qwen's (`tokenizer.ggml.pre`):

# %%
for name, d in (("SmolLM2", SMOL_DIR), ("Qwen2.5", QWEN_DIR)):
    spec = json.loads((d / "tokenizer.json").read_text())
    steps = [p["type"] for p in spec["pre_tokenizer"].get("pretokenizers", [spec["pre_tokenizer"]])]
    normalizer = (spec.get("normalizer") or {}).get("type")
    print(f"{name:<8} normalizer {normalizer}, pre-tokenizer {' -> '.join(steps)}")
print("the GGUF's tokenizer.ggml.pre:", gguf_file._field(reader, "tokenizer.ggml.pre"))
qwen_spec = json.loads((QWEN_DIR / "tokenizer.json").read_text())["pre_tokenizer"]
qwen_regex = qwen_spec["pretokenizers"][0]["pattern"]["Regex"]
print("Llama 3's number rule:", re.search(r"\\p\{N\}\{1,3\}", LLAMA3_SPLIT)[0], "  Qwen2's:", r"\p{N}")
assert qwen_regex == QWEN2_SPLIT == LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

# %% [markdown]
# Qwen2's regex is Llama 3's with one change: Llama 3 keeps up to three digits in a piece, Qwen2
# one. The six test strings of `familybench.TEXTS`, as each tokenizer cuts them:

# %%
smol_tok = Tokenizer.from_dir(SMOL_DIR)
for label, text in familybench.TEXTS.items():
    for name, t in (("SmolLM2", smol_tok), ("Qwen2.5", tok)):
        pieces = [t.token_text(i) for i in t.encode(text)]
        print(f"{label:<9} {name:<8} {len(pieces):>2} {pieces}")
token_rows = familybench.token_rows(smol_tok, tok)
CSV_TOKENS = read_csv(familybench.HERE / "day-64-tokens.csv")
assert [{k: str(v) for k, v in r.items()} for r in token_rows] == CSV_TOKENS
nfc, nfd = familybench.TEXTS["cafe NFC"], familybench.TEXTS["cafe NFD"]
assert tok.encode(nfc) == tok.encode(nfd) and smol_tok.encode(nfc) != smol_tok.encode(nfd)

# %% [markdown]
# * **Numbers**: the same 14 tokens both ways, digit by digit. Both families chose single digits,
#   so arithmetic sees the same units in each.
# * **Code**: 21 against 20. The pieces show the regexes at work: GPT-2's keeps the newline with
#   the indent that follows it (`'\n   '`), Llama 3's kind keeps it with the `):` before it
#   (`'):\n'`), and Qwen's vocabulary merges `(r`.
# * **Contractions in capitals**: 10 against 7. GPT-2's regex knows `'s`, `'re`, `'m` and the rest
#   in lower case only, so `I'M` falls apart into three pieces; Qwen's wraps them in `(?i:...)`,
#   and `'M` and `'RE` stay whole.
# * **Japanese**: 20 against 9. SmolLM2's 49,152-entry vocabulary holds few of these characters, so
#   most of them go out as single bytes or byte pairs (`bytes:...`); Qwen's 151,936 entries hold
#   each character, and `です` as one token. That one is the vocabulary, not the regex.
# * **café**: the same word typed two ways (é as one code point, or e followed by a combining
#   accent) is 2 tokens for Qwen either way, because NFC composes the second into the first
#   before anything else happens. SmolLM2, without a normalizer, sees two different byte strings:
#   3 tokens, and 4 with the accent's two bytes as tokens of their own.
#
# A prompt is only right if it is tokenized the way the model was trained, so the tokenizer is
# as much part of the family as the attention biases. `tests/test_qwen.py` holds ours to
# transformers' tokenizer from the same GGUF, token for token, on code, accents, CJK and emoji.
#
# ## 6. The real model answers, held to transformers' GGUF loader
#
# The chat template comes with the model (its `chat_template.jinja`, taken from the GGUF). Qwen's
# supplies a system message when the conversation has none:

# %%
print(tok.apply_chat_template(chat))
print(f"{len(prompt)} tokens")

# %% [markdown]
# The engine runs it as it runs SmolLM2: a paged KV pool (a small one here, a KV budget of 512
# tokens' worth), the scheduler, and the variants of the day, `engine_config(64, ...)` (linears
# packed for oneDNN where the CPU allows; the decode step as torch ops, since `decode_step="auto"`
# picks day 61's fused native step only for quantized weights).
# A greedy answer of 24 tokens:

# %%
bytes_a_token = qcfg.num_layers * 2 * qcfg.num_kv_heads * qcfg.head_dim * 4  # K and V, fp32
config = engine_config(64, max_batch=1, max_model_len=256, kv_budget=bytes_a_token * 512)
engine = Engine(qwen, tok, config)
engine.model_name = QWEN_DIR.name
t0 = time.perf_counter()
answer = engine.generate([prompt], SamplingParams(max_tokens=24), use_tqdm=False)[0]
print(f"24 tokens in {time.perf_counter() - t0:.1f} s")
print(f"decode step: {engine.decode_step}; {len(answer.token_ids)} tokens: {answer.token_ids}")
print(answer.text)
assert len(answer.token_ids) == 24 and engine.decode_step == "ops"

# %% [markdown]
# The reference is transformers reading the same GGUF file itself, with its own dequantization,
# its own `Qwen2ForCausalLM` and its own config mapping (the second load of the 0.5B model). One
# forward over the prompt and the answer checks two things at once: the logits at the prompt's
# positions against ours from section 4, and, at each answer position, whether transformers' top
# token is the one our engine chose. If it is everywhere, transformers' own greedy decoding would
# have written the same answer.

# %%
t0 = time.perf_counter()
with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
    warnings.simplefilter("ignore")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(QWEN_GGUF.parent), gguf_file=QWEN_GGUF.name, dtype=torch.float32
    ).eval()
seconds = time.perf_counter() - t0
print(f"transformers: {type(hf).__name__} from the GGUF in {seconds:.1f} s")
full = torch.tensor([prompt + answer.token_ids])
with torch.no_grad():
    ref = hf(full).logits[0]  # (64, 151936)
BOUND = 1e-3
hf_diff = (ref[: len(prompt)] - right).abs().max().item()
span = (right.max() - right.min()).item()
print(f"prompt logits, max |ours - transformers| {hf_diff:.1e} (bound {BOUND:.0e}; logits span {span:.0f})")
picked = ref[len(prompt) - 1 : -1].argmax(-1).tolist()
same = picked == answer.token_ids
print(f"transformers' top token at the {len(picked)} answer positions equals the engine's: {same}")
assert hf_diff < BOUND and picked == answer.token_ids
del hf, ref

# %% [markdown]
# The two sides widen the same blocks to the same fp32 numbers, so what is left is the order of
# fp32 sums through 24 blocks: a few times 1e-5 here, on logits spanning about 61. The bound,
# 1e-3, is the one `tests/test_qwen.py` uses; a dropped bias or a wrongly permuted row is four
# orders of magnitude past it (section 4).
#
# ## 7. What did not change
#
# Nothing after the model's forward knows which family it runs. The modules that plan, page,
# schedule and serve, searched for any of the family's names:

# %%
RUNTIME = ["blocks", "pool", "cache", "plan", "scheduler", "runner", "engine", "loop", "api", "handlers"]
RUNTIME.append("serve")
family_words = re.compile(r"qwen|qkv_bias|o_bias|q_norm|k_norm|qk_norm|\.family\b", re.I)
hits = {m: len(family_words.findall((REPO / "nanoserve" / f"{m}.py").read_text())) for m in RUNTIME}
print(", ".join(f"{m}.py {n}" for m, n in hits.items()))
assert not any(hits.values())
print(type(engine.cache).__name__, type(engine.scheduler).__name__, type(engine.allocator).__name__)
print(boot_line(engine))

# %% [markdown]
# Zero mentions in eleven modules. The K/V cache a block writes is (tokens, K/V heads, head dim)
# whatever the family, because the bias and the norm have been applied by the time a key is
# written; the pool is planned from the config's layer and head counts; the scheduler counts
# tokens and blocks. The family appears on the serving side only as a label, in the boot line
# above.
#
# ## 8. The diagram

# %%
fig = plt.figure(figsize=(16, 10))
grid = fig.add_gridspec(2, 2, height_ratios=[1, 1], hspace=0.42, wspace=0.22)

ax = fig.add_subplot(grid[0, 0])
ax.axis("off")
ax.set_xlim(0, 10)
ax.set_ylim(0, 10)
ax.set_title("one attention block: the steps a family adds (dashed)", fontsize=12)
steps = [
    ("input RMSNorm", None),
    ("qkv = h @ W_qkv", None),
    ("+ qkv_bias  (Qwen2; Llama with attention_bias)", "#fce5cd"),
    ("RMSNorm each Q and K head over head_dim  (Qwen3)", "#d9ead3"),
    ("RoPE on Q and K (halves; a llama GGUF's rows unpermuted first)", None),
    ("attention over the paged K/V cache", "#eeeeee"),
    ("out = a @ W_o", None),
    ("+ o_bias  (Llama with attention_bias)", "#cfe2f3"),
    ("residual, RMSNorm, SwiGLU MLP, residual", None),
]
for i, (text, color) in enumerate(steps):
    y = 9.1 - i * 1.02
    dashed = color not in (None, "#eeeeee")
    ax.add_patch(
        plt.Rectangle(
            (0.6, y - 0.36), 8.8, 0.72, facecolor=color or "white", edgecolor="black",
            lw=0.9, ls="--" if dashed else "-",
        )
    )  # fmt: skip
    ax.text(5.0, y, text, ha="center", va="center", fontsize=9.5)
    if i:
        ax.annotate("", (5.0, y + 0.36), (5.0, y + 0.66), arrowprops=dict(arrowstyle="->", lw=0.8))

ax = fig.add_subplot(grid[0, 1])
fams = [r["family"] for r in rows if r["inert"] != "-"]
moved = [float(r["logits_moved"]) for r in rows if r["inert"] != "-"]
bars = ax.bar(fams, moved, color=["#cfe2f3", "#fce5cd", "#d9ead3"], edgecolor="black")
for b, r in zip(bars, [r for r in rows if r["inert"] != "-"]):
    ax.text(b.get_x() + b.get_width() / 2, b.get_height() * 1.3, f"{r['logits_moved']}\n({r['inert']} inert)",
            ha="center", fontsize=9)  # fmt: skip
ax.axhline(familybench.TOL, color="tab:red", ls="--")
tol_text = f"tolerance against transformers, {familybench.TOL:.0e}"
ax.text(1.0, familybench.TOL * 0.35, tol_text, color="tab:red", ha="center", fontsize=9)
ax.set_yscale("log")
ax.set_ylim(1e-5, 30)
ax.set_ylabel("max |logit change|")
ax.set_title(
    "tiny models: what the family's extra tensors are worth\n(made inert: biases 0, norms 1)", fontsize=11
)

ax = fig.add_subplot(grid[1, 0])
labels = ["ours vs transformers'\nGGUF loader", "Q rows\nunpermuted", "Q and K rows\nunpermuted"]
values = [hf_diff, wrong_diff[("Q",)], wrong_diff[("Q", "K")]]
bars = ax.bar(labels, values, color=["tab:green", "tab:red", "tab:red"], edgecolor="black")
for b, v in zip(bars, values):
    label = f"{v:.1e}" if v < 1 else f"{v:.1f}"
    ax.text(b.get_x() + b.get_width() / 2, v * 1.4, label, ha="center", fontsize=9)
ax.axhline(BOUND, color="black", ls="--")
ax.text(2.45, BOUND * 1.5, f"bound {BOUND:.0e}", ha="right", fontsize=9)
ax.set_yscale("log")
ax.set_ylim(1e-6, 300)
ax.set_ylabel("max |logit difference|, 40 prompt positions")
ax.set_title("Qwen2.5-Coder-0.5B (qwen2 GGUF): right, and with the llama rule's row order", fontsize=11)

ax = fig.add_subplot(grid[1, 1])
texts = [r["text"] for r in CSV_TOKENS]
xs = range(len(texts))
smol_n = [int(r["smollm2_tokens"]) for r in CSV_TOKENS]
qwen_n = [int(r["qwen2_tokens"]) for r in CSV_TOKENS]
ax.bar([i - 0.2 for i in xs], smol_n, 0.4, label="SmolLM2 (digits, GPT-2 regex)", color="tab:blue")
ax.bar([i + 0.2 for i in xs], qwen_n, 0.4, label="Qwen2.5 (NFC, 'qwen2' regex)", color="tab:orange")
for i in xs:
    ax.text(i - 0.2, smol_n[i] + 0.3, str(smol_n[i]), ha="center", fontsize=9)
    ax.text(i + 0.2, qwen_n[i] + 0.3, str(qwen_n[i]), ha="center", fontsize=9)
ax.set_xticks(list(xs), texts)
ax.set_ylabel("tokens")
ax.set_ylim(0, 27)
ax.legend(fontsize=9, loc="upper right")
ax.set_title("the same strings through each family's tokenizer (day-64-tokens.csv)", fontsize=11)

fig.suptitle("Day 64: a second model family (Qwen2, Qwen3) in the same engine", fontsize=15)
png = diagram_path("day64-families.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** keeps one Python module per family under `vllm/model_executor/models/` and a table,
#   `_TEXT_GENERATION_MODELS` in `models/registry.py`, from the `architectures` string in
#   `config.json` to a module and class, imported only when a model asks for it. Several
#   architectures share a module: `MistralForCausalLM` and `InternLM3ForCausalLM`, for example,
#   map to `llama`'s `LlamaForCausalLM`. `qwen2.py` builds Q, K and V as one `QKVParallelLinear`
#   with a bias and O as a `RowParallelLinear` without one; `qwen3.py` reuses Qwen2's MLP and model
#   class (its `Qwen3Model` passes `Qwen3DecoderLayer` to `Qwen2Model`) and adds `q_norm` and
#   `k_norm`, applied to the projections viewed head by head, before `rotary_emb`. Out-of-tree
#   families register with `ModelRegistry.register_model`, and `--model-impl transformers` runs a
#   model through transformers' own classes instead.
# * **transformers** maps `model_type` to a class in `models/auto/modeling_auto.py`
#   (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: `("qwen2", "Qwen2ForCausalLM")`). Every family has a
#   complete `modeling_qwen2.py` of its own, one file to read top to bottom, but it is generated
#   from a short `modular_qwen2.py` that imports Llama's classes and states only the differences;
#   the generated file says not to edit it. For GGUF files, `modeling_gguf_pytorch_utils.py` picks
#   a tensor processor by architecture (`TENSOR_PROCESSORS`): `llama` gets one that reverses the
#   Q/K row permutation, `qwen2` the default, which copies rows as they are. Our
#   `rotary_rows_permuted` is the same decision.
# * **llama.cpp** names each family in an enum (`LLM_ARCH_LLAMA`, `LLM_ARCH_QWEN2`,
#   `LLM_ARCH_QWEN3`, ...) with its GGUF string in `LLM_ARCH_NAMES` (`src/llama-arch.cpp`), and
#   lists per architecture which tensors a file may hold. `src/llama-model.cpp` loads the
#   hyperparameters and tensors in a `switch` over the architecture and builds one compute graph
#   per family (`llm_build_qwen2`, `llm_build_qwen3`, ...). `llama_model_rope_type` returns
#   `LLAMA_ROPE_TYPE_NORM` (adjacent pairs) for `llama` and `LLAMA_ROPE_TYPE_NEOX` (halves) for
#   `qwen2`, which is why only Llama checkpoints are permuted on conversion. The converter names the
#   pre-tokenizer by hashing the tokens of a fixed test string (`get_vocab_base_pre`) and writes
#   `tokenizer.ggml.pre`; the `qwen2` value selects its own split rules in `llama-vocab.cpp`.
#
# nanoserve does none of these. It has one `Llama` class whose `Block` holds three optional
# tensors, switched on by `LlamaConfig`; a family that changes only what happens around the
# matmuls of attention fits that way, and keeps every later piece of the engine (the fused
# decode step aside, which refuses what it cannot run) shared. A family with another block shape
# (Gemma 3's norms around each sublayer, its sliding windows) is where that stops being cheap.
#
# ## Try it
#
# 1. **A Qwen2 with a bias on O?** Build a tiny checkpoint with `familybench.tiny_family("qwen2",
#    path)`, then add `"attention_bias": true` to its `config.json`. Predict `LlamaConfig.from_dir`'s
#    `o_bias` before running it. The check: `o_bias` is `False`, and `load_model(path)` still
#    matches transformers' `Qwen2ForCausalLM.from_pretrained(path)` within `familybench.TOL`,
#    because transformers' Qwen2 ignores that key too.
# 2. **Break the order on purpose.** In `block_by_hand`, move the `q_norm`/`k_norm` step after
#    `apply_rope`. The check: the four-family loop of section 2 fails for `qwen3` only (a norm
#    over a rotated head gives another result, because the weights differ per dimension), and
#    passes for the other three. Then add Q's and K's biases after the rotation instead of before
#    (V's stays where it was), and watch `qwen2` and `llama+bias` fail and the others pass.
# 3. **Count a real Qwen3.** Qwen3-0.6B has 28 blocks, 16 query heads and 8 K/V heads of 128, and
#    no biases. Write its `LlamaConfig` (`qk_norm=True`, `family="qwen3"`) and compute the
#    parameters its query/key norms add: `2 * 128` a block, `28 * 2 * 128` in all. The check: a `Llama`
#    built from that config (on the `meta` device, so nothing is allocated) has
#    `sum(b.q_norm.numel() + b.k_norm.numel() for b in model.blocks) == 7168`.
