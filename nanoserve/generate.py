"""One sequence, start to finish, on a contiguous cache (days 8-11): the plain eager path.

`decode_loop` runs prefill over the prompt, then one decode step per token, sampling each
(`sampling.py`), until `max_tokens`, an end-of-sequence token or the end of the context. It is
the reference every faster path is compared with (the batched engine, and later the bucketed
and captured decodes): the same prompt and params must give the same tokens.
`greedy_tokens` is the same loop at temperature 0, for tests and benchmarks.

Text (the incremental detokenizer, stop strings) is the engine's business (`engine.py`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nanoserve.contiguous import ContiguousKVCache
from nanoserve.errors import NanoserveError
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams, sample


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
