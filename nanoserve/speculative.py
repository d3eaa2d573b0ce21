"""Speculative decoding with n-gram proposals (phase 6, day 68): several tokens a weight pass.

At batch 1 a decode step reads every weight to produce one token. Text that copies its context
(code edited in place, an answer quoting its sources, a summary) is predictable from that
context: if the last few tokens appeared earlier, what followed them then is a good guess for
what follows now. `NgramProposer` makes that guess for each decoding row, up to
`num_speculative_tokens` (K) tokens, by looking the context's last n-gram up (the longest of
`prompt_lookup_max` down to `prompt_lookup_min` tokens that occurred before, its latest
occurrence; vLLM's `[ngram]` proposer works the same way from the earliest occurrence, and
llama.cpp's `ngram-simple` with one n-gram size). The proposal
costs no model call: each row keeps an index from n-gram to where it last ended, grown by the
tokens appended since the last step, so a lookup is a few dictionary reads.

Verification. A row with a draft d1..dk runs as a (k+1)-token chunk: its newest token and the
draft, written into its paged cache like any prompt chunk (the scheduler counts k+1 tokens
against the step's budget and gives the row blocks for them; a draft is the first thing cut
when the budget or the pool is short). The forward returns logits at all k+1 positions: position
j's are the model's distribution for the next token given the context and d1..dj. The sampler
draws one token t_j from each of them, exactly as it would draw a row's token (temperature,
top-k/p, min-p, penalties over the history including d1..dj, the grammar's mask after d1..dj,
the row's own generator), and `accepted_length` keeps the longest prefix where t_j equals
d_{j+1}. The row then gets d1..dm and t_m: m accepted tokens and one more from the model.

Why drawing and comparing is the speculative-sampling rule. The standard rule (Leviathan et
al., Chen et al. 2023) accepts a draft token x, proposed with probability q(x), with probability
min(1, p(x)/q(x)), and on rejection draws from the residual max(0, p - q) renormalized. An
n-gram proposer is deterministic: q puts all its mass on d. Then d is accepted with probability
p(d), and the residual is p with d removed, renormalized. Drawing t ~ p and accepting when t = d
does exactly that: P(accept) = p(d), and a rejected draw is a t != d with probability
p(t)/(1 - p(d)). Each emitted token is therefore distributed as the model's own conditional, and
greedy rows (t_j is the argmax) get exactly the tokens decoding one at a time gives. Seeds repeat:
the draws come from the row's generator in a fixed order (tokens differ from the same seed with
speculation off, since more draws are made; their distribution does not).

The rejected positions' K/V lies in slots past the row's accepted length: nothing reads them
(attention reads a row's first context_len slots), the next step writes over them, and blocks
beyond what the accepted tokens need go back to the pool at once (`BlockAllocator.trim`). Only
accepted tokens' blocks are registered in the prefix cache.

When it turns itself down. Verifying is not free on a CPU. Measured with Qwen2.5-Coder-0.5B's
Q4_K_M on a 2-core AVX-512 EPYC (`bench speculative --costs`, evals/speculative-costs.csv): a
one-row decode step 9.09 ms, the same row with 1, 3 and 7 draft tokens 12.21, 15.58 and 38.6 ms;
16 rows 56.36 ms, with 1 and 3 draft tokens each 100.67 and 178.55 ms. At one row the weights'
bandwidth sets the step, and each extra query row adds its arithmetic, about 2.2 ms (a quarter
of a step) at one row and 2.5 ms at 16 rows, where a row's share of the step is 3.5 ms. So a
draft token pays when it is kept a quarter of the time at one row, and most of the time at 16
(a kept token saves a whole step's share, a refused one costs its row). Each row therefore
keeps the drafts it proposed and kept over its last `WINDOW` verifications; once it has
`WINDOW` of them and fewer than `MIN_RATE` (one half, between those two) of the proposed tokens
were kept, it stops proposing for `pause` steps (8, doubling on each further failure up to 256,
back to 8 once a window passes). The default K is 3 because four query rows cost 1.71 one-row
steps there and eight 4.25: at full acceptance 4 tokens for 1.71 steps (2.33x) against 8 for
4.25 (1.88x).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 8  # verifications a row's acceptance is judged over
MIN_RATE = 0.5  # the share of its proposed tokens a row must keep to go on proposing
FIRST_PAUSE, MAX_PAUSE = 8, 256  # steps a row that fell short stops proposing for


def accepted_length(draft: list[int], samples: list) -> int:
    """How many of the draft's tokens are kept: the longest prefix where the token drawn at each
    position (`samples[j]`, from the logits after the context and draft[:j]) equals the draft's.
    `samples` has len(draft) + 1 entries; a position that could not be sampled (a sentence in
    place of a token) ends the prefix."""
    m = 0
    while m < len(draft) and samples[m] == draft[m]:
        m += 1
    return m


@dataclass
class RowState:
    """One sequence's proposer state: its n-gram index and its recent acceptance."""

    index: dict = field(default_factory=dict)  # n-gram tuple -> position just after its latest end
    indexed: int = 0  # continuation positions indexed so far
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW))  # (kept, proposed) a verification
    pause: int = 0  # steps left without proposing
    next_pause: int = FIRST_PAUSE


class NgramProposer:
    """Proposals from the context itself (prompt lookup)."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def describe(self) -> str:
        return f"speculative ngram, up to {self.k} tokens a step, n-grams of {self.min_n}-{self.max_n}"

    def _index(self, state: RowState, tokens: list[int]) -> None:
        """Index every n-gram that has a token after it, up to the newest token."""
        for e in range(max(state.indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                state.index[tuple(tokens[e - n : e])] = e
        state.indexed = max(state.indexed, len(tokens))

    def propose(self, state: RowState, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the longest
        n-gram the context ends with; [] when none occurred or the row is paused."""
        if state.pause > 0:
            state.pause -= 1
            return []
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        self._index(state, tokens)
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            e = state.index.get(tuple(tokens[n_tokens - n :]))
            if e is not None:
                return tokens[e : e + limit]
        return []

    @staticmethod
    def record(state: RowState, accepted: int, proposed: int) -> None:
        """A verification kept `accepted` of `proposed` draft tokens; pause the row when its
        last WINDOW verifications kept less than MIN_RATE of what they proposed."""
        state.recent.append((accepted, proposed))
        if len(state.recent) < WINDOW:
            return
        kept, tried = (sum(x) for x in zip(*state.recent))
        if kept < MIN_RATE * tried:
            state.pause, state.next_pause = state.next_pause, min(2 * state.next_pause, MAX_PAUSE)
            state.recent.clear()
        else:
            state.next_pause = FIRST_PAUSE


@dataclass
class SpecStats:
    """What speculation did, for /metrics and /health."""

    verifications: int = 0  # rows that ran with a draft
    draft_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # of those, kept
    emitted_tokens: int = 0  # tokens the verifying rows produced (accepted + one each)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying row produced on average (accepted drafts and the model's one)."""
        return self.emitted_tokens / self.verifications if self.verifications else 0.0

    def as_dict(self) -> dict:
        return {
            "verifications": self.verifications,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
        }
