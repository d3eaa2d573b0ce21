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
# # Day 45 — `build_engine` and `serve.py`: from a config to a listening server
#
# Until today every notebook of this phase built its engine by hand (a model, a tokenizer,
# `Engine(...)`) and handed it to `create_app`. A user does none of that: they type
# `nanoserve serve` with a few options. Between that line and the first answered request sits
# the boot path, and it has an order that matters. Cheap checks come first, so a typo in an
# option costs a sentence and not ten seconds of loading; the weights are read and the model
# built; the KV pool is planned from its budget; and only then does the server say it is ready.
#
# `build_engine(config, on_phase)` is that path in one call, and `on_phase` is how whoever
# called it learns which stage it is in. The server passes a callback that sets the phase
# `/health` reports, so a load balancer that asks during boot gets 503 "loading" rather than a
# refused connection.
#
# 1. the boot by hand, one phase per line, each timed,
# 2. configs refused before anything loads, two that can only be refused after, and a careless
#    boot that reads the weights first, caught by a check,
# 3. the same refusals from the real command line: one sentence, no traceback,
# 4. `build_engine` behind an in-process server: what `on_phase` reports, `/health` during
#    and after, the stderr lines and the boot line, the engine equal to the hand-built one, and
#    a builder that fails,
# 5. the real `nanoserve serve` watched from outside (`days/day45/boot.py`),
# 6. the diagram.

# %%
import contextlib
import csv
import io
import sys
import time

import httpx
import matplotlib
import openai
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, ServerThread, diagram_path, engine_config
from nanoserve.bench import cpu_line
from nanoserve.cli import main as cli_main
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine, build_engine
from nanoserve.models import Llama, LlamaConfig
from nanoserve.sampling import SamplingParams
from nanoserve.serve import create_app
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import load_state_dict, resolve_model_dir

sys.path.insert(0, str(REPO / "days" / "day45"))
import boot  # the day's script: its config, its bad configs, its tables

torch.set_num_threads(1)
print(cpu_line())
config = engine_config(45, **boot.BASE)  # the engine as it stands today, with the day's sizes
print({k: getattr(config, k) for k in boot.BASE})
print({k: getattr(config, k) for k in ("schedule", "attention", "linear", "decode_step", "watermark")})

# %% [markdown]
# ## 1. The boot by hand
#
# The day's config (the script's `BASE`, on top of the engine of day 45): 4 rows, a context of
# 512 tokens, a KV budget of 64 MiB, the prefill-first schedule, the gather read of the pool,
# the model's own linears and a decode step of torch ops. Each line below is one phase of
# `build_engine`, in its order, timed on its own. Reading the safetensors file is fast because
# it is memory-mapped; building the model copies every tensor into it; `Engine(...)` plans the
# pool (arithmetic: no memory yet, each layer's K and V are allocated at the first write to it).
# Today's boot ends there. Day 56 adds a "warming" stage to it (allocate the pool, record the
# decode graphs of days 51-54), and day 59 a packing of the linears.

# %%
timings = []


@contextlib.contextmanager
def phase(name):
    t0 = time.perf_counter()
    yield
    timings.append((name, time.perf_counter() - t0))


with phase("config checks"):
    config.validate()
with phase("weights"):
    model_dir = resolve_model_dir(config.model)
    cfg = LlamaConfig.from_dir(model_dir)
    state = load_state_dict(model_dir, dtype=torch.float32)
with phase("model"):
    model = Llama(cfg)
    model.load_hf_state_dict(state)
    model.eval()
    tokenizer = Tokenizer.from_dir(model_dir)
with phase("pool plan"):
    engine = Engine(model, tokenizer, config)
engine.model_name = model_dir.name
print(f"{len(state)} tensors read | linears {engine.linear} | pool planned: {engine.pool.num_blocks} blocks "
      f"of {engine.pool.block_size} | allocated so far: {engine.cache.allocated_bytes:,} bytes")
assert engine.linear == "plain" and engine.cache.allocated_bytes == 0

# %%
# NBVAL_IGNORE_OUTPUT
for name, s in timings:
    print(f"{name:>15}: {1000 * s:8.1f} ms")
print(f"{'total':>15}: {1000 * sum(s for _, s in timings):8.1f} ms")

# %% [markdown]
# ## 2. Refused before anything loads
#
# `build_engine` validates the config before it reports "loading", so a config that is wrong
# on its face costs nothing. The script's list of bad configs, handed to `build_engine` one
# at a time: five are refused by `EngineConfig.validate` with no phase reported. Two cannot be:
# whether `max_model_len` 100000 is too long depends on the model's `config.json`, and whether
# 1 MiB of KV pool holds a 512-token context depends on the model's layers and heads. Both are
# refused after "loading", with a sentence that says what to change.

