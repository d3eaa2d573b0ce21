"""Day 3: what RMSNorm sees in the real model, and what bf16 does to it.

One forward of SmolLM2-135M (fp32) over a chat prompt, with a hook in front of every block, keeps
the hidden state each norm receives: block L's `input_norm` gets the residual stream entering
block L (for block 0, the embedding rows themselves), and the final `norm` gets the stream
leaving block 29. For each chosen norm site the CSV records, over the prompt's positions:

* the scale of the input: per-position RMS (smallest, median, largest) and the largest |x|;
* the range of the norm's weight (its per-channel gain);
* `eps_shift`: the most that epsilon changes any output, 1 - sqrt(ms / (ms + eps)) at the
  position with the smallest mean square `ms`;
* the error of three bf16 versions against fp32, each as the worst position's
  max |y16 - y| / max |y|: `bf16_inputs_rel_err` rounds only x and the weight to bf16 and
  computes in fp32 (what storing the tensors in bf16 costs by itself); `bf16_rel_err` is the
  package's path (`rms_norm` on bf16 tensors: the mean taken in fp32, the normalized value
  rounded to bf16, then scaled by the bf16 weight, as transformers does); and
  `naive_bf16_rel_err` does every operation in bf16.

Scales are rounded to three significant figures and errors to two, so the table is the same on
any machine whose fp32 sums agree to far better than that.

    python days/day03/norms.py                           # 10 sites -> day-03-norms.csv
    python days/day03/norms.py --layers all --out /tmp/norms.csv
    python days/day03/norms.py --prompt "Tell me a story." --out /tmp/n.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.models import Llama, load_model, rms_norm
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-03-norms.csv"
PROMPT = "What is the capital of France?"
LAYERS = (0, 1, 2, 5, 10, 15, 20, 25, 29)  # input norms shown by default, plus the final norm


def prefill(model: Llama, ids: list[int]) -> torch.Tensor:
    """Logits (N, V) of one prefill of `ids` over a fresh contiguous cache."""
    cache = ContiguousKVCache(model.cfg, len(ids), dtype=model.dtype, device=model.device)
    positions = torch.arange(len(ids), device=model.device)
    cache.begin(positions)
    return model(torch.tensor(ids, device=model.device), positions, cache)


def norm_inputs(model: Llama, ids: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The (N, H) hidden state every norm of the model receives over one prefill of `ids`, by
    site name (`blocks.L.input_norm`, then `norm`), and that prefill's logits (N, V)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        b.register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(f"blocks.{i}.input_norm", args[0])
        )
        for i, b in enumerate(model.blocks)
    ]
    last = model.blocks[-1]
    hooks.append(last.register_forward_hook(lambda mod, args, out: seen.__setitem__("norm", out)))
    try:
        logits = prefill(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return {k: v.detach().clone() for k, v in seen.items()}, logits


def norm_weight(model: Llama, site: str) -> torch.Tensor:
    if site == "norm":
        return model.norm
    return model.blocks[int(site.split(".")[1])].input_norm


def naive_bf16_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with every operation in bf16, the mean of squares included: what not to do."""
    x, weight = x.bfloat16(), weight.bfloat16()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst position's max |got - want| over that position's max |want|, for (N, H) tensors."""
    return ((got.float() - want).abs().amax(-1) / want.abs().amax(-1)).max().item()


def sig(x: float, digits: int = 3) -> str:
    """Rounded to `digits` significant figures, written without an exponent: 24900 and 0.00482."""
    return f"{float(f'{x:.{digits}g}'):.12g}"


def site_row(site: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> dict:
    ms = x.double().pow(2).mean(-1)  # (N,): each position's mean square, in fp64 for eps_shift
    rms = ms.sqrt()
    y = rms_norm(x, weight, eps)
    y16 = rms_norm(x.bfloat16(), weight.bfloat16(), eps)
    y_rounded_inputs = rms_norm(x.bfloat16().float(), weight.bfloat16().float(), eps)
    return {
        "site": site,
        "tokens": x.shape[0],
        "rms_in_min": sig(rms.min().item()),
        "rms_in_median": sig(rms.median().item()),
        "rms_in_max": sig(rms.max().item()),
        "max_abs_in": sig(x.abs().max().item()),
        "weight_min": sig(weight.min().item()),
        "weight_max": sig(weight.max().item()),
        "eps_shift": f"{1 - (ms.min() / (ms.min() + eps)).sqrt().item():.1e}",
        "bf16_inputs_rel_err": f"{rel_err(y_rounded_inputs, y):.1e}",
        "bf16_rel_err": f"{rel_err(y16, y):.1e}",
        "naive_bf16_rel_err": f"{rel_err(naive_bf16_rms_norm(x, weight, eps), y):.1e}",
    }


def site_rows(model: Llama, inputs: dict[str, torch.Tensor], layers=LAYERS) -> list[dict]:
    """One row per chosen input norm (in block order), then the final norm, from `norm_inputs`'s
    hidden states."""
    sites = [f"blocks.{i}.input_norm" for i in layers] + ["norm"]
    eps = model.cfg.rms_norm_eps
    return [site_row(s, inputs[s], norm_weight(model, s), eps) for s in sites]


def norm_rows(model: Llama, tok: Tokenizer, prompt: str = PROMPT, layers=LAYERS) -> list[dict]:
    """The CSV's rows: `site_rows` over one prefill of the chat-rendered `prompt`."""
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    return site_rows(model, norm_inputs(model, ids)[0], layers)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default=PROMPT, help="the user message the hidden states come from")
    p.add_argument("--layers", default=",".join(map(str, LAYERS)), help="comma-separated blocks, or 'all'")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    n = model.cfg.num_layers
    layers = range(n) if args.layers == "all" else [int(s) for s in args.layers.split(",")]
    rows = norm_rows(model, tok, args.prompt, layers)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    worst = max(float(r["bf16_rel_err"]) for r in rows)
    print(f"norms sites={len(rows)} tokens={rows[0]['tokens']} worst_bf16_rel_err={worst:.1e}")


if __name__ == "__main__":
    main()
