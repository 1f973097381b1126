"""The benchmark tools refuse bad flag values before they start anything,
naming the flag, the value and the rule (exit status 2, argparse's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def refused(tool: str, *args: str) -> str:
    r = subprocess.run([sys.executable, os.path.join(TOOLS, tool), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, want", [
    # The reported input: a list with a word in it ended in a ValueError
    # traceback; an empty --load-lengths in an IndexError from random.
    (["--lengths", "16,x"], "--lengths: '16,x' is not a comma-separated list of numbers"),
    (["--lengths", "0"], "--lengths: '0': every value must be positive"),
    (["--rates=-1"], "--rates: '-1': every value must be positive"),
    (["--load-lengths", ""], "--load-lengths: give at least one prompt length for the load mode"),
    (["--trials", "0"], "--trials 0: must be at least 1"),
    (["--setups", "zero_copy"], "--setups: 'zero_copy' is not one of single, zero-copy, staging"),
    # Reported by a review: no setup wrote empty results over the last
    # run's; a setup named twice and a budget of 0 started an engine.
    (["--setups="], "--setups: give at least one setup"),
    (["--setups", "single,single"], "--setups: 'single,single' names a setup twice"),
    (["--setup-budget-seconds", "0"], "both must be positive"),
    (["--request-timeout-seconds", "-1"], "both must be positive"),
    (["--sidecar-nice", "100"], "--sidecar-nice 100: must be in [-20, 19]"),
])
def test_bench_vllm_refuses_bad_flags(args, want):
    assert want in refused("bench_vllm.py", "--kvsidecar", sys.executable, *args)


def test_bench_vllm_refuses_a_missing_binary():
    assert "--kvsidecar: '/nonexistent/kvsidecar' is not an executable file" in refused(
        "bench_vllm.py", "--kvsidecar", "/nonexistent/kvsidecar")


@pytest.mark.parametrize("args, want", [
    # The reported inputs: --cases tiny ended in a KeyError traceback,
    # --reps 0 in a StatisticsError, --threads -1 in torch's RuntimeError.
    (["--cases", "tiny"], "--cases: 'tiny' is not one of tiny-4096, 8b-4096, gap-1024"),
    (["--reps", "0"], "--reps 0: must be at least 1"),
    (["--threads", "-1"], "--threads -1: must be 0 (torch's default) or more"),
])
def test_bench_staging_refuses_bad_flags(args, want):
    assert want in refused("bench_staging.py", *args)
