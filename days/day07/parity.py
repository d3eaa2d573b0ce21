"""Day 7: our whole forward against transformers' LlamaForCausalLM, on the same weights.

For each chat prompt: greedy-decode up to `max_tokens` tokens with `nanoserve.generate.
greedy_tokens` and with transformers' `generate`, compare the token ids, then run both models
over the prompt plus the continuation in one forward and take the largest |logit difference|
over every position and every vocabulary entry, and the smallest gap between our top two logits
at any greedy step (how close a tie came). The CSV records counts, yes/no, the logit difference
as a bound ("<1e-3") rather than as a raw float, and that gap rounded to three decimals.

    python days/day07/parity.py                          # 5 prompts, 24 tokens -> day-07-parity.csv
    python days/day07/parity.py --max-tokens 256 --out days/day07/day-07-parity-256.csv
    python days/day07/parity.py --prompt "Tell me a story." --out /tmp/p.csv
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.generate import greedy_tokens
from nanoserve.models import Llama, load_model
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-07-parity.csv"
CSV_LONG = HERE / "day-07-parity-256.csv"  # the same five prompts run to their end of turn (--max-tokens 256)
LOGIT_BOUND = 1e-3  # fp32 on both sides: the same operations, summed in a different order at most
BOUND_TEXT = "<1e-3"
MAX_TOKENS = 24  # per prompt: two prompts end on EOS before it, and the notebook stays under 30 s
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning, my friend' into Spanish.",
]


def load_reference(model_dir):
    """transformers' LlamaForCausalLM in fp32 on the same directory, progress bars off."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    return transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def our_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """Logits (N, V) for every position of `ids`, one prefill over a fresh contiguous cache."""
    cache = ContiguousKVCache(model.cfg, len(ids), dtype=model.dtype, device=model.device)
    positions = torch.arange(len(ids), device=model.device)
    cache.begin(positions)
    return model(torch.tensor(ids, device=model.device), positions, cache)


@torch.no_grad()
def their_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # (N, V)


@torch.no_grad()
def their_greedy(hf, ids: list[int], n: int, eos_ids) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=sorted(eos_ids),
        pad_token_id=min(eos_ids),
    )
    return out[0, len(ids) :].tolist()


def check_logits_close(ours: torch.Tensor, theirs: torch.Tensor, bound: float = LOGIT_BOUND) -> float:
    """The largest |logit difference|; raises if it is not below `bound` (or the shapes differ)."""
    if ours.shape != theirs.shape:
        raise AssertionError(f"logits have shape {tuple(ours.shape)} here and {tuple(theirs.shape)} there")
    worst = (ours - theirs).abs().max().item() if ours.numel() else 0.0
    if not worst < bound:
        at = divmod(int((ours - theirs).abs().argmax()), ours.shape[1])
        raise AssertionError(
            f"max |logit difference| {worst:.3g} at (position, token) {at} is not below {bound:g}"
        )
    return worst


@dataclass
class PromptParity:
    prompt: str
    prompt_ids: list[int]
    ours: list[int]  # our greedy continuation
    theirs: list[int]  # transformers' greedy continuation
    max_dlogit: float  # over prompt + our continuation, every position and vocabulary entry
    min_margin: float  # smallest gap between our top-1 and top-2 logits over the greedy steps
    max_tokens: int

    def row(self) -> dict:
        return {
            "prompt": self.prompt,
            "prompt_tokens": len(self.prompt_ids),
            "greedy_tokens": len(self.ours),
            "finish": "length" if len(self.ours) == self.max_tokens else "eos",
            "identical": "yes" if self.ours == self.theirs else "no",
            "logit_positions": len(self.prompt_ids) + len(self.ours),
            "max_abs_dlogit": BOUND_TEXT if self.max_dlogit < LOGIT_BOUND else f"{self.max_dlogit:.1e}",
            "min_top2_gap": f"{self.min_margin:.3f}",
        }


def compare_prompt(
    ours: Llama, hf, tok: Tokenizer, prompt: str, max_tokens: int = MAX_TOKENS
) -> PromptParity:
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    mine = greedy_tokens(ours, ids, max_tokens, eos_ids=tok.eos_ids)
    theirs = their_greedy(hf, ids, max_tokens, tok.eos_ids)
    seq = ids + mine
    logits = our_logits(ours, seq)  # (N, V)
    dlogit = (logits - their_logits(hf, seq)).abs().max().item()
    top2 = logits[len(ids) - 1 : len(seq) - 1].topk(2, dim=-1).values  # (steps, 2): each greedy choice
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    return PromptParity(prompt, ids, mine, theirs, dlogit, margin, max_tokens)


def parity(ours, hf, tok, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[PromptParity]:
    return [compare_prompt(ours, hf, tok, p, max_tokens) for p in prompts]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="greedy tokens per prompt")
    p.add_argument("--prompt", action="append", help="a user message (repeat; default: five built-in)")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    ours, hf, tok = load_model(model_dir), load_reference(model_dir), Tokenizer.from_dir(model_dir)
    results = parity(ours, hf, tok, args.prompt or PROMPTS, args.max_tokens)
    rows = [r.row() for r in results]
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    same = sum(r.ours == r.theirs for r in results)
    worst = max(r.max_dlogit for r in results)
    print(f"parity prompts={len(results)} identical={same} max_abs_dlogit={worst:.2e} bound={LOGIT_BOUND:g}")


if __name__ == "__main__":
    main()
