#!/usr/bin/env python3
"""The main job for a vLLM user (`make vllm-demo`): a prefill and a decode
vLLM engine on the CPU, each rank beside its own `kvsidecar serve`, and a
single engine without a connector to compare with.

It makes a tiny Llama model (random weights, fixed seed: nothing is
downloaded), starts the sidecars and the three OpenAI servers, sends each
prompt the way the proxy does (prefill with do_remote_decode and
max_tokens=1, then decode with the returned kv_transfer_params) and prints,
per request: prompt tokens, KV bytes the decode's sidecar read, the decode's
time to first token, the single engine's, and whether the decode's greedy
tokens equal the single engine's. Exits 1 when one differs. With
``--zero-copy`` the prefill and decode engines run in zero copy (vLLM's KV
cache is the sidecars' pages; kvsidecar.vllm.zerocopy).

    .venv/bin/python python/tools/vllm_demo.py --kvsidecar bin/kvsidecar [--zero-copy] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvsidecar.dev import devserve, devvllm  # noqa: E402

MAX_TOKENS = 16


def prompts() -> list[tuple[str, list[int]]]:
    rnd = random.Random(42)

    def rand(n: int) -> list[int]:
        return [rnd.randrange(3, 2000) for _ in range(n)]

    shared = rand(600)
    return [
        ("1 token", rand(1)),
        ("one block", rand(devvllm.BLOCK_SIZE)),
        ("block + 1", rand(devvllm.BLOCK_SIZE + 1)),
        ("short", rand(100)),
        ("medium", rand(512)),
        ("long", rand(2048)),
        ("longer", rand(4096)),
        ("prefix source", shared),
        ("prefix hit", shared[:512] + rand(64)),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--kvsidecar", required=True, help="the kvsidecar binary")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    ap.add_argument("--zero-copy", action="store_true", help="vLLM's KV cache in the sidecars' pages")
    a = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvs-vllm-demo") as d, devserve.Cluster(a.kvsidecar) as cl:
        model = devvllm.make_tiny_llama(os.path.join(d, "model"))
        print(f"vllm-demo: tiny Llama model ({model.layers} layers, {model.kv_heads} KV heads of {model.head_dim}, "
              f"{model.dtype}) in {model.path}", flush=True)
        args, extra = model.sidecar_args(), {}
        if a.zero_copy:
            # The engines size the sidecars' caches; their blocks are vLLM's.
            args = [*model.sidecar_args(0), "--kv-layout", "H2ND", "--ownership", "coordinated"]
            extra = {"zero_copy": True}
        pre_sc = cl.start_group("prefill-demo", tp_size=1, role="prefill", args=args)
        dec_sc = cl.start_group("decode-demo", tp_size=1, role="decode", args=args)
        engines = [
            devvllm.Engine(model, name="single", log_dir=d),
            devvllm.Engine(model, name="prefill", log_dir=d, kv_transfer_config=devvllm.connector_config(
                "kv_producer", "prefill-demo", cl.socket_dir, **extra)),
            devvllm.Engine(model, name="decode", log_dir=d, kv_transfer_config=devvllm.connector_config(
                "kv_consumer", "decode-demo", cl.socket_dir, **extra)),
        ]
        single, pre, dec = engines
        print("vllm-demo: starting three vLLM engines (about a minute each on 2 cores)...", flush=True)
        try:
            devvllm.start_engines(engines)
            print("vllm-demo: engines ready in " + ", ".join(f"{e.name} {e.ready_seconds:.0f} s" for e in engines),
                  flush=True)
            rows = []
            for name, prompt in prompts():
                ref = single.complete(prompt, max_tokens=MAX_TOKENS, stream=True)
                before = dec_sc[0].metric("kvsidecar_connector_read_bytes_total")
                _, got = devvllm.pd_complete(pre, dec, prompt, max_tokens=MAX_TOKENS)
                moved = dec_sc[0].metric("kvsidecar_connector_read_bytes_total") - before
                rows.append({"request": name, "prompt_tokens": len(prompt), "kv_bytes_moved": int(moved),
                             "decode_ttft_ms": round(got.ttft_seconds * 1e3, 1),
                             "single_ttft_ms": round(ref.ttft_seconds * 1e3, 1),
                             "token_exact": got.token_ids == ref.token_ids})
            left = {s.name: s.metric("kvsidecar_vmm_blocks_used") for s in pre_sc + dec_sc}
        finally:
            for e in engines:
                e.stop()
        if a.zero_copy:
            # The blocks are vLLM's; its prefix cache keeps the freed ones a
            # while. What counts is that the sidecars free them all once the
            # engines exited (each notices its engine's session end).
            deadline = time.monotonic() + 10 * devserve.time_scale()
            while True:
                left = {s.name: s.metric("kvsidecar_vmm_blocks_used") for s in pre_sc + dec_sc}
                if not any(left.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
    print(f"\n{'request':>14} {'prompt tokens':>13} {'KV bytes moved':>14} {'decode TTFT ms':>14} "
          f"{'single TTFT ms':>14}  equals single engine")
    for r in rows:
        print(f"{r['request']:>14} {r['prompt_tokens']:>13} {r['kv_bytes_moved']:>14} {r['decode_ttft_ms']:>14} "
              f"{r['single_ttft_ms']:>14}  {'yes' if r['token_exact'] else 'NO'}")
    exact = sum(r["token_exact"] for r in rows)
    print(f"\nvllm-demo: {exact} of {len(rows)} requests token-exact ({MAX_TOKENS} greedy tokens each), "
          f"{sum(r['kv_bytes_moved'] for r in rows)} KV bytes moved, blocks left in the sidecars {left}, "
          f"{time.monotonic() - t0:.0f} s in all")
    if a.json:
        print(json.dumps(rows))
    return 0 if exact == len(rows) and not any(left.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
