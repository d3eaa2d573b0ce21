"""The Gemma 3 family: a tiny random-weight Gemma 3 held to transformers' (logits past its
sliding window, greedy tokens, the paged engine's batched and chunked paths, both attention
kernels), and the real Gemma 3 270M GGUF (Q4_K_M) held to transformers' own GGUF loader on the
same file at a prompt shorter than the window and at one of 1,500 tokens.

The window is what these tests are about: a layer that read its whole context, or one position
too many or too few, gives other logits once a prompt is longer than the window, which the
planted-window tests show.
"""

import dataclasses

import pytest
import torch
import transformers

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.models import LlamaConfig, load_model
from nanoserve.sampling import SamplingParams
from tests.test_model import make_tiny_checkpoint, prefill_logits

# six layers: 0-4 slide over the latest 8 positions (rotary base 100), layer 5 reads all (1e4);
# query_pre_attn_scalar 20, not head_dim 16, so a scale taken from head_dim would show
TINY_GEMMA3 = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=20,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    attn_implementation="eager",
)


def make_tiny_gemma3_dir(path, seed=0, **overrides):
    config = {**TINY_GEMMA3, **overrides}
    hf = make_tiny_checkpoint(
        path, transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, config, seed
    )
    (path / "tokenizer.json").write_text("{}")  # check_model_dir asks for one; these tests pass ids
    return hf


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    return make_tiny_gemma3_dir(path, seed=11), path


def test_tiny_gemma3_matches_transformers_past_its_window(tiny_gemma3):
    hf, path = tiny_gemma3
    ours = load_model(path)
    cfg = ours.cfg
    assert cfg.family == "gemma3" and cfg.sliding_window == 8 and cfg.sliding_layers == (0, 1, 2, 3, 4)
    assert cfg.query_scale == 20**-0.5 and cfg.rope_local_theta == 100.0 and cfg.rope_theta == 1e4
    ids = list(range(3, 43))  # 40 positions: five windows
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(ours, ids) - ref).abs().max().item() < 1e-4
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:6]]), max_new_tokens=30, do_sample=False)[0, 6:].tolist()
    assert greedy_tokens(ours, ids[:6], 30) == want


@pytest.mark.parametrize("window", [None, 7, 9])
def test_a_wrong_window_is_caught(tiny_gemma3, window):
    """The same weights read with no window, or one position short or over: other logits past
    the window, the same ones before it (so the check above is a check of the window)."""
    hf, path = tiny_gemma3
    ours = load_model(path)
    ids = list(range(3, 43))
    right = prefill_logits(ours, ids)
    ours.cfg = dataclasses.replace(ours.cfg, sliding_window=window)
    for b in ours.blocks:
        b.cfg = ours.cfg
    wrong = prefill_logits(ours, ids)
    first = min(w for w in (window, 8) if w is not None)
    assert torch.allclose(wrong[:first], right[:first], atol=1e-5)
    assert (wrong - right).abs().max().item() > 1e-2


PATHS = {
    "native": dict(attention="native"),
    "gather": dict(attention="gather"),
    # the serving path: decode batches padded to buckets, inputs at fixed addresses, replayed
    "captured": dict(attention="native", bucket_decode=True, persist_inputs=True, capture_decode=True),
}


def engine_tokens(model, prompts, n, **config):
    config = EngineConfig(max_batch=4, max_num_batched_tokens=16, block_size=4, **config)
    engine = Engine(model, None, config)
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs], engine


@pytest.mark.parametrize("path", list(PATHS))
def test_tiny_gemma3_through_the_paged_engine(tiny_gemma3, path):
    """Rows of 5, 17 and 40 prompt tokens decoding past the window together, prefill cut into
    chunks by a 16-token budget and blocks of 4 slots: each row's tokens are the model's own
    greedy tokens alone, which the contiguous cache above holds to transformers."""
    from tests.test_qwen import native_built

    if PATHS[path]["attention"] == "native" and not native_built():
        pytest.skip("the native kernels did not build")
    _, model_dir = tiny_gemma3
    model = load_model(model_dir)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    got, engine = engine_tokens(model, prompts, 20, **PATHS[path])
    assert engine.cache.windows == [8] * 5 + [None]
    assert got == [greedy_tokens(model, p, 20) for p in prompts]


