"""Choosing the next token (day 9): `SamplingParams` and a batched sampler.

`SamplingParams` is what a request asks for; `validate` turns a bad value into a sentence
(an `InvalidParam`, a ValueError that also names the field, which the server answers as a 400
with that `param`). `sample` picks one token per row of a (B, vocab) logits batch, each row
under its own params:

    temperature < 1e-5 -> greedy (argmax); top_k, top_p, min_p and the seed are irrelevant
    temperature t      -> logits / t, then min-p, then top-k, then top-p (nucleus), then one draw

The batch is filtered in one pass (`filter_batch`: one softmax for the rows with a min_p, one
top-k at the largest k, one sort for the rows with a top-p) and each sampled row then draws
with its own generator; `filter_logits` is the same filter for one row, the reference the
batched one is tested against.

Before any of that, a row may have its logits adjusted (`adjust_logits`), in vLLM's order:
`logit_bias` added, the end tokens masked while `min_tokens` are not yet generated, then the
repetition, frequency and presence penalties. These change the greedy token too (greedy is the
argmax of the adjusted logits), which is why they come before the greedy/sampled split. They
need what the sequence has seen, so the engine hands the sampler each row's token ids (prompt
and output) but only in a step where some row asks for an adjustment: a step where none does
runs exactly the ops it ran before these options existed (days 48 and 61 count them).

    repetition_penalty r: a logit of a token in the prompt or the output so far is divided by r
                          when positive and multiplied by r otherwise (1 changes nothing)
    frequency_penalty f, presence_penalty p: over the output so far only (not the prompt),
                          logit -= f * count + p * (count > 0)
    min_p m:              after temperature, a token whose probability is below m times the
                          row's largest is dropped (vLLM v1's place: before top-k and top-p)

A temperature below `SAMPLING_EPS` is greedy rather than a division: logits / 1e-39 are inf,
their softmax NaN, and `multinomial` raises (before `sample_rows`, that one draw ended every
request of its step; vLLM draws the greedy line at the same 1e-5). `sample_rows` keeps one
row's failure to that row: a row whose logits are not finite, whose adjustment or draw raises,
or whose every token is masked comes back as a sentence instead of a token, and the other rows
of the step keep theirs.

A request with a seed draws from its own `torch.Generator`, so its tokens do not depend on what
else shares the batch (or on the global RNG); a request without one draws from a generator
seeded from the OS once. Stop strings, `stop_token_ids`, `include_stop_str_in_output` and the
end-of-sequence rule are applied by whoever reads the tokens (`stopping.py`, the engine); the
sampler only masks the end tokens while `min_tokens` holds them off.

Scores (day 36): `logprobs` asks for each generated token's log-probability and the `logprobs`
most likely alternatives; `prompt_logprobs` the same for every prompt token after the first
(what evaluation harnesses score continuations with). Both are of the distribution the model
produced, `log_softmax` of the raw fp32 logits, before logit_bias, the penalties, temperature,
min-p, top-k and top-p (vLLM's default, `raw_logprobs`): a score then means the same whatever
sampling settings rode along, and a greedy request and a sampled one score the same text alike.
So a penalty changes which token is picked, never the score reported for it. `logprobs_of`
computes them, one batched pass for all the rows that asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # grammar.py imports this module
    from nanoserve.grammar import Guided

SAMPLING_EPS = 1e-5  # temperatures below this are greedy
SEED_RANGE = (0, 2**64 - 1)  # what torch.Generator.manual_seed takes without wrapping or raising
MAX_LOGPROBS = 20  # alternatives a position may ask for (OpenAI's chat limit; vLLM's default)
PENALTY_LIMIT = 2  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's and vLLM's)
LOGIT_BIAS_LIMIT = 100  # a logit_bias value lies in [-100, 100] (OpenAI's)


class InvalidParam(ValueError):
    """A sampling parameter out of range: the sentence, and in `param` the field it names (the
    server's 400 tells the client which field to change)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_token_id(value, vocab: int | None) -> bool:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return False
    return vocab is None or value < vocab


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
    presence_penalty: float = 0.0  # over the output so far: logit -= p if the token occurred
    frequency_penalty: float = 0.0  # over the output so far: logit -= f * occurrences
    repetition_penalty: float = 1.0  # over prompt and output: a seen token's logit / r (x r if <= 0)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely (after temperature)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the sequence, as the end token does
    min_tokens: int = 0  # end tokens masked, stop strings ignored, until this many are generated
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) is kept
    # not sampling, but the request's: its place under priority scheduling (lower runs first;
    # vLLM's `priority`). Carried here so it travels with the rest of the request to the engine.
    priority: int = 0
    guided: Guided | None = None  # structured output: a grammar the tokens must follow (grammar.py)

    def validate(self, vocab: int | None = None) -> SamplingParams:
        """Raise InvalidParam (a ValueError) with a sentence for the first out-of-range field;
        return self. With `vocab`, the token ids logit_bias and stop_token_ids name must lie
        below it (an id past the logits would fail the step's indexing, not just this row)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise InvalidParam(name, f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}")
        scoring_only = self.prompt_logprobs is not None and self.max_tokens == 0
        if not isinstance(self.max_tokens, int) or (self.max_tokens <= 0 and not scoring_only):
            raise InvalidParam(
                "max_tokens",
                f"max_tokens must be a positive integer (0 only to score a prompt), got {self.max_tokens!r}",
            )
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise InvalidParam("temperature", f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParam("top_k", f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParam("stop", "every stop string must be a non-empty string")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise InvalidParam("seed", f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        self._validate_adjustments(vocab)
        if self.guided is not None and not (
            isinstance(getattr(self.guided, "kind", None), str) and hasattr(self.guided, "grammar")
        ):
            raise InvalidParam("guided", f"guided must be a grammar.Guided or None, got {self.guided!r}")
        return self

    def _validate_adjustments(self, vocab: int | None) -> None:
        """The penalties, min_p, logit_bias, stop_token_ids, min_tokens and
        include_stop_str_in_output, each in vLLM's range (logit_bias in OpenAI's)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise InvalidParam(
                    name, f"{name} must be a number from -{PENALTY_LIMIT} to {PENALTY_LIMIT}, got {value!r}"
                )
        r = self.repetition_penalty
        if not _is_number(r) or not 0 < r < math.inf:
            raise InvalidParam(
                "repetition_penalty",
                f"repetition_penalty must be a finite number > 0 (1 changes nothing), got {r!r}",
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"min_p must be a number from 0 to 1, got {self.min_p!r}")
        m = self.min_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise InvalidParam("min_tokens", f"min_tokens must be an integer >= 0, got {m!r}")
        if m > self.max_tokens:
            raise InvalidParam(
                "min_tokens", f"min_tokens ({m}) must not be more than max_tokens ({self.max_tokens})"
            )
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidParam(
                "include_stop_str_in_output",
                f"include_stop_str_in_output must be true or false, got {self.include_stop_str_in_output!r}",
            )
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_token_id(t, vocab) for t in ids):
            where = "" if vocab is None else f" below the vocabulary size {vocab}"
            raise InvalidParam(
                "stop_token_ids", f"stop_token_ids must be a list of token ids (integers >= 0{where})"
            )
        self.stop_token_ids = tuple(dict.fromkeys(ids))  # in order, each once
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise InvalidParam("logit_bias", "logit_bias must map token ids to numbers")
        for token, value in bias.items():
            if not _is_token_id(token, vocab):
                where = "" if vocab is None else f" in this model's vocabulary of {vocab} tokens"
                raise InvalidParam(
                    "logit_bias", f"logit_bias names {token!r}, which is not a token id{where}"
                )
            if not _is_number(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise InvalidParam(
                    "logit_bias",
                    f"logit_bias values must be numbers from -{LOGIT_BIAS_LIMIT} to {LOGIT_BIAS_LIMIT}, "
                    f"got {value!r} for token {token}",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalizes(self) -> bool:
        """A repetition, frequency or presence penalty is set (each needs the tokens seen)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """Some option changes the logits before the greedy/sampled split: a penalty,
        logit_bias, or min_tokens (which masks the end tokens). False at every default: a step
        whose rows all answer False runs no op for these options (the module doc)."""
        return self.penalizes or bool(self.logit_bias) or self.min_tokens > 0

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


# --- adjusting the logits: logit_bias, min_tokens, penalties ----------------------------------------


def token_counts(rows: list[list[int]], vocab: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """(R, vocab): how often each token id occurs in each row's list. The lists are padded with
    `vocab` to one width and counted by one scatter_add into vocab + 1 columns, whose last (the
    padding's) is dropped: no loop over the vocabulary, one over the rows to build the lists."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab + 1, dtype=dtype, device=device)
    if width:
        padded = [list(r) + [vocab] * (width - len(r)) for r in rows]
        ids = torch.tensor(padded, dtype=torch.long, device=device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=dtype, device=device))
    return counts[:, :vocab]


def adjust_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    rows: list[int],
    history: list[tuple[list[int], int]] | None = None,
    eos_ids=(),
) -> torch.Tensor:
    """Rows `rows` of logits (B, V) with logit_bias, the min_tokens mask and the penalties
    applied, in vLLM's order, as a new fp32 (B, V) tensor: the other rows are copied as they
    are, and `logits` is not touched (the engine scores tokens under the raw logits).

    history[i] is row i's token ids, prompt first, and how many of them are the prompt; it is
    needed for min_tokens and the penalties (a ValueError without it). The end tokens
    min_tokens masks are `eos_ids` (whether or not the row ignores EOS, as vLLM) and the row's
    stop_token_ids."""
    out = logits.to(torch.float32, copy=True)
    vocab, device = out.shape[-1], out.device
    if history is None and any(params[i].penalizes or params[i].min_tokens for i in rows):
        raise ValueError("the penalties and min_tokens need each row's token ids (history)")
    # logit_bias: one index_put for every (row, token, bias) asked
    asked = [(i, token, float(bias)) for i in rows for token, bias in (params[i].logit_bias or {}).items()]
    if asked:
        r, t, v = zip(*asked)
        at = (torch.tensor(r, device=device), torch.tensor(t, device=device))
        out.index_put_(at, torch.tensor(v, dtype=out.dtype, device=device), accumulate=True)
    # min_tokens: the end tokens at -inf while fewer than min_tokens are generated
    r, t = [], []
    for i in rows:
        p = params[i]
        if p.min_tokens and len(history[i][0]) - history[i][1] < p.min_tokens:
            held = sorted({e for e in eos_ids if e < vocab} | set(p.stop_token_ids))
            r += [i] * len(held)
            t += held
    if r:
        out[torch.tensor(r, device=device), torch.tensor(t, device=device)] = float("-inf")
    # penalties, on the rows that have one
    pen = [i for i in rows if params[i].penalizes]
    if not pen:
        return out
    idx = torch.tensor(pen, device=device)
    part = out[idx]
    generated = token_counts([history[i][0][history[i][1] :] for i in pen], vocab, out.dtype, device)
    if any(params[i].repetition_penalty != 1 for i in pen):
        # over prompt and output alike: count every token id the row holds (none for a row
        # whose repetition penalty is 1, whose factor is 1 anyway)
        held = [history[i][0] if params[i].repetition_penalty != 1 else [] for i in pen]
        seen = token_counts(held, vocab, out.dtype, device) > 0
        rep = torch.tensor([params[i].repetition_penalty for i in pen], dtype=out.dtype, device=device)
        factor = torch.where(seen, rep[:, None], 1.0)
        part = torch.where(part > 0, part / factor, part * factor)
    freq = torch.tensor([params[i].frequency_penalty for i in pen], dtype=out.dtype, device=device)
    pres = torch.tensor([params[i].presence_penalty for i in pen], dtype=out.dtype, device=device)
    part = part - freq[:, None] * generated - pres[:, None] * (generated > 0).to(out.dtype)
    out[idx] = part
    return out


def _adjust_rows(logits, params, rows, history, eos_ids) -> tuple[torch.Tensor, dict[int, str]]:
    """`adjust_logits` over `rows`, and the rows that failed with why. Should the batched pass
    raise, each row is adjusted alone, so a failure stays with its row; a row left with no
    finite logit (every token masked) fails too, rather than have argmax pick a masked one."""
    failed: dict[int, str] = {}
    try:
        out = adjust_logits(logits, params, rows, history, eos_ids)
    except (RuntimeError, ValueError, IndexError):
        out = logits.to(torch.float32, copy=True)
        for i in rows:
            try:
                one = None if history is None else [history[i]]
                out[i] = adjust_logits(logits[i : i + 1], [params[i]], [0], one, eos_ids)[0]
            except (RuntimeError, ValueError, IndexError) as e:
                failed[i] = f"adjusting this request's logits failed ({e})"
    masked = (out[torch.tensor(rows, device=out.device)].amax(-1) == float("-inf")).tolist()
    for i, empty in zip(rows, masked):
        if empty and i not in failed:
            failed[i] = "every token is masked for this request (min_tokens holds off all of them)"
    return out, failed


# --- filtering and drawing ----------------------------------------------------------------------


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """One row's logits (V,) with everything outside min-p, the top-k and the top-p nucleus at -inf."""
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
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
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: list[tuple[list[int], int]] | None = None,
    eos_ids=(),
) -> torch.Tensor:
    """One token id per row of logits (B, V) -> (B,) int64 on logits' device. Raises on the
    first row that cannot be sampled; the engine uses `sample_rows`, which does not."""
    picked = sample_rows(logits, params, generators, history, eos_ids)
    for p in picked:
        if isinstance(p, str):
            raise ValueError(p)
    return torch.tensor(picked, dtype=torch.long, device=logits.device)