# %%
refusals = boot.refusal_table()
for r in refusals:
    print(f"{r['config']:>34} | {r['refused']:<14} | phases {r['phases_before']:<7} | {r['error']}")
with open(boot.HERE / "day-45-refusals.csv") as f:
    committed = list(csv.DictReader(f))
facts = ["config", "phases_before", "refused", "error"]
assert [[r[k] for k in facts] for r in refusals] == [[r[k] for k in facts] for r in committed]

# %%
# NBVAL_IGNORE_OUTPUT
print("time to the refusal:", ", ".join(f"{r['config']} {r['ms']:.1f} ms" for r in refusals))

# %% [markdown]
# The check behind the first five rows, as a function: a config refused by its own checks must
# be refused before any phase is reported. Here it is run against `build_engine`, and against
# a careless boot that reads the model first and validates after. That boot refuses the same
# config with the same sentence, so its user sees the same error, later; only the phases
# show the difference.


# %%
def check_refused_before_loading(builder, bad: EngineConfig) -> str:
    phases = []
    try:
        builder(bad, phases.append)
    except ValueError as e:
        if phases:
            raise AssertionError(f"refused only after {phases}: {e}") from None
        return str(e)
    raise AssertionError("the bad config was accepted")


def careless_boot(config, on_phase):
    on_phase("loading")
    load_state_dict(resolve_model_dir(config.model))  # the weights, for a config that was never valid
    config.validate()


bad = engine_config(45, **{**boot.BASE, "max_batch": 0})
print("build_engine:", check_refused_before_loading(build_engine, bad))
try:
    check_refused_before_loading(careless_boot, bad)
except AssertionError as e:
    print("careless boot -> AssertionError:", e)
else:
    raise AssertionError("the check passed a boot that loads before it validates")

# %% [markdown]
# ## 3. The same refusals from the command line
#
# `nanoserve serve` turns every mistake a user can fix into one line on stderr,
# `nanoserve: error: ...`, and a non-zero exit: `cmd_serve` checks the port and the drain timeout
# itself, parses sizes such as `--kv-budget 512MiB`, and turns a `ValueError` from the config
# into a `NanoserveError`, which `main` prints as that line. The script ran five bad options as
# real subprocesses (`day-45-cli.csv`, below); here `nanoserve.cli.main`, the function the
# command runs, is called in-process with the first of them, which saves starting a Python.

# %%
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = cli_main(["serve", "--max-batch", "0"])
print("exit code", code, "| stderr:", err.getvalue().strip())
assert code == 1 and err.getvalue().count("\n") == 1 and "Traceback" not in err.getvalue()
with open(boot.HERE / "day-45-cli.csv") as f:
    cli_rows = list(csv.DictReader(f))
for row in cli_rows:
    print(f"{row['option']:>28} -> exit {row['exit_code']}, {row['stderr_lines']} line, traceback "
          f"{row['traceback']}: {row['message'][:90]}")
assert cli_rows[0]["message"] == err.getvalue().strip()

# %% [markdown]
# ## 4. `build_engine` behind a server
#
# `build_engine(config, on_phase)` runs the phases of section 1 in the same order, after
# validating the config, and reports "loading" once the config has passed its checks (weights,
# model, the pool plan); a second report, "warming", belongs to the warm-up day 56 adds, which
# today's config does not ask for. It writes two lines to stderr, not stdout, so that a command
# whose stdout is its answer keeps it clean: the pool plan, and the paths the engine runs
# (linears, decode attention, schedule).
#
# `create_app` accepts a builder, `f(on_phase) -> Engine`, and runs it on a background thread
# once uvicorn starts, so the port answers from the first moment; the `on_phase` it passes sets
# the phase `/health` reports. To see every phase rather than race it, the builder below waits
# after each report until `/health` has been asked once, and a completion is sent during
# "loading" as well. When the builder returns, the app starts the engine loop, prints the boot
# line, and only then turns `/health` to 200.

# %%
seen_by_builder, answers, reported = [], [], []
t_start = time.perf_counter()


def builder(on_phase):
    def report(p):
        on_phase(p)
        reported.append((p, time.perf_counter() - t_start))
        seen_by_builder.append(p)
        deadline = time.monotonic() + 30
        while len(answers) < len(seen_by_builder) and time.monotonic() < deadline:
            time.sleep(0.01)  # until the cell below has asked /health in this phase

    return build_engine(config, on_phase=report)


app = create_app(builder, address="127.0.0.1:PORT")
server = ServerThread(app)
boot_err = io.StringIO()
with contextlib.redirect_stderr(boot_err):
    url = server.__enter__()
    while True:
        while len(seen_by_builder) == len(answers) and app.state.nanoserve.phase != "ready":
            time.sleep(0.01)
        h = httpx.get(url + "/health")
        if h.json()["status"] == "loading":  # sent before the builder is let go
            early = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        answers.append((h.status_code, h.json()))
        if h.status_code == 200:
            break
