"""Tool calling (issue 32): OpenAI's `tools` and `tool_choice` on a model that writes Qwen's calls.

A chat request may offer the model functions to call. The chat template writes them into the
prompt (tokenizer.py passes `tools` to it; `Tokenizer.supports_tools` says whether a template
knows how), and the model answers with text, with calls, or with both. A call is a block that
Qwen2.5's template teaches, and that Hermes-style models share:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several of them one after another when it calls several functions. Nothing in the engine knows
about tools; this module stands on either side of it:

- `check_tools` refuses a request whose tools or tool_choice are malformed, as an
  `InvalidParam` naming the field (the server's 400), before anything is rendered.
- `tool_grammar` turns tool_choice "required" or a named function into a Lark grammar for
  llguidance that admits only call blocks, each call's arguments held to its function's JSON
  schema, so the model cannot answer in prose or call a function that does not exist. "auto"
  leaves the model free; "none" does too, and the handler then does not render the tools at all.
- `parse_tool_calls` splits a finished answer into its text and OpenAI's `tool_calls`;
  `ToolCallStream` does the same piece by piece for a streamed one, and the two agree on every
  text however it is cut.

A block the model wrote badly (JSON that does not parse, no function name) is not an error: it
stays in the text, where the client sees what the model wrote. Only a grammar makes the blocks
certain; under "auto" they are the model's best effort.

In Qwen's vocabulary `<tool_call>` and `</tool_call>` are added tokens (151657, 151658) that
our tokenizer encodes whole; llguidance counts every added token as special and matches one
only by a token reference (`<tool_call>` in Lark, unquoted), never by its text spelled in
ordinary tokens. So the grammar names them as tokens: what the model samples is then the same
single token the template put in the prompt, and it decodes to the text the parsers look for.
"""

from __future__ import annotations

import json
import re
import secrets

from nanoserve.sampling import InvalidParam

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # OpenAI's limit on a request's tools
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function name
BLOCK = re.compile(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), re.DOTALL)

# How the arguments are spelled: as Qwen's template writes them in the prompt (jinja's tojson,
# json.dumps' separators) and with no whitespace elsewhere, so a model cannot run on in spaces
# or newlines inside a call (llguidance's default allows any amount of JSON whitespace).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# --- the request ---


def check_tools(tools, tool_choice, supports_tools: bool) -> None:
    """Raise an InvalidParam ("tools" or "tool_choice") unless the request's tools and
    tool_choice are well formed and this model can take them.

    `tools` is None or a list of {"type": "function", "function": {"name", "description",
    "parameters"}}, with distinct names, `parameters` a JSON schema of an object. An empty list
    counts as no tools. `tool_choice` is None (OpenAI's default: "auto" with tools, "none"
    without), "none", "auto", "required" or {"type": "function", "function": {"name": ...}};
    the last three need tools, and a named function must be one of them. A model whose chat
    template writes no tools (`supports_tools` False) is refused tools unless tool_choice is
    "none", which keeps them out of the prompt anyway.

    The schemas are checked lightly (an object, of type "object" if it says): jsonschema is
    not a runtime dependency, and llguidance reports a schema it cannot compile when the
    grammar is built.
    """
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise InvalidParam("tools", f"tools must be a list of tool objects, not {type(tools).__name__}")
    tools = list(tools or [])
    if len(tools) > MAX_TOOLS:
        raise InvalidParam(
            "tools", f"a request may offer at most {MAX_TOOLS} tools, this one has {len(tools)}"
        )
    names = [_check_tool(i, tool) for i, tool in enumerate(tools)]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidParam(
                "tools", f"tools {names.index(name)} and {i} are both named {name!r}; names must differ"
            )

    named = _named_choice(tool_choice)
    if tool_choice is not None and named is None and tool_choice not in TOOL_CHOICES:
        raise InvalidParam(
            "tool_choice",
            f"tool_choice is {tool_choice!r}; it must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
        )
    if tools and tool_choice != "none" and not supports_tools:
        raise InvalidParam(
            "tools",
            "this model's chat template has no tools, so the model would never see them; send the "
            "request without tools (or with tool_choice 'none'), or start the server with a "
            "--chat-template that renders tools",
        )
    if not tools and tool_choice not in (None, "none"):  # OpenAI and vLLM refuse it too
        what = repr(tool_choice) if named is None else f"the function {named!r}"
        raise InvalidParam("tool_choice", f"tool_choice is {what} but the request has no tools")
    if named is not None and named not in names:
        raise InvalidParam("tool_choice", f"tool_choice names {named}, which is not among the tools")


