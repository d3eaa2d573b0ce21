"""The `nanoserve` command: serve, fetch-model, import-gguf, generate, chat, bench.

Every command takes `--model DIR` (any Hugging Face Llama-family directory: config.json,
safetensors, tokenizer.json); without it the default model is fetched and converted once.
A mistake the user can fix (a bad path, an unknown option, a prompt that does not fit) is
printed as one line, `nanoserve: error: ...`, with a non-zero exit code and no traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanoserve.config import SCHEDULING_POLICIES
from nanoserve.errors import NanoserveError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (argparse's own usage dump is two or more)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="DIR|NAME|FILE.gguf",
        help="an HF-layout Llama, Qwen2, Qwen3 or Gemma 3 model directory, a Hugging Face repo id "
        "(Org/Name, through huggingface_hub's cache), a name fetch-model knows: smollm2-135m-instruct "
        "(the default), qwen2.5-coder-0.5b-instruct, gemma-3-270m, or a GGUF file (converted once "
        "for its tokenizer and config, its matrices served from the file)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and activations dtype")
    p.add_argument(
        "--weights",
        choices=["auto", "q4_1", "q8_0", "gguf", "dtype"],
        default="auto",
        help="serve quantized matrices as a GGUF holds them: gguf, the file's own mix of types (the "
        "default model's Q4_1, Q4_K_M's Q5_0, Q4_K, Q6_K, Q8_0...), or q4_1/q8_0 (the default "
        "model's file, --gguf's, or --model's fp32 weights quantized at load); dtype: --dtype's "
        "unquantized weights. auto: gguf on a CPU for a model fetched by name or a --gguf file, "
        "else dtype (default: auto)",
    )
    p.add_argument("--gguf", default=None, metavar="FILE", help="with --weights: the GGUF to read them from")
    p.add_argument(
        "--quant-activations",
        choices=["auto", "fp32", "int8"],
        default="auto",
        help="with quantized weights: fp32 (the dequantized model's numbers) or int8 per block "
        "(llama.cpp's arithmetic); auto: int8, which `make lmeval` holds to the fp32 model's "
        "scores (default: auto)",
    )
    p.add_argument(
        "--decode-step",
        choices=["auto", "fused", "ops"],
        default="auto",
        help="a decode step as one native call (fused) or as the model's torch ops; auto: fused "
        "for quantized weights (default: auto)",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="speculative decoding: ngram proposes each decoding row's next tokens from its own "
        "context (the latest earlier occurrence of its last n-gram) and one forward verifies them; "
        "the tokens are those decoding without it gives, greedy, and of the same distribution, "
        "sampled (default: off)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=3,
        metavar="K",
        help="with --speculative: the most tokens a row proposes a step (default: 3)",
    )
    p.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=2,
        metavar="N",
        help="with --speculative ngram: the shortest n-gram looked up (default: 2)",
    )
    p.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=4,
        metavar="N",
        help="with --speculative ngram: the longest n-gram looked up, tried first (default: 4)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a jinja chat template to render messages with instead of the model's own; a base "
        "model (gemma-3-270m) has none, and chat requests are refused without one",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: all cores)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument(
        "--join-timeout",
        type=float,
        default=60.0,
        help="under torchrun: seconds every rank has to join the tensor-parallel group (default: 60)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 turns the top-k cut off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")


def build_parser() -> Parser:
    parser = Parser(prog="nanoserve", description="An LLM inference engine written from scratch in PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("fetch-model", help="download and convert a model (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "name",
        nargs="?",
        default="smollm2-135m-instruct",
        help="smollm2-135m-instruct (the default) or qwen2.5-coder-0.5b-instruct",
    )
    p.add_argument("--home", type=Path, default=None, help="cache folder (default: $NANOSERVE_HOME)")

    p = sub.add_parser("import-gguf", help="convert a GGUF file (llama, qwen2, qwen3) into a model directory")
    p.add_argument("path", type=Path)
    p.add_argument("--out", type=Path, default=None, help="output directory (default: next to the file)")

    p = sub.add_parser("generate", help="complete one prompt, streaming the text")
    p.add_argument("prompt")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="a system message for the chat template")
    add_model_args(p)
    add_sampling_args(p)

    p = sub.add_parser("chat", help="a multi-turn conversation in the terminal (/reset, /exit)")
    p.add_argument("--system", default=None, help="a system message")
    add_model_args(p)
    add_sampling_args(p)

    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve the model over an OpenAI-compatible HTTP API (POST /v1/completions, "
        "POST /v1/chat/completions, GET /v1/models, /health, /metrics, POST /tokenize, POST /detokenize, "
        "GET /version). The engine is built, its KV "
        "pool planned and its decode graphs recorded (the warm list) before generation requests are "
        "accepted; /health answers 503 until then.",
    )
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $NANOSERVE_API_KEY, else none)",
    )
    p.add_argument("--max-batch", type=int, default=32, help="sequences decoded together (default: 32)")
    p.add_argument(
        "--kv-budget",
        default=None,
        help="memory for the KV pool, e.g. 512MiB or 2GB (default: 512MiB on CPU)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument(
        "--no-capture",
        action="store_true",
        help="decode eagerly: no buckets, no persistent inputs, no recorded graphs (days 51-55 off)",
    )
    p.add_argument(
        "--capture",
        action="store_true",
        help="decode through buckets, persistent inputs and recorded graphs even where the default "
        "is eager (a CPU serving quantized weights, whose fused step measured faster unpadded)",
    )
    p.add_argument(
        "--no-warm",
        action="store_true",
        help="record decode graphs lazily, on each shape's first step, instead of before serving",
    )
    p.add_argument(
        "--warm-max-rows",
        type=int,
        default=None,
        help="warm only row buckets up to this (default: --max-batch)",
    )
    p.add_argument(
        "--warm-max-width",
        type=int,
        default=None,
        help="warm only width buckets up to this many tokens (default: 256 on CPU, where a recording costs "
        "one step and saves nothing; on CUDA the smaller of --max-model-len and the free memory's width "
        "ceiling). Wider shapes run eagerly: after the warm list nothing more is recorded.",
    )
    p.add_argument(
        "--graph-budget",
        default="512MiB",
        help="with --no-warm, the memory lazily recorded graphs may hold; past it new shapes run "
        "eagerly (default: 512MiB)",
    )
    p.add_argument("--max-waiting", type=int, default=1024, help="queue length past which requests get 429")
    p.add_argument(
        "--max-body-bytes",
        default="4MiB",
        help="largest request body; a larger one gets 413 before it is read (default: 4MiB)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names a request's model field may give; answers carry the first (default: the "
        "model directory's name)",
    )
    p.add_argument(
        "--max-score-entries",
        type=int,
        default=None,
        help="most log-probability entries one request may ask for, n x max_tokens x (logprobs + 1) "
        "summed over its prompts; more gets 400 too_many_scores before it runs (default: 1048576)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM or SIGINT, seconds requests in flight may run before they are cut; new "
        "requests get 503 meanwhile (default: 30)",
    )
    p.add_argument(
        "--watermark",
        type=float,
        default=0.05,
        help="share of the KV pool admission keeps free beyond the running requests' next tokens, so "
        "a new prompt is not preempted on the next step (default: 0.05)",
    )
    p.add_argument(
        "--schedule",
        choices=["budget", "prefill-first", "static"],
        default="budget",
        help="budget: decode rows and prompt chunks share one token budget a step, so a new prompt "
        "slows the running streams instead of stopping them; prefill-first: a step is all prefill "
        "or all decode, prompts first (the earlier policy); static: a new batch only when the last has "
        "finished, nobody joins in between (the first policy) (default: budget)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=list(SCHEDULING_POLICIES),
        default="fcfs",
        help="fcfs: requests are served in arrival order; priority: by each request's `priority` "
        "field (lower first), then arrival; the sequence preempted when the KV pool runs short "
        "is the lowest priority's newest (vLLM's flag) (default: fcfs)",
    )
    p.add_argument(
        "--attention",
        choices=["auto", "native", "gather"],
        default="auto",
        help="how decode reads the KV pools: native (a C++ kernel reading them in place, built on "
        "first use), gather (a padded copy per row, then SDPA), auto (native where it builds) "
        "(default: auto)",
    )
    p.add_argument(
        "--linear",
        choices=["auto", "packed", "plain"],
        default="auto",
        help="how the linears read their weights on CPU: packed (reordered once at load for "
        "oneDNN's GEMM), plain (torch's matmul on the weights as loaded), auto (packed where "
        "oneDNN can pack the dtype on this CPU) (default: auto)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="the token budget of one step: decode rows plus prompt chunks (default: 512)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level; requests are logged by the access log, not by uvicorn (default: warning)",
    )
    p.add_argument(
        "--no-access-log",
        "--disable-uvicorn-access-log",
        dest="no_access_log",
        action="store_true",
        help="write no line per request on stderr (by default each request gets one: client, method, "
        "path, status, duration, request id)",
    )
    p.add_argument(
        "--disable-access-log-for-endpoints",
        default=None,
        metavar="PATHS",
        help="paths whose requests get no access log line, a comma list, e.g. /health,/metrics for "
        "probes and scrapers (default: none)",
    )
    p.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="origins whose browser pages may call this server (CORS), as a JSON list or a comma list: "
        "'[\"https://app.example\"]', https://a.example,http://localhost:3000, or * for any "
        "(default: none, no CORS headers at all)",
    )
    p.add_argument(
        "--allowed-methods",
        default=None,
        metavar="METHODS",
        help="with --allowed-origins: the methods they may use, a JSON or comma list (default: any)",
    )
    p.add_argument(
        "--allowed-headers",
        default=None,
        metavar="HEADERS",
        help="with --allowed-origins: the request headers they may send, a JSON or comma list (default: any)",
    )
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        help="with --allowed-origins: let their pages send cookies and HTTP authentication",
    )

    sub.add_parser("bench", help="benchmarks: see `python -m nanoserve.bench --help`", add_help=False)
    return parser


def sampling_params(args):
    from nanoserve.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        return params.validate()
    except ValueError as e:
        raise NanoserveError(str(e)) from None


def device_of(args) -> str:
    """The device the options ask for (default: cuda when torch sees one, else cpu); asking for
    cuda where there is none is a mistake the user can fix."""
    import torch

    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise NanoserveError("--device cuda was asked for, but torch sees no CUDA device here")
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def weights_options(args) -> dict:
    """What --weights and --quant-activations resolve to (`resolve_weights`), and the other
    options of the model's own files (--gguf, --chat-template)."""
    weights, activations = resolve_weights(args)
    return dict(
        weights=weights,
        gguf=args.gguf,
        quant_activations=activations,
        decode_step=args.decode_step,
        chat_template=args.chat_template,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
    )


