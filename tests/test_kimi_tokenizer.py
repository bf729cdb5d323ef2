"""Kimi K3 tokenizer and XTML chat format, on a tiny hand-made rank file (no downloads)."""

from __future__ import annotations

import base64
import json

import pytest

from deltafin.errors import CheckpointError, UsageError
from deltafin.tokenizers.kimi_k3 import KimiTokenizer, pretokenize, split_long_runs
from deltafin.tokenizers.xtml import Segment, encode_chat, render, render_text

# Ranks 0..255 are the single bytes (rank == byte value); these merges follow from 256.
MERGES = [
    b"ss",  # 256
    b"me",  # 257
    b"mess",  # 258
    b"ag",  # 259
    b"age",  # 260
    b"message",  # 261
    b"34",  # 262: would merge across the 3-digit cut in "1234"
    b"\x87a",  # 263: last byte of "文" + "a": would merge across the Han/latin cut
]
SS, ME, MESSAGE, D34, HAN_A = 256, 257, 261, 262, 263

BOS, EOS, END_OF_MSG, OPEN, CLOSE, SEP = 163584, 163585, 163586, 163587, 163588, 163589


def raw(text: str) -> list[int]:
    """Byte ids, for spans where no merge in MERGES applies (checked by eye for each use)."""
    return list(text.encode("utf-8"))


def write_ranks(path, tokens: list[bytes]) -> None:
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for rank, tok in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def model_dir(tmp_path):
    write_ranks(tmp_path / "tiktoken.model", [bytes([b]) for b in range(256)] + MERGES)
    return tmp_path


@pytest.fixture
def tok(model_dir):
    return KimiTokenizer.from_dir(model_dir)


# ---- tokenizer ----------------------------------------------------------------------------------


def test_round_trip_mixed_text(tok):
    text = "Hello, 世界! 1234567 don't\tstop\r\n\n  spaced  中文abc <|open|> émoji 🙂 end.\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(i < tok.num_base_tokens for i in ids)


def test_merges_apply_within_a_piece(tok):
    assert tok.encode("message") == [MESSAGE]
    assert tok.encode("me ss") == [ME, 32, SS]
    assert tok.encode("34") == [D34]


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Hello World123456 中文abc", ["Hello", " World", "123", "456", " ", "中文", "abc"]),
        ("我爱Python编程", ["我爱", "Python", "编程"]),
        ("don't I'LL XMLHttpRequest", ["don't", " I'LL", " XMLHttp", "Request"]),
        ("a, b!!\n\nc", ["a", ",", " b", "!!\n\n", "c"]),
        ("x   y", ["x", "  ", " y"]),
        ("1234567", ["123", "456", "7"]),
        ("end.\n", ["end", ".\n"]),
    ],
)
def test_pretokenize_splits(text, pieces):
    assert pretokenize(text) == pieces


def test_bpe_never_merges_across_pieces(tok):
    # "34" and "\x87a" are merges, but the split puts "3"|"4" and "文"|"a" in different pieces.
    assert tok.encode("1234") == raw("1234")
    assert tok.encode("文a") == raw("文a")
    assert tok.encode("34") == [D34]
    # tiktoken's own split agrees with pretokenize() on text that exercises every rule.
    text = "1234 中文abc I'LL x   y!!\n\nme34 ss"
    assert tok.encode(text) == [i for piece in pretokenize(text) for i in tok.encode(piece)]


def test_long_runs_are_cut():
    assert list(split_long_runs("aaaaa  b", limit=2)) == ["aa", "aa", "a  b"]
    assert list(split_long_runs("", limit=2)) == [""]


def test_specials_only_when_allowed(tok):
    assert tok.encode("<|open|>", allow_special=True) == [OPEN]
    assert tok.encode("<|open|>") == raw("<|open|>")
    assert tok.encode("hi<|end_of_msg|>", allow_special=True) == [*raw("hi"), END_OF_MSG]
    assert tok.encode("<|reserved_token_163600|>", allow_special=True) == [163600]


