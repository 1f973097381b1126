"""kvsidecar.dev.pdproxy's refusals and policies (its happy path runs against
real vLLM engines in test_vllm_engines.py): a prefill that answers without
kv_transfer_params, fails or cannot be reached is, under ``fail``, the
client's 502 naming it (the decode never asked), and under ``fallback`` the
decode's to compute whole (counted on /metrics, logged with the request
id); a prefill's or decode's 4xx is the client's; a decode that cannot be
reached is a 502 naming it; a prompt that ends at its first token is the
decode's to answer whole; a prompt list gets a prefill and a decode per
prompt, each with its own params."""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import socket
import threading
from collections.abc import Callable

import pytest
from conftest import wait_for

from kvsidecar.dev import devvllm
from kvsidecar.dev.pdproxy import PDProxy


class Upstream:
    """A local HTTP server answering every POST with ``status`` and
    ``body`` (or what ``body(request)`` returns for it), recording the
    requests it got. ``cut_stream``: it streams one event and dies instead
    (its connection closed before the stream's end)."""

    def __init__(self, status: int, body: dict | Callable[[dict], dict], cut_stream: bool = False) -> None:
        self.got: list[dict] = []
        up = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                return

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    up.got.append(req)
                if cut_stream:
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    ev = b'data: {"choices": [{"index": 0, "token_ids": [5]}]}\n\n'
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                data = json.dumps(body(req) if callable(body) else body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def post(proxy: PDProxy, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    return r.status, out


@pytest.mark.parametrize("status, body", [
    (200, {"choices": [{"token_ids": [5]}]}),
    (500, {"error": "engine dead"}),
])
# fault-matrix: proxy-prefill-failure
def test_prefill_without_params_is_a_502_under_fail_and_decode_is_not_asked(status, body):
    pre, dec = Upstream(status, body), Upstream(200, {"choices": []})
    proxy = PDProxy([pre.url], [dec.url], on_prefill_failure="fail").start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 9, "stream": True})
        assert code == 502
        assert f"prefill {pre.url} answered {status} without kv_transfer_params" in out["error"]
        assert pre.got == [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False,
                            "kv_transfer_params": {"do_remote_decode": True}}]
        assert dec.got == []
        reason = "no_params" if status == 200 else "server_error"
        assert proxy.metrics.get("kvsidecar_pdproxy_prefill_failures_total", reason) == 1
        assert proxy.metrics.get("kvsidecar_pdproxy_fallbacks_total", reason) == 0
    finally:
        proxy.close()
        pre.close()
        dec.close()


def get(proxy: PDProxy, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    out = r.read().decode()
    conn.close()
    return r.status, out


# fault-matrix: proxy-prefill-failure
@pytest.mark.parametrize("failure", ["no_params", "server_error", "unreachable"])
def test_a_failed_prefill_falls_back_to_the_decode_counted_and_logged(failure, caplog):
    # Issue 36: with the prefill sidecar down, the prefill engine answered
    # 200 without params and the proxy answered 502 to most requests. Under
    # fallback (the default) the decode computes the prompt; the fallback
    # is counted on the proxy's /metrics and logged with the request id.
    pre = {"no_params": Upstream(200, {"choices": [{"token_ids": [5], "finish_reason": "length"}]}),
           "server_error": Upstream(503, {"error": "sidecar unavailable"}),
           "unreachable": Upstream(200, {})}[failure]
    if failure == "unreachable":
        pre.close()  # its port now refuses
    dec = Upstream(200, {"choices": [{"token_ids": [7, 8]}]})
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvsidecar.dev.pdproxy"):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": [1, 2], "max_tokens": 4}),
                         {"Content-Type": "application/json", "X-Request-Id": "client-42"})
            r = conn.getresponse()
            assert (r.status, json.loads(r.read())) == (200, {"choices": [{"token_ids": [7, 8]}]})
            assert r.getheader("X-Request-Id") == "client-42"
            conn.close()
        assert dec.got == [{"model": "m", "prompt": [1, 2], "max_tokens": 4}], "no params: the decode computes it"
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvsidecar.dev.pdproxy"]
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"request client-42: prefill {pre.url} ")
        assert "fallback: the decode computes the prompt" in lines[0]
        code, text = get(proxy, "/metrics")
        assert code == 200
        assert f'kvsidecar_pdproxy_fallbacks_total{{reason="{failure}"}} 1\n' in text
        assert f'kvsidecar_pdproxy_prefill_failures_total{{reason="{failure}"}} 1\n' in text
        assert "kvsidecar_pdproxy_requests_total 1\n" in text
        others = {"no_params", "server_error", "unreachable"} - {failure}
        assert all(f'kvsidecar_pdproxy_fallbacks_total{{reason="{o}"}} 0\n' in text for o in others)
        assert "# TYPE kvsidecar_pdproxy_fallbacks_total counter" in text
    finally:
        proxy.close()
        if failure != "unreachable":
            pre.close()
        dec.close()