def decode_capture(args, quantized: bool, on_cuda: bool) -> bool:
    """Whether `serve` decodes through buckets, persistent inputs and recorded graphs: yes by
    default, except on a CPU serving quantized weights, whose fused decode step is one native
    call with nothing to record and measured faster on unpadded rows (README, "The default
    path"); --capture and --no-capture say it outright."""
    if args.capture:
        return True
    return not (args.no_capture or (quantized and not on_cuda))


def resolve_weights(args) -> tuple[str | None, str]:
    """(weights, activations) for EngineConfig. By default the fastest path `make lmeval` holds
    correct: on a CPU, a model that comes as a GGUF (fetched by name, the default one included,
    or --gguf FILE) is served from the file's own blocks with int8 activations (config.py's
    DEFAULT_QUANT_ACTIVATIONS); a model directory, a GPU, bfloat16 and tensor parallelism keep the
    dtype's unquantized weights."""
    import os

    from nanoserve.config import DEFAULT_QUANT_ACTIVATIONS
    from nanoserve.fetch import DEFAULT_NAME, NAMED, is_gguf_path

    weights = args.weights
    if weights == "auto":
        has_gguf = (
            args.gguf is not None or args.model in (None, DEFAULT_NAME, *NAMED) or is_gguf_path(args.model)
        )
        cpu = not device_of(args).startswith("cuda")
        single = os.environ.get("WORLD_SIZE", "1") == "1"
        weights = "gguf" if has_gguf and cpu and single and args.dtype == "float32" else None
    elif weights == "dtype":
        weights = None
    activations = args.quant_activations
    if activations == "auto":
        activations = DEFAULT_QUANT_ACTIVATIONS if weights else "fp32"
    return weights, activations


