"""Reasoning split from the answer (Kimi K3 XTML channels, ``<think>`` tags), streamed piece by piece equal to
whole, markup and special tokens never in the output; thinking switches and effort in the chat templates."""

from __future__ import annotations

import json

import pytest

from deltafin.errors import UsageError
from deltafin.k3_tiny import TINY_TOKENIZER_VOCAB, write_tiny_k3, write_tiny_k3_tokenizer
from deltafin.runtime.reasoning import Parts, Plain, ThinkTags, XTMLChannels, split_all, splitter_for
from deltafin.runtime.tokenizer import load_codec
from tests.tiny import build_tiny, save_byte_tokenizer

K3_REPLY = ("Let me see: 2 < 3 and <|op is not a tag.<|close|>think<|sep|><|open|>response<|sep|>Yes, 2 < 3."
            "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"calc\" index=\"1\"<|sep|>"
            "<|open|>argument key=\"x\" type=\"number\"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>"
            "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")


def stream(splitter, text: str, step: int) -> Parts:
    out = Parts()
    for i in range(0, len(text), step):
        out += splitter.feed(text[i : i + step])
    out += splitter.flush()
    return out


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_k3_channels_streamed_equal_whole(step):
    out = stream(XTMLChannels(thinking=True, hide=("[EOS]",)), K3_REPLY, step)
    assert out.reasoning == "Let me see: 2 < 3 and <|op is not a tag."
    assert out.content == "Yes, 2 < 3."
    assert out.tools.startswith("<|open|>tools<|sep|><|open|>call tool=\"calc\"")
    assert out.tools.endswith("<|close|>tools<|sep|>") and "2<|close|>argument" in out.tools


def test_k3_thinking_off_starts_in_response_and_hides_other_specials():
    out = split_all(XTMLChannels(thinking=False, hide=("[EOS]", "<|media_pad|>")),
                    "Hi[EOS] there<|media_pad|>.<|close|>response<|sep|><|close|>message<|sep|>")
    assert (out.reasoning, out.content, out.tools) == ("", "Hi there.", "")


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_think_tags(step):
    text = "<think>\nFirst, 1 + 1.\n</think>\n\nIt is 2.<|im_start|>"
    out = stream(ThinkTags(open_at_start=False, hide=("<|im_start|>",)), text, step)
    assert (out.reasoning, out.content) == ("First, 1 + 1.\n", "It is 2.")
    out = stream(ThinkTags(open_at_start=True), "\nhmm</think>\n\nok", step)
    assert (out.reasoning, out.content) == ("hmm", "ok")


def test_plain_removes_special_names_split_across_pieces():
    assert stream(Plain(("<|im_end|>",)), "a<|im_end|>b <|im_", 2).content == "ab <|im_"


@pytest.fixture(scope="module")
def k3_codec(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3tok")
    write_tiny_k3(root, vocab_size=TINY_TOKENIZER_VOCAB)
    write_tiny_k3_tokenizer(root)
    return load_codec(str(root), json.loads((root / "config.json").read_text()))


def test_k3_chat_thinking_switch_effort_and_splitter(k3_codec):
    msgs = [{"role": "user", "content": "hi"}]
    on, off = k3_codec.chat(msgs), k3_codec.chat(msgs, thinking=False)
    assert k3_codec.decode(on).endswith("<|open|>think<|sep|>")
    assert k3_codec.decode(off).endswith("<|open|>response<|sep|>")
    assert k3_codec.chat(msgs, template_kwargs={"thinking": False}) == off
    assert "thinking_effort=high" in k3_codec.decode(k3_codec.chat(msgs, effort="high"))
    with pytest.raises(UsageError, match="thinking_effort='huge'"):
        k3_codec.chat(msgs, effort="huge")
    assert isinstance(splitter_for(k3_codec, on, chat=True), XTMLChannels)
    sp = splitter_for(k3_codec, off, chat=True)
    assert split_all(sp, "ok<|close|>response<|sep|>").content == "ok"
    assert isinstance(splitter_for(k3_codec, k3_codec.encode("plain"), chat=False), Plain)


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_hf_template_gets_enable_thinking(tmp_path):
    build_tiny("qwen3_moe", tmp_path, vocab_size=320)
    save_byte_tokenizer(tmp_path, 320)
    codec = load_codec(str(tmp_path), json.loads((tmp_path / "config.json").read_text()))
    codec.impl.chat_template = QWEN3_LIKE
    msgs = [{"role": "user", "content": "hi"}]
    assert "<think>" not in codec.decode(codec.chat(msgs))
    off = codec.chat(msgs, template_kwargs={"enable_thinking": False})
    assert codec.decode(off).endswith("<think>\n\n</think>\n\n") and codec.chat(msgs, thinking=False) == off
    sp = splitter_for(codec, codec.chat(msgs), chat=True)
    assert isinstance(sp, ThinkTags) and split_all(sp, "<think>a</think>b").reasoning == "a"
    codec.check_thinking(False, None)
    with pytest.raises(UsageError, match="no effort levels"):
        codec.check_thinking(None, "high")


def test_partial_tail():
    from deltafin.runtime.reasoning import partial_tail

    assert partial_tail("abc<|op", ("<|open|>",)) == 4
    assert partial_tail("abc<|open|>", ("<|open|>",)) == 0  # a whole marker is not a partial one
    assert partial_tail("ab</thi", ("<think>", "</think>")) == 5
    assert partial_tail("ab<", ("<|open|>", "<think>")) == 1
    assert partial_tail("", ("<x>",)) == 0 and partial_tail("abc", ()) == 0
