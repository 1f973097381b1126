"""examples/python/engine.py runs as a user would run it, against real
`kvsidecar serve` processes (examples/goengine runs in `go test`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_python_example_moves_one_request(binary, cluster):
    # (cluster: the openssl check; the example makes its own.)
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "python", "engine.py"), "--kvsidecar", binary],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    params = json.loads(lines[0].removeprefix("kv_transfer_params: "))
    assert params["tp_size"] == 2 and params["do_remote_prefill"] is True and len(params["remote_block_ids"]) == 63
    # (protobuf JSON leaves out fields at their default: tp_rank 0 is absent)
    assert [e.get("tp_rank", 0) for e in params["rank_exports"]] == [0, 1], "each prefill rank's export travels"
    # 63 blocks × 32 regions × 16 KiB (8 heads × 16 tokens × 128 bytes).
    assert lines[-1].endswith("prefill TP 2 -> decode TP 4: 33030144 bytes verified, 0 mismatches"), lines[-1]