def load(args):
    """An `Engine` over the model the options name (one sequence at a time is all a terminal needs,
    but the same engine serves a batch: see `nanoserve.engine`)."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import build_engine

    device_of(args)
    config = EngineConfig(
        model=args.model,
        dtype=DTYPES[args.dtype],
        device=args.device,
        max_batch=1,
        max_model_len=args.max_model_len,
        fit_context=True,  # without --max-model-len: what the KV pool holds, if shorter
        keep_freed_memory=True,  # malloc.py: a prefill step's pages not faulted in again
        threads=args.threads,
        join_timeout=args.join_timeout,
        **weights_options(args),
    )
    if run_as_worker(config):
        return None
    try:
        return build_engine(config)
    except ValueError as e:
        raise NanoserveError(str(e)) from None


def run_as_worker(config) -> bool:
    """Under torchrun, a rank other than 0 follows rank 0's steps instead of running the command
    (tp.py); True once it has. Rank 0 (or a single process) runs the command."""
    from nanoserve.tp import launched, run_worker

    where = launched()
    if where is None or where[0] == 0:
        return False
    try:
        run_worker(config)
    except ValueError as e:
        raise NanoserveError(str(e)) from None
    return True


def stream(engine, prompt_ids, params, out=sys.stdout) -> str:
    """Run one request on the engine, writing its text as it comes; return the whole text."""
    import time

    try:
        rid = engine.add_request(prompt_ids, params)
    except ValueError as e:
        raise NanoserveError(str(e)) from None
    text, n, first, reason = "", 0, None, None
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id != rid:
                continue
            n += len(o.new_token_ids)
            first = first if first is not None else time.perf_counter() - t0
            out.write(o.text_delta)
            out.flush()
            text += o.text_delta
            reason = o.finish_reason or reason
    total = time.perf_counter() - t0
    out.write("\n")
    rate = (n - 1) / (total - first) if n > 1 and total > first else 0.0
    print(
        f"[{len(prompt_ids)} prompt tokens, {n} generated, first token {first or 0:.2f} s, "
        f"decode {rate:.1f} tok/s, finish: {reason}]",
        file=sys.stderr,
    )
    return text


def cmd_generate(args) -> None:
    params = sampling_params(args)
    engine = load(args)
    if engine is None:  # a tensor-parallel worker: its part is done
        return
    tokenizer = engine.tokenizer
    if not args.raw and not tokenizer.template_source:
        print(
            "nanoserve: this model has no chat template (a base model); the prompt goes as written",
            file=sys.stderr,
        )
        args.raw = True
    if args.raw:
        ids = tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        ids = tokenizer.encode_chat(messages)
    stream(engine, ids, params)


def cmd_chat(args) -> None:
    params = sampling_params(args)
    engine = load(args)
    if engine is None:
        return
    tokenizer = engine.tokenizer
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    print("nanoserve chat: type a message; /reset starts over, /exit (or Ctrl-D) leaves.", file=sys.stderr)
    while True:
        if interactive:
            print("you> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        line = line.rstrip("\n")
        if line.strip() == "/reset":
            history = []
            print("(history cleared)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = tokenizer.encode_chat(system + history)
            print("bot> ", end="", flush=True, file=sys.stderr)
            answer = stream(engine, ids, params)
        except NanoserveError as e:
            history.pop()
            print(f"nanoserve: error: {e}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": answer})


def http_options(args) -> dict:
    """create_app's CORS and access-log options from the serve flags, checked before anything is
    loaded: a malformed list, an origin a browser would never send, or a CORS detail without
    --allowed-origins is a one-line mistake now rather than a server that silently ignores it."""
    from nanoserve.http_extras import cors_options, parse_list

    origins = parse_list(args.allowed_origins, "--allowed-origins")
    methods = parse_list(args.allowed_methods, "--allowed-methods")
    headers = parse_list(args.allowed_headers, "--allowed-headers")
    skip = parse_list(args.disable_access_log_for_endpoints, "--disable-access-log-for-endpoints") or []
    if origins is None:
        for flag, given in [
            ("--allowed-methods", methods),
            ("--allowed-headers", headers),
            ("--allow-credentials", args.allow_credentials or None),
        ]:
            if given is not None:
                raise ValueError(f"{flag} applies to the origins of --allowed-origins; give those too")
    else:
        cors_options(origins, methods, headers, args.allow_credentials)
    for path in skip:
        if not path.startswith("/"):
            raise ValueError(f"--disable-access-log-for-endpoints takes paths such as /health, got {path!r}")
    return dict(
        allowed_origins=origins,
        allowed_methods=methods,
        allowed_headers=headers,
        allow_credentials=args.allow_credentials,
        access_log=not args.no_access_log,
        access_log_skip=tuple(skip),
    )


def cmd_serve(args) -> None:
    import os

    from nanoserve.config import EngineConfig
    from nanoserve.pool import parse_bytes
    from nanoserve.serve import serve

    on_cuda = device_of(args).startswith("cuda")
    if not 0 < args.port < 65536:
        raise NanoserveError(f"--port must be between 1 and 65535, got {args.port}")
    if not args.drain_timeout >= 0:
        raise NanoserveError(f"--drain-timeout must be 0 or more seconds, got {args.drain_timeout}")
    if args.capture and args.no_capture:
        raise NanoserveError("--capture and --no-capture ask for opposite things; give one")
    try:
        http = http_options(args)
        max_body = parse_bytes(args.max_body_bytes)
        if max_body < 1:
            raise ValueError(f"--max-body-bytes must be at least 1 byte, got {args.max_body_bytes}")
        if args.max_score_entries is not None and args.max_score_entries < 1:
            raise ValueError(f"--max-score-entries must be at least 1, got {args.max_score_entries}")
        weights = weights_options(args)
        capture = decode_capture(args, weights["weights"] is not None, on_cuda)
        config = EngineConfig(
            model=args.model,
            dtype=DTYPES[args.dtype],
            device=args.device,
            max_batch=args.max_batch,
            max_model_len=args.max_model_len,
            fit_context=True,  # without --max-model-len: what the KV pool holds, if shorter
            keep_freed_memory=True,  # malloc.py: a prefill step's pages not faulted in again
            block_size=args.block_size,
            kv_budget=parse_bytes(args.kv_budget) if args.kv_budget else None,
            threads=args.threads,
            join_timeout=args.join_timeout,
            bucket_decode=capture,
            persist_inputs=capture,
            capture_decode=capture,
            warm=not args.no_warm,
            graph_budget=parse_bytes(args.graph_budget),
            watermark=args.watermark,
            schedule=args.schedule,
            scheduling_policy=args.scheduling_policy,
            attention=args.attention,
            linear=args.linear,
            **weights,
            max_num_batched_tokens=args.max_num_batched_tokens,
            warm_max_rows=args.warm_max_rows,
            warm_max_width=args.warm_max_width
            if args.warm_max_width is not None
            else (None if on_cuda else 256),
        ).validate()
        if run_as_worker(config):  # the server runs on rank 0 only
            return
        serve(
            config,
            host=args.host,
            port=args.port,
            api_key=args.api_key or os.environ.get("NANOSERVE_API_KEY") or None,
            max_waiting=args.max_waiting,
            max_body_bytes=max_body,
            **({"max_score_entries": args.max_score_entries} if args.max_score_entries else {}),
            served_model_names=args.served_model_name,
            drain_timeout=args.drain_timeout,
            log_level=args.log_level,
            app_options=http,
        )
    except ValueError as e:
        raise NanoserveError(str(e)) from None


def cmd_fetch_model(args) -> None:
    from nanoserve.fetch import DEFAULT_NAME, fetch_named_model
    from nanoserve.weights import fetch_default_model

    say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    if args.name == DEFAULT_NAME:
        path = fetch_default_model(args.home, progress=say)
    else:
        path = fetch_named_model(args.name, args.home, progress=say)
    print(path)


def cmd_import_gguf(args) -> None:
    from nanoserve.weights import import_gguf

    out = args.out or args.path.with_suffix("")
    print(import_gguf(args.path, out))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from nanoserve.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    commands = {
        "fetch-model": cmd_fetch_model,
        "import-gguf": cmd_import_gguf,
        "generate": cmd_generate,
        "chat": cmd_chat,
        "serve": cmd_serve,
    }
    try:
        commands[args.command](args)
    except NanoserveError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
