"""Tensor parallelism (nanoserve/tp.py): a model split over processes gives one process's tokens.

Ranks are started the way torchrun starts them (`tp.spawn`: its environment variables), so a
test can watch each one and kill one; two tests go through torchrun itself (one machine's
launch, and three single-rank launches meeting at a c10d rendezvous, as three machines would).
The default model has 3 K/V heads, so it splits over 1 or 3 ranks (2 is refused, as the split
gives each rank whole K/V heads); the 2-rank runs use a tiny random model with 2 K/V heads.

Tolerance. Only the o and down all-reduces add floats from different ranks; the embedding's
all-reduce adds zeros and the logits are gathered, not summed. So a split model's logits differ
from one process's by the order of fp32 sums inside those two projections, ~1e-6 relative; the
log-probabilities compared here (every generated position's top 5) moved by at most 6.5e-5 on
SmolLM2 over 3 ranks and 1.9e-6 on the tiny model over 2 (the tests print theirs); they are held
to LOGPROB_TOL = 1e-3, and greedy tokens to equality or a near-tie of the reference
(tests/test_engine.py's rule).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from nanoserve import tp
from nanoserve.config import EngineConfig
from nanoserve.engine import build_engine
from nanoserve.errors import NanoserveError
from nanoserve.models import LlamaConfig
from tests.test_engine import check_same_or_near_tie, random_requests
from tests.test_faults import free_port
from tests.test_model import make_tiny_dir, ours_from_dir
from tests.tp_ranks import run

LOGPROB_TOL = 1e-3
QUESTIONS = ("What is the capital of France?", "Name a colour.", "Why is the sky blue?")


def spawn_ranks(world: int, spec: dict, tmp_path, name: str) -> dict:
    """Every rank runs tests.tp_ranks on spec; rank 0's output, after all have exited 0."""
    spec = spec | {"out": str(tmp_path / f"{name}.json")}
    (tmp_path / f"{name}.spec.json").write_text(json.dumps(spec))
    procs = tp.spawn(
        world,
        ["-m", "tests.tp_ranks", str(tmp_path / f"{name}.spec.json")],
        stderr=subprocess.PIPE,
        text=True,
    )
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    return json.loads((tmp_path / f"{name}.json").read_text())