def _check_tool(i: int, tool) -> str:
    """Tool `i`'s function name, or an InvalidParam saying what is wrong with it."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise InvalidParam(
            "tools",
            f"tool {i} is {_short(tool)}; a tool is {{'type': 'function', 'function': {{'name': ..., "
            "'description': ..., 'parameters': ...}}}",
        )
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidParam(
            "tools",
            f"tool {i}'s name is {_short(name)}; a function name is 1 to 64 letters, digits, "
            "underscores or dashes",
        )
    if not isinstance(function.get("description", ""), str):
        raise InvalidParam("tools", f"tool {i} ({name})'s description must be a string")
    params = function.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise InvalidParam(
            "tools",
            f"tool {i} ({name})'s parameters are {_short(params)}; they must be a JSON schema of an "
            "object, such as {'type': 'object', 'properties': {...}}",
        )
    if params is not None and not isinstance(params.get("properties", {}), dict):
        raise InvalidParam("tools", f"tool {i} ({name})'s parameters have properties that are not an object")
    return name


def _named_choice(tool_choice) -> str | None:
    """The function a tool_choice object names; None for a string or anything malformed."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the grammar ---


def tool_grammar(tools, tool_choice, parallel: bool = True) -> str | None:
    """A Lark grammar (llguidance's dialect) that admits only tool-call blocks, or None.

    tool_choice "required": one or more calls of any of the tools, separated by a newline (and
    optionally closed by one), or exactly one when `parallel` is False (OpenAI's
    parallel_tool_calls);
    a named function: exactly one call of it. Each call is spelled as Qwen's template writes
    one, and its arguments obey the function's `parameters` (a function without parameters
    takes {}). "auto" and "none" (and None) constrain nothing and get None; under "none" the
    handler also leaves the tools out of the prompt, so the model does not know of them.
    Expects tools and tool_choice that passed `check_tools`. For tool_choice "required" and
    the tools get_weather and get_time:

        start: call ("\\n" call)* "\\n"?
        call: call_0 | call_1
        call_0: <tool_call> "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " args_0 "}\\n" </tool_call>
        args_0: %json {"type": "object", "properties": {"city": {"type": "string"}}, ...}
        call_1: ...

    The grammar ends after the last block; the matcher then allows the end token (the
    llguidance tokenizer must know it: `eos_token=` the template's end of turn, <|im_end|>).
    """
    named = _named_choice(tool_choice)
    if named is not None:
        chosen = [t for t in tools if t["function"]["name"] == named]
        start = "start: call_0"
    elif tool_choice == "required" and not parallel:  # parallel_tool_calls false: one call
        chosen = list(tools)
        start = "start: call\ncall: " + " | ".join(f"call_{i}" for i in range(len(chosen)))
    elif tool_choice == "required":
        chosen = list(tools)
        # a newline may close the calls: Qwen2.5-Coder-0.5B, greedy, writes one after a call and,
        # made to choose between another call and the end token there, called get_weather four
        # times until max_tokens; offered the newline, it takes it and then the end token
        start = 'start: call ("\\n" call)* "\\n"?\ncall: ' + " | ".join(
            f"call_{i}" for i in range(len(chosen))
        )
    else:
        return None
    rules = [start]
    for i, tool in enumerate(chosen):
        head = json.dumps(f'\n{{"name": "{tool["function"]["name"]}", "arguments": ')
        rules.append(f'call_{i}: <tool_call> {head} args_{i} "}}\\n" </tool_call>')
        rules.append(f"args_{i}: %json {json.dumps(_arguments_schema(tool['function'].get('parameters')))}")
    return "\n".join(rules) + "\n"


def _arguments_schema(parameters: dict | None) -> dict:
    """The JSON schema of one call's arguments: the function's parameters (an object even when
    they leave the type out) in `JSON_STYLE`; no parameters: the empty object."""
    if parameters is None:
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
    else:
        schema = {**parameters, "type": "object"}
    return {**schema, "x-guidance": {**(schema.get("x-guidance") or {}), **JSON_STYLE}}


