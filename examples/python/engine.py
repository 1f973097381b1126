#!/usr/bin/env python3
"""The smallest engine stand-in in Python: starts six `kvsidecar serve`
processes on loopback (a prefill instance of TP 2 and a decode instance of
TP 4, llama-3.2-1b's KV geometry), moves one request's KV from prefill to
decode through them with kvsidecar.local, checks every byte on every decode
rank and prints the bytes it verified. It follows
docs/engine-integration.md step by step.

    go build -o bin/kvsidecar ./cmd/kvsidecar
    /usr/bin/python3 examples/python/engine.py --kvsidecar bin/kvsidecar

Needs protobuf (python3-protobuf) and openssl (for the dev certificates).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

from kvsidecar.dev import devserve  # noqa: E402
from kvsidecar.local import LocalClient  # noqa: E402
from kvsidecar.params import merge_exports, params_from_json, params_to_json, req_meta  # noqa: E402
from kvsidecar.v1 import local_pb2, params_pb2  # noqa: E402

# llama-3.2-1b: 16 layers (32 regions, K and V of each), 8 KV heads of 64
# bf16 elements, 16-token blocks. Prefill rank p holds heads 4p..4p+3,
# decode rank d heads 2d, 2d+1. A block of one region is HND:
# [heads of the rank][16 tokens][128 bytes].
PREFILL_TP, DECODE_TP, KV_HEADS, BLOCK_SIZE, ROW = 2, 4, 8, 16, 128


def row(key: int, region: int, head: int, token: int) -> bytes:
    """The 128 bytes of one head of one token in one region."""
    return hashlib.blake2b(f"{key}/{region}/{head}/{token}".encode(), digest_size=64).digest() * 2


def block_bytes(key: int, region: int, first_head: int, heads: int, first_token: int) -> bytes:
    return b"".join(row(key, region, h, first_token + t) for h in range(first_head, first_head + heads)
                    for t in range(BLOCK_SIZE))


def wait_finished(c: LocalClient, done, timeout: float = 60.0) -> local_pb2.GetFinishedReply:
    """Polls get_finished (an engine does once per step) until done(acc)."""
    acc = local_pb2.GetFinishedReply()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        acc.MergeFrom(c.get_finished())
        if done(acc):
            return acc
        time.sleep(0.002)
    raise TimeoutError(f"{c.path}: nothing finished within {timeout}s")


def run(binary: str, tokens: int) -> int:
    key = 42
    nblocks = -(-tokens // BLOCK_SIZE)
    with devserve.Cluster(binary) as cl:
        args = ["--model", "llama-3.2-1b", "--num-blocks", "1024"]
        pre_sc = cl.start_group("prefill-a", tp_size=PREFILL_TP, role="prefill", args=args)
        dec_sc = cl.start_group("decode-a", tp_size=DECODE_TP, role="decode", args=args)
        # One connection per rank: each engine rank attaches to its own
        # sidecar (no geometry: the sidecar was started with --model).
        prefill = [LocalClient(s.socket) for s in pre_sc]
        decode = [LocalClient(s.socket) for s in dec_sc]
        try:
            for ranks in (prefill, decode):
                for r, c in enumerate(ranks):
                    c.attach(tp_rank=r, tp_size=len(ranks))

            # Prefill: every rank allocates the request's blocks (each rank's
            # own ids; they need not agree), writes its heads of every layer,
            # then calls RequestFinished with its ids; the ranks'
            # kv_transfer_params, merged (each rank's export), go to the decode.
            heads = KV_HEADS // PREFILL_TP
            src: list[list[int]] = []
            for p, c in enumerate(prefill):
                src.append(c.alloc(nblocks))
                for r in range(c.info.num_regions):
                    for k, b in enumerate(src[p]):
                        c.block(r, b)[:] = block_bytes(key, r, p * heads, heads, k * BLOCK_SIZE)
            parts = [c.request_finished("req-1", src[p], local_pb2.FINISH_STATUS_LENGTH,
                                        params_pb2.KVTransferParams(do_remote_decode=True))
                     for p, c in enumerate(prefill)]
            params = merge_exports(parts)
            # The proxy carries the params as JSON to the decode's request.
            js = json.dumps(params_to_json(params))
            print(f"kv_transfer_params: {js}")
            params = params_from_json(json.loads(js))

            # Decode: every rank allocates blocks and starts the load; each
            # reads its heads from the prefill rank holding them.
            dst = []
            for d, c in enumerate(decode):
                dst.append(c.alloc(nblocks))
                # No local prefix hit: remote block i lands in dst[d][i].
                c.start_load(req_meta("req-1", dst[d], params, remote_hit_blocks=0))
            for d, c in enumerate(decode):
                f = wait_finished(c, lambda f: f.done_recving or f.failed)
                if f.failed:
                    fl = f.failed[0]
                    raise SystemExit(f"decode rank {d}: load failed ({fl.error.message}), "
                                     f"{len(fl.block_ids)} blocks to recompute")
            heads = KV_HEADS // DECODE_TP
            verified = 0
            for d, c in enumerate(decode):
                for r in range(c.info.num_regions):
                    for k, b in enumerate(dst[d]):
                        got = bytes(c.block(r, b))
                        if got != block_bytes(key, r, d * heads, heads, k * BLOCK_SIZE):
                            raise SystemExit(f"decode rank {d} region {r} block {b}: bytes differ")
                        verified += len(got)
                c.free(dst[d])
            # The decode notified every prefill rank: each reports the
            # request in done_sending and freed its blocks.
            for c in prefill:
                wait_finished(c, lambda f: f.done_sending)
            print(f"moved req-1 ({tokens} tokens, {nblocks} blocks × 32 regions) prefill TP {PREFILL_TP} -> "
                  f"decode TP {DECODE_TP}: {verified} bytes verified, 0 mismatches")
            return verified
        finally:
            for c in prefill + decode:
                c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="Move one request prefill TP 2 -> decode TP 4 through kvsidecar.")
    ap.add_argument("--kvsidecar", default="bin/kvsidecar", help="path of the kvsidecar binary")
    ap.add_argument("--tokens", type=int, default=1000, help="prompt tokens of the request")
    a = ap.parse_args()
    run(os.path.abspath(a.kvsidecar), a.tokens)


if __name__ == "__main__":
    main()
