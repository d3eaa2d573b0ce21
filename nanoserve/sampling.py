"""Choosing the next token (day 9): `SamplingParams` and a batched sampler.

`SamplingParams` is what a request asks for; `validate` turns a bad value into a sentence.
`sample` picks one token per row of a (B, vocab) logits batch, each row under its own params:

    temperature < 1e-5 -> greedy (argmax); top_k, top_p and the seed are irrelevant
    temperature t      -> logits / t, then top-k, then top-p (nucleus), then one draw

The batch is filtered in one pass (`filter_batch`: one top-k at the largest k, one sort for
the rows with a top-p) and each sampled row then draws with its own generator; `filter_logits`
is the same filter for one row, the reference the batched one is tested against.

A temperature below `SAMPLING_EPS` is greedy rather than a division: logits / 1e-39 are inf,
their softmax NaN, and `multinomial` raises (before `sample_rows`, that one draw ended every
request of its step; vLLM draws the greedy line at the same 1e-5). `sample_rows` keeps one
row's failure to that row: a row whose logits are not finite, or whose draw raises, comes back
as a sentence instead of a token, and the other rows of the step keep theirs.

A request with a seed draws from its own `torch.Generator`, so its tokens do not depend on what
else shares the batch (or on the global RNG); a request without one draws from a generator
seeded from the OS once. Stop strings and the end-of-sequence rule are applied by whoever reads
the tokens (`stopping.py`); they only ride along in the params.

Scores (day 36): `logprobs` asks for each generated token's log-probability and the `logprobs`
most likely alternatives; `prompt_logprobs` the same for every prompt token after the first
(what evaluation harnesses score continuations with). Both are of the distribution the model
produced, `log_softmax` of the raw fp32 logits, before temperature, top-k and top-p (vLLM's
default, `raw_logprobs`): a score then means the same whatever sampling settings rode along,
and a greedy request and a sampled one score the same text alike. `logprobs_of` computes them,
one batched pass for all the rows that asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes without wrapping or raising
MAX_LOGPROBS = 20  # alternatives a position may ask for (OpenAI's chat limit; vLLM's default)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no scores; N: each new token's and the N most likely
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (all but the first)

    def validate(self) -> SamplingParams:
        """Raise ValueError with a sentence for the first out-of-range field; return self."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}")
        scoring_only = self.prompt_logprobs is not None and self.max_tokens == 0
        if not isinstance(self.max_tokens, int) or (self.max_tokens <= 0 and not scoring_only):
            raise ValueError(
                f"max_tokens must be a positive integer (0 only to score a prompt), got {self.max_tokens!r}"
            )
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("every stop string must be a non-empty string")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def make_generator(self, device="cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


@dataclass
class TokenLogprobs:
    """One position's scores: the token there, its log-probability, and the most likely tokens."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first

    def as_tuple(self):
        return self.token_id, self.logprob, self.top


def logprobs_of(logits: torch.Tensor, targets, num_top: list[int] | int) -> list[TokenLogprobs]:
    """Scores of `targets` (M token ids) under logits (M, V): log_softmax in fp32, the target's
    entry, and the top `num_top[i]` of row i (one topk for all rows, at the largest asked)."""
    if isinstance(num_top, int):
        num_top = [num_top] * logits.shape[0]
    if logits.shape[0] == 0:
        return []
    lp = logits.float().log_softmax(-1)
    target = torch.as_tensor(targets, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, target[:, None])[:, 0].tolist()
    k = max(num_top)
    if k:
        values, ids = lp.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    out = []
    for i, (t, c) in enumerate(zip(target.tolist(), chosen)):
        top = list(zip(ids[i][: num_top[i]], values[i][: num_top[i]])) if k else []
        out.append(TokenLogprobs(t, c, top))
    return out


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row's logits (V,) with everything outside the top-k and the top-p nucleus at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(logits, descending=True).values
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        # Every logit equal to the last one kept stays too: the order a sort gives equal logits
        # is arbitrary, and a cut between them would depend on it.
        kept = int(((probs.cumsum(-1) - probs) < top_p).sum())
        logits = logits.masked_fill(logits < sorted_logits[kept - 1], float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One token id per row of logits (B, V) -> (B,) int64 on logits' device. Raises on the
    first row that cannot be sampled; the engine uses `sample_rows`, which does not."""
    picked = sample_rows(logits, params, generators)
    for p in picked:
        if isinstance(p, str):
            raise ValueError(p)
    return torch.tensor(picked, dtype=torch.long, device=logits.device)


def filter_batch(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`filter_logits` for every row at once, each under its own top_k and top_p: one topk at
    the largest k asked, one sort for the rows with a top_p below 1. Row by row it keeps
    exactly what `filter_logits` keeps (tests/test_sampling.py holds it to that)."""
    rows, vocab = logits.shape
    k = torch.tensor([t if 0 < t < vocab else 0 for t in top_k], device=logits.device)
    if int(k.max()) > 0:
        values = torch.topk(logits, int(k.max()), dim=-1).values  # (R, kmax), largest first
        kth = values.gather(1, (k.clamp(min=1) - 1)[:, None])  # (R, 1) each row's k-th largest
        logits = logits.masked_fill((k > 0)[:, None] & (logits < kth), float("-inf"))
    nucleus = [i for i, p in enumerate(top_p) if p < 1.0]
    if nucleus:
        idx = torch.tensor(nucleus, device=logits.device)
        part = logits if len(nucleus) == rows else logits[idx]
        p = torch.tensor([top_p[i] for i in nucleus], dtype=logits.dtype, device=logits.device)
        floor = torch.full((rows, 1), float("-inf"), dtype=logits.dtype, device=logits.device)
        floor[idx] = nucleus_floor(part, p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


NUCLEUS_CANDIDATES = 1024


def nucleus_floor(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest logit inside its top-p nucleus, (R, 1): what `filter_logits` keeps
    is every logit at or above it (the same set, ties at the floor aside).

    Without sorting the vocabulary: the nucleus of a peaked distribution is a few tokens, so
    the largest NUCLEUS_CANDIDATES logits (one topk) and the row's logsumexp give the top
    probabilities in order; where their mass reaches top_p the boundary lies among them. Only
    a row whose first 1,024 tokens hold less than top_p (a flat distribution at a high
    temperature) is sorted whole. Over Gemma 3's 262,144 logits a row's sort took ~10 ms here,
    the topk ~1 ms."""
    rows, vocab = logits.shape
    c = min(NUCLEUS_CANDIDATES, vocab)
    values = logits.topk(c, dim=-1).values  # (R, c), largest first
    probs = (values - logits.logsumexp(-1, keepdim=True)).exp()
    cum = probs.cumsum(-1)
    # a token is dropped when the mass before it already reaches top_p; the first always stays
    kept = ((cum - probs) < top_p[:, None]).sum(-1, keepdim=True)  # (R, 1), >= 1
    floor = values.gather(1, kept - 1)
    short = (cum[:, -1] < top_p).nonzero().flatten() if c < vocab else None
    if short is not None and short.numel():  # nuclei past the candidates: those rows sorted whole
        ordered = logits[short].sort(dim=-1, descending=True).values
        probs = ordered.softmax(-1)
        n = ((probs.cumsum(-1) - probs) < top_p[short, None]).sum(-1, keepdim=True)
        floor[short] = ordered.gather(1, n - 1)
    return floor


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | str]:
    """One token id per row of logits (B, V), or for a row that cannot be sampled a sentence
    saying why. Greedy rows are one batched argmax. The sampled rows are filtered and turned
    into probabilities in one batched pass (`filter_batch`); then each draws from its own
    generator, so a seeded row's token does not depend on what shares its batch. Should the
    batched pass fail, every sampled row is tried alone, so the failure stays with its row."""
    finite = torch.isfinite(logits).all(-1).tolist()  # (B,): a NaN or inf row poisons only itself
    tokens: list[int | str] = logits.argmax(-1).tolist()  # right for every greedy row
    sampled = []
    for i, p in enumerate(params):
        if not finite[i]:
            tokens[i] = "the model produced non-finite logits for this request"
        elif not p.greedy:
            sampled.append(i)
    if not sampled:
        return tokens
    try:
        idx = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        rows = logits[idx].float() / temps[:, None]
        probs = filter_batch(rows, [params[i].top_k for i in sampled], [params[i].top_p for i in sampled])
        probs = probs.softmax(-1)
    except (RuntimeError, ValueError):
        probs = None
    for j, i in enumerate(sampled):
        p = params[i]
        try:
            if probs is None:
                row = filter_logits(logits[i].float() / p.temperature, p.top_k, p.top_p).softmax(-1)
            else:
                row = probs[j]
            tokens[i] = int(torch.multinomial(row, 1, generator=generators[i])[0])
        except (RuntimeError, ValueError) as e:
            tokens[i] = f"sampling failed for this request ({e})"
    return tokens