# --- the answer ---


def new_call_id() -> str:
    """An id for one tool call, in OpenAI's shape: call_ and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def _call(block: str) -> dict | None:
    """An OpenAI tool call from the inside of one block, or None if the model wrote it badly:
    not a JSON object, no string name, or arguments that are not an object (absent: {})."""
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": data["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished answer.

    Each well-formed <tool_call> block becomes an OpenAI tool call (its arguments re-serialized
    as a JSON string, as OpenAI sends them); everything else, badly written blocks and an
    unclosed one included, is the content, joined and stripped of whitespace at both ends
    (None when nothing is left). A block ends at the first </tool_call> after its start.
    """
    pieces, calls, at = [], [], 0
    for m in BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue  # stays in the text between `at` and the next good block
        pieces.append(text[at : m.start()])
        calls.append(call)
        at = m.end()
    pieces.append(text[at:])
    return "".join(pieces).strip() or None, calls


class ToolCallStream:
    """`parse_tool_calls` for a streamed answer: text pieces in, chat-chunk deltas out.

        s = ToolCallStream()
        s.feed("Checking.\\n<tool")   -> [{"content": "Checking."}]   "\\n<tool" may be a block: held
        s.feed('_call>\\n{"name": "f", "arguments": {}}\\n</tool_call>')
                                     -> [{"tool_calls": [{"index": 0, "id": ..., "type": "function",
                                            "function": {"name": "f", "arguments": "{}"}}]}]
        s.finish()                   -> []                           s.called is True

    Text goes out as {"content": ...} as soon as it cannot be the start of a block (a suffix
    that could begin "<tool_call>" waits for the next piece). A call goes out whole, in one
    delta, once its block closes: OpenAI and vLLM stream the arguments in pieces, but a client
    must join those pieces before it can use them, so one delta is the same to it and spares
    us a partial-JSON parser. A block that closes badly written goes out as content, as it
    stays in `parse_tool_calls`' content. To agree with that content's stripping, whitespace
    before the first text is dropped and whitespace is held back until more text follows it
    (so whitespace at the end never goes out). `finish` releases what is held: an unclosed
    block, as content. Joined, the content deltas equal parse_tool_calls' content, and the
    calls its calls (but for the ids), however the text was cut into pieces.
    """

    def __init__(self):
        self.buffer = ""  # text not yet released: a partial "<tool_call>", or an open block
        self.in_block = False
        self.spaces = ""  # whitespace held back after released text
        self.started = False  # some content went out (whitespace before it is dropped)
        self.calls = 0

    @property
    def called(self) -> bool:
        """Whether a tool call went out (the handler's finish_reason is then "tool_calls")."""
        return self.calls > 0

    def feed(self, piece: str) -> list[dict]:
        """The deltas that `piece` makes final, in order."""
        self.buffer += piece
        out: list[dict] = []
        while True:
            if self.in_block:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                block, self.buffer = self.buffer[: end + len(CLOSE)], self.buffer[end + len(CLOSE) :]
                self.in_block = False
                call = _call(block[len(OPEN) : -len(CLOSE)])
                if call is None:
                    self._content(block, out)
                else:
                    out.append({"tool_calls": [{"index": self.calls, **call}]})
                    self.calls += 1
            else:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = _partial_open(self.buffer)
                    self._content(self.buffer[: len(self.buffer) - keep], out)
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                self._content(self.buffer[:start], out)
                self.buffer, self.in_block = self.buffer[start:], True
        return out

    def finish(self) -> list[dict]:
        """What is still held, once the answer is complete: a partial tag or an unclosed block
        is text after all. Whitespace at the end is dropped."""
        out: list[dict] = []
        self._content(self.buffer, out)
        self.buffer, self.in_block, self.spaces = "", False, ""
        return out

    def _content(self, text: str, out: list[dict]) -> None:
        """Release `text` as content, minus whitespace that may turn out to be the end."""
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            if self.started:
                self.spaces += text
            return
        delta = self.spaces + body
        self.spaces, self.started = text[len(body) :], True
        if out and "content" in out[-1]:
            out[-1]["content"] += delta
        else:
            out.append({"content": delta})


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of "<tool_call>"."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
