"""The `nanoserve` command as a user runs it: real processes, real model, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.tokenizer import Tokenizer


def nanoserve(*args, stdin=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "nanoserve.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def assert_one_line_error(r, *words):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    # informational lines (the KV pool plan) may precede it; the error itself is one line
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("KV pool:", "paths:"))]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_unknown_option_is_one_line():
    assert_one_line_error(
        nanoserve("generate", "hi", "--frobnicate"), "unrecognized arguments", "--frobnicate"
    )


def test_unknown_command_is_one_line():
    assert_one_line_error(nanoserve("summon"), "invalid choice")


def test_missing_model_dir_is_one_line(tmp_path):
    assert_one_line_error(
        nanoserve("generate", "hi", "--model", str(tmp_path / "nope")), str(tmp_path / "nope")
    )


def test_corrupt_model_dir_is_one_line(tmp_path, smollm_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bad / name).write_bytes((smollm_dir / name).read_bytes())
    (bad / "config.json").write_text(json.dumps(json.loads((smollm_dir / "config.json").read_text())))
    (bad / "model.safetensors").write_bytes((smollm_dir / "model.safetensors").read_bytes()[:10_000])
    assert_one_line_error(nanoserve("generate", "hi", "--model", str(bad)), "safetensors")
    (bad / "config.json").write_text("{not json")
    assert_one_line_error(nanoserve("generate", "hi", "--model", str(bad)), "config.json")


def test_gguf_of_another_architecture_is_one_line(gpt2_gguf):
    assert_one_line_error(nanoserve("import-gguf", str(gpt2_gguf)), "gpt2")


def test_prompt_longer_than_context_is_one_line(smollm_dir):
    r = nanoserve("generate", "word " * 100, "--raw", "--max-model-len", "32", "--model", str(smollm_dir))
    assert_one_line_error(r, "prompt", "32")


def test_bad_sampling_option_is_one_line(smollm_dir):
    assert_one_line_error(nanoserve("generate", "hi", "--top-p", "0", "--model", str(smollm_dir)), "top_p")


@pytest.mark.slow
def test_generate_streams_the_greedy_continuation(smollm_dir):
    prompt = "Name the largest planet in the solar system."
    r = nanoserve("generate", prompt, "--max-tokens", "12", "--model", str(smollm_dir))
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_dir(smollm_dir)
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    tokens = greedy_tokens(load_model(smollm_dir), ids, 12, eos_ids=tok.eos_ids)
    expected = tok.decode([t for t in tokens if t not in tok.eos_ids])
    assert r.stdout == expected + "\n"
    assert "tok/s" in r.stderr and "12 generated" in r.stderr or "finish: stop" in r.stderr


@pytest.mark.slow
def test_chat_keeps_history_and_resets(smollm_dir):
    """Each answer is the greedy continuation of the whole conversation so far; /reset forgets."""
    turns = ["My name is Ada.", "What is my name?", "/reset", "What is my name?", "/exit"]
    r = nanoserve("chat", "--max-tokens", "16", "--model", str(smollm_dir), stdin="\n".join(turns) + "\n")
    assert r.returncode == 0, r.stderr
    assert "(history cleared)" in r.stderr
    tok = Tokenizer.from_dir(smollm_dir)
    model = load_model(smollm_dir)

    def answer(messages):
        ids = tok.encode_chat(messages)
        return tok.decode(
            [t for t in greedy_tokens(model, ids, 16, eos_ids=tok.eos_ids) if t not in tok.eos_ids]
        )

    first = answer([{"role": "user", "content": turns[0]}])
    history = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first}]
    second = answer(history + [{"role": "user", "content": turns[1]}])
    after_reset = answer([{"role": "user", "content": turns[3]}])
    assert r.stdout == f"{first}\n{second}\n{after_reset}\n"
    assert second != after_reset  # the history changed the answer, so the test can tell


def test_generate_serves_the_gguf_own_q4_1_weights(smollm_dir):
    """`--weights q4_1` reads the default model's own GGUF blocks (through `python -m nanoserve`):
    the same text as the fp32 model converted from that file; `--weights q8_0` on that Q4_1 file
    is one sentence saying what it holds."""
    prompt = "Name the largest planet in the solar system."
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoserve",
            "generate",
            prompt,
            "--max-tokens",
            "12",
            "--weights",
            "q4_1",
            "--quant-activations",
            "fp32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 0, r.stderr
    assert "paths: weights q4_1 (fp32 activations), 96.6 MB, linears q4_1, decode step fused" in r.stderr
    from nanoserve.malloc import keep_freed_memory

    if keep_freed_memory() == "kept":  # glibc: the CLI keeps freed memory (malloc.py), and says so
        assert "schedule budget, freed memory kept" in r.stderr
    tok = Tokenizer.from_dir(smollm_dir)
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    tokens = greedy_tokens(load_model(smollm_dir), ids, 12, eos_ids=tok.eos_ids)
    assert r.stdout == tok.decode([t for t in tokens if t not in tok.eos_ids]) + "\n"
    r = nanoserve("generate", prompt, "--weights", "q8_0")
    assert_one_line_error(r, "--weights q8_0", "holds them as q4_1")


def test_the_default_path_is_the_gguf_with_int8_activations_on_a_cpu(monkeypatch, tmp_path):
    """What --weights and --quant-activations resolve to when not given (cli.resolve_weights),
    and when serve records decode graphs (cli.decode_capture): a model that comes as a GGUF is
    served from its blocks with int8 activations and an eager fused step on a CPU; a directory,
    bfloat16, a GPU or several ranks keep the dtype's weights (and the recorded graphs)."""
    from nanoserve.cli import build_parser, decode_capture, resolve_weights

    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def resolved(*argv):
        args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
        w, acts = resolve_weights(args)
        return w, acts, decode_capture(args, w is not None, on_cuda=False)

    assert resolved() == ("gguf", "int8", False)
    assert resolved("--model", "qwen2.5-coder-0.5b-instruct") == ("gguf", "int8", False)
    assert resolved("--gguf", "x.gguf") == ("gguf", "int8", False)
    assert resolved("--quant-activations", "fp32") == ("gguf", "fp32", False)
    assert resolved("--capture") == ("gguf", "int8", True)
    assert resolved("--weights", "q4_1") == ("q4_1", "int8", False)
    assert resolved("--model", str(tmp_path)) == (None, "fp32", True)  # a directory: its fp32 weights
    assert resolved("--weights", "dtype") == (None, "fp32", True)
    assert resolved("--dtype", "bfloat16") == (None, "fp32", True)
    assert resolved("--weights", "dtype", "--no-capture") == (None, "fp32", False)
    monkeypatch.setenv("WORLD_SIZE", "2")  # tensor parallelism keeps the dtype's weights
    assert resolved() == (None, "fp32", True)