def filter_batch(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float] | None = None
) -> torch.Tensor:
    """`filter_logits` for every row at once, each under its own min_p, top_k and top_p: one
    softmax for min-p (only when a row asks), one topk at the largest k asked, one sort for the
    rows with a top_p below 1. Row by row it keeps exactly what `filter_logits` keeps
    (tests/test_sampling.py and tests/test_penalties.py hold it to that)."""
    rows, vocab = logits.shape
    if min_p is not None and any(m > 0 for m in min_p):
        # a row's floor is min_p x its largest probability; a row with min_p 0 keeps everything
        m = torch.tensor(min_p, dtype=logits.dtype, device=logits.device)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < probs.amax(-1, keepdim=True) * m[:, None], float("-inf"))
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
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: list[tuple[list[int], int]] | None = None,
    eos_ids=(),
    masks: tuple[list[int], torch.Tensor] | None = None,
) -> list[int | str]:
    """One token id per row of logits (B, V), or for a row that cannot be sampled a sentence
    saying why. The rows whose params adjust their logits (`adjusts_logits`: logit_bias,
    min_tokens, a penalty) are adjusted first (`adjust_logits`; `history` and `eos_ids` as
    there), on a copy; a step with no such row skips that without a single op. Greedy rows are
    then one batched argmax. The sampled rows are filtered and turned into probabilities in one
    batched pass (`filter_batch`); then each draws from its own generator, so a seeded row's
    token does not depend on what shares its batch. Should the batched pass fail, every sampled
    row is tried alone, so the failure stays with its row.

    `masks`, (rows, bitmask): the grammar rows of structured output (grammar.py) and their
    token masks, one int32 row of bits each; a refused token's logit is -inf before anything
    else, on a copy. Where the grammar allows only tokens that min_tokens holds off (its end),
    the grammar wins: the row is sampled under its mask alone."""
    finite = torch.isfinite(logits).all(-1).tolist()  # (B,): a NaN or inf row poisons only itself
    failed: dict[int, str] = {}
    grammar_rows = masks[0] if masks is not None else []
    if grammar_rows:
        from nanoserve.grammar import apply_mask

        logits = logits.to(torch.float32, copy=True)
        apply_mask(logits, grammar_rows, masks[1])
    constrained = logits  # the grammars' masks only
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits and finite[i]]
    if adjusted:
        logits, failed = _adjust_rows(logits, params, adjusted, history, eos_ids)
    for i in grammar_rows:
        # a grammar that allows only its end while min_tokens holds the end tokens off: the
        # grammar wins, and the row ends (the engine ends a row whose grammar is complete)
        if (
            i in failed
            and finite[i]
            and constrained is not logits
            and bool(torch.isfinite(constrained[i]).any())
        ):
            logits[i] = constrained[i]
            del failed[i]
    tokens: list[int | str] = logits.argmax(-1).tolist()  # right for every greedy row
    sampled = []
    for i, p in enumerate(params):
        if not finite[i]:
            tokens[i] = "the model produced non-finite logits for this request"
        elif i in failed:
            tokens[i] = failed[i]
        elif not p.greedy:
            sampled.append(i)
    if not sampled:
        return tokens
    min_p = [params[i].min_p for i in sampled]
    try:
        idx = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        rows = logits[idx].float() / temps[:, None]
        probs = filter_batch(
            rows,
            [params[i].top_k for i in sampled],
            [params[i].top_p for i in sampled],
            min_p if any(min_p) else None,
        )
        probs = probs.softmax(-1)
    except (RuntimeError, ValueError):
        probs = None
    for j, i in enumerate(sampled):
        p = params[i]
        try:
            if probs is None:
                row = filter_logits(logits[i].float() / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1)
            else:
                row = probs[j]
            tokens[i] = int(torch.multinomial(row, 1, generator=generators[i])[0])
        except (RuntimeError, ValueError) as e:
            tokens[i] = f"sampling failed for this request ({e})"
    return tokens