def test_the_paged_cache_with_a_window_off_by_one_is_caught(tiny_gemma3, monkeypatch):
    """The engine's cache told its sliding layers read 9 positions: other tokens."""
    _, model_dir = tiny_gemma3
    model = load_model(model_dir)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    right, _ = engine_tokens(model, prompts, 20, attention="gather", window_blocks=False)
    original = Engine.__init__

    def planted(self, *args, **kw):
        original(self, *args, **kw)
        self.cache.windows = [9 if w else None for w in self.cache.windows]

    monkeypatch.setattr(Engine, "__init__", planted)
    wrong, _ = engine_tokens(model, prompts, 20, attention="gather", window_blocks=False)
    assert wrong != right


# --- the sliding layers' own blocks (blocks.WindowBlocks) ---------------------------------------


def run_checked(engine, requests, stagger=2):
    """Run requests (prompt ids, max_tokens), `stagger` steps apart, checking both allocators'
    books after every step and the rows' sliding blocks before it; tokens by request, and the
    most sliding blocks held at once."""
    from tests.test_engine import run_all

    most = 0
    step = engine.step

    def checked_step():
        nonlocal most
        out = step()
        running = engine.scheduler.running
        engine.allocator.check_invariants([s.block_table for s in running])
        if engine.window_blocks is not None:
            engine.window_blocks.check_invariants()
            most = max(most, engine.window_blocks.num_used)
        return out

    engine.step = checked_step
    blocks = engine.window_blocks
    if blocks is not None:  # every row of a step holds what its queries read
        prepare = blocks.prepare

        def checked_prepare(chunks):
            prepare(chunks)
            blocks.check_rows(chunks)

        blocks.prepare = checked_prepare
    return run_all(engine, requests, stagger), most


@pytest.mark.parametrize("budget_blocks", [None, 40])
def test_window_blocks_give_the_same_tokens_and_all_come_back(tiny_gemma3, budget_blocks):
    """Twelve requests of 10-70 prompt tokens, half of them sharing a 32-token prefix (prefix
    hits, some cut back to what the sliding blocks still hold), joining two steps apart; with
    `budget_blocks`, a pool small enough that rows are preempted. Tokens equal to the engine
    whose every layer holds every position; every block of both groups back at the end; and
    the sliding layers never held more than the rows' windows."""
    import random

    from nanoserve.blocks import WindowBlocks

    _, model_dir = tiny_gemma3
    model = load_model(model_dir)
    rng = random.Random(4)
    shared = [rng.randrange(3, 300) for _ in range(32)]
    requests = []
    for i in range(12):
        tail = [rng.randrange(3, 300) for _ in range(rng.randint(10, 38))]
        requests.append(((shared if i % 2 else []) + tail, rng.randint(8, 30)))
    kw = dict(max_batch=4, max_num_batched_tokens=16, block_size=4, attention="gather", max_model_len=128)
    plain_kw, grouped_kw = dict(kw), dict(kw)
    if budget_blocks is not None:  # budget_blocks full blocks either way, plus the sliding pool
        layer_block = model.cfg.kv_bytes_per_token(torch.float32) // 6 * 4  # one layer, 4 tokens
        plain_kw["kv_budget"] = 6 * layer_block * budget_blocks + 6 * layer_block // 4  # and the sink
        sliding = (WindowBlocks.blocks_for(4, 16, 4, 8) + 1) * 5 * layer_block
        grouped_kw["kv_budget"] = sliding + layer_block * budget_blocks + layer_block // 4
    plain, _ = run_checked(Engine(model, None, EngineConfig(window_blocks=False, **plain_kw)), requests)
    engine = Engine(model, None, EngineConfig(**grouped_kw))
    assert engine.pool.num_blocks == (budget_blocks or engine.pool.num_blocks)
    assert engine.window_blocks is not None
    grouped, most = run_checked(engine, requests)
    assert grouped == plain
    assert engine.allocator.num_used == 0 and engine.window_blocks.num_used == 0
    assert most <= WindowBlocks.blocks_for(4, 16, 4, 8)
    if budget_blocks is not None:
        assert engine.scheduler.num_preemptions > 0


def test_one_row_prefilling_a_long_prompt_stays_within_its_blocks(tiny_gemma3):
    """One row (max_batch 1), a 70-token prompt in chunks of 16: the sliding pool is sized for
    one row's window and one chunk (9 blocks of 4), and a row that took its next chunk's blocks
    before giving back the last chunk's would run out here."""
    from nanoserve.blocks import WindowBlocks

    _, model_dir = tiny_gemma3
    model = load_model(model_dir)
    prompts = [list(range(3, 73))]
    engine = Engine(model, None, EngineConfig(max_batch=1, max_num_batched_tokens=16, block_size=4))
    assert engine.window_blocks.num_blocks == WindowBlocks.blocks_for(1, 16, 4, 8) == 9
    got, most = run_checked(engine, [(prompts[0], 20)])
    assert got[0] == greedy_tokens(model, prompts[0], 20)
    assert most <= 9 and engine.window_blocks.num_used == 0


