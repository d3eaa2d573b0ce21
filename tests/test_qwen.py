"""The Qwen family: Qwen2 (a Llama with biases on Q, K and V) and Qwen3 (an RMSNorm on each
query and key head, no biases), from an HF directory and from a GGUF.

A tiny random-weight Qwen2 and Qwen3 are held to transformers' (logits, greedy tokens, the
engine's batched path, tensor-parallel shards); the real Qwen2.5-Coder-0.5B-Instruct GGUF
(Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 blocks, dequantized by `gguf` on import) is held to
transformers' own GGUF loader on the same file: logits, tokens, the tokenizer and the template.
"""

import pytest
import torch
import transformers

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.errors import NanoserveError
from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from tests.test_model import TINY, make_tiny_checkpoint, prefill_logits


def native_built() -> bool:
    from nanoserve.kernels import native

    return native() is not None


TINY_QWEN2 = {k: v for k, v in TINY.items() if k != "head_dim"} | dict(use_sliding_window=False)


def make_tiny_qwen2_dir(path, seed=0, **overrides):
    """A random-weight Qwen2 checkpoint; biases randomized too (they start at zero)."""
    config = {**TINY_QWEN2, **overrides}
    hf = make_tiny_checkpoint(
        path, transformers.Qwen2Config, transformers.Qwen2ForCausalLM, config, seed, True
    )
    (path / "tokenizer.json").write_text("{}")  # check_model_dir asks for one; these tests pass ids
    return hf


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return make_tiny_qwen2_dir(path, seed=5), path


def test_tiny_qwen2_logits_and_tokens_match_transformers(tiny_qwen2):
    hf, path = tiny_qwen2
    ours = load_model(path)
    assert ours.cfg.qkv_bias and not ours.cfg.o_bias
    ids = list(range(3, 60))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(ours, ids) - ref).abs().max().item() < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:8]]), max_new_tokens=24, do_sample=False)[0, 8:].tolist()
    assert greedy_tokens(ours, ids[:8], 24) == want


def test_the_biases_are_not_ignored(tiny_qwen2):
    """The same weights with the biases zeroed give other logits: the test above would catch a
    loader that dropped them."""
    hf, path = tiny_qwen2
    ours = load_model(path)
    ids = list(range(3, 20))
    before = prefill_logits(ours, ids)
    for b in ours.blocks:
        b.qkv_bias.zero_()
    assert (prefill_logits(ours, ids) - before).abs().max().item() > 1e-2


def test_tiny_qwen2_through_the_engine_batched(tiny_qwen2):
    """Several prompts at once, chunked prefill and decode buckets: each row's tokens are the
    model's own greedy tokens alone."""
    _, path = tiny_qwen2
    model = load_model(path)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    engine = Engine(model, None, EngineConfig(max_batch=4, max_num_batched_tokens=32))
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [greedy_tokens(model, p, 12) for p in prompts]


def fused_and_ops_tokens(model, prompts, n):
    """Each prompt's greedy tokens from an engine whose decode steps are one native call, and the
    model's own greedy tokens (torch ops)."""
    engine = Engine(model, None, EngineConfig(max_batch=4, decode_step="fused"))
    assert engine.decode_step == "fused"
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs], [greedy_tokens(model, p, n) for p in prompts]


@pytest.mark.skipif(not native_built(), reason="the native kernels did not build")
def test_the_fused_step_runs_qwen2s_biases(tiny_qwen2):
    _, path = tiny_qwen2
    model = load_model(path)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    fused, ops = fused_and_ops_tokens(model, prompts, 12)
    assert fused == ops
    # the same step with its bias list emptied is another model: the check above can fail
    model._fused[-1].pop("biases")
    engine = Engine(model, None, EngineConfig(max_batch=4, decode_step="fused"))
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] != ops


