"""Text <-> token ids: the model directory's tokenizer, its chat template, streaming detokenization.

Day 1. `Tokenizer` wraps the `tokenizers` library around a directory's `tokenizer.json` (we do
not reimplement BPE; the notebook does that once, to show it) and renders chat messages with the
directory's jinja template under the same conventions as transformers, so a prompt tokenizes
here exactly as it does there. `IncrementalDetokenizer` turns a stream of generated ids into
text pieces that never cut a UTF-8 character in half.

`bpe_from_vocab` (Day 2) builds the `tokenizers` object from the vocabulary fields of a GGUF
with byte-level BPE, `spm_from_vocab` from those of a SentencePiece one (Llama 2, Gemma);
reading the GGUF and writing the directory is `gguf_file.py`'s business. When to stop generating
(EOS, stop strings) belongs to the generation loop, which only asks this module for `eos_ids`.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from nanoserve.errors import NanoserveError

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: every byte as a printable character, the alphabet of byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise NanoserveError(f"{path} is not valid JSON ({e}); fix or re-download it.") from None


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _compile_template(source: str):
    """Compile a chat template with the environment transformers gives templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which would change the prompt
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise NanoserveError(f"the chat template does not parse ({e}); fix chat_template.jinja.") from None


def check_messages(messages) -> None:
    """Raise a NanoserveError unless `messages` is a conversation the chat template can take.

    Each message is a dict with a string `role` and a string `content`, with OpenAI's tool
    calling besides: an assistant message that made `tool_calls` may have no content (null or
    absent; without tool calls it needs text, as OpenAI's does), its calls checked by
    `_tool_calls_of`, and a `tool` message may name the call it answers in `tool_call_id`.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise NanoserveError("messages must be a non-empty list of {'role': ..., 'content': ...} objects.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise NanoserveError(
                f"message {i} is {m!r}; each message needs a string 'role' and a string 'content'."
            )
        content = m.get("content")
        if m["role"] == "assistant":
            calls = _tool_calls_of(i, m)
            if content is None and not calls:
                raise NanoserveError(
                    f"message {i} is an assistant message with no content and no tool calls; "
                    "send its text or the tool calls it made."
                )
            if content is not None and not isinstance(content, str):
                raise NanoserveError(f"message {i}'s content is {content!r}; it must be a string or null.")
            continue
        if not isinstance(content, str):
            raise NanoserveError(
                f"message {i} is {m!r}; each message needs a string 'role' and a string 'content' "
                "(only an assistant's may be null)."
            )
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise NanoserveError(f"message {i}'s tool_call_id is {m['tool_call_id']!r}; it must be a string.")


def _tool_calls_of(i: int, message: dict) -> list[dict]:
    """The tool calls of assistant message `i` as the template takes them, their `arguments`
    parsed into a dict: OpenAI clients send the arguments as a JSON string, but templates write
    them with `arguments | tojson` (Qwen's), which would quote the string a second time. vLLM
    parses them the same way. [] when the message has none (null, absent or an empty list)."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, (list, tuple)):
        raise NanoserveError(f"message {i}'s tool_calls is {calls!r}; it must be a list of tool calls.")
    out = []
    for j, call in enumerate(calls):
        where = f"message {i}'s tool call {j}"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
        ):
            raise NanoserveError(
                f"{where} is {call!r}; a tool call is "
                "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}."
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise NanoserveError(
                f"{where} has arguments {function.get('arguments')!r}; they must be a JSON object "
                "(a string holding one, as OpenAI sends them)."
            )
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _as_rendered(messages) -> list[dict]:
    """Copies of checked messages with the tool calls' arguments parsed (the caller's stay as sent)."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            m["tool_calls"] = _tool_calls_of(i, m)
        out.append(m)
    return out


# A tool no real request names: rendering it shows whether a template writes tools at all.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "nanoserve_probe_tool_7c1e",
        "description": "Whether the chat template renders tools.",
        "parameters": {"type": "object", "properties": {}},
    },
}


# --- a tokenizer from a GGUF's vocabulary (gguf_file.py writes it out as tokenizer.json) ---

# The split regex of Llama 3's tokenizer.json (llama.cpp calls its pre-tokenizer 'llama-bpe').
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: Llama 3's with numbers cut into single digits, after an NFC normalization.
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = ("smollm", "gpt2", "default", "llama-bpe", "llama3", "qwen2")


def bpe_from_vocab(tokens, token_types, merges, pre: str = "default", bos_id: int | None = None):
    """A byte-level BPE `tokenizers.Tokenizer` from llama.cpp's fields (tokenizer.ggml.*).

    `tokens` are already spelled in GPT-2's byte alphabet ("Ġthe"); `merges` are "Ġ t" strings;
    `token_types` follow llama.cpp (1 normal, 3 control, 4 user-defined); `pre` is llama.cpp's
    name for the pre-tokenizer. With `bos_id`, encoding with special tokens puts BOS in front.
    """
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    if pre not in PRE_TOKENIZERS:
        raise NanoserveError(
            f"the pre-tokenizer {pre!r} is not supported; nanoserve knows {', '.join(PRE_TOKENIZERS)}."
        )
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated string keeps its first id, as llama.cpp's lookup does
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    llama3 = pre in ("llama-bpe", "llama3")
    # Llama 3's own tokenizer.json takes a whole word from the vocabulary before merging.
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=llama3))
    split_first = llama3 or pre == "qwen2"  # a Split does what ByteLevel's own regex would
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not split_first)
    if pre == "smollm":
        # SmolLM's own tokenizer (and llama.cpp's 'smollm') cuts numbers into single digits first.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif split_first:
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT if llama3 else QWEN2_SPLIT), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        if pre == "qwen2":
            backend.normalizer = normalizers.NFC()
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) and user-defined ones are matched whole in the text.
    kinds = dict(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds.items() if k == 3]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds.items() if k == 4])
    post = [processors.ByteLevel(trim_offsets=False)]
    if bos_id is not None:
        bos = tokens[bos_id]
        single, pair = f"{bos}:0 $A:0", f"{bos}:0 $A:0 {bos}:1 $B:1"
        post.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=[(bos, bos_id)]))
    backend.post_processor = processors.Sequence(post)
    return backend


# llama.cpp's token types whose text BPE can never produce: unknown, control and byte tokens
# (SentencePiece keeps these out of the pieces its merges look up, too).
_NOT_MERGEABLE = (2, 3, 6)


def spm_merges(tokens, scores, token_types) -> list[tuple[str, str]]:
    """BPE merges, best first, that make a BPE model tokenize as a SentencePiece vocabulary does.

    SentencePiece's BPE (llama.cpp's `llm_tokenizer_spm`) stores no merges: it starts from the
    characters and, again and again, joins the adjacent pair whose joined string is the
    vocabulary entry with the highest score (the leftmost such pair on a tie). A list of ranked
    merges gives the same result if every way of cutting an entry into two entries is a merge,
    and the merges come in the order of their joined entry's score. The cuts of one entry share
    its rank, which a list cannot say; we put the shorter left piece first. The two can disagree
    only where two cuts of one entry overlap in the text (s1|s2|s3 with s1+s2 == s2+s3), which
    we never met: against llama.cpp on Gemma 3's vocabulary both orders gave the same ids for
    12,543 texts, runs of one character up to 40 long and random strings over two or three
    letters among them.

    Gemma 3's 262,144 entries give 514,847 merges in 1.3 s here (the whole tokenizer 2.4 s),
    once per conversion.
    """
    pieces = {t for t, k in zip(tokens, token_types, strict=True) if k not in _NOT_MERGEABLE}
    ranked = sorted(
        (i for i, (t, k) in enumerate(zip(tokens, token_types)) if k not in _NOT_MERGEABLE and len(t) > 1),
        key=lambda i: -scores[i],  # stable: equal scores keep the file's order
    )
    merges, seen = [], set()
    for i in ranked:
        token = tokens[i]
        if token in seen:  # a repeated string: its first (best) rank stands
            continue
        seen.add(token)
        for cut in range(1, len(token)):
            left = token[:cut]
            if left in pieces:
                right = token[cut:]
                if right in pieces:
                    merges.append((left, right))
    return merges


def spm_from_vocab(tokens, scores, token_types, bos_id: int | None = None, add_space_prefix: bool = False):
    """A SentencePiece-style BPE `tokenizers.Tokenizer` from llama.cpp's fields (model 'llama').

    Such a GGUF (Llama 2, Mistral, Gemma) spells words with '▁' for a space, carries one score
    per entry and no merges; `spm_merges` turns the scores into merges. The rest follows what
    llama.cpp does with the same fields:

    - spaces become '▁' before merging, and with `add_space_prefix` each stretch of text
      between two matched tokens starts with one (llama.cpp prefixes every such fragment);
      decoding turns '▁' back into spaces and then drops the first one;
    - a character that no entry holds comes out as its UTF-8 bytes, the '<0xE9>' entries
      (byte fallback), and decoding joins the bytes back into the character;
    - control entries (type 3: '<bos>', '<start_of_turn>') are special tokens, user-defined
      ones (type 4) plain added tokens; both are matched whole in the text before it is
      normalized (llama.cpp matches control text so when asked to parse special tokens, as
      its server does), so Gemma's user-defined runs of 2-31 real spaces, tabs and newlines
      take a stretch of whitespace as one token, the longest first.

    With `bos_id`, encoding with special tokens puts BOS in front, as in `bpe_from_vocab`.

    On Gemma 3 270M's GGUF the ids equal llama-server's /tokenize for all 13,050 texts tried
    (tests/test_tokenizer_spm.py's 507, 2,619 chunks of source code and prose, 9,924 runs and
    random strings). transformers' GGUF loader differs where a run of spaces is longer than 31
    or the text holds a '▁': it respells the runs as '▁▁'... entries and merges them, so 32
    spaces become 16 + 16 there and 31 + 1 here and in llama.cpp.
    """
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as Backend

    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a repeated string keeps its first id, as llama.cpp's lookup does
    unk = next((t for t, k in zip(tokens, token_types) if k == 2), None)
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, token_types),
        unk_token=unk,
        fuse_unk=False,
        byte_fallback=True,
    )
    backend = Backend(model)
    space = normalizers.Replace(" ", "\u2581")
    # No pre-tokenizer: SentencePiece merges across a whole fragment, spaces included.
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if add_space_prefix else space
    )
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    kinds = dict(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds.items() if k == 3]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds.items() if k == 4])
    if bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return backend


# --- the tokenizer of a model directory ---


class Tokenizer:
    """A model directory's tokenizer: `encode`, `decode`, chat template, special ids."""

    def __init__(
        self, backend, *, tokenizer_config=None, model_config=None, generation_config=None, template=None
    ):
        self.backend = backend  # tokenizers.Tokenizer
        self.config = tokenizer_config or {}
        self.template_source = template
        self._template = None
        self._supports_tools = None  # known once asked (supports_tools)
        model_config, generation_config = model_config or {}, generation_config or {}

        bos = _token_text(self.config.get("bos_token"))
        self.bos_id = backend.token_to_id(bos) if bos else None
        if self.bos_id is None:
            self.bos_id = generation_config.get("bos_token_id", model_config.get("bos_token_id"))
        # Whether a plain prompt starts with BOS: tokenizer_config.json's add_bos_token when it
        # says, else what tokenizer.json's post-processor does (Llama 3's adds <|begin_of_text|>
        # there and nowhere else), as transformers' fast tokenizers encode by default.
        if "add_bos_token" in self.config:
            self.add_bos_token = bool(self.config["add_bos_token"])
        else:
            self.add_bos_token = self._post_processor_adds_bos(backend, self.bos_id)

        # Stop on every end token any of the three files names (Llama 3 lists several).
        eos = set()
        for value in (generation_config.get("eos_token_id"), model_config.get("eos_token_id")):
            eos.update(value if isinstance(value, list) else [value])
        eos_text = _token_text(self.config.get("eos_token"))
        eos.add(backend.token_to_id(eos_text) if eos_text else None)
        self.eos_ids = frozenset(int(i) for i in eos if i is not None)

        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # Every special token's text, for templates that write e.g. {{ bos_token }}.
        self.template_vars = {
            name: _token_text(self.config[name])
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if _token_text(self.config.get(name))
        }

    @staticmethod
    def _post_processor_adds_bos(backend, bos_id) -> bool:
        """Whether encoding with special tokens puts `bos_id` in front of a plain text."""
        if bos_id is None:
            return False
        with_special = backend.encode("a", add_special_tokens=True).ids
        plain = backend.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [bos_id] and with_special[1 : 1 + len(plain)] == plain

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise NanoserveError(f"{path} has no tokenizer.json; point at a model directory that has one.")
        try:
            backend = Backend.from_file(str(tokenizer_json))
        except Exception as e:
            raise NanoserveError(
                f"{tokenizer_json} cannot be loaded ({e}); re-download or re-convert it."
            ) from None
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(
            backend,
            tokenizer_config=config,
            model_config=_read_json(path / "config.json"),
            generation_config=_read_json(path / "generation_config.json"),
            template=template,
        )

    def use_template_file(self, path: str | Path) -> None:
        """Render chat messages with the jinja template in `path` instead of the directory's."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise NanoserveError(f"the chat template file {path} does not exist; pass a jinja file.")
        self.template_source, self._template, self._supports_tools = path.read_text(), None, None
        _compile_template(self.template_source)  # a template that does not parse is refused now

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest vocabulary
        entry in UTF-8 bytes (a byte-level entry of k symbols is k bytes of text, at most k
        characters). So a text longer than n * max_token_chars surely takes more than n tokens,
        and the server can refuse it without tokenizing it. (Assumes the normalizer deletes no
        text, true of the byte-level and sentencepiece tokenizers of Llama-family models.)"""
        return max(len(piece.encode()) for piece in self.backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token strings in it ('<|im_start|>') become their ids.

        A BOS id is put in front only if `add_bos` says so, or, when it is None, if
        tokenizer_config.json's add_bos_token does (or, where it is silent, the post-processor).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800" decodes to a lone surrogate, not a character
            raise ValueError(
                f"the text has a lone surrogate at character {e.start} ({text[e.start]!r}), which is not "
                "a character and cannot be tokenized; send valid Unicode"
            ) from None
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos_token if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder maps vocabulary symbols back to bytes (GPT-2's ByteLevel)."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        return any(d.get("type") == "ByteLevel" for d in parts)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its text). For the scores of day 36:
        a token may be part of a character, which no string of its own can show."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode()
        if self._byte_level:
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            except KeyError:  # an added token written as plain text
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """One token as a string: its text when its bytes are whole UTF-8 characters, else
        OpenAI's `bytes:\\xe2\\x80` form (a replacement character would make different
        tokens look alike, and clients key the alternatives of a position by this string)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text for `messages`, as transformers' apply_chat_template(tokenize=False) gives it.

        `tools` (OpenAI tool objects, checked by tools.check_tools) go to the template as they
        are, which writes them into the prompt if it knows how (`supports_tools`). An assistant
        tool call's `arguments`, a JSON string from an OpenAI client, reach it parsed."""
        import jinja2

        if not self.template_source:
            raise NanoserveError(
                "this model has no chat template (a base model); send a plain prompt to /v1/completions "
                "instead of chat messages, or start the server with --chat-template FILE."
            )
        check_messages(messages)
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise NanoserveError(f"tools is {tools!r}; it must be a list of tool objects.")
        if self._template is None:
            self._template = _compile_template(self.template_source)
        try:
            return self._template.render(
                messages=_as_rendered(messages),
                tools=None if tools is None else list(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.template_vars,
            )
        except jinja2.exceptions.TemplateError as e:
            raise NanoserveError(f"the chat template refused these messages: {e}") from None
        except (TypeError, ValueError, LookupError, AttributeError) as e:
            # e.g. a template that adds a null content to a string: the template's limit, not ours
            raise NanoserveError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})."
            ) from None

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template writes tools into the prompt. A template may take `tools`
        in many ways (a loop, a filter, a macro), so rather than read its source we render a
        one-message conversation with a probe tool and look for the tool's name in the text.
        Asked once per template (use_template_file forgets the answer)."""
        if self._supports_tools is None:
            try:
                text = self.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL])
            except NanoserveError:
                text = ""
            self._supports_tools = _PROBE_TOOL["function"]["name"] in text
        return self._supports_tools

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        # The template writes any BOS itself; adding another would double it (transformers agrees).
        text = self.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.encode(text, add_bos=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Generated ids in, final text out, one token at a time.

    Decoding a lone token is wrong in two ways: a character split over byte tokens decodes to
    U+FFFD, and decoders that strip a leading space (sentencepiece) drop it. So each step decodes
    a short window twice, `ids[prefix:read]` (already emitted) and `ids[prefix:]`, and emits the
    difference (vLLM's prefix/read offsets). While the window's text ends in U+FFFD the bytes so
    far are an unfinished character and nothing is emitted. The window then restarts at a clean
    character boundary, so the cost per token stays constant and

        "".join(add(i) for i in ids) + flush() == tokenizer.decode(ids)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window: a character boundary
        self.read = 0  # end of what has been emitted
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._pieces: list[str] = []  # what has been emitted, kept as pieces: no copy a token
        self.chars = 0  # len(self.text), kept as a count

    @property
    def text(self) -> str:
        """Everything emitted so far (joined when asked, not on every token)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _emit(self, window: str) -> str:
        """Emit `window` (= decode(ids[prefix:])) past what is already out, and slide the window."""
        delta = window[len(self._prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self.prefix : self.read])
        if delta:
            self._pieces.append(delta)
            self.chars += len(delta)
        return delta

    def add(self, token_id: int) -> str:
        """The text that `token_id` makes final; "" while a character is still incomplete."""
        self.ids.append(int(token_id))
        window = self._decode(self.ids[self.prefix :])
        return "" if window.endswith(REPLACEMENT) else self._emit(window)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character comes out as U+FFFD, as decode gives it)."""
        return self._emit(self._decode(self.ids[self.prefix :])) if self.read < len(self.ids) else ""
