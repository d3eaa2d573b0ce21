"""Day 9: what temperature, top-k and top-p do to one real next-token distribution.

One chat prompt and the first words of a reply, one forward: the logits for the next token of
the reply (which animal). Each
setting of `SamplingParams` turns them into the distribution `nanoserve.sampling.sample` draws
from (greedy: all the mass on the argmax; otherwise logits / temperature, then top-k, then
top-p, then softmax). `day-09-settings.csv` has one row per setting: how many tokens keep any
probability, the top token's probability, the entropy in bits, and then `draws` draws through
`sample` itself with the setting's seed: how many distinct tokens came up and how often the top
token did. `day-09-texts.csv` continues the same prompt through `nanoserve.generate.decode_loop`
under a few settings and seeds.

Every number is deterministic on a given machine (fixed weights, fixed seeds, torch's CPU
generator); probabilities are rounded to three decimals.

    python days/day09/sampling.py                            # the default prompt -> both CSVs
    python days/day09/sampling.py --draws 10000 --out-dir /tmp/d9
    python days/day09/sampling.py --prompt "Name a fruit." --prefix "A fruit I like is the" --out-dir /tmp/d9
"""

from __future__ import annotations

import argparse
import math
from collections import Counter
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.contiguous import NoCache
from nanoserve.generate import decode_loop
from nanoserve.models import Llama, load_model
from nanoserve.sampling import SamplingParams, filter_logits, sample
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
PROMPT = "Name one animal that lives in the ocean."
# The start of the model's reply, written for it: the next token is then the animal, a choice
# with many fair answers, where the reply's own first token would be "One" or "The".
PREFIX = "One animal that lives in the ocean is the"
DRAWS = 1000  # per setting, through `sample`
SEED = 1
MAX_TOKENS = 24  # per continuation in the texts table
SETTINGS = {  # name -> SamplingParams (seed added per row)
    "greedy (t=0)": SamplingParams(temperature=0.0),
    "t=1e-6 (below SAMPLING_EPS)": SamplingParams(temperature=1e-6),
    "t=0.5": SamplingParams(temperature=0.5),
    "t=0.7": SamplingParams(temperature=0.7),
    "t=1.0": SamplingParams(temperature=1.0),
    "t=1.5": SamplingParams(temperature=1.5),
    "t=1.0 top_k=5": SamplingParams(temperature=1.0, top_k=5),
    "t=1.0 top_k=50": SamplingParams(temperature=1.0, top_k=50),
    "t=1.0 top_p=0.5": SamplingParams(temperature=1.0, top_p=0.5),
    "t=1.0 top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "t=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t=1.0 top_p=1e-9": SamplingParams(temperature=1.0, top_p=1e-9),
}
TEXT_SETTINGS = [  # (temperature, top_p, seed)
    (0.0, 1.0, None),
    (0.7, 0.9, 1),
    (0.7, 0.9, 1),
    (0.7, 0.9, 2),
    (1.0, 1.0, 1),
    (1.5, 1.0, 1),
]


def prompt_ids(tok: Tokenizer, prompt: str = PROMPT, prefix: str = PREFIX) -> list[int]:
    """The chat prompt through the template, then the first words of the reply."""
    return tok.encode_chat([{"role": "user", "content": prompt}]) + tok.encode(prefix, add_bos=False)


def next_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """The logits (V,) for the token after `ids`, one forward with no cache."""
    cache = NoCache()
    positions = torch.arange(len(ids))
    cache.begin(positions)
    return model(torch.tensor(ids), positions, cache, logits_at=torch.tensor([len(ids) - 1]))[0]


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities (V,) that `sample` draws from under `params`."""
    if params.greedy:
        return torch.zeros_like(logits).scatter_(0, logits.argmax().view(1), 1.0)
    return filter_logits(logits.float() / params.temperature, params.top_k, params.top_p).softmax(-1)


def entropy_bits(probs: torch.Tensor) -> float:
    p = probs[probs > 0].double()
    return max(0.0, -(p * p.log2()).sum().item())


def setting_row(
    tok: Tokenizer, logits: torch.Tensor, name: str, params: SamplingParams, draws: int, seed: int
):
    params = SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed).validate()
    probs = distribution(logits, params)
    gen = params.make_generator()
    drawn = Counter(int(sample(logits[None], [params], [gen])[0]) for _ in range(draws))
    top = int(logits.argmax())
    return {
        "setting": name,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "kept": int((probs > 0).sum()),
        "p_top1": f"{probs[top].item():.3f}",
        "entropy_bits": f"{entropy_bits(probs):.2f}",
        "draws": draws,
        "distinct": len(drawn),
        "top1_share": f"{drawn[top] / draws:.3f}",
        "most_drawn": repr(tok.decode([drawn.most_common(1)[0][0]])),
    }


def settings_rows(tok, logits, settings=SETTINGS, draws: int = DRAWS, seed: int = SEED) -> list[dict]:
    return [setting_row(tok, logits, name, params, draws, seed) for name, params in settings.items()]


def text_rows(model, tok, ids, text_settings=TEXT_SETTINGS, max_tokens: int = MAX_TOKENS) -> list[dict]:
    rows = []
    for temperature, top_p, seed in text_settings:
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
        tokens = list(decode_loop(model, ids, params.validate(), eos_ids=tok.eos_ids))
        rows.append(
            {
                "temperature": temperature,
                "top_p": top_p,
                "seed": "-" if seed is None else seed,
                "tokens": len(tokens),
                "text": tok.decode(tokens),
            }
        )
    return rows


def overflow_temperature(logits: torch.Tensor) -> float:
    """The temperature below which logits / t overflows fp32 for the largest |logit|."""
    return logits.abs().max().item() / torch.finfo(torch.float32).max


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default=PROMPT, help="the user message")
    p.add_argument("--prefix", default=PREFIX, help="the start of the reply ('' for none)")
    p.add_argument("--draws", type=int, default=DRAWS, help="draws per setting")
    p.add_argument("--seed", type=int, default=SEED, help="the seed of every setting's draws")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="tokens per continuation")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: the sampler's ops are small)"
    )
    p.add_argument("--out-dir", default=str(HERE), help="folder for the CSVs")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    ids = prompt_ids(tok, args.prompt, args.prefix)
    logits = next_logits(model, ids)
    out = Path(args.out_dir)
    rows = settings_rows(tok, logits, draws=args.draws, seed=args.seed)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, out / 'day-09-settings.csv')}")
    texts = text_rows(model, tok, ids, max_tokens=args.max_tokens)
    for r in texts:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(texts, out / 'day-09-texts.csv')}")
    t = overflow_temperature(logits)
    print(f"sampling prompt_tokens={len(ids)} max_logit={logits.max().item():.2f} overflow_below_t={t:.1e}")
    assert not math.isnan(t)


if __name__ == "__main__":
    main()
