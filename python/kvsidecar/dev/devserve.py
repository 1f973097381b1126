"""Start ``kvsidecar serve`` processes on loopback: for tests, examples and
trying kvsidecar out on one machine.

Production runs one ``kvsidecar serve`` per GPU under a supervisor with
certificates from a real CA (see the README). This module does the same on
127.0.0.1 with a throwaway CA made by ``openssl`` (the README's commands),
UDP ports picked here and logs parsed from the sidecar's JSON lines::

    from kvsidecar.dev import devserve

    with devserve.Cluster("/path/to/bin/kvsidecar") as cl:
        prefill = cl.start_group("prefill-a", tp_size=2, role="prefill", args=["--model", "llama-3.2-1b"])
        print(prefill[0].socket, prefill[0].metrics_url)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

__all__ = ["Cluster", "DevCerts", "ServeError", "Sidecar", "free_udp_addrs", "make_dev_certs", "prom_sum", "rss_bytes"]

#: Seconds a process may take to log "serving" (multiplied by
#: KVSIDECAR_TIME_SCALE, as the Go e2e harness does).
START_TIMEOUT_SECONDS = 20.0


def time_scale() -> float:
    """KVSIDECAR_TIME_SCALE (default 1): a factor for every wall-clock bound
    on a loaded machine."""
    try:
        return max(1.0, float(os.environ.get("KVSIDECAR_TIME_SCALE", "1")))
    except ValueError:
        return 1.0


def prom_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric ``name`` in Prometheus text format
    (``/metrics`` of a sidecar or a vLLM server) whose labels include every
    ``labels`` pair; 0 when there is none. ``name`` is the sample's name
    (``x_sum``, ``x_count``, ``x_total``), not the family's."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        rest = line[len(name):]
        if rest and rest[0] not in " {":
            continue
        if want:
            lab = rest[1:rest.find("}")] if rest.startswith("{") else ""
            if any(w not in lab.split(",") for w in want):
                continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command (which may hold spaces): state,
    ppid, pgrp, ... (field 3 of proc(5) first).

    Raises:
        OSError: no such process.
    """
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _pids(pid: int, group: bool) -> list[int]:
    """``[pid]``, or with ``group`` every process in the process group
    ``pid`` leads (a vLLM server started in a session of its own: its API
    server, engine core and workers)."""
    if not group:
        return [pid]
    pids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and int(_stat_fields(name)[2]) == pid:
                pids.append(int(name))
        except (OSError, IndexError, ValueError):
            continue  # not a process, or gone meanwhile
    return pids