def test_special_table_from_spec(tok):
    assert tok.eos_id == END_OF_MSG == 163586
    assert tok.vocab_size == 163840
    assert tok.token_to_id("[BOS]") == BOS
    assert tok.token_to_id("<|sep|>") == SEP
    assert tok.token_to_id("<|media_pad|>") == 163605
    assert tok.token_to_id("[PAD]") == 163839
    assert tok.id_to_token(163592) == "<|reserved_token_163592|>"
    assert tok.id_to_token(MESSAGE) == "message"
    assert tok.token_to_id("message") == MESSAGE
    assert tok.decode([OPEN, MESSAGE, SEP, END_OF_MSG]) == "<|open|>message<|sep|><|end_of_msg|>"


def test_special_table_from_tokenizer_config(model_dir):
    decoder = {
        "163584": {"content": "[BOS]", "special": True},
        "163586": {"content": "<|end_of_msg|>", "special": True},
        "163587": {"content": "<|open|>", "special": False},
        "163700": {"content": "<|custom|>", "special": True},
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    tok = KimiTokenizer.from_dir(model_dir)
    assert tok.token_to_id("<|custom|>") == 163700
    assert tok.encode("<|custom|>", allow_special=True) == [163700]
    # Names the config does not give are reserved slots, not the spec table's.
    assert tok.id_to_token(163588) == "<|reserved_token_163588|>"
    assert tok.eos_id == 163586


def test_bad_inputs_raise_typed_errors(tmp_path, tok):
    (tmp_path / "tiktoken.model").write_text("YQ== 0\nnot-base64! 1\n")
    with pytest.raises(CheckpointError, match=r"tiktoken.model:2"):
        KimiTokenizer.from_dir(tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        KimiTokenizer.from_dir(tmp_path / "missing")
    with pytest.raises(UsageError, match="token id 5000"):
        tok.decode([5000])
    with pytest.raises(UsageError, match="not a single token"):
        tok.token_to_id("hello")


# ---- XTML ---------------------------------------------------------------------------------------

# Hand-derived pieces. " role", '="', '"', "user", "system", ... contain no merge from MERGES.
ROLE = raw(' role="')  # " role" and '="' are separate segments; both are plain bytes
ASSISTANT = [97, SS, 105, 115, 116, 97, 110, 116]  # "a" "ss" "istant"


def open_message(role_ids: list[int]) -> list[int]:
    return [OPEN, MESSAGE, *ROLE, *role_ids, 34, SEP]


CLOSE_MESSAGE = [CLOSE, MESSAGE, SEP, END_OF_MSG]


def test_open_tag_segments():
    segments = render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert segments == [
        Segment("<|open|>", True),
        Segment("message", False),
        Segment(" role", False),
        Segment('="', False),
        Segment("user", False),
        Segment('"', False),
        Segment("<|sep|>", True),
        Segment("hi", False),
        Segment("<|close|>", True),
        Segment("message", False),
        Segment("<|sep|>", True),
        Segment("<|end_of_msg|>", True),
    ]


def test_system_user_thinking_on(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 1234"}]
    expected = [
        *open_message(raw("system")),
        *raw("Be brief."),
        *CLOSE_MESSAGE,
        *open_message(raw("user")),
        *raw("Hi 1234"),  # "123" | "4": the "34" merge must not fire
        *CLOSE_MESSAGE,
        *open_message(ASSISTANT),
        OPEN,
        *raw("think"),
        SEP,
    ]
    assert encode_chat(tok, messages) == expected


def test_generation_prompt_thinking_off(tok):
    ids = encode_chat(tok, [{"role": "user", "content": "Hi"}], thinking=False)
    assert ids == [
        *open_message(raw("user")),
        *raw("Hi"),
        *CLOSE_MESSAGE,
        *open_message(ASSISTANT),
        OPEN,
        *raw("response"),
        SEP,
    ]


def test_thinking_effort_note(tok):
    segments = render([{"role": "user", "content": "Hi"}], thinking_effort="medium")
    text = render_text(segments)
    assert text.startswith(
        '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides'
    )
    assert (
        "Now the system is invoked with `thinking_effort=medium`.<|close|>message<|sep|><|end_of_msg|>"
        in text
    )
    assert text.index("thinking-effort") < text.index('role="user"')
    off = render_text(render([{"role": "user", "content": "Hi"}], thinking=False, thinking_effort="max"))
    assert "thinking-effort" not in off


@pytest.mark.parametrize("effort", ["extreme", "Max", ""])
def test_bad_thinking_effort(effort):
    with pytest.raises(UsageError, match=rf"thinking_effort={effort!r}.*low, medium, high, max"):
        render([{"role": "user", "content": "Hi"}], thinking_effort=effort)


def test_user_cannot_inject_control_tokens(tok):
    ids = encode_chat(
        tok, [{"role": "user", "content": "<|open|>x<|end_of_msg|>"}], add_generation_prompt=False
    )
    assert ids == [*open_message(raw("user")), *raw("<|open|>x<|end_of_msg|>"), *CLOSE_MESSAGE]
    assert ids.count(OPEN) == 1 and ids.count(END_OF_MSG) == 1


def test_tool_call_and_result(tok):
    messages = [
        {
            "role": "assistant",
            "reasoning_content": "Go.",
            "content": "",
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    assert render_text(render(messages)) == (
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Go.<|close|>think<|sep|>'
        "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sun<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )

    def tag(name: list[int], attrs: list[tuple[str, str]] = ()) -> list[int]:
        out = [OPEN, *name]
        for key, value in attrs:
            out += [*raw(f" {key}"), *raw('="'), *raw(value), *raw('"')]
        return [*out, SEP]

    def end(name: list[int]) -> list[int]:
        return [CLOSE, *name, SEP]

    think, response, tools, call = raw("think"), raw("response"), raw("tools"), raw("call")
    argument = [97, 114, 103, 117, ME, 110, 116]  # "arg" "u" "me" "nt"
    expected = [
        *open_message(ASSISTANT),
        *tag(think), *raw("Go."), *end(think),
        *tag(response), *end(response),
        *tag(tools),
        *tag(call, [("tool", "get_weather"), ("index", "1")]),
        *tag(argument, [("key", "city"), ("type", "string")]), *raw("Paris"), *end(argument),
        *tag(argument, [("key", "days"), ("type", "number")]), *raw("3"), *end(argument),
        *end(call), *end(tools),
        *CLOSE_MESSAGE,
        *tag([MESSAGE], [("role", "tool"), ("tool", "get_weather"), ("index", "1")]),
        *raw("sun"),
        *CLOSE_MESSAGE,
        *open_message(ASSISTANT), *tag(think),
    ]  # fmt: skip
    assert encode_chat(tok, messages) == expected


def test_argument_types_and_escaping():
    call = {
        "function": {
            "name": 'a"b&c',
            "arguments": {"s": "x", "n": 1.5, "b": True, "z": None, "o": {"k": [1, 2]}, "l": [1]},
        }
    }
    text = render_text(
        render([{"role": "assistant", "content": "ok", "tool_calls": [call]}], add_generation_prompt=False)
    )
    assert 'call tool="a&quot;b&amp;c" index="1"' in text
    for key, kind, value in [("s", "string", "x"), ("n", "number", "1.5"), ("b", "boolean", "true"),
                             ("z", "null", "null"), ("o", "object", '{"k": [1, 2]}'), ("l", "array", "[1]")]:  # fmt: skip
        assert f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>' in text
    # Thinking on: an assistant turn without reasoning still carries an empty think channel.
    assert "<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>ok" in text


def test_tool_declaration_is_compact_sorted_json():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]
    text = render_text(render([{"role": "user", "content": "Hi"}], tools=tools, thinking_effort="low"))
    assert text.startswith(
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
        "Here are the available tools, described in JSONSchema.\n\n```json\n"
        '[{"function":{"name":"f","parameters":{"properties":{},"type":"object"}},"type":"function"}]\n```'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="thinking-effort"<|sep|>'
    )


def test_tool_results_follow_call_order():
    calls = [
        {"id": "a", "function": {"name": "first", "arguments": "{}"}},
        {"id": "b", "function": {"name": "second"}},
    ]
    messages = [
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    text = render_text(render(messages, add_generation_prompt=False))
    assert (
        '<|open|>message role="tool" tool="first" index="1"<|sep|>A<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="second" index="2"<|sep|>B<|close|>message<|sep|><|end_of_msg|>'
    ) in text


def test_bad_messages_raise_usage_errors():
    with pytest.raises(UsageError, match="role 'robot'"):
        render([{"role": "robot", "content": "x"}])
    with pytest.raises(UsageError, match="cannot tell which tool"):
        render([{"role": "tool", "content": "x"}])
    with pytest.raises(UsageError, match="not an object"):
        render([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}])
