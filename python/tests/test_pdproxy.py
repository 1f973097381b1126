"""kvsidecar.pdproxy's refusals (its happy path runs against real vLLM
engines in test_vllm_engines.py): a prefill that answers without
kv_transfer_params, or with an error, is the client's 502 naming it, and
the decode is never asked; a server that cannot be reached is a 502 naming
it; a prompt that ends at its first token is the decode's to answer whole."""

from __future__ import annotations

import http.client
import http.server
import json
import threading

import pytest

from kvsidecar.pdproxy import PDProxy


class Upstream:
    """A local HTTP server answering every POST with ``status`` and
    ``body``, recording the requests it got."""

    def __init__(self, status: int, body: dict) -> None:
        self.got: list[dict] = []
        up = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                return

            def do_POST(self) -> None:
                up.got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
def test_prefill_without_params_is_a_502_and_decode_is_not_asked(status, body):
    pre, dec = Upstream(status, body), Upstream(200, {"choices": []})
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 9, "stream": True})
        assert code == 502
        assert f"prefill {pre.url} answered {status} without kv_transfer_params" in out["error"]
        assert pre.got == [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": False,
                            "kv_transfer_params": {"do_remote_decode": True}}]
        assert dec.got == []
    finally:
        proxy.close()
        pre.close()
        dec.close()


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
    proxy = PDProxy([pre.url], [dec.url]).start()
    try:
        code, out = post(proxy, {"model": "m", "prompt": [1], "max_tokens": 4})
        assert code == 502
        assert out["error"].startswith(f"pdproxy: {down} {gone.url} cannot be reached: ")
    finally:
        proxy.close()
        up.close()
