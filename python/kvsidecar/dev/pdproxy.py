"""A small prefill/decode proxy in front of vLLM's OpenAI-compatible servers.

For one machine's trials and the tests, as vLLM's own
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` is for
NixlConnector: each ``POST /v1/completions`` is sent to a prefill server
with ``kv_transfer_params = {"do_remote_decode": true}``, ``max_tokens = 1``,
one choice (``n``, ``best_of`` and ``min_tokens`` left out: the prefill
only computes the prompt's KV) and no streaming; the ``kv_transfer_params``
it returns go unchanged into the same request sent to a decode server, whose
answer (streamed or not) is the client's. Prefill and decode servers are
taken round robin. Standard library only::

    python -m kvsidecar.dev.pdproxy --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

**Prompt lists.** A ``prompt`` that is a list of prompts (strings or token
id lists; vLLM answers one choice per prompt and ``n``, choice ``i * n + j``
for prompt ``i``) is split: each prompt gets its own prefill and its own
decode with its own ``kv_transfer_params``, side by side, and the answers
are put back together as vLLM would have given them (choices in that
order, usage summed; streamed chunks relayed as they come with their
``index`` so numbered, one usage chunk and one ``[DONE]`` at the end). One
prefill's params for several prompts would hand every prompt after the
first another prompt's KV.

Errors: a prefill's 4xx (the request is the client's error: ``n > 1`` with
greedy sampling, a prompt too long, ...) is the client's, with the
prefill's body. A prefill that cannot be reached (refused, timed out),
fails (5xx, or an answer that is not JSON) or answers without
``kv_transfer_params`` (its sidecar is down, say) is handled by the
policy ``on_prefill_failure`` (``--on-prefill-failure``):

- ``fallback`` (the default): the decode gets the request without params
  and computes the prompt itself; the answer is the same tokens, later.
  Counted in ``kvsidecar_pdproxy_fallbacks_total{reason}``.
- ``fail``: the client gets 502 naming the prefill, its status and text
  (or the connection error); the decode is not asked.

A decode that cannot be reached is a 502 naming it; the decode's own
status is passed through. A decode that refuses a request the prefill
exported (its own 4xx, say ``n > 1`` with greedy sampling, which the
prefill was not asked) would leave the export to its lease: the proxy then
sends the decode the prefill's own request (one token) with the params,
which loads and releases it.

Every failure (either side, a client error included) is logged (logger
``kvsidecar.dev.pdproxy``) with the request id: the client's ``X-Request-Id``
header, else one the proxy makes (``pd-`` and 16 hex digits), returned to
the client in ``X-Request-Id``. ``GET /metrics`` is the proxy's own, in
Prometheus text: ``kvsidecar_pdproxy_requests_total``,
``kvsidecar_pdproxy_prefill_failures_total{reason}`` (``unreachable``,
``server_error``, ``no_params``: every one, whatever the policy),
``kvsidecar_pdproxy_fallbacks_total{reason}``,
``kvsidecar_pdproxy_decode_failures_total{reason}`` (``unreachable``,
``server_error``, ``cut_short``) and
``kvsidecar_pdproxy_client_errors_total{side}`` (4xx passed through). A
prompt list counts each prompt's prefill and decode.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import itertools
import json
import logging
import os
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

__all__ = ["POLICIES", "PDProxy", "main"]

#: Seconds one upstream request may take.
UPSTREAM_TIMEOUT_SECONDS = 300.0

#: The values of ``on_prefill_failure`` (see the module doc).
POLICIES = ("fallback", "fail")

log = logging.getLogger("kvsidecar.dev.pdproxy")

#: The proxy's metric families: name -> (help, label, label values); a
#: family without a label has label "".
_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "kvsidecar_pdproxy_requests_total": ("Completion requests the proxy received.", "", ()),
    "kvsidecar_pdproxy_prefill_failures_total": (
        "Prefills that could not be reached, failed (5xx) or answered without kv_transfer_params.",
        "reason", ("unreachable", "server_error", "no_params")),
    "kvsidecar_pdproxy_fallbacks_total": (
        "Prompts the decode computed itself because their prefill failed (on_prefill_failure=fallback).",
        "reason", ("unreachable", "server_error", "no_params")),
    "kvsidecar_pdproxy_decode_failures_total": (
        "Decodes that could not be reached, failed (5xx) or whose answer was cut short.",
        "reason", ("unreachable", "server_error", "cut_short")),
    "kvsidecar_pdproxy_client_errors_total": (
        "Client errors (4xx) of a prefill or decode passed through to the client.", "side", ("prefill", "decode")),
}


class _Metrics:
    """The proxy's counters, every series at 0 from the start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v: dict[tuple[str, str], int] = {
            (name, value): 0 for name, (_, _, values) in _FAMILIES.items() for value in (values or ("",))}

    def inc(self, name: str, value: str = "") -> None:
        with self._lock:
            self._v[(name, value)] += 1

    def get(self, name: str, value: str = "") -> int:
        """The counter's value (tests, operators in a Python shell)."""
        with self._lock:
            return self._v[(name, value)]

    def text(self) -> bytes:
        """Prometheus text exposition format 0.0.4."""
        out: list[str] = []
        with self._lock:
            for name, (help_, label, values) in _FAMILIES.items():
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
                for value in values or ("",):
                    series = f'{name}{{{label}="{value}"}}' if label else name
                    out.append(f"{series} {self._v[(name, value)]}")
        return ("\n".join(out) + "\n").encode()