t_done = time.perf_counter() - t_start
print("on_phase reported:", [p for p, _ in reported])
for code, body in answers:
    print("GET /health ->", code, body["status"], "" if code == 200 else body)
print("a completion while loading:", early.status_code, early.json()["error"])
print("stderr:", *[ln.replace("·", "\n    ·") for ln in boot_err.getvalue().splitlines()], sep="\n  ")
assert [(c, b["status"]) for c, b in answers] == [(503, "loading"), (200, "ok")]
assert early.status_code == 503

# %%
# NBVAL_IGNORE_OUTPUT
for (p, t), nxt in zip(reported, [t for _, t in reported[1:]] + [t_done]):
    print(f"{p:>8}: from {1000 * t:7.1f} ms, for {1000 * (nxt - t):7.1f} ms (the waits for /health included)")

# %% [markdown]
# The engine the builder made equals the one built by hand in section 1: the same pool plan,
# the same paths, and, asked through the door with the `openai` client, the same greedy tokens
# as the hand-built engine gives for the same chat. That chat is the hand-built engine's first
# request, so its pool is allocated now: K and V for every slot of every layer, and one more
# slot, the sink that padded positions write to.

# %%
built = app.state.nanoserve.engine
assert built.pool == engine.pool and built.linear == engine.linear
assert built.cache.attention == engine.cache.attention
question = [{"role": "user", "content": "What is a lighthouse?"}]
(ours,) = engine.generate([question], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
reply = client.chat.completions.create(
    model=built.model_name, messages=question, max_tokens=8, temperature=0,
    extra_body={"return_token_ids": True},
)
print(f"by hand: {ours.text!r}\nthrough the door: {reply.choices[0].message.content!r}")
assert reply.choices[0].message.content == ours.text and reply.choices[0].token_ids == ours.token_ids
print(f"allocated after the first request: {engine.cache.allocated_bytes:,} bytes")
assert engine.cache.allocated_bytes == (engine.pool.num_slots + 1) * 2 * 30 * 3 * 64 * 4  # + the sink slot
del engine, model, state

# %% [markdown]
# The last stderr line is the boot line, `serve.boot_line`: the model's directory name, dtype and
# device, the KV pool (blocks, tokens, MB) and the address, with "warm list none" for the graphs
# day 56 records at boot. It is printed before the phase turns "ready", so whoever has seen the
# 200 can also find it. The 200 itself carries the same facts as JSON:

# %%
health = answers[-1][1]
print("pool:", {k: health["pool"][k] for k in ("num_blocks", "block_size", "num_slots", "dtype")})
print("boot line printed before the 200:", "listening on" in boot_err.getvalue().splitlines()[-1])
server.__exit__(None, None, None)

# %% [markdown]
# A builder that raises does not take the process down: `/health` turns 503 "failed" with the
# reason, generation routes answer 503 with it, and the error is one line on stderr. Here the
# builder is handed the "max_batch 0" config of section 2.

# %%
app = create_app(lambda on_phase: build_engine(bad, on_phase))
fail_err = io.StringIO()
with contextlib.redirect_stderr(fail_err), ServerThread(app) as url:
    while (h := httpx.get(url + "/health")).json()["status"] != "failed":
        time.sleep(0.02)
    refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
print("/health:", h.status_code, h.json())
print("a completion:", refused.status_code, refused.json()["error"]["message"])
print("stderr:", *[ln for ln in fail_err.getvalue().splitlines() if "nanoserve" in ln])
assert h.status_code == 503 and refused.status_code == 503 and "max_batch must be" in h.json()["error"]

# %% [markdown]
# ## 5. The real command, watched from outside
#
# `days/day45/boot.py` launches `python -m nanoserve serve` with the day's config as options,
# reads its stderr line by line, asks `/health` every 20 ms, sends one completion once it is
# 200, and stops it with SIGTERM. The command's defaults are the finished engine's, so the
# script names today's ways as options (`boot.DAY_OPTIONS`: fp32 weights, plain linears, the
# gather read, the prefill-first schedule, torch ops a step, no recorded graphs). `serve()` adds
# to the in-process path two checks before it listens (the model directory, and that the port
# can be bound) and a first line saying what `/health` will answer until ready; that line names
# the warming of day 56 too, and the paths line ends with the command's allocator setting,
# "freed memory kept" (`nanoserve/malloc.py`, of phase 6). The table (`day-45-serve.csv`), as
# that run saw it:

# %%
with open(boot.HERE / "day-45-serve.csv") as f:
    events = list(csv.DictReader(f))
for e in events:
    print(f"{e['n']:>2} {e['source']:>7}: {e['what'][:110]}")
statuses = [e["what"] for e in events if e["source"] == "health"]
assert statuses == ["no answer", "503 loading", "200 ok", "no answer"]
assert events[-2]["what"] == "exit code 0"

# %%
# NBVAL_IGNORE_OUTPUT
marks = {e["what"][:22]: float(e["t_s"]) for e in events}
print(f"first stderr line {events[1]['t_s']} s after launch (imports); '503 loading' at "
      f"{marks['503 loading']} s; '200 ok' at {marks['200 ok']} s")

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
fig.suptitle("Day 45 — the boot path (SmolLM2-135M, CPU, 1 thread)", fontsize=13)
ax = axes[0]
left = 0.0
colors = plt.cm.tab10.colors
for i, (name, s) in enumerate(timings):
    ax.barh(0, s, left=left, color=colors[i % 10], label=f"{name} ({1000 * s:.0f} ms)")
    left += s
ax.set_yticks([])
ax.set_xlabel("seconds (this run)")
ax.set_title("build_engine's phases, by hand, one after another")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8)
ax.set_ylim(-0.6, 0.6)