def compare(ref: dict, got: dict, model, requests) -> float:
    """Tokens equal (or parting at a near-tie of the reference); returns the largest difference
    of the top-5 log-probabilities over the positions both runs produced alike."""
    worst, ties = 0.0, []
    for (prompt, _), a, b, la, lb in zip(
        requests, ref["tokens"], got["tokens"], ref["logprobs"], got["logprobs"]
    ):
        check_same_or_near_tie(model, prompt, a, b, ties)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for pa, pb in zip(la[:same], lb[:same]):
            da, db = dict(map(tuple, pa)), dict(map(tuple, pb))
            worst = max([worst] + [abs(da[t] - db[t]) for t in da.keys() & db.keys()])
    return worst


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm_dir):
    """A random-weight Llama (8 heads, 2 K/V heads, MLP 160) with SmolLM2's vocabulary and
    tokenizer, so that `build_engine` takes it as it takes any model directory."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-tp")
    make_tiny_dir(path, seed=11, max_position_embeddings=256, vocab_size=49152)
    for f in smollm_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy(f, path / f.name)
    return path


def test_rank_counts_that_do_not_divide_the_kv_heads_are_refused(smollm_dir, tiny_dir):
    cfg = LlamaConfig.from_dir(smollm_dir)
    assert tp.allowed_ranks(cfg) == [1, 3]
    with pytest.raises(NanoserveError, match=r"3 K/V heads.*run it on 1, 3 ranks"):
        tp.check_split(cfg, 2)
    tp.check_split(cfg, 3)  # allowed: no error
    tiny = LlamaConfig.from_dir(tiny_dir)
    assert tp.allowed_ranks(tiny) == [1, 2]
    with pytest.raises(NanoserveError, match="MLP is 161 columns"):
        tp.check_split(LlamaConfig(**(tiny.__dict__ | {"intermediate_size": 161})), 2)
    # launched as 2 ranks, both say so in one line and exit at once (nobody waits on a group)
    procs = tp.spawn(
        2, ["-m", "nanoserve", "generate", "hi", "--max-tokens", "2"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 1
        assert err.strip().splitlines()[-1].startswith("nanoserve: error: 2 ranks cannot split this model")
        assert "Traceback" not in err


def test_a_shard_holds_its_heads_columns_and_vocabulary_rows(tiny_dir):
    full = ours_from_dir(tiny_dir)
    cfg, hd = full.cfg, full.cfg.head_dim
    shards = [tp.shard(full, r, 2)[0] for r in range(2)]
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    for b, (s0, s1) in enumerate(zip(*(m.blocks for m in shards))):
        whole = full.blocks[b]
        qkv = [torch.split(s.qkv, [q // 2, kv // 2, kv // 2]) for s in (s0, s1)]
        for part, start in ((0, 0), (1, q), (2, q + kv)):  # q, k and v rows, rank 0's then rank 1's
            size = (q if part == 0 else kv) // 2
            assert torch.equal(torch.cat([qkv[0][part], qkv[1][part]]), whole.qkv[start : start + 2 * size])
        assert torch.equal(torch.cat([s0.o, s1.o], dim=1), whole.o)
        assert torch.equal(torch.cat([s0.down, s1.down], dim=1), whole.down)
        gate = torch.cat([s0.gate_up[: cfg.intermediate_size // 2], s1.gate_up[: cfg.intermediate_size // 2]])
        assert torch.equal(gate, whole.gate_up[: cfg.intermediate_size])
    assert torch.equal(torch.cat([m.embed for m in shards]), full.embed)
    assert torch.equal(torch.cat([m.head for m in shards]), full.head)
    assert all(m.cfg.num_kv_heads == 1 and m.cfg.vocab_size == cfg.vocab_size for m in shards)


def test_a_plan_travels_as_two_int64_tensors_and_comes_back_whole():
    from nanoserve.plan import PrefillPlan, StepPlan

    g = torch.Generator().manual_seed(0)
    ints = lambda *shape: torch.randint(0, 5000, shape, generator=g)  # noqa: E731
    mixed = PrefillPlan(
        input_ids=ints(9), positions=ints(9), write_slots=ints(9), context_lens=ints(3),
        slot_window=ints(3, 16), logits_at=ints(3), rows=("seq",) * 3, chunks=["chunk"] * 3,
        row_spans=[(0, 1, 5), (1, 2, 9), (2, 9, 7)], num_decode=2, decode_width=9,
    )  # fmt: skip
    decode = StepPlan(
        input_ids=ints(4), positions=ints(4), write_slots=ints(4), context_lens=ints(4),
        slot_window=ints(8, 4).t(), logits_at=ints(4), rows=("seq",) * 4, is_decode=True,
        row_spans=[(i, i + 1, 3) for i in range(4)],
    )  # fmt: skip
    for plan in (mixed, decode):
        header, payload = tp.pack_plan(plan)
        assert header.shape == (tp.HEADER,) and header.dtype == payload.dtype == torch.long
        assert payload.shape == (tp.payload_length(header.tolist()),)
        back = tp.unpack_plan(header.tolist(), payload.clone())
        assert type(back) is type(plan)
        for f in dataclasses.fields(plan):
            if f.name in ("rows", "chunks"):  # the sequences stay on rank 0
                continue
            a, b = getattr(plan, f.name), getattr(back, f.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
        assert not back.rows and not back.chunks


def test_a_worker_stuck_in_a_collective_exits_once_rank_0_leaves_a_note(capsys):
    import torch.distributed as dist

    store, done, codes = dist.HashStore(), threading.Event(), []

    def exit(code):  # os._exit in a worker
        codes.append(code)
        done.set()

    watcher = threading.Thread(
        target=tp.watch_for_break, args=(store, 2, done), kwargs=dict(poll=0.01, grace=0.05, exit=exit)
    )
    watcher.start()
    store.set(tp.BROKEN_KEY, "rank 0 failed in the middle of step 7 (RuntimeError: boom)")
    watcher.join(timeout=30)
    assert codes == [1]
    assert "rank 2: rank 0 failed in the middle of step 7 (RuntimeError: boom); this rank exits" in (
        capsys.readouterr().err
    )


def test_only_an_error_while_a_step_is_open_on_rank_0_is_fatal(monkeypatch):
    """The rule in tp.py's docstring, on rank 0's side alone (the collectives are stubs): an error
    before the plan leaves or after the logits are gathered fails that step only; an error in
    between leaves a note in the store, takes the groups down and raises StepBroken (fatal)."""
    import torch.distributed as dist

    from nanoserve.plan import plan_decode

    sent, taken = [], []
    monkeypatch.setattr(dist, "broadcast", lambda tensor, src, group: sent.append(tensor.shape[0]))
    monkeypatch.setattr(tp, "_take_down", lambda: taken.append(True))
    store = dist.HashStore()
    rank0 = tp.TP(0, 2, "gloo", None, None, None, store=store)

    class Table:
        blocks = [3]

        def block_ids(self):
            return torch.tensor(self.blocks)

        def slot(self, pos):
            return 3 * 4 + pos

    class Seq:
        token_ids, block_table = [7, 8], Table()

    plan = plan_decode([Seq()], block_size=4)

    def forward(where):
        if where == "after the gather":
            rank0.open = False  # what gather_logits does once the step's last collective is done
        raise ValueError(f"failed {where}")

    step = rank0.guard(forward)
    with pytest.raises(RuntimeError, match="no plan announced"):  # nothing announced: nothing sent
        step("mid-step")
    rank0.announce(plan)
    with pytest.raises(ValueError, match="after the gather") as after:
        step("after the gather")
    assert not getattr(after.value, "fatal", False) and not store.check([tp.BROKEN_KEY]) and not taken
    assert sent == [tp.HEADER, tp.payload_length(tp.pack_plan(plan)[0].tolist())]  # one hand-off
    rank0.announce(plan)
    note = "rank 0 failed in the middle of step 2 (ValueError: failed mid-step)"
    with pytest.raises(tp.StepBroken) as e:
        step("mid-step")
    assert str(e.value).startswith(note) and e.value.fatal and taken == [True] and rank0.stopped
    assert store.get(tp.BROKEN_KEY).decode() == note


def test_two_ranks_give_one_process_tokens_with_batching_and_preemption(tiny_dir, tmp_path):
    model = ours_from_dir(tiny_dir)
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * 4
    config = dict(
        model=str(tiny_dir), max_batch=8, block_size=4, max_model_len=256, watermark=None,
        kv_budget=per_block * 64 + per_block // 4, max_num_batched_tokens=64, threads=1,
    )  # fmt: skip
    requests = random_requests(12, model.cfg.vocab_size, seed=2, min_len=20, max_len=40, max_tokens=(20, 40))
    ref = run(build_engine(EngineConfig(**config)), requests, stagger=2)
    # no_pickles: broadcast_object_list raises on rank 0 once setup is done, so every plan went as tensors
    spec = {"config": config, "requests": requests, "stagger": 2, "no_pickles": True}
    got = spawn_ranks(2, spec, tmp_path, "tiny")
    assert ref["preemptions"] > 0, "the pool was meant to be too small for every request at once"
    assert got["preemptions"] == ref["preemptions"] and got["steps"] == ref["steps"]
    assert got["free_blocks"] == got["blocks"] == ref["blocks"]  # every block came back
    worst = compare(ref, got, model, requests)
    print(
        f"2 ranks, tiny model: largest top-5 logprob difference {worst:.2e}, {got['preemptions']} preemptions"
    )
    assert worst < LOGPROB_TOL
    # per step: the plan's hand-off (header and payload, counted once), the embedding's all-reduce,
    # two a block, the logits' gather; and two at setup (the pool to the workers, their shares back)
    assert got["collectives"] == 2 + got["steps"] * (2 * model.cfg.num_layers + 3)
    shares = got["shares"]
    assert [s["kv_heads"] for s in shares] == [1, 1] and [s["vocab_start"] for s in shares] == [0, 24576]


def test_an_error_on_rank_0_mid_forward_ends_the_loop_and_the_workers_exit(tiny_dir, tmp_path):
    """Rank 0's last block raises at its third call (the second decode step): the plan has left
    and rank 1 waits in that block's all-reduce. The loop must die with a sentence (so /health
    fails) and end the requests with it, and rank 1 must exit by itself, with rank 0 still alive;
    before, the step failed alone, serving went on and rank 1 waited for 7 days."""
    from tests.tp_ranks import PLANTED

    # a pool of 32 blocks of 4 tokens (3 blocks x 2 K/V heads x 8 x fp32 x K and V = 384 bytes a token)
    config = dict(
        model=str(tiny_dir), max_batch=4, block_size=4, max_model_len=64, kv_budget=384 * 4 * 32, threads=1
    )
    requests = [[[5, 17, 42, 9, 100], 8], [[7, 7, 3, 250, 31], 8]]
    spec = {"config": config, "requests": requests, "fault_at": 3, "out": str(tmp_path / "fault.json")}
    (tmp_path / "fault.spec.json").write_text(json.dumps(spec))
    procs = tp.spawn(
        2, ["-m", "tests.tp_ranks", str(tmp_path / "fault.spec.json")], stderr=subprocess.PIPE, text=True
    )
    try:
        t0 = time.monotonic()
        while not (tmp_path / "fault.json").exists():
            assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
            assert time.monotonic() - t0 < 300, "rank 0 did not finish its requests"
            time.sleep(0.2)
        got = json.loads((tmp_path / "fault.json").read_text())
        assert got["calls"] == 3
        assert got["failure"] is not None, got  # the loop died: the server's /health reads this
        assert "StepBroken: rank 0 failed in the middle of step 3" in got["failure"]
        assert PLANTED in got["failure"]
        assert got["deaths"] == [got["failure"]] and not got["alive"]
        assert got["ends"] == [[500, got["failure"]]] * 2  # both requests ended with the reason
        try:
            err = procs[1].communicate(timeout=60)[1]  # a few seconds, unless it hangs
        except subprocess.TimeoutExpired:
            raise AssertionError("rank 1 still waits in a collective 60 s after rank 0's error") from None
        assert procs[1].returncode == 1 and "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("nanoserve: error: rank 1: rank 0 failed in the middle of step 3"), err[-3000:]
        assert PLANTED in last and last.endswith("this rank exits after 2 steps")
        assert procs[0].poll() is None  # rank 0 lives on: rank 1 stopped because it was told
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=30)


def test_three_ranks_give_the_default_models_tokens(smollm_dir, tmp_path):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm_dir)
    requests = [[tok.encode_chat([{"role": "user", "content": q}]), 16] for q in QUESTIONS]
    config = dict(max_batch=4, threads=1)
    ref = run(build_engine(EngineConfig(**config)), requests)
    got = spawn_ranks(3, {"config": config, "requests": requests}, tmp_path, "smollm")
    worst = compare(ref, got, load_model(smollm_dir), requests)
    print(f"3 ranks, SmolLM2: largest top-5 logprob difference {worst:.2e}")
    assert got["tokens"] == ref["tokens"]  # the held prompts part nowhere near a tie
    assert worst < LOGPROB_TOL
    one = ref  # a rank holds a third of the weights' matrices and of the pool
    assert [s["kv_heads"] for s in got["shares"]] == [1, 1, 1]
    assert len({s["kv_tokens"] for s in got["shares"]}) == 1 and one["blocks"] == got["blocks"]


def wait_health(url: str, procs, want: int = 200, timeout: float = 300) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert procs[0].poll() is None, "rank 0 exited"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == want:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"/health did not answer {want} within {timeout} s")


def test_three_ranks_serve_one_process_text_and_a_killed_rank_turns_health_503(smollm_dir, tmp_path):
    import concurrent.futures

    from openai import OpenAI

    from nanoserve.sampling import SamplingParams

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "ranks.log", "w+")
    args = ["-m", "nanoserve", "serve", "--port", str(port), "--threads", "1", "--max-batch", "4"]
    procs = tp.spawn(3, args, stdout=subprocess.DEVNULL, stderr=log)
    try:
        health = wait_health(url, procs)
        assert health["tensor_parallel"]["ranks"] == 3 and health["tensor_parallel"]["backend"] == "gloo"
        shares = health["tensor_parallel"]["shares"]
        assert [s["rank"] for s in shares] == [0, 1, 2] and all(s["kv_heads"] == 1 for s in shares)
        assert httpx.get(f"{url}/metrics").status_code == 200
        # the same greedy text as one process, three requests decoding together
        engine = build_engine(EngineConfig(max_batch=4, threads=1))
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        want = [o.text for o in engine.generate(chats, SamplingParams(max_tokens=12), use_tqdm=False)]
        engine = None
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def ask(messages):
            r = client.chat.completions.create(
                model=health["model"], messages=messages, max_tokens=12, temperature=0
            )
            return r.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, chats)) == want
        # a rank killed while a stream runs: the stream ends short with an error, /health fails
        stream = client.completions.create(
            model=health["model"], prompt="Once upon a time", max_tokens=400, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks, error = 0, None
        try:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    procs[2].kill()
        except Exception as e:  # the server ends the stream with an error event
            error = e
        assert chunks < 400 and error is not None, (chunks, error)
        body = wait_health(url, procs, want=503, timeout=60)
        assert body["status"] == "failed" and "tensor-parallel rank is gone" in body["error"], body
        r = httpx.post(
            f"{url}/v1/completions", json={"model": health["model"], "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 503 and "tensor-parallel rank is gone" in r.json()["error"]["message"]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
        log.seek(0)
        print(log.read()[-3000:])


def test_a_rank_that_never_joins_fails_the_build_with_a_sentence(smollm_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # rank 0 of 3 alone: the other two are killed before they can join
    args = ["-m", "nanoserve", "serve", "--port", str(port), "--threads", "1", "--join-timeout", "3"]
    procs = tp.spawn(3, args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for p in procs[1:]:
        p.kill()
        p.wait()
    try:
        body = wait_health(url, procs[:1], want=503, timeout=120)  # listening, not ready
        assert body["status"] in ("loading", "failed")
        _, err = procs[0].communicate(timeout=120)  # the build fails: the server says why and exits
        assert procs[0].returncode == 1
        last = err.strip().splitlines()[-1]
        assert last.startswith("nanoserve: error: the engine failed to start"), err[-2000:]
        assert "the tensor-parallel group did not form within 3 s" in last and "Traceback" not in err
    finally:
        procs[0].kill()


QUESTION = "What is the capital of France?"
# the fp32 model: what tensor parallelism serves (one process would serve the GGUF by default)
GENERATE = [
    "-m",
    "nanoserve",
    "generate",
    QUESTION,
    "--max-tokens",
    "12",
    "--threads",
    "1",
    "--weights",
    "dtype",
]


@pytest.fixture(scope="module")
def one_process_text(smollm_dir) -> str:
    """`python -m nanoserve generate` in one process: what every launch below must print."""
    one = subprocess.run([sys.executable, *GENERATE], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip()
    return one.stdout


def test_torchrun_launches_generate_and_prints_one_process_text(one_process_text):
    run3 = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", *GENERATE],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run3.returncode == 0, run3.stderr  # whole: rank 0's own lines come before the agent's summary
    assert run3.stdout == one_process_text
    assert "tensor parallel rank 2/3" in run3.stderr


def test_three_torchrun_nodes_with_a_c10d_rendezvous_print_one_process_text(one_process_text):
    """Three `torchrun --nnodes 3 --nproc-per-node 1` launches meeting at a c10d rendezvous, as
    three machines would run them (here all on 127.0.0.1). The c10d rendezvous assigns the ranks
    itself, ignoring --node-rank, so whichever launch got global rank 0 prints the text and the
    other two print nothing."""
    port = free_port()
    launches = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "1",
                "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "nanoserve-test", *GENERATE,
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in range(3)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=600) for p in launches]
    finally:
        for p in launches:
            p.kill()
    assert [p.returncode for p in launches] == [0, 0, 0], [err[-2000:] for _, err in outs]
    assert sorted(out for out, _ in outs) == ["", "", one_process_text]
    rank0_err = next(err for out, err in outs if out)
    assert all(f"tensor parallel rank {r}/3" in rank0_err for r in range(3))
