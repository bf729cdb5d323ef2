"""OpenAI request fields beyond the basics, through the official client over loopback: sampling fields
(top_k, min_p, penalties, logit_bias, n), response_format by constrained decoding, tools in the
checkpoint's own format, /v1/models/{id}, an optional model, and pydantic validation in OpenAI's shape."""

from __future__ import annotations

import json
import random

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
xgrammar = pytest.importorskip("xgrammar")

from deltafin.runtime.engine import Engine, EngineOptions  # noqa: E402
from deltafin.runtime.sampling import Sampler, SamplingParams  # noqa: E402
from deltafin.serve import tools  # noqa: E402
from deltafin.serve.app import create_app  # noqa: E402
from deltafin.serve.protocol import Context, Limits  # noqa: E402
from deltafin.serve.worker import Worker  # noqa: E402
from deltafin.tokenizers import xtml  # noqa: E402
from tests.test_serve import live  # noqa: E402
from tests.tiny import pack_tiny  # noqa: E402

MODEL = "tiny-qwen-tools"
T = 30
# A Qwen3-style template, cut down: tools in a system turn, calls as <tool_call>{json}</tool_call>.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools>\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "metric": {"type": "boolean"}},
                   "required": ["city", "metric"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = pack_tiny(tmp_path_factory.mktemp("openai"), "qwen3_moe", tokenizer=True)
    with open(f"{path}/chat_template.jinja", "w") as f:
        f.write(TOOL_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def ref(model_dir):
    eng = Engine(model_dir, EngineOptions(exact=True, cache_gb=0.05, max_len=1024, threads=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def served(model_dir):
    eng = Engine(model_dir, EngineOptions(exact=True, cache_gb=0.05, max_len=1024, threads=2))
    worker = Worker(eng, max_batch=8).start()
    app = create_app(worker, MODEL, limits=Limits(max_tokens=120))
    with live(app) as url:
        yield url, app.state.server
    worker.stop()
    eng.close()


@pytest.fixture
def client(served):
    c = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", timeout=T, max_retries=0)
    yield c
    c.close()


def token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def complete(client, prompt="Revenue rose in", n_tokens=12, **kw):
    extra = {"return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n_tokens, logprobs=0, extra_body=extra,
                                     **{"temperature": 0, **kw})


def ref_tokens(ref, prompt: str, n: int, sampling: SamplingParams) -> list[int]:
    return [t for t, _ in ref.generate(ref.codec.encode(prompt), n, sampling)]


# ---- models and validation -------------------------------------------------------------------------


def test_model_by_id_and_model_optional(served, client):
    url, _ = served
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "no model named", "max_tokens": 3, "temperature": 0},
                   timeout=T)
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=T)
    assert r.status_code == 200


def test_validation_errors_name_the_field(served):
    url, _ = served
    cases = [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", None),
        ("/v1/completions", {"prompt": "x", "top_k": 1.5}, "top_k", None),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", None),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias", None),
        ("/v1/completions", {"prompt": "x", "n": 40}, "n", None),
        ("/v1/completions", {"prompt": "x", "bogus": 1}, "bogus", "unknown_parameter"),
        ("/v1/completions", {"max_tokens": 2}, "prompt", "missing_required_parameter"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "maybe", "tools": [WEATHER]}, "tool_choice", None),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type", None),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema"}},
         "response_format.json_schema", None),
        ("/v1/chat/completions", {"messages": USER, "tools": [WEATHER], "tool_choice":
                                  {"type": "function", "function": {"name": "nope"}}}, "tool_choice", None),
    ]
    for path, body, param, code in cases:
        r = httpx.post(f"{url}{path}", json=body, timeout=T)
        err = r.json()["error"]
        assert r.status_code == 400 and set(err) == {"message", "type", "param", "code"}, (body, r.text)
        assert err["param"] == param and (code is None or err["code"] == code), (body, err)


# ---- sampling fields -------------------------------------------------------------------------------