def cpu_seconds(pid: int, *, group: bool = False) -> float:
    """CPU time (user + system, seconds) process ``pid`` has used so far,
    from /proc (``utime`` and ``stime``, proc(5)); with ``group`` of every
    process of its process group (see :func:`rss_bytes`). A process gone
    counts 0."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in _pids(pid, group):
        try:
            f = _stat_fields(p)
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


def rss_bytes(pid: int, *, group: bool = False) -> int:
    """The resident set (VmRSS, bytes) of process ``pid`` now, from /proc;
    with ``group`` of every process in the process group ``pid`` leads (a
    vLLM server started in a session of its own: its API server, engine
    core and workers). Shared pages (the sidecar's memfd pages an engine
    maps) count in each process that touched them; 0 for a process gone."""
    total = 0
    for p in _pids(pid, group):
        try:
            with open(f"/proc/{p}/status") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        except OSError:
            continue
    return total


class ServeError(RuntimeError):
    """A ``kvsidecar serve`` process did not start or behave as expected;
    the message ends with its last log lines."""


class DevCerts:
    """PEM files of a throwaway CA and one leaf for 127.0.0.1, ::1 and
    localhost with serverAuth and clientAuth (every sidecar may present the
    same leaf: each verifies only that a peer's chain ends at the CA and
    that the dialled address is in the leaf's names)."""

    def __init__(self, ca: str, cert: str, key: str) -> None:
        self.ca, self.cert, self.key = ca, cert, key


def make_dev_certs(directory: str) -> DevCerts:
    """Writes ``ca.pem``, ``leaf.pem`` and ``leaf-key.pem`` (ECDSA P-256)
    into ``directory`` with openssl, as the README's Certificates section.

    Raises:
        ServeError: openssl is missing or fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ServeError("openssl not found (apt-get install openssl): it makes the dev TLS certificates")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    p = lambda name: os.path.join(directory, name)  # noqa: E731
    with open(p("leaf.ext"), "w") as f:
        f.write(
            "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\n"
            "extendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature\n"
        )
    steps = [
        ["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", p("ca-key.pem")],
        ["req", "-x509", "-new", "-key", p("ca-key.pem"), "-sha256", "-days", "2", "-subj", "/CN=kvsidecar-dev-ca",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
         "-out", p("ca.pem")],
        ["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", p("leaf-key.pem")],
        ["req", "-new", "-key", p("leaf-key.pem"), "-subj", "/CN=kvsidecar-dev", "-out", p("leaf.csr")],
        ["x509", "-req", "-in", p("leaf.csr"), "-CA", p("ca.pem"), "-CAkey", p("ca-key.pem"), "-CAcreateserial",
         "-days", "2", "-sha256", "-extfile", p("leaf.ext"), "-out", p("leaf.pem")],
    ]
    for args in steps:
        r = subprocess.run([openssl, *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise ServeError(f"openssl {args[0]} failed ({r.returncode}): {r.stderr.strip()}")
    os.chmod(p("leaf-key.pem"), 0o600)
    return DevCerts(p("ca.pem"), p("leaf.pem"), p("leaf-key.pem"))


def free_udp_addrs(n: int, host: str = "127.0.0.1") -> list[str]:
    """``n`` host:port addresses whose UDP ports were free a moment ago
    (bound together, then closed)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((host, 0))
            socks.append(s)
        return [f"{host}:{s.getsockname()[1]}" for s in socks]
    finally:
        for s in socks:
            s.close()


class Sidecar:
    """One running ``kvsidecar serve``. Its stderr JSON log lines are kept
    (``logs``) and searchable (:meth:`wait_log`).

    Attributes:
        name: ``<engine>-tp<rank>``.
        socket: the local API socket path (from the "serving" log line).
        metrics_url: ``http://host:port`` of /metrics, /healthz, /readyz.
        quic_addr: the bound QUIC address.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self._cond = threading.Condition()
        self.logs: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env)
        self._reader = threading.Thread(target=self._read, name=f"logs-{name}", daemon=True)
        self._reader.start()
        self.socket = ""
        self.metrics_url = ""
        self.quic_addr = ""

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    rec = {"raw": line}
            except ValueError:
                rec = {"raw": line}
            with self._cond:
                self.logs.append(rec)
                self._cond.notify_all()
        self.proc.wait()
        with self._cond:
            self._cond.notify_all()

    def tail(self, n: int = 20) -> str:
        """The last ``n`` log lines, one per line."""
        with self._cond:
            return "\n".join(json.dumps(x) for x in self.logs[-n:])

    def wait_log(self, msg: str, timeout: float = START_TIMEOUT_SECONDS, **fields: Any) -> dict[str, Any]:
        """Waits for a log line whose "msg" is ``msg`` (and whose fields equal
        ``fields``) and returns it.

        Raises:
            ServeError: the process exited first, or ``timeout`` (scaled)
                passed.
        """
        deadline = time.monotonic() + timeout * time_scale()
        seen = 0
        with self._cond:
            while True:
                for rec in self.logs[seen:]:
                    if rec.get("msg") == msg and all(rec.get(k) == v for k, v in fields.items()):
                        return rec
                seen = len(self.logs)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise ServeError(f"{self.name} exited ({self.proc.returncode}) before logging {msg!r}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServeError(f"{self.name} did not log {msg!r} within {timeout * time_scale():.0f}s:\n{self.tail()}")
                self._cond.wait(min(left, 0.5))

    def get(self, path: str) -> tuple[int, str]:
        """GETs ``path`` from the metrics endpoint; returns (status, body)."""
        try:
            with urllib.request.urlopen(self.metrics_url + path, timeout=10 * time_scale()) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        """The sum of every sample of metric family ``name`` in /metrics (0
        when absent)."""
        return prom_sum(self.metrics_text(), name)

    def metrics_text(self) -> str:
        """The sidecar's /metrics, Prometheus text (read it once and sum
        several metrics with :func:`prom_sum`).

        Raises:
            ServeError: /metrics did not answer 200.
        """
        code, body = self.get("/metrics")
        if code != 200:
            raise ServeError(f"{self.name}: /metrics answered {code}")
        return body

    def signal(self, sig: int) -> None:
        """Sends ``sig`` (SIGTERM, SIGKILL, SIGSTOP, SIGCONT) to the process."""
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash: the process cannot clean up. Waits for it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30 * time_scale())

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (drain, then exit 0) and waits; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout * time_scale())
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class Cluster:
    """Sidecars of one test or example: a temp dir with dev certificates, a
    capability key and a socket dir; every sidecar started here is stopped
    by :meth:`close` (or leaving the ``with`` block).

    Args:
        binary: path of the ``kvsidecar`` binary.
        workdir: where to put certificates and sockets; default a new
            temp dir, removed by :meth:`close`. Unix socket paths are
            limited to 107 bytes, so keep it short.
    """

    def __init__(self, binary: str, workdir: str | None = None) -> None:
        self.binary = binary
        self._own = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="kvs")
        self.socket_dir = os.path.join(self.dir, "sock")
        os.makedirs(self.socket_dir, mode=0o700, exist_ok=True)
        self.certs = make_dev_certs(os.path.join(self.dir, "tls"))
        self.cap_key = os.path.join(self.dir, "cap.key")
        fd = os.open(self.cap_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        self.sidecars: list[Sidecar] = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        engine_id: str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        role: str = "both",
        listen: str = "127.0.0.1:0",
        args: Sequence[str] = (),
    ) -> Sidecar:
        """Starts one ``kvsidecar serve`` and waits until its local socket and
        metrics endpoint are up ("serving").

        Raises:
            ServeError: it exited or did not log "serving" in time.
        """
        argv = [
            self.binary, "serve", "--engine-id", engine_id, "--role", role, "--tp-rank", str(tp_rank),
            "--tp-size", str(tp_size), "--tls-cert", self.certs.cert, "--tls-key", self.certs.key,
            "--tls-ca", self.certs.ca, "--capability-key-file", self.cap_key, "--socket-dir", self.socket_dir,
            "--listen", listen, "--metrics-addr", "127.0.0.1:0", "--log-level", "debug",
            # The dev certificates name loopback only; nothing else is dialled.
            "--allow-peers", "127.0.0.0/8,::1", *args,
        ]
        return self._launch(f"{engine_id}-tp{tp_rank}", argv)

    def _launch(self, name: str, argv: list[str]) -> Sidecar:
        s = Sidecar(name, argv, dict(os.environ, QUIC_GO_DISABLE_RECEIVE_BUFFER_WARNING="true"))
        self.sidecars.append(s)
        s.metrics_url = "http://" + s.wait_log("metrics listening")["addr"]
        serving = s.wait_log("serving")
        s.socket, s.quic_addr = serving["socket"], serving["quic_addr"]
        return s

    def restart(self, s: Sidecar) -> Sidecar:
        """Starts ``s`` again with the same command line (its QUIC address is
        fixed by --listen/--rank-addrs), as an operator restarting a crashed
        sidecar does; ``s`` must have exited. Returns the new process."""
        if s.proc.poll() is None:
            raise ServeError(f"{s.name} is still running")
        return self._launch(s.name, s.argv)

    def start_group(self, engine_id: str, *, tp_size: int, role: str = "both", args: Sequence[str] = ()) -> list[Sidecar]:
        """Starts the ``tp_size`` ranks of one engine instance, each on a UDP
        port picked here and given to every rank with ``--rank-addrs``."""
        addrs = free_udp_addrs(tp_size)
        return [
            self.start(engine_id, tp_rank=r, tp_size=tp_size, role=role, listen=addrs[r],
                       args=[*args, "--rank-addrs", ",".join(addrs)])
            for r in range(tp_size)
        ]

    def close(self) -> None:
        """Stops every sidecar (SIGTERM, then SIGKILL after 30 s) and removes
        the temp dir this cluster made."""
        for s in self.sidecars:
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGCONT)
                s.proc.terminate()
        for s in self.sidecars:
            try:
                s.proc.wait(timeout=30 * time_scale())
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)