def _request_id(given: str | None) -> str:
    """The client's X-Request-Id when it sent a usable one, else a new id."""
    if given and len(given) <= 128 and given.isprintable():
        return given
    return "pd-" + os.urandom(8).hex()


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
        on_prefill_failure: ``fallback`` (default: the decode computes the
            prompt) or ``fail`` (502 naming the prefill); see the module doc.

    Raises:
        ValueError: no prefill or decode server, or an unknown policy.
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], host: str = "127.0.0.1", port: int = 0,
                 on_prefill_failure: str = "fallback") -> None:
        if not prefill or not decode:
            raise ValueError("pdproxy: needs at least one prefill and one decode server")
        if on_prefill_failure not in POLICIES:
            raise ValueError(f"pdproxy: on_prefill_failure {on_prefill_failure!r} must be one of {', '.join(POLICIES)}")
        self.on_prefill_failure = on_prefill_failure
        #: The proxy's counters (served on GET /metrics).
        self.metrics = _Metrics()
        self._prefill = itertools.cycle(list(prefill))
        self._decode = itertools.cycle(list(decode))
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            request_id = ""

            def log_message(self, fmt: str, *args: Any) -> None:
                return

            def end_headers(self) -> None:
                if self.request_id:
                    self.send_header("X-Request-Id", self.request_id)
                super().end_headers()

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/metrics":
                    data = proxy.metrics.text()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                # /v1/models and the like: the decode servers serve the model.
                with proxy._lock:
                    dec_url = next(proxy._decode)
                proxy._stream(self, dec_url, None, self.path)

            def do_POST(self) -> None:
                self.request_id = _request_id(self.headers.get("X-Request-Id"))
                if self.path.rstrip("/") != "/v1/completions":
                    self._reply(404, {"error": f"pdproxy serves /v1/completions, not {self.path}"})
                    return
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    req = json.loads(self.rfile.read(n) or b"{}")
                except json.JSONDecodeError as e:
                    log.warning("request %s: the request body is not JSON (400): %s", self.request_id, e)
                    self._reply(400, {"error": f"pdproxy: the request body is not JSON: {e}"})
                    return
                proxy.metrics.inc("kvsidecar_pdproxy_requests_total")
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
        prompts = _prompt_list(req.get("prompt"))
        if prompts is not None:
            self._forward_list(h, req, prompts)
            return
        pre_url, dec_url = self._next()
        got = self._run_prefill(pre_url, req, h.request_id)
        if isinstance(got, _Reply):
            got.send(h)
            return
        body = dict(req) if got is None else dict(req, kv_transfer_params=got)
        self._stream(h, dec_url, body, release=None if got is None else self._release_request(req, got))

    def _run_prefill(self, pre_url: str, req: dict[str, Any], rid: str) -> dict[str, Any] | _Reply | None:
        """Runs ``req``'s prefill on ``pre_url``: the ``kv_transfer_params``
        for the decode; None when the decode answers the prompt whole (its
        first token ended it: no KV to hand over; or the prefill failed
        under the ``fallback`` policy); or the reply the client gets
        instead (the prefill's 4xx, or under ``fail`` a 502 naming it).
        ``rid`` is the request id the failures are logged with."""
        try:
            conn, r = _request(pre_url, _prefill_request(req))
        except OSError as e:
            return self._prefill_failed(rid, pre_url, "unreachable", f"cannot be reached: {e}", None)
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
        except (OSError, http.client.HTTPException) as e:
            return self._prefill_failed(rid, pre_url, "unreachable", f"answer cut short: {e}", None)
        finally:
            conn.close()
        if 400 <= r.status < 500:
            # The client's error, as the prefill found it: passed through.
            self.metrics.inc("kvsidecar_pdproxy_client_errors_total", "prefill")
            log.info("request %s: prefill %s refused it (%d), passed to the client: %s", rid, pre_url, r.status,
                     data[:500].decode(errors="replace"))
            return _Reply(r.status, None, data, r.getheader("Content-Type", "application/json"))
        if params is None and finished:
            return None
        if params is None:
            reason = "no_params" if r.status == 200 else "server_error"
            return self._prefill_failed(rid, pre_url, reason, f"answered {r.status} without kv_transfer_params",
                                        data[:2000].decode(errors="replace"))
        return dict(params)

    def _prefill_failed(self, rid: str, pre_url: str, reason: str, what: str, body: str | None) -> _Reply | None:
        """A prefill failure (``reason``: unreachable, server_error,
        no_params), counted and logged with the request id and the policy's
        action: None under ``fallback`` (the decode computes the prompt), the
        502 naming the prefill under ``fail``."""
        self.metrics.inc("kvsidecar_pdproxy_prefill_failures_total", reason)
        if self.on_prefill_failure == "fallback":
            self.metrics.inc("kvsidecar_pdproxy_fallbacks_total", reason)
            log.warning("request %s: prefill %s %s; fallback: the decode computes the prompt%s", rid, pre_url, what,
                        f": {body[:500]}" if body else "")
            return None
        log.error("request %s: prefill %s %s; fail: the client gets 502%s", rid, pre_url, what,
                  f": {body[:500]}" if body else "")
        obj: dict[str, Any] = {"error": f"pdproxy: prefill {pre_url} {what}"}
        if body is not None:
            obj["prefill"] = body
        return _Reply(502, obj)

    def _decode_failed(self, rid: str, dec_url: str, reason: str, what: str) -> None:
        """Counts and logs a decode failure (unreachable, server_error,
        cut_short) with the request id."""
        self.metrics.inc("kvsidecar_pdproxy_decode_failures_total", reason)
        log.error("request %s: decode %s %s", rid, dec_url, what)

    def _decode_status(self, rid: str, dec_url: str, r: http.client.HTTPResponse) -> None:
        """Counts and logs a decode's answer that is not 200 (its body is
        the client's)."""
        if 400 <= r.status < 500:
            self.metrics.inc("kvsidecar_pdproxy_client_errors_total", "decode")
            log.info("request %s: decode %s refused it (%d), passed to the client", rid, dec_url, r.status)
        elif r.status >= 500:
            self._decode_failed(rid, dec_url, "server_error", f"answered {r.status}, passed to the client")

    def _release_request(self, req: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The decode request that releases an export whose decode was
        refused: the prefill's own (which its server accepted) with the
        params."""
        return dict(_prefill_request(req), kv_transfer_params=params)

    def _release(self, dec_url: str, body: dict[str, Any]) -> None:
        """Sends ``body`` (:meth:`_release_request`) to the decode in the
        background and drops the answer: the load notifies the prefill,
        which releases the export now instead of at its lease's end."""

        def run() -> None:
            try:
                conn, r = _request(dec_url, body)
                try:
                    r.read()
                finally:
                    conn.close()
            except OSError:
                pass  # the lease ends it

        threading.Thread(target=run, name="pdproxy-release", daemon=True).start()

    def _stream(self, h: Any, dec_url: str, body: dict[str, Any] | None, path: str = "/v1/completions",
                release: dict[str, Any] | None = None) -> None:
        """Sends ``body`` (None: a GET of ``path``) to the decode server and
        relays its answer; a refusal (4xx) of a request whose export
        ``release`` names sends that release."""
        rid = h.request_id or "-"
        try:
            conn, r = _request(dec_url, body, path)
        except OSError as e:
            self._decode_failed(rid, dec_url, "unreachable", f"cannot be reached: {e}; the client gets 502")
            h._reply(502, {"error": f"pdproxy: decode {dec_url} cannot be reached: {e}"})
            return
        if body is not None:
            self._decode_status(rid, dec_url, r)
        if release is not None and 400 <= r.status < 500:
            self._release(dec_url, release)
        try:
            w = _ChunkWriter(h, r.status, r.getheader("Content-Type", "application/json"))
            while True:
                chunk = r.read1(1 << 16)
                if not chunk:
                    break
                w.write(chunk)
            w.close()
        except (OSError, http.client.HTTPException) as e:
            # The client went away (closing the decode request aborts it
            # there), or the decode's answer was cut short (it died): the
            # client's connection is closed without the answer's end, so
            # the client sees it cut short too, never as complete.
            self._cut_short(rid, dec_url, e)
            h.close_connection = True
        finally:
            conn.close()

    def _cut_short(self, rid: str, dec_url: str, e: Exception) -> None:
        """Logs an answer that did not reach the client whole: the decode's
        was cut short (counted), or the client went away."""
        if isinstance(e, (http.client.HTTPException, ValueError)):  # ValueError: a JSON answer cut short
            self._decode_failed(rid, dec_url, "cut_short", f"answer cut short ({e!r}); the client's is cut short too")
        else:
            log.warning("request %s: the answer from decode %s did not reach the client whole: %s", rid, dec_url, e)

    def _forward_list(self, h: Any, req: dict[str, Any], prompts: list[Any]) -> None:
        """A prompt list: a prefill and a decode per prompt, side by side,
        the answers put back together (see the module doc)."""
        n = int(req.get("n") or 1)
        urls = [self._next() for _ in prompts]
        subs = [dict(req, prompt=p) for p in prompts]
        got: list[dict[str, Any] | _Reply | None] = [None] * len(prompts)

        def prefill(i: int) -> None:
            got[i] = self._run_prefill(urls[i][0], subs[i], f"{h.request_id}/{i}")

        _each(prefill, len(prompts))
        bodies, releases = [], []
        for sub, g in zip(subs, got, strict=True):
            bodies.append(dict(sub) if g is None or isinstance(g, _Reply) else dict(sub, kv_transfer_params=g))
            releases.append(None if g is None or isinstance(g, _Reply) else self._release_request(sub, g))
        failed = next((g for g in got if isinstance(g, _Reply)), None)
        if failed is not None:
            # Every export made is released; the client gets the refusal.
            for (_, dec_url), rel in zip(urls, releases, strict=True):
                if rel is not None:
                    self._release(dec_url, rel)
            failed.send(h)
            return
        answers: list[tuple[http.client.HTTPConnection, http.client.HTTPResponse] | _Reply] = [
            _Reply(502, {})] * len(prompts)

        def decode(i: int) -> None:
            try:
                conn, r = _request(urls[i][1], bodies[i])
            except OSError as e:
                self._decode_failed(f"{h.request_id}/{i}", urls[i][1], "unreachable",
                                    f"cannot be reached: {e}; the client gets 502")
                answers[i] = _Reply(502, {"error": f"pdproxy: decode {urls[i][1]} cannot be reached: {e}"})
                return
            answers[i] = (conn, r)
            self._decode_status(f"{h.request_id}/{i}", urls[i][1], r)

        _each(decode, len(prompts))
        try:
            bad = next((i for i, a in enumerate(answers) if isinstance(a, _Reply) or a[1].status != 200), None)
            if bad is not None:
                for i, a in enumerate(answers):
                    rel = releases[i]
                    if not isinstance(a, _Reply) and 400 <= a[1].status < 500 and rel is not None:
                        self._release(urls[i][1], rel)
                a = answers[bad]
                if isinstance(a, _Reply):
                    a.send(h)
                else:
                    _Reply(a[1].status, None, a[1].read(), a[1].getheader("Content-Type", "application/json")).send(h)
                return
            responses = [a[1] for a in answers if not isinstance(a, _Reply)]
            if req.get("stream"):
                include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
                _merge_streams(h, responses, n, include_usage)
            else:
                _merge_bodies(h, responses, n)
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            # The client went away (closing the decode requests aborts them
            # there), or a decode's answer was cut short: the client's
            # connection is closed without the answer's end.
            self._cut_short(h.request_id, ", ".join(u for _, u in urls), e)
            h.close_connection = True
        finally:
            for a in answers:
                if not isinstance(a, _Reply):
                    a[0].close()

    def start(self) -> PDProxy:
        """Serves in a background thread; returns self."""
        self._thread = threading.Thread(target=self.server.serve_forever, name="pdproxy", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops serving and closes the listening socket."""
        self.server.shutdown()
        self.server.server_close()


def _prompt_list(prompt: Any) -> list[Any] | None:
    """The prompts of a ``prompt`` that is a list of them (strings, or
    token id lists); None for one prompt (a string, or one token id list)
    and for what vLLM would refuse (the prefill says why)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return None


def _prefill_request(req: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill runs for ``req``: one token, one choice, no
    stream, the KV kept for a decode."""
    pre = dict(req, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    for k in ("stream_options", "n", "best_of", "min_tokens"):
        pre.pop(k, None)
    return pre


def _each(fn: Any, n: int) -> None:
    """Runs ``fn(i)`` for i in range(n) side by side and waits for all."""
    ts = [threading.Thread(target=fn, args=(i,), name=f"pdproxy-{i}") for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


class _Reply:
    """An answer the proxy gives the client itself: ``status`` and JSON
    ``obj``, or the bytes ``raw`` of an upstream answer passed through."""

    def __init__(self, status: int, obj: dict[str, Any] | None, raw: bytes = b"",
                 content_type: str = "application/json") -> None:
        self.status, self.content_type = status, content_type
        self.data = json.dumps(obj).encode() if obj is not None else raw

    def send(self, h: Any) -> None:
        h.send_response(self.status)
        h.send_header("Content-Type", self.content_type)
        h.send_header("Content-Length", str(len(self.data)))
        h.end_headers()
        h.wfile.write(self.data)


class _ChunkWriter:
    """An HTTP/1.1 chunked answer to the client."""

    def __init__(self, h: Any, status: int, content_type: str) -> None:
        self.h = h
        h.send_response(status)
        h.send_header("Content-Type", content_type)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

    def write(self, data: bytes) -> None:
        if data:
            self.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.h.wfile.flush()

    def close(self) -> None:
        self.h.wfile.write(b"0\r\n\r\n")


def _renumber(choices: list[dict[str, Any]], prompt: int, n: int) -> None:
    """Numbers prompt ``prompt``'s choices as vLLM numbers a prompt list's:
    ``prompt * n + index``."""
    for c in choices:
        c["index"] = prompt * n + int(c.get("index") or 0)


def _add_usage(total: dict[str, int], usage: dict[str, Any] | None) -> None:
    for k, v in (usage or {}).items():
        if isinstance(v, int):
            total[k] = total.get(k, 0) + v


def _merge_bodies(h: Any, responses: list[http.client.HTTPResponse], n: int) -> None:
    """The non-streamed answers of a prompt list's decodes as one."""
    outs = [json.loads(r.read()) for r in responses]
    merged = dict(outs[0])
    merged.pop("kv_transfer_params", None)
    choices: list[dict[str, Any]] = []
    usage: dict[str, int] = {}
    for i, out in enumerate(outs):
        cs = list(out.get("choices") or ())
        _renumber(cs, i, n)
        choices += cs
        _add_usage(usage, out.get("usage"))
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    merged["usage"] = usage or merged.get("usage")
    _Reply(200, merged).send(h)


def _merge_streams(h: Any, responses: list[http.client.HTTPResponse], n: int, include_usage: bool) -> None:
    """The streamed answers of a prompt list's decodes relayed as one
    stream: each chunk as it comes, its choices renumbered; each stream's
    usage chunk and ``[DONE]`` held back, one usage chunk (when asked for)
    and one ``[DONE]`` sent at the end.

    Raises:
        http.client.IncompleteRead: a decode's stream ended without its
            ``[DONE]`` (it died): the merged stream is left without its end.
    """
    w = _ChunkWriter(h, 200, responses[0].getheader("Content-Type", "text/event-stream"))
    lock = threading.Lock()
    usage: dict[str, int] = {}
    last: dict[str, Any] = {}

    done = [False] * len(responses)

    def relay(i: int) -> None:
        for raw in responses[i]:
            line = raw.strip()
            if line == b"data: [DONE]":
                done[i] = True
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            choices = ev.get("choices") or []
            with lock:
                _add_usage(usage, ev.get("usage"))
                if not choices:
                    last.update(ev)
                    continue
                _renumber(choices, i, n)
                ev["usage"] = None
                w.write(b"data: " + json.dumps(ev).encode() + b"\n\n")

    _each(relay, len(responses))
    if not all(done):
        # (http.client ends the lines of a chunked answer cut short
        # without an error: [DONE] is how the end is known.)
        raise http.client.IncompleteRead(b"")
    if include_usage:
        tail = dict(last, choices=[], usage=usage)
        w.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
    w.write(b"data: [DONE]\n\n")
    w.close()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="kvsidecar's prefill/decode proxy for vLLM's OpenAI servers")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill server's base URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode server's base URL (repeatable)")
    ap.add_argument("--on-prefill-failure", choices=POLICIES, default="fallback",
                    help="a prefill that cannot be reached, fails (5xx) or answers without kv_transfer_params: "
                         "fallback (the decode computes the prompt; counted in /metrics) or fail (502 naming the "
                         "prefill). Default fallback")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = PDProxy(a.prefill, a.decode, a.host, a.port, on_prefill_failure=a.on_prefill_failure)
    print(f"pdproxy listening on {p.url} (on prefill failure: {a.on_prefill_failure}; metrics at {p.url}/metrics)",
          flush=True)
    try:
        p.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        p.server.server_close()


if __name__ == "__main__":
    main()