def test_a_prompt_list_falls_back_per_prompt():
    # One prompt's prefill fails: that prompt's decode computes it, the
    # other keeps its params.
    good, dead = Upstream(200, _prefill_of), Upstream(500, {"error": "boom"})
    dec = Upstream(200, _decode_of)
    proxy = PDProxy([good.url, dead.url], [dec.url]).start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [[10], [20]], "max_tokens": 4})
        assert code == 200
        assert [c["params"] for c in out["choices"]] == ["p-10", None]
        assert proxy.metrics.get("kvsidecar_pdproxy_fallbacks_total", "server_error") == 1
    finally:
        proxy.close()
        good.close()
        dead.close()
        dec.close()


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"on_prefill_failure 'retry' must be one of fallback, fail"):
        PDProxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], on_prefill_failure="retry")


def test_a_prompt_that_ends_at_its_first_token_goes_to_decode_whole():
    # The reported input: the prefill stopped on its first token (EOS), so it
    # returned no params, and the proxy answered 502 for a valid request.
    pre = Upstream(200, {"choices": [{"token_ids": [2], "finish_reason": "stop"}], "kv_transfer_params": None})
    dec = Upstream(200, {"choices": [{"token_ids": [2]}]})
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [1], "max_tokens": 4})
        assert (code, out) == (200, {"choices": [{"token_ids": [2]}]})
        assert dec.got == [{"model": "m", "prompt": [1], "max_tokens": 4}], "no params: the decode computes it"
    finally:
        proxy.close()
        pre.close()
        dec.close()


def test_params_go_to_decode_unchanged():
    params = {"do_remote_prefill": True, "tp_size": 2, "remote_block_ids": [3, 4], "capability": "AQI="}
    pre, dec = Upstream(200, {"kv_transfer_params": params}), Upstream(200, {"choices": [{"token_ids": [7]}]})
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [1], "max_tokens": 4})
        assert (code, out) == (200, {"choices": [{"token_ids": [7]}]})
        assert dec.got == [{"model": "m", "prompt": [1], "max_tokens": 4, "kv_transfer_params": params}]
    finally:
        proxy.close()
        pre.close()
        dec.close()


@pytest.mark.parametrize("down", ["prefill", "decode"])
def test_a_server_that_cannot_be_reached_is_a_502_naming_it(down):
    # A new user's run: with the decode down, the proxy printed a traceback
    # and closed the client's connection without an answer.
    params = {"do_remote_prefill": True, "tp_size": 1}
    up = Upstream(200, {"kv_transfer_params": params})
    gone = Upstream(200, {})
    gone.close()  # its port now refuses
    pre, dec = (gone, up) if down == "prefill" else (up, gone)
    proxy = PDProxy([pre.url], [dec.url], on_prefill_failure="fail").start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [1], "max_tokens": 4})
        assert code == 502
        assert out["error"].startswith(f"pdproxy: {down} {gone.url} cannot be reached: ")
        assert proxy.metrics.get(f"kvsidecar_pdproxy_{down}_failures_total", "unreachable") == 1
    finally:
        proxy.close()
        up.close()


def test_a_prefills_4xx_is_the_clients():
    # The reported input: n > 1 with greedy sampling, refused by the prefill
    # with 400, reached the client as a 502 naming the prefill.
    why = {"error": {"message": "n must be 1 when using greedy sampling, got 2.", "code": 400}}
    pre, dec = Upstream(400, why), Upstream(200, {"choices": []})
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        assert post(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 4, "n": 2, "temperature": 0}) == (400, why)
        assert dec.got == [], "the decode is never asked"
        assert proxy.metrics.get("kvsidecar_pdproxy_client_errors_total", "prefill") == 1
        assert proxy.metrics.get("kvsidecar_pdproxy_fallbacks_total", "server_error") == 0, "a 4xx is no fallback"
    finally:
        proxy.close()
        pre.close()
        dec.close()


