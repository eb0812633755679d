"""Hostile and careless requests against the REAL server on loopback (the tiny model dir, CPU):
each is a 400 in OpenAI's error shape naming the problem, logged as one WARNING line with no
traceback, and the server keeps serving. Also: the API key from --config / the environment,
never logged; a second SIGTERM aborts what is left with 503 and exits 143; and, in-process, a
property test of the request schema's conversion to SamplingParams."""
from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fastdeploy_ext.engine.errors import InvalidRequest
from fastdeploy_ext.entrypoints.openai import protocol
from fastdeploy_ext.entrypoints.openai.errors import APIError
from fastdeploy_ext.entrypoints.openai.serving_chat import sampling_params

from .server_harness import ImageHost, ServerProc, chat, data_url, png_bytes, tiny_vl

YAML_KEY = "sk-yaml-3f9a1c7e5b"          # --config's api_key: must win over both env variables
FD_ENV_KEY = "sk-fdenv-8d2e4a6b0c"
VLLM_ENV_KEY = "sk-vllmenv-1a2b3c4d5e"
GREEDY = {"temperature": 0, "ignore_eos": True}
NO_GUARD = {"repetition_guard": {"enabled": False}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    cfg.write_text(f"api_key: {YAML_KEY}\nmax_model_len: 1024\n")
    s = ServerProc("--config", str(cfg), env={"FD_API_KEY": FD_ENV_KEY, "VLLM_API_KEY": VLLM_ENV_KEY})
    try:
        yield s.wait_healthy()
    finally:
        assert s.stop() == 0, s.output


AUTH = {"Authorization": f"Bearer {YAML_KEY}"}


def post_raw(srv, raw: bytes, headers=AUTH) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", content=raw, timeout=120,
                      headers={"Content-Type": "application/json", **headers})


def body(**kw) -> bytes:
    return json.dumps(chat(None, **{"max_tokens": 2, **kw})).encode()


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _text(text_json: str) -> bytes:
    """A chat body whose message text is the given JSON string literal (escapes kept as sent)."""
    return ('{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}' % text_json).encode()


DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = {
    # name: (raw body, param, words the message must contain)
    "nested_100k_deep": (DEEP, None, "deeper than 32 levels"),
    "nested_40_deep": (b'{"messages": [{"role": "user", "content": "x"}], "stop": ' + b"[" * 40 + b"]" * 40 + b"}",
                       "stop", "deeper than 32 levels"),
    "seed_2_64": (body(seed=2 ** 64), "seed", "seed: the integer 18446744073709551616 is outside the 64-bit range"),
    "seed_minus_2_63_minus_1": (body(seed=-2 ** 63 - 1), "seed", "outside the 64-bit range"),
    "max_tokens_2_70": (body(max_tokens=2 ** 70), "max_tokens", "max_tokens: the integer"),
    "top_k_2_64": (body(top_k=2 ** 64), "top_k", "top_k: the integer"),
    "stop_token_id_2_64": (body(stop_token_ids=[1, 2 ** 64]), "stop_token_ids.1", "stop_token_ids.1: the integer"),
    "repetition_guard_2_64": (body(repetition_guard={"max_period": 2 ** 64}), "repetition_guard.max_period",
                              "repetition_guard.max_period: the integer"),
    "integer_of_5000_digits": (body(seed=1).replace(b'"seed": 1', b'"seed": 1' + b"0" * 5000), None,
                               "not valid JSON (Exceeds the limit (4300 digits)"),
    "temperature_1e999": (body(temperature=1).replace(b'"temperature": 1', b'"temperature": 1e999'), "temperature",
                          "temperature: the number is out of range"),
    "top_p_nan_literal": (body(top_p=1).replace(b'"top_p": 1', b'"top_p": NaN'), "top_p",
                          "top_p: NaN is not a JSON number"),
    "lone_surrogate_in_text": (_text("a\\ud800b"), "messages.0.content", "lone UTF-16 surrogate U+D800"),
    "lone_low_surrogate_in_part": (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}], "max_tokens": 2}',
        "messages.0.content.0.text", "lone UTF-16 surrogate U+DFFF"),
    "lone_surrogate_in_stop": (body(stop="x").replace(b'"stop": "x"', b'"stop": "\\ud83d"'), "stop",
                               "lone UTF-16 surrogate U+D83D"),
    "not_utf8": (b'{"messages": "\xff"}', None, "not valid JSON"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_body_is_400_naming_the_problem(srv, name):
    raw, param, needle = HOSTILE[name]
    err = error_of(post_raw(srv, raw), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert needle in err["message"], err["message"]


def test_a_surrogate_pair_is_text_not_an_error(srv):
    """The check refuses LONE surrogates only: an escaped pair is one astral character."""
    r = post_raw(srv, _text("\\ud83d\\ude00 OCR:"))
    assert r.status_code == 200, r.text


def test_openai_client_gets_bad_request_for_oversized_seed(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=YAML_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(tiny_vl()), messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, seed=2 ** 64)
    assert e.value.status_code == 400 and "seed" in e.value.message
    r = client.chat.completions.create(model=str(tiny_vl()), messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, seed=2 ** 63 - 1, temperature=1.0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


@pytest.mark.parametrize("prefix", ["DATA:image/png;base64,", "Data:Image/PNG;Base64,", "DATA://image/png;base64,"])
def test_data_url_scheme_in_any_case_is_the_same_image(srv, prefix):
    """media.py passes it through, the engine's resolve_source decodes it: the same prompt (and
    greedy tokens) as the lower-case data URL, never a 'local path not allowed' 400."""
    url = data_url(png_bytes(56, 56))
    ref = post_raw(srv, json.dumps(chat(url, max_tokens=3, **GREEDY)).encode()).json()
    got = post_raw(srv, json.dumps(chat(prefix + url.split(",", 1)[1], max_tokens=3, **GREEDY)).encode())
    assert got.status_code == 200, got.text
    assert got.json()["usage"] == ref["usage"] and got.json()["choices"][0]["message"] == ref["choices"][0]["message"]


# Values at the edges of the sampling rules: the accepted ones generate, the refused ones are a
# 400 naming the field. Several rows are the engine's SamplingParams rules (seed range, top_k
# "off" above the vocabulary, temperature < 1e-5 = greedy, top_p = 0).
EDGES = [
    ("seed_min", {"seed": -2 ** 63, "temperature": 1.0}, None),
    ("seed_max", {"seed": 2 ** 63 - 1, "temperature": 1.0}, None),
    ("top_k_minus_1_off", {"top_k": -1, "temperature": 1.0}, None),
    ("top_k_2_62_off", {"top_k": 2 ** 62, "temperature": 1.0}, None),
    ("top_k_2_63", {"top_k": 2 ** 63, "temperature": 1.0}, "top_k"),
    ("temperature_1e_46_greedy", {"temperature": 1e-46}, None),
    ("top_p_0_keeps_the_top_token", {"top_p": 0, "temperature": 1.0}, None),   # PaddleX sends it
    ("top_k_minus_2", {"top_k": -2, "temperature": 1.0}, "top_k"),
]


@pytest.mark.parametrize("name,fields,bad", EDGES, ids=[e[0] for e in EDGES])
def test_sampling_edges_generate_or_400_naming_the_field(srv, name, fields, bad):
    r = post_raw(srv, body(**fields))
    if bad is None:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    else:
        assert bad in error_of(r, 400)["message"]


def test_client_errors_log_one_warning_line_and_no_traceback(srv):
    """Runs after the tests above (same module server): each refusal was one WARNING line; no
    traceback anywhere; the server still answers."""
    r = post_raw(srv, body())
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    out = srv.output
    assert "Traceback" not in out and "Logging error" not in out, out[-4000:]
    warnings = [ln for ln in out.splitlines() if "WARNING POST /v1/chat/completions -> 400" in ln]
    assert len(warnings) >= len(HOSTILE), out[-4000:]
    assert any("lone UTF-16 surrogate U+D800" in ln for ln in warnings)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


# --------------------------------------------------------------------------- API key
def test_api_key_from_config_wins_and_is_never_logged(srv):
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key=YAML_KEY, max_retries=0, timeout=60)
    assert [m.id for m in ok.models.list().data] == [str(tiny_vl()), tiny_vl().name]   # the path and the directory name
    for other in (FD_ENV_KEY, VLLM_ENV_KEY, "wrong"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key=other, max_retries=0, timeout=60).models.list()
    out = srv.output
    for key in (YAML_KEY, FD_ENV_KEY, VLLM_ENV_KEY):
        assert key not in out
    assert "--api-key <redacted>" in out and "API key: required, from --api-key" in out


def test_api_key_from_env_fd_first_then_vllm_never_logged_and_sigint_exits_130():
    """(This server also ends by SIGINT, idle: the stop-now path with nothing in flight, status
    130, rather than uvicorn's shutdown re-raising the signal.)"""
    s = ServerProc("--max-model-len", "512", env={"FD_API_KEY": FD_ENV_KEY, "VLLM_API_KEY": VLLM_ENV_KEY})
    try:
        s.wait_healthy()
        url = s.url + "/v1/models"
        assert httpx.get(url, headers={"Authorization": f"Bearer {FD_ENV_KEY}"}).status_code == 200
        assert httpx.get(url, headers={"Authorization": f"Bearer {VLLM_ENV_KEY}"}).status_code == 401
        assert httpx.get(url).status_code == 401
        assert "API key: required, from FD_API_KEY" in s.output
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(60) == 130, s.output
    finally:
        s.stop()
    assert FD_ENV_KEY not in s.output and VLLM_ENV_KEY not in s.output
    assert "SIGINT: aborting 0 request(s) in flight with 503; exiting with status 130" in s.output


# --------------------------------------------------------------------------- second SIGTERM
def test_second_sigterm_aborts_in_flight_with_503_and_exits_143():
    """Two long streams generating and one plain request held while fetching its image: SIGTERM
    drains (they keep running), a second SIGTERM answers all three 503 (the streams with an error
    event, then [DONE]), frees the engine and exits 143 instead of hanging or dying by signal.
    (The key of this server comes from VLLM_API_KEY alone: the last source, never logged.)"""
    host = ImageHost(png_bytes(64, 48))
    s = ServerProc("--max-model-len", "8192", "--media-fetch-timeout", "120", "--allow-private-media-fetch", env={"VLLM_API_KEY": VLLM_ENV_KEY})
    auth = {"Authorization": f"Bearer {VLLM_ENV_KEY}"}
    try:
        s.wait_healthy()
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/v1/models", headers=auth).status_code == 200
        host.release.clear()
        plain: list = []
        t_plain = threading.Thread(target=lambda: plain.append(httpx.post(
            s.url + "/v1/chat/completions", json=chat(host.url + "/hold.png", max_tokens=3), headers=auth,
            timeout=120)))
        t_plain.start()
        assert host.held.acquire(timeout=60)           # in flight, fetching its image
        streams: list[list[str]] = [[], []]
        started = [threading.Event(), threading.Event()]

        def stream(i):
            with httpx.stream("POST", s.url + "/v1/chat/completions", timeout=120, headers=auth,
                              json=chat(data_url(png_bytes(56, 56, seed=i)), max_tokens=7000, stream=True,
                                        **GREEDY, **NO_GUARD)) as r:
                for line in r.iter_lines():
                    if line:
                        streams[i].append(line)
                        started[i].set()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)        # both generating
        s.proc.send_signal(signal.SIGTERM)
        for _ in range(200):                           # draining: new requests 503 "draining"
            r = httpx.post(s.url + "/v1/chat/completions", json=chat(None, max_tokens=2), headers=auth, timeout=60)
            if r.status_code == 503:
                break
        assert error_of(r, 503)["code"] == "draining"
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 143, s.output
        t_plain.join(60)
        for t in threads:
            t.join(60)
        assert error_of(plain[0], 503)["code"] == "server_stopping"
        for lines in streams:
            assert lines[-1] == "data: [DONE]"
            event = json.loads(lines[-2][len("data: "):])
            assert event["error"]["code"] == "server_stopping" and "stopping now" in event["error"]["message"]
            finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-2]]
            assert finish[-1] is None                   # cut off mid-generation, not finished
        out = s.output
        assert "SIGTERM while draining: aborting 3 request(s) in flight with 503; exiting with status 143" in out
        assert "server exited with status 143" in out and "Traceback" not in out
        assert "API key: required, from VLLM_API_KEY" in out and VLLM_ENV_KEY not in out
    finally:
        host.close()
        s.stop()