def test_a_window_freed_one_block_early_is_caught(tiny_gemma3):
    """The sliding blocks given back one block too soon: the row no longer holds a block its
    first query reads, which `check_rows` finds at the first chunk. (A block
    given back keeps its K/V until it is handed out again, so the tokens may well survive such
    a bug for a while; the books do not.)"""
    _, model_dir = tiny_gemma3
    model = load_model(model_dir)
    engine = Engine(model, None, EngineConfig(max_batch=4, max_num_batched_tokens=16, block_size=4))
    blocks = engine.window_blocks
    first, prepare = blocks.first_needed, blocks.prepare
    blocks.first_needed = lambda start: first(start) + 1

    def checked(chunks):
        prepare(chunks)
        blocks.check_rows(chunks)

    blocks.prepare = checked
    engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(
        AssertionError,
        match="a row whose chunk is positions 0..15 does not hold the sliding block of positions 0..3",
    ):
        while engine.has_unfinished():
            engine.step()
    blocks.first_needed = first  # as built, the same run passes the check
    engine = Engine(model, None, EngineConfig(max_batch=4, max_num_batched_tokens=16, block_size=4))
    run_checked(engine, [(list(range(3, 43)), 8)])


def test_a_long_context_costs_the_sliding_layers_only_their_window(tiny_gemma3):
    """One row at 200 positions (25 windows): the full layers hold 50 blocks of 4, the sliding
    layers 2 or 3, and the K/V bytes held are what that mix costs, not 50 blocks of all six."""
    _, model_dir = tiny_gemma3
    model = load_model(model_dir)
    engine = Engine(model, None, EngineConfig(max_batch=4, max_num_batched_tokens=16, block_size=4))
    engine.add_request(list(range(3, 103)), SamplingParams(max_tokens=110, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        seq = engine.scheduler.running[0]
        if seq.num_computed == 200:  # K/V of positions 0..199 written
            full, sliding = engine.allocator.num_used, engine.window_blocks.num_used
            held = engine.kv_bytes_held()
            break
    assert full == 50 and 2 <= sliding <= 3  # the window's 8 positions span 2 or 3 blocks
    per_token = model.cfg.kv_bytes_per_token(torch.float32) // 6  # one layer's
    assert held == (50 * 1 + sliding * 5) * 4 * per_token


# --- the real file: Gemma 3 270M, Q4_K_M, against transformers' GGUF loader ---------------------


def seeded_text(words: int, seed: int = 0) -> str:
    """Plain English sentences of seeded random words: a long prompt that needs no file."""
    import random

    rng = random.Random(seed)
    vocab = (
        "the a memory block cache page token model engine server request window layer of to in "
        "and for with that runs reads holds keeps every each one two many small large long short "
        "first last next fast slow paged sliding attention query key value table slot row step"
    ).split()
    out = []
    while len(out) < words:
        n = rng.randint(6, 14)
        sentence = [rng.choice(vocab) for _ in range(n)]
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out[:words])


@pytest.fixture(scope="module")
def gemma():
    """(our converted directory, the GGUF, transformers' model from the GGUF, our tokenizer)."""
    from nanoserve.fetch import fetch_named_gguf, fetch_named_model
    from nanoserve.tokenizer import Tokenizer

    name = "gemma-3-270m"
    model_dir, gguf = fetch_named_model(name), fetch_named_gguf(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    return model_dir, gguf, hf, Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def gemma_prompts(gemma):
    tok = gemma[3]
    short = tok.encode("The history of virtual memory begins with a machine in Manchester, where")
    long = tok.encode(seeded_text(1400, seed=3))[:1500]
    assert len(short) < 512 < len(long) == 1500
    return {"short": short, "long": long}


def gguf_model(gguf, model_dir, activations="fp32"):
    from nanoserve.models import LlamaConfig, load_gguf_model

    return load_gguf_model(gguf, LlamaConfig.from_dir(model_dir), "gguf", activations)


@pytest.mark.slow
def test_gemma_logits_match_transformers_gguf_loader(gemma, gemma_prompts):
    """Both sides read the same blocks: ours with the native kernels on fp32 activations (the
    dequantized weights exactly), transformers dequantized by `gguf`. What is left is fp32
    rounding, so the bound is derived from the reference's own: 4x the largest difference
    between transformers in fp32 and in fp64 at the same positions (rounding each way, twice
    over). At 1,500 tokens, the last 64 positions are compared (every layer has read past its
    window there); the same weights with every layer reading its whole context are caught."""
    import dataclasses

    from nanoserve.contiguous import ContiguousKVCache

    model_dir, gguf, hf, _ = gemma
    ours = gguf_model(gguf, model_dir)
    measured = {}
    for name, ids in gemma_prompts.items():
        keep = len(ids) if name == "short" else 64
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf(x, logits_to_keep=keep).logits[0]
            # nn.Module's own casts: transformers refuses .float() on a model loaded from a GGUF
            ref64 = torch.nn.Module.double(hf)(x, logits_to_keep=keep).logits[0]
            torch.nn.Module.float(hf)
        bound = 4 * (ref64 - ref.double()).abs().max().item()
        cache = ContiguousKVCache(ours.cfg, len(ids))
        pos = torch.arange(len(ids))
        cache.begin(pos)
        got = ours(x[0], pos, cache, logits_at=torch.arange(len(ids) - keep, len(ids)))
        diff = (got - ref).abs().max().item()
        measured[name] = (diff, bound)
        assert diff < bound, (name, diff, bound)
        if name == "long":  # every layer reading all 1,500 positions: another model
            whole = dataclasses.replace(ours.cfg, sliding_window=None)
            cache = ContiguousKVCache(whole, len(ids))
            cache.begin(pos)
            wrong = ours(x[0], pos, cache, logits_at=torch.arange(len(ids) - keep, len(ids)))
            assert (wrong - ref).abs().max().item() > 100 * bound
    print(f"max |ours - transformers| and bound: {measured}")


@pytest.mark.slow
def test_gemma_greedy_tokens_through_the_engine_match_transformers(gemma, gemma_prompts):
    """16 greedy tokens after each prompt, the two rows in one paged engine (its sliding layers
    on their own blocks, its decode steps fused where the native kernels built), equal to
    transformers' generate, or parting at a near-tie of ours."""
    from tests.test_engine import check_same_or_near_tie

    model_dir, gguf, hf, _ = gemma
    ours = gguf_model(gguf, model_dir)
    prompts = list(gemma_prompts.values())
    engine = Engine(ours, None, EngineConfig(max_batch=2, max_model_len=2048))
    assert engine.window_blocks is not None
    from tests.test_qwen import native_built

    assert engine.decode_step == ("fused" if native_built() else "ops")  # decode as one native call
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    ties = []
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            out_ids = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        want = out_ids[0, len(ids) :].tolist()
        check_same_or_near_tie(ours, ids, want, out.token_ids, ties)
    print(f"near-ties where the runs parted: {ties}")


@pytest.mark.slow
def test_our_converted_directory_is_the_gguf_to_transformers(gemma, gemma_prompts):
    """The directory `fetch-model gemma-3-270m` writes (norms shifted back to Gemma's 1 + w,
    the config's layer types and query scale) loads in transformers as the GGUF does."""
    model_dir, _, hf, _ = gemma
    mine = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([gemma_prompts["short"]])
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, hf(ids).logits)


def test_a_prompt_repeated_after_the_first_finished_reuses_its_prefix(tiny_gemma3):
    """Sliding blocks given back keep their K/V on the free list, as the prefix cache keeps
    full blocks: a prompt sent again after the first has finished finds 36 of its 40 tokens
    cached (the last block's window included), and gives the same tokens."""
    _, model_dir = tiny_gemma3
    model = load_model(model_dir)
    engine = Engine(model, None, EngineConfig(max_batch=4, max_num_batched_tokens=16, block_size=4))
    prompt, params = list(range(3, 43)), SamplingParams(max_tokens=12, ignore_eos=True)
    first = engine.generate([prompt], params, use_tqdm=False)[0].token_ids
    engine.add_request(prompt, params)
    again = [t for o in engine.step() for t in o.new_token_ids]
    assert engine.scheduler.running[0].block_table.num_cached_tokens == 36
    while engine.has_unfinished():
        again += [t for o in engine.step() for t in o.new_token_ids]
    assert again == first
    assert engine.allocator.num_used == 0 and engine.window_blocks.num_used == 0


@pytest.mark.slow
def test_gemma_served_a_base_model_refuses_chat_with_a_sentence_and_completes(gemma, tmp_path):
    """The server on the real file: chat without a template is a 400 that says why, a plain
    completion works, /health reports both pool groups, and --chat-template gives chat a
    template. Two ranks are refused: one K/V head cannot be split."""
    import httpx
    import openai

    from nanoserve import tp
    from nanoserve.engine import build_engine
    from nanoserve.errors import NanoserveError
    from nanoserve.serve import create_app
    from nanoserve.threads import ServerThread

    with pytest.raises(NanoserveError, match="this model has 1 K/V heads.*run it on 1 rank"):
        tp.check_split(LlamaConfig.from_dir(gemma[0]), 2)
    template = tmp_path / "turns.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    for chat_template in (None, str(template)):
        config = EngineConfig(model="gemma-3-270m", max_batch=2, chat_template=chat_template)
        engine = build_engine(config)
        with ServerThread(create_app(engine)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            messages = [{"role": "user", "content": "Name a colour."}]
            if chat_template is None:
                with pytest.raises(openai.BadRequestError, match="no chat template"):
                    client.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=4)
                done = client.completions.create(
                    model=engine.model_name, prompt="The capital of France is", max_tokens=6, temperature=0
                )
                assert done.choices[0].text and done.usage.completion_tokens == 6
                pool = httpx.get(url + "/health").json()["pool"]
                assert pool["num_layers"] == 3 and pool["window_group"]["num_layers"] == 15
                assert pool["window_group"]["window"] == 512
            else:
                answer = client.chat.completions.create(
                    model=engine.model_name, messages=messages, max_tokens=4, temperature=0
                )
                assert answer.choices[0].message.content is not None


@pytest.mark.parametrize("window_blocks", [True, False])
def test_the_fused_step_runs_a_gemma_block(tiny_gemma3, window_blocks):
    """Decode steps as one native call (day 61's step with Gemma's switches): rows of 5, 17 and
    40 prompt tokens decoding 20 past the window of 8, on the sliding layers' own blocks and on
    shared slots, give the ops path's tokens; the same call with any one switch taken away (the
    two extra norms, GELU, the sliding layers' window, their rotary tables, the query scale, the
    embedding's scale) gives other tokens, so each switch is checked."""
    from tests.test_qwen import native_built

    if not native_built():
        pytest.skip("the native kernels did not build")
    _, model_dir = tiny_gemma3
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    config = dict(attention="native", window_blocks=window_blocks)
    ops, _ = engine_tokens(load_model(model_dir), prompts, 20, decode_step="ops", **config)
    model = load_model(model_dir)  # the ops engine packed its linears for oneDNN
    assert model.fused_status() is None
    fused, engine = engine_tokens(model, prompts, 20, decode_step="fused", **config)
    assert engine.decode_step == "fused" and (engine.window_blocks is not None) == window_blocks
    assert fused == ops
    extra = model._fused[-1]
    planted = {
        "out_norms": [],
        "gelu": False,
        "sliding": [0] * len(extra["sliding"]),
        "attn_scale": 0.0,
        "embed_scale": 1.0,
    }
    for name, value in planted.items():
        kept, extra[name] = extra[name], value
        if name == "sliding" and window_blocks:  # every layer read as global: the sliding pools are too small
            with pytest.raises(RuntimeError, match="outside the pools"):
                engine_tokens(model, prompts, 20, decode_step="fused", **config)
        else:
            wrong, _ = engine_tokens(model, prompts, 20, decode_step="fused", **config)
            assert wrong != ops, name
        extra[name] = kept
    tables = model.cos_local, model.sin_local
    model.cos_local, model.sin_local = model.cos, model.sin  # the global layers' base for all
    wrong, _ = engine_tokens(model, prompts, 20, decode_step="fused", **config)
    model.cos_local, model.sin_local = tables
    assert wrong != ops, "rotary tables"


@pytest.mark.slow
def test_gemma_fused_step_gives_the_ops_tokens_on_the_gguf(gemma, gemma_prompts):
    """Gemma 3 270M from its Q4_K_M file, fp32 activations: two prompts (14 and 700 tokens, the
    long one past every sliding window) decoded together, 24 greedy tokens each, as
    one native call a step and as torch ops, on the sliding layers' own blocks: the same tokens.
    (With int8 activations the two part where rounding re-rolls the int8 error: the README.)"""
    from tests.test_qwen import native_built

    if not native_built():
        pytest.skip("the native kernels did not build")
    model_dir, gguf, _, _ = gemma
    prompts = [gemma_prompts["short"], gemma_prompts["long"][:700]]
    model, got = gguf_model(gguf, model_dir), {}
    for step in ("fused", "ops"):
        engine = Engine(model, None, EngineConfig(max_batch=2, max_model_len=2048, decode_step=step))
        assert engine.decode_step == step and engine.window_blocks is not None
        outs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
        got[step] = [o.token_ids for o in outs]
    assert got["fused"] == got["ops"]
