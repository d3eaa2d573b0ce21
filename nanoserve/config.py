"""`EngineConfig`: every knob of an engine in one place (day 34, grown since).

Configuration flows from here through `build_engine`; no module reads globals or the
environment for its settings.
"""

from __future__ import annotations

from dataclasses import dataclass

# the orders requests can be served in (vLLM's --scheduling-policy; Scheduler.ORDERS, the CLI's
# choices): "fcfs" as they arrive, "priority" by each request's `priority`, then arrival
SCHEDULING_POLICIES = ("fcfs", "priority")

# What `nanoserve serve`/`chat`/`generate` give quantized weights when --quant-activations is not
# given (cli.resolve_weights): int8, since `make lmeval` scores the default model served so
# within the standard errors of its fp32 conversion's (evals/check.py, README "The default path").
DEFAULT_QUANT_ACTIVATIONS = "int8"


@dataclass
class EngineConfig:
    model: str | None = None  # HF Llama-family directory; None: the default model (fetched once)
    dtype: str = "float32"  # float32 | bfloat16
    device: str | None = None  # None: cuda when available, else cpu
    max_batch: int = 32  # rows: sequences running at once
    max_model_len: int | None = None  # None: the model's own context length
    # with max_model_len None, a KV pool shorter than the model's context shortens the context to
    # what the pool holds (the CLI's choice, said in the paths line) instead of refusing to start
    # (the engine's own rule since day 16)
    fit_context: bool = False
    block_size: int = 16  # tokens per KV block
    kv_budget: int | None = None  # bytes for the KV pool; None: pool.py's default for the device
    max_num_batched_tokens: int = 512  # tokens one prefill step may carry (longer prompts are chunked)
    enable_prefix_caching: bool = True
    # a model with sliding-window layers (Gemma 3): give those layers blocks of their own, freed
    # once out of every window a row can still read (blocks.WindowBlocks), so a long context
    # costs them no more than their window; False: every layer holds every position
    window_blocks: bool = True
    # "budget": decode rows and prompt chunks share one token budget a step (vLLM's default);
    # "prefill-first": a step is all prefill or all decode, prompts first (the earlier policy);
    # "static": a new batch only when the last has finished, nobody joins (the first policy)
    schedule: str = "budget"
    # the order requests are served in (vLLM's --scheduling-policy): "fcfs" as they arrive;
    # "priority" by each request's `priority` (lower first), then arrival (scheduler.py)
    scheduling_policy: str = "fcfs"
    # how decode rows read the KV pools: "native" (the C++ kernel, in place), "gather" (a padded
    # copy per row and SDPA, days 18-24), "auto" (native on a CPU where it builds)
    attention: str = "auto"
    # how the linears read their weights on CPU: "packed" (reordered once for oneDNN's GEMM at
    # load, model.pack_linears), "plain" (torch's matmul on the weights as loaded, days 3-12),
    # "auto" (packed where oneDNN can pack this dtype on this CPU, else plain)
    linear: str = "auto"
    # what the block matrices hold (phase 6): None, the dtype's own (float32/bfloat16 weights);
    # "q4_1" or "q8_0", blocks of 32 as a GGUF holds them (quant.py), activations stay fp32. For
    # the default model they are read from its GGUF as they lie; `gguf` names another file to
    # read them from; otherwise the directory's fp32 weights are quantized at load.
    weights: str | None = None
    gguf: str | None = None
    # a jinja file to render chat messages with instead of the directory's own template (a base
    # model has none, and chat requests are refused without one)
    chat_template: str | None = None
    # a quantized linear's activations: "fp32" (the products see exactly the dequantized weights:
    # the default model's greedy tokens equal its fp32 conversion's), or "int8" per block of 32,
    # llama.cpp's arithmetic (its tokens, not the fp32 model's: they part at the first token of a
    # plain question to SmolLM2)
    quant_activations: str = "fp32"
    # a decode step as "fused" (one native call: csrc/quant.cpp) or "ops" (the model's torch ops);
    # "auto": fused for quantized weights where the native kernels build, ops otherwise
    decode_step: str = "auto"
    # admission keeps a block free for each running sequence's next token plus this share of the
    # pool (scheduler.py); None admits into the last free blocks (the earlier policy). 5%, not
    # vLLM's 1%: 1% of a CPU pool of ~100 blocks rounds to nothing (bench admission measures it)
    watermark: float | None = 0.05
    threads: int | None = None  # CPU threads for torch; None: leave torch's default
    # on a CPU, glibc keeps the memory a step frees for the next step instead of handing it back
    # and faulting it in again (malloc.py; a process-wide setting, like threads): the CLI's choice
    keep_freed_memory: bool = False
    # decode at fixed addresses (days 51-53): pad each decode batch to a (rows, width) bucket,
    # addressed through the slot table; with persist_inputs, through buffers written in place
    bucket_decode: bool = False
    persist_inputs: bool = False
    capture_decode: bool = False  # record one decode graph per (rows, width) shape, replay it after
    width_multiple: int = 32
    # day 56: with capture_decode, build_engine records the warm list before anything is served;
    # the list is every (rows, width) bucket trimmed to rows <= warm_max_rows (default max_batch)
    # and width <= the smallest of max_model_len, warm_max_width and the free memory's width ceiling
    warm: bool = True
    # bytes recorded decode graphs may hold when shapes are recorded lazily (no warm list); past
    # it a new shape runs eagerly. After a warm list nothing more is recorded (runner.py).
    graph_budget: int = 512 * 2**20
    warm_max_rows: int | None = None
    warm_max_width: int | None = None
    # tensor parallelism (tp.py, under torchrun): seconds every rank has to join the group
    join_timeout: float = 60.0
    # speculative decoding (speculative.py): "ngram" proposes up to num_speculative_tokens tokens
    # a decoding row by finding the context's last n-gram (prompt_lookup_max down to
    # prompt_lookup_min tokens) earlier in its prompt and output; one forward verifies them all.
    # None: one token a row a step, as before. (vLLM's names for the lookup's bounds.)
    speculative: str | None = None
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def validate(self) -> EngineConfig:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        for name in ("max_batch", "block_size", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.persist_inputs and not self.bucket_decode:
            raise ValueError("persist_inputs needs bucket_decode: persistent buffers hold a bucketed batch")
        if self.capture_decode and not self.persist_inputs:
            raise ValueError(
                "capture_decode needs persist_inputs: a graph reads its inputs at fixed addresses"
            )
        if self.attention not in ("auto", "native", "gather"):
            raise ValueError(f"attention must be auto, native or gather, got {self.attention!r}")
        if self.linear not in ("auto", "packed", "plain"):
            raise ValueError(f"linear must be auto, packed or plain, got {self.linear!r}")
        if self.weights not in (None, "q4_1", "q8_0", "gguf"):
            raise ValueError(
                f"weights must be q4_1, q8_0 or gguf (or unset: the dtype's), got {self.weights!r}"
            )
        if self.weights and self.dtype != "float32":
            raise ValueError(
                f"quantized weights compute in float32; --weights {self.weights} with dtype {self.dtype} "
                "is not a combination nanoserve runs"
            )
        if self.gguf and not self.weights:
            raise ValueError(
                "a gguf file is read for quantized weights; give weights q4_1, q8_0 or gguf with it"
            )
        if self.quant_activations not in ("int8", "fp32"):
            raise ValueError(f"quant_activations must be int8 or fp32, got {self.quant_activations!r}")
        if self.decode_step not in ("auto", "fused", "ops"):
            raise ValueError(f"decode_step must be auto, fused or ops, got {self.decode_step!r}")
        if self.schedule not in ("budget", "prefill-first", "static"):
            raise ValueError(f"schedule must be budget, prefill-first or static, got {self.schedule!r}")
        if self.watermark is not None and not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.width_multiple < 1:
            raise ValueError(f"width_multiple must be at least 1, got {self.width_multiple}")
        if self.graph_budget < 0:
            raise ValueError(f"graph_budget must be at least 0 bytes, got {self.graph_budget}")
        for name in ("warm_max_rows", "warm_max_width"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.join_timeout > 0:
            raise ValueError(f"join_timeout must be more than 0 seconds, got {self.join_timeout}")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative is ngram (or unset: off), got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"the n-gram lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        return self