def test_a_llama_with_attention_bias_matches_transformers(tmp_path):
    """LlamaConfig's attention_bias puts a bias on all four projections, O's included."""
    from tests.test_model import make_tiny_dir, ours_from_dir

    hf = make_tiny_dir(tmp_path, seed=6, random_biases=True, attention_bias=True)
    ours = ours_from_dir(tmp_path)
    assert ours.cfg.qkv_bias and ours.cfg.o_bias
    ids = list(range(5, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(ours, ids) - ref).abs().max().item() < 1e-4
    # under tensor parallelism O's outputs are summed over ranks: its bias is added by rank 0 only
    from nanoserve import tp

    o_biases = [tp.shard(ours, r, 2)[0].blocks[2].o_bias for r in range(2)]
    assert torch.equal(o_biases[0], ours.blocks[2].o_bias) and not o_biases[1].any()


def test_qwen2_shards_split_the_biases_with_their_rows(tmp_path):
    """Tensor parallelism's split of a biased model (3 K/V heads, so 3 ranks): each rank's Q, K
    and V biases are the rows of its heads."""
    from nanoserve import tp

    make_tiny_qwen2_dir(tmp_path, seed=7, num_attention_heads=6, num_key_value_heads=3, intermediate_size=150)
    full = load_model(tmp_path)
    hd, nh, nkv = full.cfg.head_dim, 6, 3
    whole = full.blocks[1].qkv_bias
    for r in range(3):
        mine = tp.shard(full, r, 3)[0].blocks[1].qkv_bias
        q = whole[r * 2 * hd : (r + 1) * 2 * hd]
        k = whole[nh * hd + r * hd : nh * hd + (r + 1) * hd]
        v = whole[(nh + nkv) * hd + r * hd : (nh + nkv) * hd + (r + 1) * hd]
        assert torch.equal(mine, torch.cat([q, k, v])), r


def make_tiny_qwen3_dir(path, seed=0):
    """A random-weight Qwen3 checkpoint; its query/key norms randomized like the others."""
    config = TINY_QWEN2 | dict(head_dim=8)
    hf = make_tiny_checkpoint(path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, config, seed)
    (path / "tokenizer.json").write_text("{}")
    return hf


def test_tiny_qwen3_matches_transformers_and_its_norms_count(tmp_path):
    hf = make_tiny_qwen3_dir(tmp_path, seed=8)
    ours = load_model(tmp_path)
    assert ours.cfg.qk_norm and not ours.cfg.qkv_bias
    ids = list(range(3, 50))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    logits = prefill_logits(ours, ids)
    assert (logits - ref).abs().max().item() < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:6]]), max_new_tokens=20, do_sample=False)[0, 6:].tolist()
    assert greedy_tokens(ours, ids[:6], 20) == want
    prompts = [list(range(3, 3 + n)) for n in (4, 30)]
    engine = Engine(ours, None, EngineConfig(max_batch=4, max_num_batched_tokens=16))
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [greedy_tokens(ours, p, 10) for p in prompts]
    if native_built():  # the fused step: its per-head norms in C++, the same tokens
        fresh = load_model(tmp_path)  # `ours` is packed for oneDNN now, which the fused step cannot read
        fused, ops = fused_and_ops_tokens(fresh, prompts, 10)
        assert fused == ops
        fresh._fused[-1]["qk_norms"] = [torch.ones_like(n) for n in fresh._fused[-1]["qk_norms"]]
        engine = Engine(fresh, None, EngineConfig(max_batch=4, decode_step="fused"))
        outs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in outs] != ops  # without them: other tokens
    for b in ours.blocks:  # the same model without its query/key norms is another model
        b.q_norm.fill_(1.0)
    assert (prefill_logits(ours, ids) - logits).abs().max().item() > 1e-2


def test_an_unknown_family_is_refused_with_a_sentence(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}')
    with pytest.raises(NanoserveError, match="runs the families llama, mistral, gemma3, qwen2, qwen3 only"):
        load_model(tmp_path)


# --- the real file: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, against transformers' GGUF loader ---


