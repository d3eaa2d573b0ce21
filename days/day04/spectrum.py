"""Day 4: the rotary frequency spectrum of a model, and what Llama-3 scaling does to it.

RoPE rotates each pair of coordinates of a query or key head, (i, i + head_dim/2), by the angle
position x inv_freq[i], with inv_freq[i] = theta^(-2i/head_dim). A pair's wavelength,
2 pi / inv_freq[i], is how many positions one full turn takes. For each pair the CSV records
its frequency and wavelength as the package computes them (`nanoserve.models.rope_inv_freq`, in
fp32), how many turns it makes over the model's context, and what Llama-3 scaling
(`rope_type: llama3`) would do to it with the given parameters: the band the pair falls in
(`high`: wavelength below original_context / high_freq_factor, kept; `low`: above
original_context / low_freq_factor, slowed by `factor`; `medium`: blended between the two), the
slowdown, and the new wavelength. The defaults are Llama 3.1's parameters (factor 8, low 1,
high 4, original context 8192), applied to the model's own theta and head size; SmolLM2's
context is that original 8192, so this is the rule that would stretch it to 65,536.

Every number is rounded to three significant figures, so the table is the same on any machine.

    python days/day04/spectrum.py                          # SmolLM2-135M -> day-04-spectrum.csv
    python days/day04/spectrum.py --factor 4 --original-context 4096 --out /tmp/s.csv
    python days/day04/spectrum.py --model DIR --out /tmp/s.csv   # another Llama directory
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from nanocourse import write_csv
from nanoserve.models import LlamaConfig, rope_inv_freq
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-04-spectrum.csv"
LLAMA31 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_config(cfg: LlamaConfig, **params) -> LlamaConfig:
    """`cfg` with Llama-3 rope scaling switched on (Llama 3.1's parameters unless overridden)."""
    return dataclasses.replace(cfg, rope_scaling={"rope_type": "llama3", **LLAMA31, **params})


def band(wavelength: float, scaling: dict) -> str:
    """Which part of Llama-3 scaling a pair of this wavelength falls in."""
    old = scaling["original_max_position_embeddings"]
    if wavelength < old / scaling["high_freq_factor"]:
        return "high"
    if wavelength > old / scaling["low_freq_factor"]:
        return "low"
    return "medium"


def sig(x: float, digits: int = 3) -> str:
    """Three significant figures without an exponent (6.28, 70100), or with one below 0.01."""
    return f"{x:.{digits - 1}e}" if abs(x) < 0.01 else f"{float(f'{x:.{digits}g}'):.12g}"


def spectrum_rows(cfg: LlamaConfig, scaled: LlamaConfig) -> list[dict]:
    inv, inv_scaled = rope_inv_freq(cfg).tolist(), rope_inv_freq(scaled).tolist()
    half, context = cfg.head_dim // 2, cfg.max_position_embeddings
    rows = []
    for i, (f, g) in enumerate(zip(inv, inv_scaled)):
        wavelength = 2 * math.pi / f
        rows.append(
            {
                "pair": i,
                "dims": f"{i} & {i + half}",
                "inv_freq": sig(f),
                "wavelength": sig(wavelength),
                f"turns_in_{context}": sig(context / wavelength),
                "llama3_band": band(wavelength, scaled.rope_scaling),
                "llama3_slowdown": sig(f / g),
                "llama3_wavelength": sig(2 * math.pi / g),
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--factor", type=float, default=LLAMA31["factor"])
    p.add_argument("--low-freq-factor", type=float, default=LLAMA31["low_freq_factor"])
    p.add_argument("--high-freq-factor", type=float, default=LLAMA31["high_freq_factor"])
    p.add_argument("--original-context", type=int, default=LLAMA31["original_max_position_embeddings"])
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    cfg = LlamaConfig.from_dir(resolve_model_dir(args.model))
    scaled = llama3_config(
        cfg,
        factor=args.factor,
        low_freq_factor=args.low_freq_factor,
        high_freq_factor=args.high_freq_factor,
        original_max_position_embeddings=args.original_context,
    )
    rows = spectrum_rows(cfg, scaled)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    bands = {b: sum(r["llama3_band"] == b for r in rows) for b in ("high", "medium", "low")}
    slow = sum(float(r["wavelength"]) > cfg.max_position_embeddings for r in rows)
    print(f"spectrum pairs={len(rows)} longer_than_context={slow} llama3_bands={bands}")


if __name__ == "__main__":
    main()
