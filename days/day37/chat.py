"""Day 37's tables: chat completions, the prompt the template makes and the prompt the server sees.

SmolLM2-135M-Instruct behind `create_app` on loopback, reached over HTTP only. For each
conversation of `CONVERSATIONS`:

* `day-37-prompts.csv`: what the chat template makes of it (its roles, whether the template put
  SmolLM2's own system message in front, characters, tokens, the generation prompt's tokens),
  the server's `prompt_tokens` for the same messages on `/v1/chat/completions`, whether the
  server's top-5 scores for the first answer token equal those of `/v1/completions` given our
  token ids (the same scores mean the model saw the same tokens), and the id of the token the
  model writes first (greedy) when the template is rendered without the generation prompt.
* `day-37-answers.csv`: a greedy answer of up to `--max-tokens` tokens on the chat route, the
  same on the completions route from our token ids (they must be the same tokens), and the
  completions answer to the rendering without the generation prompt; with this machine's wall
  time for the two routes.

    python days/day37/chat.py                      # writes both CSVs next to this file
    python days/day37/chat.py --max-tokens 24
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import torch

from nanocourse import engine_config, served, write_csv
from nanoserve.engine import Engine

HERE = Path(__file__).resolve().parent
MODEL_NAME = "SmolLM2-135M-Instruct"
HTTP = httpx.Client(timeout=120)
ONE_WORD = {"role": "system", "content": "You answer in one word."}
SKY = {"role": "user", "content": "What colour is the sky?"}
GRASS = [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"}]
PARTS = [{"type": "text", "text": "What colour"}, {"type": "text", "text": " is the sky?"}]
CONVERSATIONS = {
    "user only": [{"role": "user", "content": "What is 2+2? Answer with a number."}],
    "system + user": [ONE_WORD, SKY],
    "developer + user": [{"role": "developer", "content": ONE_WORD["content"]}, SKY],
    "multi-turn": [ONE_WORD, SKY, *GRASS],
    "content parts": [{"role": "user", "content": PARTS}],  # OpenAI's list-of-parts content
}


def make_engine(model, tokenizer) -> Engine:
    """SmolLM2 on a 32 MiB pool (720 tokens), 8 rows, the default (packed) linears."""
    engine = Engine(model, tokenizer, engine_config(37, max_batch=8, max_model_len=512, kv_budget=32 * 2**20))
    engine.model_name = MODEL_NAME
    return engine


def as_engine_sees(messages: list[dict]) -> list[dict]:
    """The messages as the server hands them to the template: content parts joined into one
    string, `developer` (OpenAI's newer name for the system role) as `system`."""
    out = []
    for m in messages:
        content = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    text = tokenizer.apply_chat_template(
        as_engine_sees(messages), add_generation_prompt=add_generation_prompt
    )
    return tokenizer.encode(text, add_bos=False)  # the template writes its own special tokens


def chat(url: str, messages, **kw) -> dict:
    r = HTTP.post(url + "/v1/chat/completions", json={"messages": messages, "temperature": 0} | kw)
    assert r.status_code == 200, r.text
    return r.json()


def complete(url: str, ids: list[int], **kw) -> dict:
    r = HTTP.post(url + "/v1/completions", json={"prompt": ids, "temperature": 0} | kw)
    assert r.status_code == 200, r.text
    return r.json()


def first_scores(url: str, tokenizer, messages) -> tuple[dict, dict, list[int]]:
    """One token from each route with its top-5 scores: (chat response, completions response on
    our template ids, those ids)."""
    ids = template_ids(tokenizer, messages)
    by_chat = chat(url, messages, max_tokens=1, logprobs=True, top_logprobs=5)
    by_ids = complete(url, ids, max_tokens=1, logprobs=5)
    return by_chat, by_ids, ids


def same_top5(by_chat: dict, by_ids: dict) -> bool:
    top_chat = by_chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    top_ids = by_ids["choices"][0]["logprobs"]["top_logprobs"][0]
    pairs = [(t["token"], t["logprob"]) for t in top_chat]
    return [p[0] for p in pairs] == list(top_ids)[:5] and all(abs(lp - top_ids[t]) < 1e-5 for t, lp in pairs)


def prompt_row(url: str, tokenizer, name: str, messages) -> dict:
    by_chat, by_ids, ids = first_scores(url, tokenizer, messages)
    bare = template_ids(tokenizer, messages, add_generation_prompt=False)
    after_bare = complete(url, bare, max_tokens=1, return_token_ids=True)["choices"][0]["token_ids"]
    seen = as_engine_sees(messages)
    return {
        "conversation": name,
        "roles": " ".join(m["role"] for m in messages),
        "default_system": "yes" if seen[0]["role"] != "system" else "no",
        "chars": len(tokenizer.apply_chat_template(seen)),
        "template_tokens": len(ids),
        "gen_prompt_tokens": len(ids) - len(bare),
        "server_prompt_tokens": by_chat["usage"]["prompt_tokens"],
        "first_token": by_chat["choices"][0]["logprobs"]["content"][0]["token"],
        "same_top5": "yes" if same_top5(by_chat, by_ids) else "no",
        "bare_first_id": after_bare[0],  # an id: the special tokens' names hold a "|"
    }


def shown(text: str) -> str:
    """Text for a table cell: a newline written as \\n."""
    return text.replace("\n", "\\n")


def answer_row(url: str, tokenizer, name: str, messages, max_tokens: int) -> dict:
    ids = template_ids(tokenizer, messages)
    t0 = time.perf_counter()
    by_chat = chat(url, messages, max_tokens=max_tokens, return_token_ids=True)
    t1 = time.perf_counter()
    by_ids = complete(url, ids, max_tokens=max_tokens, return_token_ids=True)
    t2 = time.perf_counter()
    bare = complete(
        url, template_ids(tokenizer, messages, False), max_tokens=max_tokens, return_token_ids=True
    )
    c, d, b = by_chat["choices"][0], by_ids["choices"][0], bare["choices"][0]
    return {
        "conversation": name,
        "chat_text": shown(c["message"]["content"]),
        "chat_tokens": len(c["token_ids"]),
        "finish_reason": c["finish_reason"],
        "same_as_completions": "yes" if c["token_ids"] == d["token_ids"] else "no",
        "bare_text": shown(b["text"]),
        "bare_tokens": len(b["token_ids"]),
        "bare_finish": b["finish_reason"],
        "chat_ms": round((t1 - t0) * 1000, 1),
        "completions_ms": round((t2 - t1) * 1000, 1),
    }


def main() -> None:
    from nanoserve.bench import cpu_line
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-tokens", type=int, default=16, help="the longest answer of the answers table")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE, help="folder for the CSVs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = fetch_default_model()
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    with served(make_engine(model, tok)) as url:
        prompts = [prompt_row(url, tok, name, m) for name, m in CONVERSATIONS.items()]
        answers = [answer_row(url, tok, name, m, args.max_tokens) for name, m in CONVERSATIONS.items()]
    answers = [r | {"cpu": cpu_line()} for r in answers]  # its ms columns are this machine's
    for name, rows in (("prompts", prompts), ("answers", answers)):
        for row in rows:
            print(row)
        write_csv(rows, args.out / f"day-37-{name}.csv")


if __name__ == "__main__":
    main()