def test_a_decode_that_refuses_an_export_releases_it():
    # The prefill ran one choice; the decode refuses the client's n > 1: the
    # client gets the decode's 400, and the export is released by a decode
    # of the prefill's own request with the params, not left to its lease.
    params = {"do_remote_prefill": True, "tp_size": 1, "remote_block_ids": [3]}
    why = {"error": {"message": "n must be 1 when using greedy sampling, got 2.", "code": 400}}
    pre = Upstream(200, {"kv_transfer_params": params, "choices": [{"token_ids": [9]}]})
    dec = Upstream(400, why)
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        assert post(proxy, {"model": "m", "prompt": [1, 2], "max_tokens": 4, "n": 2, "temperature": 0}) == (400, why)
        assert pre.got == [{"model": "m", "prompt": [1, 2], "max_tokens": 1, "temperature": 0, "stream": False,
                            "kv_transfer_params": {"do_remote_decode": True}}], "one choice of one token"
        wait_for("the release request", lambda: len(dec.got) == 2)
        assert dec.got[1] == {"model": "m", "prompt": [1, 2], "max_tokens": 1, "temperature": 0, "stream": False,
                              "kv_transfer_params": params}
        assert proxy.metrics.get("kvsidecar_pdproxy_client_errors_total", "decode") == 1
    finally:
        proxy.close()
        pre.close()
        dec.close()


def _prefill_of(req: dict) -> dict:
    # Params naming the prompt they were made for.
    return {"kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": f"p-{req['prompt'][0]}"},
            "choices": [{"token_ids": [0]}]}


def _decode_of(req: dict) -> dict:
    # One choice per n, its tokens the prompt's first and the params' id.
    p = req["prompt"]
    rid = (req.get("kv_transfer_params") or {}).get("remote_request_id")
    return {"id": f"cmpl-{p[0]}", "choices": [{"index": j, "token_ids": [p[0], j], "params": rid}
                                              for j in range(req.get("n", 1))],
            "usage": {"prompt_tokens": len(p), "completion_tokens": 2, "total_tokens": len(p) + 2}}


@pytest.mark.parametrize("n", [1, 2])
def test_a_prompt_list_gets_a_prefill_and_a_decode_per_prompt(n):
    # The reported input: a prompt list went to the decode with prompt 0's
    # kv_transfer_params, and prompt 1 was decoded over prompt 0's KV.
    pre, dec = Upstream(200, _prefill_of), Upstream(200, _decode_of)
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [[10, 11], [20], [30, 31, 32]], "max_tokens": 4, "n": n,
                                 "temperature": 1.0, "seed": 3})
        assert code == 200
        assert sorted(r["prompt"][0] for r in pre.got) == [10, 20, 30]
        assert all(r["max_tokens"] == 1 and "n" not in r for r in pre.got)
        for r in dec.got:
            assert r["kv_transfer_params"]["remote_request_id"] == f"p-{r['prompt'][0]}", "each prompt its own params"
            assert r["n"] == n and r["seed"] == 3
        assert [(c["index"], c["token_ids"], c["params"]) for c in out["choices"]] == [
            (i * n + j, [p, j], f"p-{p}") for i, p in enumerate((10, 20, 30)) for j in range(n)]
        assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    finally:
        proxy.close()
        pre.close()
        dec.close()


def test_a_prompt_list_with_a_refused_prompt_is_the_refusal():
    pre, dec = Upstream(200, _prefill_of), Upstream(200, _decode_of)
    bad = Upstream(400, {"error": "token id 99999 is out of vocabulary"})
    proxy = PDProxy([pre.url, bad.url], [dec.url]).start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [[10], [20]], "max_tokens": 4})
        assert (code, out) == (400, {"error": "token id 99999 is out of vocabulary"})
        # The export the other prompt made is released by its decode.
        wait_for("the release request", lambda: len(dec.got) == 1)
        assert [r["max_tokens"] for r in dec.got] == [1] and dec.got[0]["kv_transfer_params"]["remote_request_id"] == "p-10"
    finally:
        proxy.close()
        pre.close()
        dec.close()
        bad.close()


@pytest.mark.parametrize("prompt", [[1, 2], [[1], [2]]])
def test_a_decode_answer_cut_short_reaches_the_client_cut_short(prompt):
    # The soak's input: a decode engine killed mid-stream; the client got a
    # stream that ended as if complete, with some of its tokens: a wrong
    # answer. The client's connection now ends without the stream's end.
    pre, dec = Upstream(200, _prefill_of), Upstream(200, {}, cut_stream=True)
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": prompt, "stream": True}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        with pytest.raises(http.client.IncompleteRead):
            devvllm.choices(r, True)
        conn.close()
    finally:
        proxy.close()
        pre.close()
        dec.close()
