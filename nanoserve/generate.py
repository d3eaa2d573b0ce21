"""One sequence, start to finish, on a contiguous cache (days 8-11): the plain eager path.

`Generation` runs prefill over the prompt, then one decode step per token, and yields text as
it becomes final: sampling (`sampling.py`), the incremental detokenizer (`tokenizer.py`) and
stop strings (`stopping.py`) are applied in that order. It is what `nanoserve generate` and
`nanoserve chat` ran before the batched engine, and it stays as the reference every faster path
is compared with: the same prompt and params give the same tokens.

`greedy_tokens` is the bare loop (no text), for tests and benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from nanoserve.contiguous import ContiguousKVCache
from nanoserve.errors import NanoserveError
from nanoserve.model import Llama
from nanoserve.sampling import SamplingParams, sample
from nanoserve.stopping import StopStrings


def check_prompt_fits(n_prompt: int, max_model_len: int) -> None:
    if n_prompt == 0:
        raise NanoserveError("the prompt is empty; give at least one token of text")
    if n_prompt >= max_model_len:
        raise NanoserveError(
            f"the prompt is {n_prompt} tokens, which leaves no room in the context of {max_model_len} "
            "tokens; shorten the prompt"
        )


def decode_loop(
    model: Llama, prompt_ids: list[int], params: SamplingParams, eos_ids=frozenset(), max_model_len=None
) -> Iterator[int]:
    """Yield sampled token ids until max_tokens, an end-of-sequence token or the context's end."""
    max_model_len = max_model_len or model.cfg.max_position_embeddings
    check_prompt_fits(len(prompt_ids), max_model_len)
    budget = min(params.max_tokens, max_model_len - len(prompt_ids))
    device = model.device
    cache = ContiguousKVCache(model.cfg, len(prompt_ids) + budget, dtype=model.dtype, device=device)
    gen = params.make_generator()
    ids = torch.tensor(prompt_ids, device=device)
    positions = torch.arange(len(prompt_ids), device=device)
    last = torch.tensor([len(prompt_ids) - 1], device=device)
    for _ in range(budget):
        cache.begin(positions)
        logits = model(ids, positions, cache, logits_at=last)  # (1, V)
        token = int(sample(logits, [params], [gen])[0])
        yield token
        if token in eos_ids and not params.ignore_eos:
            return
        ids = torch.tensor([token], device=device)
        positions = torch.tensor([cache.length], device=device)
        last = torch.zeros(1, dtype=torch.long, device=device)


def greedy_tokens(model: Llama, prompt_ids: list[int], n: int, eos_ids=frozenset()) -> list[int]:
    return list(decode_loop(model, prompt_ids, SamplingParams(max_tokens=n), eos_ids))


class Generation:
    """Iterate for text deltas; afterwards `token_ids`, `finish_reason` and timings are set."""

    def __init__(self, model, tokenizer, prompt_ids: list[int], params: SamplingParams, max_model_len=None):
        self.model, self.tokenizer, self.params = model, tokenizer, params.validate()
        self.prompt_ids = list(prompt_ids)
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        check_prompt_fits(len(self.prompt_ids), self.max_model_len)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.first_token_s = self.total_s = 0.0

    def __iter__(self) -> Iterator[str]:
        detok = self.tokenizer.detokenizer()
        stops = StopStrings(self.params.stop)
        eos = self.tokenizer.eos_ids
        t0 = time.perf_counter()
        for token in decode_loop(self.model, self.prompt_ids, self.params, eos, self.max_model_len):
            if not self.token_ids:
                self.first_token_s = time.perf_counter() - t0
            self.token_ids.append(token)
            if token in eos and not self.params.ignore_eos:
                self.finish_reason = "stop"
                break
            piece, stopped = stops.feed(detok.add(token))
            if piece:
                self.text += piece
                yield piece
            if stopped:
                self.finish_reason = "stop"
                break
        if self.finish_reason is None:
            self.finish_reason = "length"
        if not stops.stopped:  # held text is ordinary text after all
            tail, _ = stops.feed(detok.flush())
            tail += stops.flush()
            if tail:
                self.text += tail
                yield tail
        self.total_s = time.perf_counter() - t0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the first: the decode rate."""
        n = len(self.token_ids) - 1
        dt = self.total_s - self.first_token_s
        return n / dt if n > 0 and dt > 0 else 0.0
