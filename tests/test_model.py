"""The forward pass against transformers' LlamaForCausalLM, on tiny random weights and on SmolLM2."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from nanoserve.contiguous import ContiguousKVCache, NoCache
from nanoserve.errors import NanoserveError
from nanoserve.generate import greedy_tokens
from nanoserve.models import Llama, LlamaConfig, load_model, pack_linears, packing_status, rope_inv_freq

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,  # grouped-query: 4 query heads per K/V head
    head_dim=8,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,  # an untied head, unlike SmolLM2
)


def make_tiny_checkpoint(path, config_cls, model_cls, config: dict, seed=0, random_biases=False):
    """A random-weight transformers model written the way a checkpoint is: config.json +
    model.safetensors. Norm weights start at 1 and biases at 0; norms (and, with
    `random_biases`, biases) are randomized so a swapped or skipped one cannot hide."""
    torch.manual_seed(seed)
    hf_cfg = config_cls(**config)
    hf = model_cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif random_biases and name.endswith(".bias"):
                p.normal_(0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(path)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    save_file(sd, path / "model.safetensors")
    return hf


def make_tiny_dir(path, seed=0, random_biases=False, **overrides):
    """A random-weight Llama checkpoint (`make_tiny_checkpoint`)."""
    config = {**TINY, **overrides}
    return make_tiny_checkpoint(
        path, transformers.LlamaConfig, transformers.LlamaForCausalLM, config, seed, random_biases
    )


def ours_from_dir(path, dtype=torch.float32):
    from safetensors.torch import load_file

    cfg = LlamaConfig.from_dir(path)
    m = Llama(cfg, dtype=dtype)
    m.load_hf_state_dict({k: v.to(dtype) for k, v in load_file(path / "model.safetensors").items()})
    return m


def tiny_engine_at(path, context=128, max_batch=4, blocks=64):
    """The servers' tests' engine: a random-weight tiny model (seed 3) with `context` positions,
    no tokenizer (prompts are ids) and a pool of `blocks` 16-token blocks."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine

    make_tiny_dir(path, seed=3, max_position_embeddings=context)
    model = ours_from_dir(path)
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    return Engine(model, None, EngineConfig(max_batch=max_batch, kv_budget=per_block * blocks))


def prefill_logits(model, ids):
    cache = ContiguousKVCache(model.cfg, len(ids) + 8, dtype=model.dtype)
    pos = torch.arange(len(ids))
    cache.begin(pos)
    return model(torch.tensor(ids), pos, cache)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = make_tiny_dir(path)
    return hf, ours_from_dir(path), path