def test_top_k_1_and_min_p_1_are_greedy(client):
    greedy = token_ids(complete(client).choices[0])
    assert token_ids(complete(client, temperature=1.0, seed=5, extra_body={"top_k": 1}).choices[0]) == greedy
    assert token_ids(complete(client, temperature=1.0, seed=5, extra_body={"min_p": 1.0}).choices[0]) == greedy


def test_logit_bias_moves_the_choice(client):
    q = ord("Q")  # the byte tokenizer's ids are the bytes
    r = complete(client, logit_bias={str(q): 100})
    assert token_ids(r.choices[0]) == [q] * 12 and r.choices[0].text == "Q" * 12
    greedy = token_ids(complete(client).choices[0])
    banned = token_ids(complete(client, logit_bias={str(greedy[0]): -100}).choices[0])
    assert banned[0] != greedy[0]


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.0), ("frequency_penalty", 1.5),
                                          ("repetition_penalty", 3.0)])
def test_penalties_match_the_runtime_sampler(client, ref, field, value):
    """The server's tokens equal Engine.generate with the same SamplingParams (the CLI's path)."""
    prompt = "aaaa aaaa aaaa"
    kw = {field: value} if field != "repetition_penalty" else {"extra_body": {field: value}}
    got = token_ids(complete(client, prompt, 16, **kw).choices[0])
    want = ref_tokens(ref, prompt, 16, SamplingParams(**{field: value}))
    plain = ref_tokens(ref, prompt, 16, SamplingParams())
    assert got == want[: len(got)] and len(got) == len(want)
    assert want != plain  # the penalty changed something


def test_sampler_processors_by_hand():
    torch.manual_seed(0)
    lg = torch.randn(50)
    prompt = (3, 4)
    s = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                               logit_bias=((7, 3.0),)), prompt)
    s.counts = {4: 2, 9: 1}
    s.seen = {3, 4, 9}
    want = lg.clone()
    want[7] += 3.0
    for t in (3, 4, 9):
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[4] -= 2 * 0.25 + 0.5
    want[9] -= 1 * 0.25 + 0.5
    assert torch.allclose(s.process(lg), want)
    assert s(lg) == int(torch.argmax(want))


def test_n_choices(client):
    r = complete(client, n_tokens=8, n=3, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = complete(client, n_tokens=8, n=3, temperature=1.0, seed=11)
    assert [token_ids(c) for c in r.choices] == [token_ids(c) for c in again.choices]  # reproducible
    assert len({tuple(token_ids(c)) for c in r.choices}) > 1  # and not all the same
    greedy = complete(client, n_tokens=8, n=2)
    assert token_ids(greedy.choices[0]) == token_ids(greedy.choices[1]) == token_ids(complete(client, n_tokens=8).choices[0])
    assert r.usage.completion_tokens == sum(len(token_ids(c)) for c in r.choices)
    multi = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, n=2, max_tokens=4, temperature=0,
                                                 stream=True))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    whole = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    assert texts == {0: whole.choices[0].message.content, 1: whole.choices[0].message.content}


# ---- response_format ---------------------------------------------------------------------------------


def test_json_schema_reply_keeps_to_the_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, temperature=1.0, seed=seed,
                                           response_format=rf)
        value = json.loads(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop"
        assert set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=100, temperature=0, response_format=rf, stream=True) if c.choices)
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, temperature=0, response_format=rf)
    assert streamed == plain.choices[0].message.content and json.loads(streamed)["color"] in ("red", "green", "blue")


def test_json_object_reply_is_an_object(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    c = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "v", "schema": SCHEMA}}})
    assert set(json.loads(c.choices[0].text)) == {"ok", "color"}


def test_bad_schema_and_missing_xgrammar_are_400s(served, client, monkeypatch):
    _, srv = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format"
    monkeypatch.setattr(srv, "ctx", Context(None, srv.ctx.tool_format))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, response_format={"type": "json_object"})
    assert "xgrammar" in e.value.body["message"]


# ---- tools -------------------------------------------------------------------------------------------


def check_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Oslo", "Lima") and isinstance(args["metric"], bool)


