"""tools.py and the tokenizer's tools: requests checked, prompts as transformers renders them,
grammars that admit only correct calls (llguidance on the real Qwen tokenizer), and the two
parsers agreeing on every way a streamed answer can be cut."""

import copy
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.errors import NanoserveError
from nanoserve.fetch import nanoserve_home
from nanoserve.sampling import InvalidParam
from nanoserve.tokenizer import Tokenizer
from nanoserve.tools import ToolCallStream, check_tools, parse_tool_calls, tool_grammar

QWEN_DIR = nanoserve_home() / "models" / "Qwen2.5-Coder-0.5B-Instruct"
IM_END, TOOL_CALL = 151645, 151657

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'The weather in a city; answers {"temp": ...}\nin degrees.',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get-time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}},
            "required": ["zone"],
            "$defs": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: takes {}
TOOLS = [WEATHER, TIME, NOW]


def block(name: str, arguments) -> str:
    """A call as Qwen's template writes it (and as the grammar spells it)."""
    arguments = json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


PARIS = block("get_weather", {"city": "Paris", "days": 3})


@pytest.fixture(scope="module")
def qwen():
    if not (QWEN_DIR / "tokenizer.json").is_file():
        pytest.skip(f"{QWEN_DIR} is not on disk (nanoserve fetch-model qwen2.5-coder-0.5b-instruct)")
    return Tokenizer.from_dir(QWEN_DIR)


@pytest.fixture(scope="module")
def hf_qwen(qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN_DIR)


@pytest.fixture(scope="module")
def llg(qwen):
    """llguidance's tokenizer for Qwen, with the end of turn as its end token."""
    llguidance = pytest.importorskip("llguidance")
    n_vocab = json.loads((QWEN_DIR / "config.json").read_text())["vocab_size"]
    return llguidance.LLTokenizer(qwen.backend.to_str(), n_vocab=n_vocab, eos_token=IM_END)


def matcher(llg, grammar):
    import llguidance

    m = llguidance.LLMatcher(llg, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(qwen, llg, grammar, text) -> bool:
    """Whether the grammar takes our tokenizer's ids of `text` and then the end of turn."""
    m = matcher(llg, grammar)
    return m.consume_tokens(qwen.encode(text, add_bos=False)) and m.consume_token(IM_END) and m.is_accepting()


# --- the tokenizer: tools and tool calls in the prompt ---


CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Weather in Paris and in 東京, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "東京"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25}'},
    {
        "role": "assistant",
        "content": "Let me check the time.",
        "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
    },
    {"role": "tool", "content": "12:00"},
    {"role": "assistant", "content": "18 C in Paris, 25 C in 東京, at noon."},
    {"role": "user", "content": "Thanks!"},
]