# --------------------------------------------------------------------------- in-process
SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens", "min_tokens",
                   "repetition_penalty", "stop", "stop_token_ids", "n", "logprobs", "top_logprobs", "ignore_eos",
                   "skip_special_tokens", "include_stop_str_in_output", "repetition_guard"]
_scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2 ** 70, 2 ** 70)
            | st.sampled_from([0, 1, -1, 2 ** 63 - 1, 2 ** 63, -2 ** 63, -2 ** 63 - 1, 2 ** 64, 0.0, 1e-46, 1e-5,
                               1e308, 0.5, float("inf"), float("nan")])
            | st.floats() | st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfffb", "", "1", "0.5"]))
json_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.sampled_from(["enabled", "max_period", "min_repeats", "min_span",
                                                              "x"]) | st.text(max_size=4), kids, max_size=4),
                           max_leaves=8)


@seed(20261201)
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(SAMPLING_FIELDS), json_values, min_size=1, max_size=4))
def test_property_sampling_fields_are_400_naming_the_field_or_valid_params(fields):
    """Any JSON value in the sampling fields, through the server's own conversion (bytes ->
    parse_json_body -> parse_chat_request -> SamplingParams.validate): a 400 whose message
    names one of the fields sent, or parameters that validate. Never another exception."""
    raw = json.dumps({"messages": [{"role": "user", "content": "x"}], **fields}).encode()
    try:
        req = protocol.parse_chat_request(protocol.parse_json_body(raw))
        try:
            params = sampling_params(req, None)
            params.validate()
        except (InvalidRequest, TypeError) as e:      # what ChatHandler.create turns into a 400
            raise APIError(400, str(e)) from None
    except APIError as e:
        assert e.status == 400
        assert any(f in e.message for f in fields), (e.message, fields)
        return
    assert params.n == 1 and isinstance(params.temperature, float | int)


