"""Day 6: where a decoder block's parameters and FLOPs go.

Both tables are arithmetic on `config.json` alone, so they are the same on every machine:

* `day-06-block.csv`: one decoder block, row by row (the two norms, the fused QKV projection,
  the two attention products, the output projection, the fused gate/up projection, down), with
  each row's parameters and the FLOPs one token costs when it attends over a context of L
  tokens. A matmul of an (out, in) weight costs 2 * out * in FLOPs a token; the attention
  products have no weights and cost 2 * heads * head_dim * L each. Elementwise work (norms,
  RoPE, SiLU, the product, the residual adds) is not counted.
* `day-06-model.csv`: the same for the whole model: the embedding (a lookup, no FLOPs), the
  blocks, the final norm and the LM head (tied to the embedding, so no parameters of its own).

    python days/day06/blockcost.py                         # the default model -> both CSVs
    python days/day06/blockcost.py --context 512 --context 32768 --out-dir /tmp/d6
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.models import LlamaConfig
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CONTEXTS = (128, 8192)  # a short chat turn, and SmolLM2's whole context window


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}"


def block_rows(cfg: LlamaConfig, contexts=CONTEXTS) -> list[dict]:
    """One row per part of a decoder block: parameters, and FLOPs per token at each context."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = 2 * cfg.num_heads * hd  # FLOPs per token per key, for each of the two products
    parts = [  # (component, weight shape, params, FLOPs per token as a function of the context)
        ("input_norm", f"{h}", h, None),
        ("qkv (q k v fused)", f"{q + 2 * kv} x {h}", (q + 2 * kv) * h, lambda L: 2 * (q + 2 * kv) * h),
        ("attention scores q.k", "-", 0, lambda L: attn * L),
        ("attention values p.v", "-", 0, lambda L: attn * L),
        ("o", f"{h} x {q}", h * q, lambda L: 2 * h * q),
        ("post_norm", f"{h}", h, None),
        ("gate_up (gate up fused)", f"{2 * i} x {h}", 2 * i * h, lambda L: 2 * 2 * i * h),
        ("down", f"{h} x {i}", h * i, lambda L: 2 * h * i),
    ]
    total_params = sum(p for _, _, p, _ in parts)
    total_flops = {L: sum(f(L) for *_, f in parts if f) for L in contexts}
    rows = []
    for name, shape, params, flops in parts + [("block", "-", total_params, lambda L: total_flops[L])]:
        row = {"component": name, "weight": shape, "params": params, "params_pct": _pct(params, total_params)}
        for L in contexts:
            row[f"flops_ctx{L}"] = flops(L) if flops else "-"
            row[f"flops_pct_ctx{L}"] = _pct(flops(L), total_flops[L]) if flops else "-"
        rows.append(row)
    return rows


def model_rows(cfg: LlamaConfig, contexts=CONTEXTS) -> list[dict]:
    """The whole model per token: embedding, all blocks, final norm, head (tied or not)."""
    block = block_rows(cfg, contexts)[-1]
    h, v = cfg.hidden_size, cfg.vocab_size
    head_params = 0 if cfg.tie_word_embeddings else v * h
    parts = [
        ("embedding (lookup)", v * h, {L: 0 for L in contexts}),
        (f"{cfg.num_layers} blocks", cfg.num_layers * block["params"],
         {L: cfg.num_layers * block[f"flops_ctx{L}"] for L in contexts}),
        ("final norm", h, {L: 0 for L in contexts}),
        ("lm head" + (" (tied: the embedding)" if cfg.tie_word_embeddings else ""), head_params,
         {L: 2 * v * h for L in contexts}),
    ]  # fmt: skip
    total_params = sum(p for _, p, _ in parts)
    total = {L: sum(f[L] for *_, f in parts) for L in contexts}
    rows = []
    for name, params, flops in parts + [("model", total_params, total)]:
        row = {"component": name, "params": params, "params_pct": _pct(params, total_params)}
        for L in contexts:
            row[f"flops_ctx{L}"] = flops[L]
            row[f"flops_pct_ctx{L}"] = _pct(flops[L], total[L])
        rows.append(row)
    return rows


def attention_equals_weights_at(cfg: LlamaConfig) -> float:
    """The context length at which a block's two attention products cost as much as its matmuls."""
    weight_flops = block_rows(cfg, (1,))[-1]["flops_ctx1"] - 2 * 2 * cfg.num_heads * cfg.head_dim
    return weight_flops / (2 * 2 * cfg.num_heads * cfg.head_dim)


def layer_weights(sd: dict[str, torch.Tensor], layer: int = 0) -> dict[str, torch.Tensor]:
    """One layer's tensors under transformers' names without the prefix: 'self_attn.q_proj', ..."""
    prefix = f"model.layers.{layer}."
    return {k[len(prefix) :].removesuffix(".weight"): v for k, v in sd.items() if k.startswith(prefix)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--context", type=int, action="append", help="context length (repeat; default 128, 8192)")
    p.add_argument("--out-dir", default=str(HERE), help="folder for the CSVs")
    args = p.parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    cfg = LlamaConfig.from_dir(model_dir)
    contexts = tuple(args.context or CONTEXTS)
    out = Path(args.out_dir)
    print(f"wrote {write_csv(block_rows(cfg, contexts), out / 'day-06-block.csv')}")
    print(f"wrote {write_csv(model_rows(cfg, contexts), out / 'day-06-model.csv')}")
    print(f"blockcost attention_equals_weights_at={attention_equals_weights_at(cfg):.0f} tokens")


if __name__ == "__main__":
    main()
