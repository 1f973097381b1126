"""A small prefill/decode proxy in front of vLLM's OpenAI-compatible servers.

For one machine's trials and the tests, as vLLM's own
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` is for
NixlConnector: each ``POST /v1/completions`` is sent to a prefill server
with ``kv_transfer_params = {"do_remote_decode": true}``, ``max_tokens = 1``
and no streaming; the ``kv_transfer_params`` it returns go unchanged into
the same request sent to a decode server, whose answer (streamed or not) is
the client's. Prefill and decode servers are taken round robin. Standard
library only::

    python -m kvsidecar.pdproxy --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Errors: a prefill that fails, or returns no ``kv_transfer_params``, is
answered with 502 and the prefill's status and text; a server that cannot be
reached (refused, timed out) with 502 naming it and the error; the decode's
status is passed through.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import itertools
import json
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

__all__ = ["PDProxy", "main"]

#: Seconds one upstream request may take.
UPSTREAM_TIMEOUT_SECONDS = 300.0


def _request(url: str, body: dict[str, Any] | None, path: str = "/v1/completions"
             ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POSTs ``body`` as JSON (None: GETs) to ``path`` under base URL ``url``."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=UPSTREAM_TIMEOUT_SECONDS)
    target = u.path.rstrip("/") + path
    if body is None:
        conn.request("GET", target)
    else:
        conn.request("POST", target, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


class PDProxy:
    """The proxy's HTTP server on ``host:port`` (port 0: the kernel picks).

    Args:
        prefill: base URLs of prefill servers (``http://host:port``).
        decode: base URLs of decode servers.
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], host: str = "127.0.0.1", port: int = 0) -> None:
        if not prefill or not decode:
            raise ValueError("pdproxy: needs at least one prefill and one decode server")
        self._prefill = itertools.cycle(list(prefill))
        self._decode = itertools.cycle(list(decode))
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                # /v1/models and the like: the decode servers serve the model.
                with proxy._lock:
                    dec_url = next(proxy._decode)
                proxy._stream(self, dec_url, None, self.path)

            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/v1/completions":
                    self._reply(404, {"error": f"pdproxy serves /v1/completions, not {self.path}"})
                    return
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    req = json.loads(self.rfile.read(n) or b"{}")
                except json.JSONDecodeError as e:
                    self._reply(400, {"error": f"pdproxy: the request body is not JSON: {e}"})
                    return
                proxy._forward(self, req)

            def _reply(self, status: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://{host}:{self.port}"
        self._thread: threading.Thread | None = None

    def _next(self) -> tuple[str, str]:
        with self._lock:
            return next(self._prefill), next(self._decode)

    def _forward(self, h: Any, req: dict[str, Any]) -> None:
        pre_url, dec_url = self._next()
        pre = dict(req, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        pre.pop("stream_options", None)
        try:
            conn, r = _request(pre_url, pre)
        except OSError as e:
            h._reply(502, {"error": f"pdproxy: prefill {pre_url} cannot be reached: {e}"})
            return
        finished = False
        try:
            data = r.read()
            out = json.loads(data) if r.status == 200 else {}
            params = out.get("kv_transfer_params")
            # A prompt whose first token ends it (stop or EOS) leaves no KV
            # to hand over: the decode answers it whole.
            finished = any(c.get("finish_reason") == "stop" for c in out.get("choices") or ())
        except (json.JSONDecodeError, AttributeError):
            params = None
        finally:
            conn.close()
        if params is None and finished:
            self._stream(h, dec_url, dict(req))
            return
        if params is None:
            h._reply(502, {"error": f"pdproxy: prefill {pre_url} answered {r.status} without kv_transfer_params",
                           "prefill": data[:2000].decode(errors="replace")})
            return
        self._stream(h, dec_url, dict(req, kv_transfer_params=params))

    def _stream(self, h: Any, dec_url: str, body: dict[str, Any] | None, path: str = "/v1/completions") -> None:
        """Sends ``body`` (None: a GET of ``path``) to the decode server and
        relays its answer."""
        try:
            conn, r = _request(dec_url, body, path)
        except OSError as e:
            h._reply(502, {"error": f"pdproxy: decode {dec_url} cannot be reached: {e}"})
            return
        try:
            h.send_response(r.status)
            h.send_header("Content-Type", r.getheader("Content-Type", "application/json"))
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            while True:
                chunk = r.read1(1 << 16)
                if not chunk:
                    break
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                h.wfile.flush()
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away: closing the decode request aborts it there
        finally:
            conn.close()

    def start(self) -> PDProxy:
        """Serves in a background thread; returns self."""
        self._thread = threading.Thread(target=self.server.serve_forever, name="pdproxy", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops serving and closes the listening socket."""
        self.server.shutdown()
        self.server.server_close()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvsidecar's prefill/decode proxy for vLLM's OpenAI servers")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill server's base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode server's base URL (repeatable)")
    a = ap.parse_args(argv)
    p = PDProxy(a.prefill, a.decode, a.host, a.port)
    print(f"pdproxy listening on {p.url}", flush=True)
    try:
        p.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        p.server.server_close()


if __name__ == "__main__":
    main()