def test_the_json_checks_are_what_stop_these_bodies(monkeypatch):
    """Fault injection: without check_json_values a lone surrogate reaches the tokenizers, which
    cannot encode it (the 500 this check replaced), and a 40-deep body passes parsing."""
    from tokenizers import Tokenizer

    from fastdeploy_ext.models.paddleocr_vl.tokenizer import ByteTokenizer, HFTokenizer
    raw = _text("a\\ud800b")
    with pytest.raises(APIError, match="lone UTF-16 surrogate"):
        protocol.parse_json_body(raw)
    monkeypatch.setattr(protocol, "check_json_values", lambda body: None)
    text = protocol.parse_json_body(raw)["messages"][0]["content"]
    assert text == "a\ud800b"
    tokenizers = [HFTokenizer(Tokenizer.from_file(str(tiny_vl() / "tokenizer.json")), "tokenizer.json"),
                  ByteTokenizer({"<unk>": 0})]            # the real tokenizer; --load-format dummy's
    for tok in tokenizers:
        assert tok.encode("ab")                           # works on valid text
        with pytest.raises((TypeError, UnicodeError)):
            tok.encode(text)
    deep = protocol.parse_json_body(b'{"stop": ' + b"[" * 40 + b"]" * 40 + b"}")["stop"]
    depth = 0
    while isinstance(deep, list) and deep:
        deep, depth = deep[0], depth + 1
    assert depth == 39


def test_recursion_error_from_the_json_decoder_is_a_400():
    with pytest.raises(RecursionError):
        json.loads(DEEP)                                # what the server used to turn into a 500
    with pytest.raises(APIError) as e:
        protocol.parse_json_body(DEEP)
    assert e.value.status == 400 and "deeper than 32 levels" in e.value.message


@pytest.mark.parametrize("fields,param", [
    ({"max_completion_tokens": False}, "max_completion_tokens"),     # lax pydantic: False == 0
    ({"max_completion_tokens": 0}, "max_completion_tokens"),         # not "max_tokens", which it feeds
    ({"seed": "5"}, "seed"),
    ({"top_k": 5.0}, "top_k"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids.1"),
    ({"temperature": True}, "temperature"),
    ({"repetition_guard": {"max_period": "8"}}, "repetition_guard.max_period"),
])
def test_numeric_fields_take_json_numbers_only(fields, param):
    with pytest.raises(APIError) as e:
        protocol.parse_chat_request({"messages": [{"role": "user", "content": "x"}], **fields})
    assert e.value.status == 400 and e.value.param == param, e.value.message
    ok = protocol.parse_chat_request({"messages": [{"role": "user", "content": "x"}], "temperature": 1, "seed": 5})
    assert ok.temperature == 1.0 and ok.seed == 5                    # an integer is a float