def as_transformers_takes_it(messages):
    """transformers renders arguments as given: it wants them as dicts."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def test_tools_and_tool_calls_render_as_transformers_renders_them(qwen, hf_qwen):
    sent = copy.deepcopy(CONVERSATION)
    theirs = as_transformers_takes_it(CONVERSATION)
    for prompt in (True, False):
        want = hf_qwen.apply_chat_template(theirs, tools=TOOLS, tokenize=False, add_generation_prompt=prompt)
        assert qwen.apply_chat_template(CONVERSATION, add_generation_prompt=prompt, tools=TOOLS) == want
    want = hf_qwen.apply_chat_template(theirs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert qwen.encode_chat(CONVERSATION, tools=TOOLS) == hf_qwen.encode(want, add_special_tokens=False)
    assert '"arguments": {"city": "東京"}' in want and "<tool_response>\n12:00\n</tool_response>" in want
    assert CONVERSATION == sent  # the caller's arguments stay strings
    # no tools: the template's plain system prompt, as before; positional use still works
    plain = [{"role": "user", "content": "Hi"}]
    assert qwen.apply_chat_template(plain, False) == hf_qwen.apply_chat_template(plain, tokenize=False)
    assert "# Tools" not in qwen.apply_chat_template(plain) and "# Tools" in qwen.apply_chat_template(
        plain, True, TOOLS
    )


def test_a_call_parsed_from_an_answer_renders_back_to_the_same_text(qwen):
    answer = PARIS + "\n" + block("now", {})
    content, calls = parse_tool_calls(answer)
    assert content is None
    history = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": content, "tool_calls": calls},
    ]
    assert f"<|im_start|>assistant\n{answer}<|im_end|>" in qwen.apply_chat_template(history, tools=TOOLS)


def test_which_templates_render_tools(qwen, smollm_dir, tmp_path):
    assert qwen.supports_tools is True
    smol = Tokenizer.from_dir(smollm_dir)
    assert smol.supports_tools is False
    assert Tokenizer(qwen.backend, template=None).supports_tools is False  # no template at all
    gemma = nanoserve_home() / "models" / "gemma-3-270m"
    if (gemma / "tokenizer.json").is_file():
        assert Tokenizer.from_dir(gemma).supports_tools is False  # a base model: no template
    # a template that takes `tools` its own way; and one that fails on them counts as none
    assert Tokenizer(qwen.backend, template="{{ tools | map(attribute='function') | list }}").supports_tools
    assert not Tokenizer(qwen.backend, template="{{ tools[0].nope.deeper }}").supports_tools
    # the answer belongs to the template: another one is asked again
    path = tmp_path / "t.jinja"
    path.write_text("{% for t in tools %}{{ t.function.name }}{% endfor %}")
    smol.use_template_file(path)
    assert smol.supports_tools is True


def test_messages_of_tool_calling_are_taken(qwen):
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    for messages in (
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [call]}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call]}],  # content absent
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        [{"role": "user", "content": "a"}, {"role": "tool", "content": "b", "tool_call_id": "c"}],
        [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
    ):
        assert qwen.apply_chat_template(messages, tools=TOOLS).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "message, says",
    [
        ({"role": "user", "content": None}, "only an assistant's may be null"),
        ({"role": "system", "content": None}, "only an assistant's may be null"),
        ({"role": "tool", "content": None, "tool_call_id": "c"}, "only an assistant's may be null"),
        ({"role": "tool", "tool_call_id": "c"}, "only an assistant's may be null"),
        ({"role": "tool", "content": "x", "tool_call_id": 7}, "tool_call_id is 7"),
        ({"role": "assistant", "content": None}, "no content and no tool calls"),
        ({"role": "assistant", "content": None, "tool_calls": []}, "no content and no tool calls"),
        ({"role": "assistant", "content": ["x"]}, "must be a string or null"),
        ({"role": "assistant", "content": None, "tool_calls": {"a": 1}}, "must be a list of tool calls"),
        ({"role": "assistant", "tool_calls": ["now"]}, "tool call 0 is 'now'"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "a tool call is"),
        (
            {"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]},
            "a tool call is",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{city: Paris}"}}]},
            "arguments '{city: Paris}'; they must be a JSON object",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]},
            "must be a JSON object",
        ),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}, "JSON object"),
    ],
)
def test_malformed_tool_messages_are_refused_with_their_index(qwen, message, says):
    with pytest.raises(NanoserveError, match="message 1") as e:
        qwen.apply_chat_template([{"role": "user", "content": "a"}, message], tools=TOOLS)
    assert says in str(e.value)


def test_a_template_that_fails_on_tool_messages_is_a_sentence(qwen):
    # Qwen's own template adds an assistant's content to a string unless it made tool calls
    strict = Tokenizer(qwen.backend, template="{% for m in messages %}{{ m.content + '!' }}{% endfor %}")
    call = {"function": {"name": "now", "arguments": "{}"}}
    with pytest.raises(NanoserveError, match="the chat template failed on these messages"):
        strict.apply_chat_template([{"role": "assistant", "content": None, "tool_calls": [call]}])
    with pytest.raises(NanoserveError, match="tools is 'now'; it must be a list"):
        qwen.apply_chat_template([{"role": "user", "content": "a"}], tools="now")


# --- check_tools ---


def test_good_requests_pass():
    for tools, choice, supports in [
        (None, None, False),
        (None, "none", True),
        ([], "none", False),
        (TOOLS, None, True),
        (TOOLS, "auto", True),
        (TOOLS, "required", True),
        (TOOLS, {"type": "function", "function": {"name": "get-time"}}, True),
        (TOOLS, "none", False),  # never rendered, so the template need not know tools
        (
            [{"type": "function", "function": {"name": "a" * 64, "parameters": {"properties": {}}}}],
            "auto",
            True,
        ),
    ]:
        check_tools(tools, choice, supports)


def named(name):
    return {"type": "function", "function": {"name": name}}


def tool(**function):
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "tools, choice, supports, param, says",
    [
        (TOOLS, None, False, "tools", "this model's chat template has no tools"),
        (TOOLS, "required", False, "tools", "this model's chat template has no tools"),
        ({"get_weather": WEATHER}, None, True, "tools", "tools must be a list"),
        ([WEATHER["function"]], None, True, "tools", "tool 0 is"),
        ([{"type": "retrieval", "function": WEATHER["function"]}], None, True, "tools", "tool 0 is"),
        ([WEATHER, tool()], None, True, "tools", "tool 1's name is None"),
        ([tool(name="get weather")], None, True, "tools", "letters, digits, underscores or dashes"),
        ([tool(name="")], None, True, "tools", "1 to 64"),
        ([tool(name="a" * 65)], None, True, "tools", "1 to 64"),
        ([tool(name="f", description=3)], None, True, "tools", "description must be a string"),
        ([tool(name="f", parameters="{}")], None, True, "tools", "must be a JSON schema of an object"),
        ([tool(name="f", parameters={"type": "string"})], None, True, "tools", "JSON schema of an object"),
        ([tool(name="f", parameters={"properties": []})], None, True, "tools", "properties that are not"),
        ([WEATHER, TIME, WEATHER], None, True, "tools", "tools 0 and 2 are both named 'get_weather'"),
        ([tool(name=f"f{i}") for i in range(129)], None, True, "tools", "at most 128 tools"),
        (TOOLS, "any", True, "tool_choice", "tool_choice is 'any'; it must be"),
        (TOOLS, {"type": "function"}, True, "tool_choice", "it must be"),
        (TOOLS, {"function": {"name": "now"}}, True, "tool_choice", "it must be"),
        (TOOLS, named("get_wether"), True, "tool_choice", "names get_wether, which is not among the tools"),
        (None, "required", True, "tool_choice", "tool_choice is 'required' but the request has no tools"),
        ([], "auto", True, "tool_choice", "tool_choice is 'auto' but the request has no tools"),
        ([], named("now"), True, "tool_choice", "the function 'now' but the request has no tools"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(tools, choice, supports, param, says):
    with pytest.raises(InvalidParam) as e:
        check_tools(tools, choice, supports)
    assert e.value.param == param and says in str(e.value)


# --- tool_grammar ---


def test_no_grammar_unless_a_call_is_required():
    for choice in (None, "auto", "none"):
        assert tool_grammar(TOOLS, choice) is None


def test_the_grammar_of_a_named_function():
    g = tool_grammar(TOOLS, named("get_weather"))
    lines = g.splitlines()
    assert lines[:2] == [
        "start: call_0",
        r'call_0: <tool_call> "\n{\"name\": \"get_weather\", \"arguments\": " args_0 "}\n" </tool_call>',
    ]
    schema = json.loads(lines[2].removeprefix("args_0: %json "))
    assert schema["properties"] == WEATHER["function"]["parameters"]["properties"]
    assert schema["x-guidance"] == {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }
    assert len(lines) == 3
    assert "parameters" not in WEATHER["function"]["parameters"]  # the tool itself is untouched


def test_the_grammars_compile_for_qwen_and_force_the_call_token(qwen, llg):
    for choice in ("required", named("get_weather"), named("get-time"), named("now")):
        m = matcher(llg, tool_grammar(TOOLS, choice))
        assert m.compute_ff_tokens()[0] == TOOL_CALL  # the one token the template writes, not "<", "tool"...
    assert qwen.encode("<tool_call>", add_bos=False) == [TOOL_CALL]


def test_a_named_grammar_takes_exactly_one_correct_call(qwen, llg):
    g = tool_grammar(TOOLS, named("get_weather"))
    assert accepts(qwen, llg, g, PARIS)
    assert accepts(qwen, llg, g, block("get_weather", {"city": 'Zürich "Nord"\n', "unit": "C"}))
    for wrong in [
        PARIS.replace("get_weather", "get_wether"),  # a wrong name
        block("get-time", {"zone": "Europe/Paris"}),  # another tool
        block("get_weather", {"days": 3}),  # a required argument missing
        block("get_weather", {"city": "Paris", "days": "3"}),  # the wrong type
        block("get_weather", {"city": "Paris", "days": 8}),  # out of range
        block("get_weather", {"city": "Paris", "unit": "K"}),  # not in the enum
        block("get_weather", {"city": "Paris", "country": "FR"}),  # additionalProperties: false
        PARIS.replace('"days": 3', '"days":3'),  # not the template's spelling
        PARIS.replace("\n</tool_call>", "</tool_call>"),
        "Sure: " + PARIS,  # prose first
        PARIS + "\n" + PARIS,  # a second call
        PARIS[:-5],  # unfinished
    ]:
        assert not accepts(qwen, llg, g, wrong), wrong


def test_required_takes_one_or_more_calls_of_any_tool(qwen, llg):
    g = tool_grammar(TOOLS, "required")
    time, now = block("get-time", {"zone": "Europe/Paris"}), block("now", {})
    assert accepts(qwen, llg, g, PARIS)
    assert accepts(qwen, llg, g, f"{PARIS}\n{time}\n{now}")
    for wrong in [
        "",  # no call at all
        "It is sunny.",
        block("get-time", {"zone": "europe/paris"}),  # the $ref'd pattern
        block("now", {"a": 1}),  # no parameters: only {}
        block("sleep", {}),  # not a tool
        f"{PARIS}{time}",  # calls not separated by a newline
        f"{PARIS}\n\n{time}",
    ]:
        assert not accepts(qwen, llg, g, wrong), wrong


def test_parallel_tool_calls_false_takes_exactly_one_call(qwen, llg):
    g = tool_grammar(TOOLS, "required", parallel=False)
    time = block("get-time", {"zone": "Europe/Paris"})
    assert accepts(qwen, llg, g, PARIS) and accepts(qwen, llg, g, time)
    assert not accepts(qwen, llg, g, f"{PARIS}\n{time}")  # two calls: what parallel allows
    assert accepts(qwen, llg, tool_grammar(TOOLS, "required"), f"{PARIS}\n{time}")


# --- parse_tool_calls ---

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def names_and_arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_are_parsed_out_of_an_answer():
    text = "Let me look.\n" + PARIS + "\n" + block("get-time", {"zone": "Asia/東京"}) + "\n"
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert names_and_arguments(calls) == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get-time", {"zone": "Asia/東京"}),
    ]
    assert calls[1]["function"]["arguments"] == '{"zone": "Asia/東京"}'  # not \\u escapes
    assert all(c["type"] == "function" and CALL_ID.fullmatch(c["id"]) for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert (
        parse_tool_calls('<tool_call>\n{"name": "now"}\n</tool_call>')[1][0]["function"]["arguments"] == "{}"
    )
    assert parse_tool_calls("  Just text.\n") == ("Just text.", [])
    assert parse_tool_calls("") == (None, []) and parse_tool_calls(" \n") == (None, [])


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n{name: get_weather}\n</tool_call>",  # not JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "{}"}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["f", {}]\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}}',  # never closed
    ],
)
def test_a_badly_written_block_stays_in_the_content(bad):
    assert parse_tool_calls(f" {bad}\n") == (bad, [])
    content, calls = parse_tool_calls(f"Before. {bad} {PARIS}")
    if "</tool_call>" in bad:
        assert content == f"Before. {bad}"
        assert names_and_arguments(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    else:  # an unclosed block runs to the good one's end, and is no call as a whole
        assert (content, calls) == (f"Before. {bad} {PARIS}", [])


# --- ToolCallStream ---


def streamed(pieces):
    """(content, calls, the stream) of feeding `pieces` and finishing."""
    s = ToolCallStream()
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls = [c for d in deltas if "tool_calls" in d for c in d["tool_calls"]]
    assert all(len(d) == 1 and (d.get("content") or len(d.get("tool_calls", ())) == 1) for d in deltas)
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert all(CALL_ID.fullmatch(c["id"]) and c["type"] == "function" for c in calls)
    return content or None, calls, s


def same_as_parsed(text, pieces):
    content, calls, s = streamed(pieces)
    want_content, want_calls = parse_tool_calls(text)
    assert content == want_content, (text, pieces)
    assert names_and_arguments(calls) == names_and_arguments(want_calls), (text, pieces)
    assert s.called == bool(want_calls)


def test_a_stream_sends_text_at_once_and_a_call_when_its_block_closes():
    s = ToolCallStream()
    assert s.feed("Checking") == [{"content": "Checking"}]
    assert s.feed(" the weather.\n<tool") == [{"content": " the weather."}]  # "\n<tool" held
    assert s.feed('_call>\n{"name": "get_weather", ') == []
    delta, after = s.feed('"arguments": {"city": "Paris"}}\n</tool_call>\nDone')
    assert delta["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert delta["tool_calls"][0]["index"] == 0 and s.called
    assert after == {"content": "\n\nDone"}  # the held newline goes out in front of more text
    assert s.feed("\n") == [] and s.finish() == []  # whitespace at the end never does


def test_a_stream_lets_out_what_is_not_a_block():
    s = ToolCallStream()
    assert s.feed("a <b> <tool") == [{"content": "a <b>"}]
    assert s.feed("box>") == [{"content": " <toolbox>"}]  # not a tag after all
    assert s.feed("<tool_call>\n{broken}\n</tool_call>") == [
        {"content": "<tool_call>\n{broken}\n</tool_call>"}
    ]
    assert s.feed('<tool_call>\n{"name": "f"') == []
    assert s.finish() == [{"content": '<tool_call>\n{"name": "f"'}]  # never closed: text
    assert not s.called


ATOMS = [
    "Sure",
    "Let me check.",
    " ",
    "\n",
    "\n\n",
    "東京 😀",
    "<",
    "<tool",
    "</tool_call>",
    "<tool_call>",
    "<tool_call>\n",
    PARIS,
    block("now", {}),
    block("get-time", {"zone": "Asia/東京"}),
    "<tool_call>\n{oops}\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
]


@pytest.mark.parametrize(
    "text",
    [
        "Let me check.\n" + PARIS + "\n" + block("now", {}) + "\n",
        PARIS + "\n\nThe weather is fine, " + block("now", {}),
        "  <tool_call>\n{oops}\n</tool_call> <tool_call>x" + PARIS,
        "a <tool_ca b </tool_call> <tool_call> c <tool_call>" + PARIS + " d",
        " \n ",
    ],
)
def test_a_stream_cut_anywhere_gives_the_parsed_answer(text):
    same_as_parsed(text, [text])
    same_as_parsed(text, list(text))  # a character at a time
    for cut in range(len(text) + 1):
        same_as_parsed(text, [text[:cut], text[cut:]])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ATOMS), max_size=10), st.data())
def test_any_answer_cut_any_way_streams_as_it_parses(atoms, data):
    text = "".join(atoms)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    same_as_parsed(text, pieces)