def test_serve_http_options_parse_and_refuse_mistakes_in_one_line():
    """The serve flags of the HTTP operations (cli.http_options): the access log on by default,
    CORS off by default, origins as a JSON list or a comma list; a malformed one, an origin a
    browser never sends, or a CORS detail without origins is one line before anything loads."""
    from nanoserve.cli import build_parser, http_options

    def options(*argv):
        return http_options(build_parser().parse_args(["serve", *argv]))

    default = options()
    assert default["access_log"] is True and default["access_log_skip"] == ()
    assert default["allowed_origins"] is None and default["allow_credentials"] is False
    assert options("--no-access-log")["access_log"] is False
    assert options("--disable-uvicorn-access-log")["access_log"] is False  # vLLM's name
    skip = options("--disable-access-log-for-endpoints", "/health,/metrics")["access_log_skip"]
    assert skip == ("/health", "/metrics")
    origins = ["https://app.example", "http://localhost:3000"]
    assert options("--allowed-origins", json.dumps(origins))["allowed_origins"] == origins
    cors = options(
        "--allowed-origins",
        ",".join(origins),
        "--allowed-methods",
        "GET,POST",
        "--allowed-headers",
        '["Authorization"]',
        "--allow-credentials",
    )
    assert cors["allowed_origins"] == origins and cors["allowed_methods"] == ["GET", "POST"]
    assert cors["allowed_headers"] == ["Authorization"] and cors["allow_credentials"] is True
    help_text = nanoserve("serve", "--help").stdout
    for flag in [
        "--allowed-origins",
        "--allowed-methods",
        "--allowed-headers",
        "--allow-credentials",
        "--no-access-log",
        "--disable-access-log-for-endpoints",
    ]:
        assert flag in help_text, flag
    for argv, words in [
        (["--allowed-origins", "app.example"], ["--allowed-origins", "'app.example' is not an origin"]),
        (["--allowed-origins", "[not json"], ["--allowed-origins", "JSON list"]),
        (["--allowed-methods", "GET"], ["--allowed-methods", "--allowed-origins"]),
        (["--disable-access-log-for-endpoints", "health"], ["takes paths such as /health"]),
    ]:
        assert_one_line_error(nanoserve("serve", *argv), *words)