def test_named_tool_choice_gives_a_parsed_call(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice,
                                       max_tokens=100, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    check_weather_call(c.message.tool_calls[0])
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, CLOCK],
                                                 tool_choice=choice, max_tokens=100, temperature=0, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert len(deltas) == 1 and deltas[0].index == 0 and chunks[-1].choices[0].finish_reason == "tool_calls"
    check_weather_call(deltas[0])
    assert json.loads(deltas[0].function.arguments) == json.loads(c.message.tool_calls[0].function.arguments)
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)  # no markup as content


def test_required_tool_choice_calls_one_of_the_tools(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, CLOCK], tool_choice="required",
                                           max_tokens=100, temperature=1.0, seed=seed)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)


def test_tools_are_rendered_and_a_turn_with_results_is_accepted(served, client, ref):
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    auto = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=4, temperature=0)
    assert auto.usage.prompt_tokens == len(ref.codec.chat(USER, tools=[WEATHER])) > plain.usage.prompt_tokens
    none = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none",
                                          max_tokens=4, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens and none.choices[0].message.tool_calls is None
    turn = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "metric": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    r = client.chat.completions.create(model=MODEL, messages=turn, tools=[WEATHER], max_tokens=4, temperature=0)
    rendered = ref.codec.decode(ref.codec.chat([USER[0], {**turn[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Oslo", "metric": True}}}]}, turn[2]],
        tools=[WEATHER]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "metric": true}}' in rendered
    assert r.usage.prompt_tokens == len(ref.codec.encode(rendered))


def test_tools_on_a_template_without_them_is_a_400(served, client, monkeypatch):
    _, srv = served
    monkeypatch.setattr(srv, "ctx", Context(srv.ctx.grammars, None))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    assert e.value.body["param"] == "tools" and "declares no tools" in e.value.body["message"]


def test_tool_call_formats_parse():
    assert tools.split("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                                 '<tool_call>{"name": "g", "arguments": "{}"}</tool_call>') == (
        "Sure.", [tools.Call("f", '{"a": 1}'), tools.Call("g", "{}")])
    assert tools.split("hermes", "<tool_call>{not json}</tool_call>")[1] == []
    ds = (f"x{tools.DS_CALLS}{tools.DS_CALL}function{tools.DS_SEP}f\n```json\n{{\"a\": [1]}}\n```{tools.DS_END}"
          f"{tools.DS_CALL}g{tools.DS_SEP}{{\"b\": 2}}{tools.DS_END}{tools.DS_CALLS_END}")
    assert tools.split("deepseek", ds) == ("x", [tools.Call("f", '{"a": [1]}'), tools.Call("g", '{"b": 2}')])
    k2 = (f"{tools.K2_SECTION}{tools.K2_CALL}functions.get_time:0{tools.K2_ARGS}{{\"utc\": true}}{tools.K2_END}"
          f"{tools.K2_SECTION_END}")
    assert tools.split("kimi", k2) == ("", [tools.Call("get_time", '{"utc": true}')])
    assert tools.split("hermes", "no calls here") == ("no calls here", [])


def test_xtml_calls_round_trip_through_the_k3_renderer():
    """What the K3 template writes for an assistant's calls parses back to the same calls."""
    rng = random.Random(0)
    for _ in range(20):
        args = {f"k{i}": rng.choice(["text & \"quotes\"", 3, 2.5, True, None, [1, "a"], {"x": {"y": 1}}])
                for i in range(rng.randint(0, 3))}
        msg = {"role": "assistant", "content": "ok", "tool_calls": [
            {"id": "1", "function": {"name": "look_up", "arguments": json.dumps(args)}}]}
        text = xtml.render_text(xtml.render([msg], thinking=False, add_generation_prompt=False))
        content, calls = tools.split("xtml", text)
        assert [c.name for c in calls] == ["look_up"] and json.loads(calls[0].arguments) == args
        assert "<|open|>tools" not in content


def test_tool_stream_holds_back_only_what_may_be_a_call():
    from deltafin.serve.responses import ToolStream

    ts = ToolStream("hermes")
    shown = "".join(ts.feed(p) for p in ["Let me ", "check <to", "ol_call>", '{"name": "f", "arguments": {}}',
                                          "</tool_call>"])
    rest, calls = ts.finish()
    assert shown == "Let me check " and rest == "" and calls == [tools.Call("f", "{}")]
    ts = ToolStream("hermes")
    shown = "".join(ts.feed(p) for p in ["a <t", "able>"])
    assert shown + ts.finish()[0] == "a <table>"


def test_cli_run_takes_the_same_sampling_fields(model_dir, ref, capsys):
    """`deltafin run` and the server share the sampler: the CLI's tokens equal Engine.generate's."""
    from deltafin.cli import build_parser, main
    from deltafin.interfaces.cmd_run import sampling_params

    flags = ["--greedy", "--repetition-penalty", "3", "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
             "--min-p", "0.1"]
    args = build_parser().parse_args(["run", model_dir, "-p", "aaaa aaaa", "-n", "12", *flags])
    want = SamplingParams(0.0, 0.95, 0, None, 0.1, 0.5, 0.25, 3.0)
    assert sampling_params(args) == want
    capsys.readouterr()
    assert main(["run", model_dir, "-p", "aaaa aaaa", "-n", "12", "--raw", "--quiet", "--cache-gb", "0.05", *flags]) == 0
    shown = "".join(d for _, d in ref.generate(ref.codec.encode("aaaa aaaa"), 12, want))
    plain = "".join(d for _, d in ref.generate(ref.codec.encode("aaaa aaaa"), 12, SamplingParams()))
    assert capsys.readouterr().out.rstrip("\n") == shown != plain


@pytest.fixture(scope="module")
def k3_served(tmp_path_factory):
    from deltafin.k3_tiny import TINY_TOKENIZER_VOCAB, write_tiny_k3, write_tiny_k3_tokenizer
    from deltafin.store.drives import parse_drives
    from deltafin.store.pack import PackOptions, pack

    root = tmp_path_factory.mktemp("k3serve")
    write_tiny_k3(root / "src", vocab_size=TINY_TOKENIZER_VOCAB)
    write_tiny_k3_tokenizer(root / "src")
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=1"]), PackOptions(progress=False))
    eng = Engine(str(root / "model"), EngineOptions(exact=True, cache_gb=0.05, max_len=1024, threads=2))
    worker = Worker(eng, max_batch=4).start()
    with live(create_app(worker, "tiny-k3", limits=Limits(max_tokens=120))) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
        yield c, eng
        c.close()
    worker.stop()
    eng.close()


def test_k3_tools_are_rendered_and_json_mode_keeps_to_the_schema(k3_served):
    """Kimi K3's own tokenizer (tiktoken ranks, XTML template): tools in its tool-declare message, and the
    grammar built from its raw byte vocabulary."""
    c, eng = k3_served
    a = {"65": 100}  # a byte token: the random model may otherwise pick an id the tokenizer leaves unused
    plain = c.chat.completions.create(model="tiny-k3", messages=USER, max_tokens=2, temperature=0, logit_bias=a)
    auto = c.chat.completions.create(model="tiny-k3", messages=USER, tools=[WEATHER], max_tokens=2, temperature=0,
                                     logit_bias=a)
    assert auto.usage.prompt_tokens == len(eng.codec.chat(USER, tools=[WEATHER])) > plain.usage.prompt_tokens
    r = c.chat.completions.create(model="tiny-k3", messages=USER, max_tokens=100, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop" and set(json.loads(r.choices[0].message.content)) == {"ok", "color"}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-k3", messages=USER, tools=[WEATHER], tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "xtml" in e.value.body["message"]


def test_server_starts_without_xgrammar(monkeypatch):
    import sys

    from deltafin.runtime.grammar import Grammars
    from deltafin.serve.app import _grammars

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    assert _grammars(None, 10) is None
    with pytest.raises(Exception, match="pip install 'deltafin\\[grammar\\]'"):
        Grammars(None, 10).json_object()
