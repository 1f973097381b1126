"""pytest fixtures: the kvsidecar binary (built once per session) and a
Cluster of real ``kvsidecar serve`` processes per test."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYTHON_DIR)
sys.path.insert(0, PYTHON_DIR)

from kvsidecar.dev import devserve  # noqa: E402
from kvsidecar.dev.devserve import time_scale  # noqa: E402
from kvsidecar.local import LocalClient  # noqa: E402


def stats(sidecar: devserve.Sidecar) -> dict[str, int]:
    """A sidecar's blocks_used, leases_held and loads_in_flight (its Stats
    call, on a connection of its own)."""
    with LocalClient(sidecar.socket) as c:
        s = c.stats()
    return {"blocks_used": s.blocks_used, "leases_held": s.leases_held, "loads_in_flight": s.loads_in_flight}


def wait_for(what: str, cond, timeout: float = 30.0) -> None:
    """Polls ``cond`` until it holds, failing after ``timeout`` seconds
    times KVSIDECAR_TIME_SCALE."""
    # wallclock: real sidecar and engine processes settle on their own time;
    # the bound scales with KVSIDECAR_TIME_SCALE.
    deadline = time.monotonic() + timeout * time_scale()
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.01)


class LogWatch(logging.Handler):
    """Keeps the messages of one logger at ``level`` and above while
    installed (a ``with`` block); ``seen`` is set at the first."""

    def __init__(self, logger: str, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.logger = logging.getLogger(logger)
        self.records: list[logging.LogRecord] = []
        self.seen = threading.Event()

    def __enter__(self) -> LogWatch:
        self.logger.addHandler(self)
        if self.logger.getEffectiveLevel() > self.level:
            self.logger.setLevel(self.level)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.seen.set()

    def messages(self, level: int) -> list[str]:
        """The messages logged at exactly ``level``."""
        return [r.getMessage() for r in self.records if r.levelno == level]


class Background:
    """Runs ``fn`` on a thread; :meth:`result` joins it and returns its
    value or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = fn()
            except BaseException as e:
                self._error = e

        self._t = threading.Thread(target=run)
        self._t.start()

    def result(self) -> Any:
        self._t.join()
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture(scope="session")
def binary() -> Iterator[str]:
    """Path of a kvsidecar binary: $KVSIDECAR_BIN, or ./cmd/kvsidecar built
    with `go build` into a temp dir for this session."""
    given = os.environ.get("KVSIDECAR_BIN")
    if given:
        yield os.path.abspath(given)
        return
    go = shutil.which("go") or "/usr/local/go/bin/go"
    d = tempfile.mkdtemp(prefix="kvsidecar-pytest-bin")
    out = os.path.join(d, "kvsidecar")
    r = subprocess.run([go, "build", "-o", out, "./cmd/kvsidecar"], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"go build ./cmd/kvsidecar failed:\n{r.stderr}")
    yield out
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cluster(binary: str, request: pytest.FixtureRequest) -> Iterator[devserve.Cluster]:
    """A Cluster whose sidecars are stopped at the end of the test; their
    logs are printed when the test failed."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed (apt-get install openssl): it makes the dev TLS certificates")
    cl = devserve.Cluster(binary)
    yield cl
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print_logs(cl, 40)
    cl.close()


def print_logs(cl: devserve.Cluster, n: int) -> None:
    """Prints the last ``n`` log lines of every sidecar of ``cl`` (for a
    failed test's report)."""
    for s in cl.sidecars:
        print(f"--- {s.name} (exit {s.proc.poll()}) ---\n{s.tail(n)}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