@pytest.fixture(scope="module")
def qwen():
    """(our converted directory, the GGUF, transformers' model and tokenizer from the GGUF)."""
    from nanoserve.fetch import fetch_named_gguf, fetch_named_model

    name = "qwen2.5-coder-0.5b-instruct"
    model_dir, gguf = fetch_named_model(name), fetch_named_gguf(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model_dir, gguf, hf, hf_tok


CHAT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


def test_qwen_tokenizer_and_template_are_transformers(qwen):
    from nanoserve.tokenizer import Tokenizer

    model_dir, _, _, hf_tok = qwen
    tok = Tokenizer.from_dir(model_dir)
    for text in [
        "def f(x):\n    return x ** 2  # 12345 squared",
        "Ünïcödé — naïve café, 東京, emoji 🙂\r\n\ttabs",
        "  leading spaces and 3.14159 and 1,000,000",
    ]:
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
    want = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(CHAT) == want
    assert tok.encode_chat(CHAT) == hf_tok.encode(want, add_special_tokens=False)


def test_qwen_logits_and_greedy_tokens_match_transformers_gguf_loader(qwen):
    """Both sides dequantize the same blocks with `gguf` to the same fp32 weights, so what is
    left is the order of fp32 sums over 24 blocks: measured 6.4e-5 at most on two chat prompts
    whose logits span -28 to 32 (std 5.8). The bound, 1e-3, is ~15x that and still 1/60,000 of
    the span, far below any gap a wrong weight or a missing bias makes (> 1e-2 in the tiny
    model's test above). The greedy continuation is the same."""
    from nanoserve.tokenizer import Tokenizer

    model_dir, _, hf, _ = qwen
    ours = load_model(model_dir)
    ids = Tokenizer.from_dir(model_dir).encode_chat(CHAT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours_logits = prefill_logits(ours, ids)
    assert (ours_logits - ref).abs().max().item() < 1e-3
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert greedy_tokens(ours, ids, 24) == want


def test_a_model_is_named_by_its_fetch_name(qwen):
    from nanoserve.fetch import fetch_named_model
    from nanoserve.weights import resolve_model_dir

    model_dir = qwen[0]
    assert resolve_model_dir("qwen2.5-coder-0.5b-instruct") == model_dir
    assert (model_dir / "LICENSE.txt").read_text().startswith("Qwen2.5-Coder-0.5B-Instruct is released")
    with pytest.raises(NanoserveError, match="no model is named 'qwen-9000'; the names are"):
        fetch_named_model("qwen-9000")


def test_qwen_served_from_its_own_blocks_gives_the_conversions_tokens(qwen):
    """--weights gguf: the file's Q5_0, Q8_0, Q4_K and Q6_K matrices kept as blocks (a layer
    whose V is Q8_0 and its Q, K Q5_0 keeps them as one RowStack of two parts: Q and K, one
    Q5_0 matrix, then V), widened by kquants.py each
    call. The logits are the fp32 conversion's up to the order of sums, and so are the tokens."""
    from nanoserve.models import LlamaConfig, describe_weights, load_gguf_model
    from nanoserve.quant import RowStack
    from nanoserve.tokenizer import Tokenizer

    model_dir, gguf, _, _ = qwen
    blocks = load_gguf_model(gguf, LlamaConfig.from_dir(model_dir), "gguf")
    assert blocks.weight_kinds == ["q4_k", "q5_0", "q6_k", "q8_0"]
    stacked = [b.qkv for b in blocks.blocks if isinstance(b.qkv, RowStack)]
    assert len(stacked) == 12 and stacked[0].kinds == ["q5_0", "q8_0"]
    assert [tuple(p.shape) for p in stacked[0].parts] == [(896 + 128, 896), (128, 896)]
    assert describe_weights(blocks).startswith("gguf q4_k+q5_0+q6_k+q8_0 (fp32 activations), 4")
    assert blocks.fused_status() is None

    fp32 = load_model(model_dir)
    ids = Tokenizer.from_dir(model_dir).encode_chat(CHAT)
    assert (prefill_logits(blocks, ids) - prefill_logits(fp32, ids)).abs().max().item() < 1e-3
    assert greedy_tokens(blocks, ids, 4) == greedy_tokens(fp32, ids, 4)


def test_an_hf_repo_id_loads_from_huggingface_hubs_cache_offline(tmp_path, monkeypatch):
    """`--model Org/Name`: the repo's snapshot in huggingface_hub's cache, laid out here as the
    hub lays it out (refs/main naming the snapshot), read with the network off; a repo the
    cache lacks is one sentence."""
    import huggingface_hub.constants as hub

    from nanoserve.weights import hub_id, resolve_model_dir

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--tiny-org--tiny-qwen3" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (cache / "models--tiny-org--tiny-qwen3" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-qwen3" / "refs" / "main").write_text(commit)
    hf = make_tiny_qwen3_dir(snapshot, seed=9)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert hub_id("tiny-org/tiny-qwen3") and not hub_id("./models/x") and not hub_id("plain")
    model_dir = resolve_model_dir("tiny-org/tiny-qwen3")
    assert model_dir == snapshot
    ids = list(range(3, 30))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(load_model(model_dir), ids) - ref).abs().max().item() < 1e-4
    with pytest.raises(NanoserveError, match="neither a local directory nor a Hugging Face repo"):
        resolve_model_dir("tiny-org/not-cached")