ax = axes[1]
health_ev = [(float(e["t_s"]), e["what"]) for e in events if e["source"] == "health"]
band = {"no answer": "#bbbbbb", "503 loading": "#8da0cb", "200 ok": "#66c2a5"}
end = float(events[-1]["t_s"])
for (t, what), (t_next, _) in zip(health_ev, health_ev[1:] + [(end + 0.5, "")]):
    ax.axvspan(t, t_next, color=band[what], alpha=0.6, label=what if what not in
               [w for _, w in health_ev[: health_ev.index((t, what))]] else None)  # fmt: skip
for e in events:
    if e["source"] in ("stderr", "client", "process"):
        ax.axvline(float(e["t_s"]), color="k", lw=0.8)
        ax.text(float(e["t_s"]), 0.02 + 0.07 * (int(e["n"]) % 12), " " + e["what"][:28], fontsize=7,
                transform=ax.get_xaxis_transform())  # fmt: skip
ax.set_yticks([])
ax.set_xlabel("seconds since `nanoserve serve` was launched (the script's run)")
ax.set_title("/health from outside, and what the process said")
ax.legend(loc="upper left", fontsize=8)
path = diagram_path("day45-boot.png")
fig.savefig(path, dpi=80, bbox_inches="tight")
plt.close(fig)
display(Image(str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**: `vllm serve` runs `vllm/entrypoints/openai/api_server.py`. The command-line
#   arguments become engine arguments and then one config, checked before any weights are read.
#   `AsyncLLM` starts `EngineCore` in a process of its own, and that process does the slow
#   part: load the weights, profile memory to size the KV cache, capture CUDA graphs. The HTTP
#   routes (`/health` among them) are served once the engine client is up.
# * **SGLang**: `python -m sglang.launch_server` calls `_launch_subprocesses`, which starts the
#   scheduler (it loads the model and allocates the KV pool) and the detokenizer in processes
#   of their own, with the tokenizer manager in the server's process. `_wait_and_warmup` then
#   sends one real request to the server itself and only after it succeeds marks the server up.
# * **TGI**: `text-generation-launcher` starts the Python model server shards, waits for them to
#   load, and then launches the Rust router with matching arguments; the router is what
#   answers HTTP.
# * **llama.cpp**: `llama-server` answers `/health` with 503 and an error object whose message
#   is "Loading model" while the GGUF loads, and 200 `{"status": "ok"}` once it can serve.
# * Ours keeps all of it in one process: the builder thread plays the part of vLLM's engine
#   core start-up, and the boot line plus `/health`'s JSON play the part of their start-up logs.
#
# ## Try it
#
# 1. **Report too early, on purpose.** In a copy of `build_engine`, move `on_phase("loading")`
#    above `config.validate()`, and hand the copy to `check_refused_before_loading` with
#    section 2's `bad` config (`max_batch` 0). The check: it raises
#    `AssertionError: refused only after ['loading']: max_batch must be at least 1, got 0`,
#    the line the careless boot prints in its cell. The user's sentence is the same; only the
#    phase reported before it gives the mistake away.
# 2. **One more bad config.** Append `("dtype int8", {"dtype": "int8"})` to `boot.BAD_CONFIGS`
#    and rerun section 2. The check: the new last row reads `before loading`, phases `none`,
#    `ValueError: dtype must be float32 or bfloat16, got 'int8'`, and the cell's assert against
#    the committed `day-45-refusals.csv` then fails, because the table has a row the file does not.
# 3. **One more bad option.** Append `("--max-model-len", "1")` to `boot.BAD_OPTIONS` and run
#    `boot.cli_table()` (five subprocesses, and the new one). The check: the new last row has
#    `exit_code` 1, `stderr_lines` 1, `traceback` no and the message
#    `nanoserve: error: max_model_len must be at least 2, got 1`: the config's own sentence,
#    reached through the command line without loading a weight.