def test_tiny_logits_match_transformers(tiny):
    hf, ours, _ = tiny
    ids = torch.randint(0, TINY["vocab_size"], (50,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = prefill_logits(ours, ids.tolist())
    assert (out - ref).abs().max().item() < 1e-4


def test_tiny_tied_head_matches_transformers(tmp_path):
    hf = make_tiny_dir(tmp_path, seed=3, tie_word_embeddings=True)
    ours = ours_from_dir(tmp_path)
    assert ours.head is ours.embed
    ids = list(range(5, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(ours, ids) - ref).abs().max().item() < 1e-4


def test_tiny_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=32,
    )
    hf = make_tiny_dir(tmp_path, seed=4, rope_scaling=scaling)
    ours = ours_from_dir(tmp_path)
    assert ours.cfg.rope_scaling and ours.cfg.rope_scaling["rope_type"] == "llama3"
    # The scaled frequencies differ from the plain ones, so this test sees the scaling at all.
    plain = rope_inv_freq(LlamaConfig.from_dict(TINY | {"num_hidden_layers": 1}))
    assert not torch.allclose(rope_inv_freq(ours.cfg), plain)
    ids = list(range(1, 100))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(ours, ids) - ref).abs().max().item() < 1e-4


def test_tiny_greedy_continuation_matches_transformers(tiny):
    hf, ours, _ = tiny
    prompt = [3, 17, 42, 99, 7]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
    assert greedy_tokens(ours, prompt, 40) == ref[0, len(prompt) :].tolist()


def test_cache_gives_the_same_logits_as_recomputing(tiny):
    """Decoding with the contiguous cache equals re-running the whole sequence with no cache."""
    _, ours, _ = tiny
    ids = [5, 6, 7, 8, 9, 10, 11]
    cache = ContiguousKVCache(ours.cfg, 16)
    pos = torch.arange(4)
    cache.begin(pos)
    ours(torch.tensor(ids[:4]), pos, cache)
    for t in range(4, len(ids)):
        p = torch.tensor([t])
        cache.begin(p)
        step = ours(torch.tensor([ids[t]]), p, cache)[0]
        nc = NoCache()
        full_pos = torch.arange(t + 1)
        nc.begin(full_pos)
        full = ours(torch.tensor(ids[: t + 1]), full_pos, nc)[-1]
        assert (step - full).abs().max().item() < 1e-5


def test_bf16_forward_runs_and_tracks_fp32(tiny):
    _, ours32, path = tiny
    ours16 = ours_from_dir(path, torch.bfloat16)
    ids = list(range(30))
    a, b = prefill_logits(ours32, ids), prefill_logits(ours16, ids)
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def test_missing_tensor_is_a_sentence(tmp_path):
    from safetensors.torch import load_file

    make_tiny_dir(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    m = Llama(LlamaConfig.from_dir(tmp_path))
    with pytest.raises(NanoserveError, match="layers.1.mlp.up_proj.weight"):
        m.load_hf_state_dict(sd)


def test_wrong_shape_is_a_sentence(tmp_path):
    make_tiny_dir(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128  # the checkpoint's MLP is 160 wide
    from safetensors.torch import load_file

    m = Llama(LlamaConfig.from_dict(cfg))
    with pytest.raises(NanoserveError, match="shape"):
        m.load_hf_state_dict(load_file(tmp_path / "model.safetensors"))


# --- the real model ----------------------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning, my friend' into Spanish.",
]


@pytest.fixture(scope="module")
def real(smollm_dir):
    from nanoserve.tokenizer import Tokenizer

    ours = load_model(smollm_dir)
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    return ours, hf, Tokenizer.from_dir(smollm_dir)


@pytest.mark.slow
def test_smollm_logits_match_transformers(real):
    ours, hf, tok = real
    worst = 0.0
    for prompt in PROMPTS[:3] + ["The quick brown fox jumps over the lazy dog. " * 8]:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        worst = max(worst, (prefill_logits(ours, ids) - ref).abs().max().item())
    assert worst < 1e-3, f"max |logit difference| {worst:.2e}"


@pytest.mark.slow
def test_smollm_greedy_64_tokens_match_transformers(real):
    ours, hf, tok = real
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=sorted(tok.eos_ids),
                pad_token_id=min(tok.eos_ids),
            )[0, len(ids) :].tolist()
        got = greedy_tokens(ours, ids, 64, eos_ids=tok.eos_ids)
        assert got == ref, f"{prompt!r}: ours {tok.decode(got)!r} vs transformers {tok.decode(ref)!r}"


# --- packed linears (model.pack_linears, phase 6) ------------------------------------------------

needs_packing = pytest.mark.skipif(
    packing_status(torch.float32, "cpu") is not None, reason=f"{packing_status(torch.float32, 'cpu')}"
)


def packed_copy(path, **kw):
    m = ours_from_dir(path)
    pack_linears(m, **kw)
    return m


@needs_packing
def test_packed_linears_give_the_plain_logits_up_to_rounding(tiny, tmp_path):
    hf, plain, path = tiny
    packed = packed_copy(path)
    assert packed.blocks[0].qkv.is_mkldnn and packed.head.is_mkldnn and not packed.embed.is_mkldnn
    assert pack_linears(packed) == 0, "packing twice is a no-op"
    ids = torch.randint(0, TINY["vocab_size"], (50,), generator=torch.Generator().manual_seed(3)).tolist()
    for rows in (ids, ids[:1]):  # a prefill and a one-token step
        assert (prefill_logits(packed, rows) - prefill_logits(plain, rows)).abs().max().item() < 1e-4
    # a tied head: the embedding stays a plain tensor for the lookup, the head a packed copy
    make_tiny_dir(tmp_path, tie_word_embeddings=True)
    tied, tied_packed = ours_from_dir(tmp_path), packed_copy(tmp_path)
    assert tied_packed.head is not tied_packed.embed and torch.equal(tied_packed.embed, tied.embed)
    assert (prefill_logits(tied_packed, ids) - prefill_logits(tied, ids)).abs().max().item() < 1e-4


@needs_packing
def test_the_packing_check_fails_on_a_weight_packed_wrongly(tiny):
    """The comparison above, shown failing: gate and up swapped before packing (a loader that
    packs the halves in the wrong order) changes the logits far beyond rounding."""
    _, plain, path = tiny
    wrong = ours_from_dir(path)
    b = wrong.blocks[0]
    half = b.gate_up.shape[0] // 2
    b.gate_up.copy_(torch.cat([b.gate_up[half:], b.gate_up[:half]]))
    pack_linears(wrong)
    ids = list(range(1, 30))
    assert (prefill_logits(wrong, ids) - prefill_logits(plain, ids)).abs().max().item() > 1e-2


def test_packing_is_refused_with_a_sentence_where_it_cannot_be_done(tiny):
    _, _, path = tiny
    bf16 = ours_from_dir(path, dtype=torch.bfloat16)
    why = packing_status(torch.bfloat16, "cpu")
    if why is None:  # a CPU with bf16 instructions packs bf16 too
        assert pack_linears(bf16) > 0
    else:
        assert "bf16" in why
        with pytest.raises(ValueError, match="bf16"):
            pack_linears(bf16)
        assert not bf16.head.is_mkldnn, "a refused packing leaves the model as it was"
    assert "cuda" in packing_status(torch.float32, "cuda")


def test_the_engine_packs_as_config_linear_says(tiny):
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine

    _, _, path = tiny
    small = dict(max_batch=2, max_model_len=64, kv_budget=2**20)
    model = ours_from_dir(path)
    with pytest.raises(ValueError, match="KV budget of 4,096 bytes"):
        Engine(model, None, EngineConfig(**{**small, "kv_budget": 4096}))
    assert not model.head.is_mkldnn, "an engine refused for its config leaves the model as it was"
    plain = Engine(ours_from_dir(path), None, EngineConfig(**small, linear="plain"))
    assert plain.linear == "plain" and not plain.model.head.is_mkldnn
    auto = Engine(ours_from_dir(path), None, EngineConfig(**small))
    assert auto.linear == ("packed" if packing_status(torch.float32, "cpu") is None else "plain")
    with pytest.raises(ValueError, match="linear must be auto, packed or plain"):
        EngineConfig(linear="fast").validate()
    if packing_status(torch.bfloat16, "cpu") is not None:
        with pytest.raises(ValueError, match="linear='packed' is not possible here"):
            bf16 = EngineConfig(**small, dtype="bfloat16", linear="packed")
            Engine(ours_from_dir(path, torch.bfloat16), None, bf16)
