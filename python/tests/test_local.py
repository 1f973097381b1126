"""kvsidecar.local against real `kvsidecar serve` processes (and, for what
needs a GPU driver or a misbehaving server, small stand-ins on a unix
socket)."""

from __future__ import annotations

import logging
import os
import socket
import threading

import pytest
from conftest import Background, LogWatch

from kvsidecar import errors
from kvsidecar.dev.devserve import time_scale
from kvsidecar.local import LocalClient, dial_waiting
from kvsidecar.params import params_from_json, params_to_json
from kvsidecar.paths import local_socket_path
from kvsidecar.v1 import common_pb2, local_pb2, params_pb2

# 2 layers, 8 KV heads of 64 bf16 elements, 16-token blocks: 16 KiB per block
# per region at TP 1, 4 regions, 128 blocks per 2 MiB page.
GEOM_FLAGS = ["--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--dtype", "bfloat16", "--block-size", "16"]
GEOM = common_pb2.ModelGeometry(
    model="custom", num_layers=2, num_kv_heads=8, head_dim=64, dtype=common_pb2.DTYPE_BFLOAT16, block_size=16,
    layout=common_pb2.LAYOUT_HND, attention=common_pb2.ATTENTION_GQA,
)


def pattern(key: int, region: int, block: int, n: int) -> bytes:
    """n bytes that differ per (key, region, block, offset)."""
    seed = (key * 1_000_003 + region * 7919 + block * 104_729) & 0xFFFFFFFF
    return bytes(((seed >> (8 * (i % 4))) + i * 31 + region) & 0xFF for i in range(n))


def test_socket_path_matches_serve(cluster):
    # An id with a space, a slash and a non-ASCII letter is sanitized and
    # hashed; the sidecar logs the path it listens on.
    engine = "pré fill/a"
    s = cluster.start(engine, args=GEOM_FLAGS)
    want = local_socket_path(cluster.socket_dir, engine, 0)
    assert s.socket == want
    assert os.path.basename(want).startswith("kvsidecar-pr___fill_a-")
    st = os.stat(want)
    assert st.st_mode & 0o777 == 0o600, oct(st.st_mode)


def test_socket_path_rules():
    assert local_socket_path("/run/kvs/", "prefill-a", 3) == "/run/kvs/kvsidecar-prefill-a-tp3-api.sock"
    long = local_socket_path("/tmp", "a" * 200, 0)
    assert len(long.encode()) <= 107 and long.endswith("-tp0-api.sock")
    assert local_socket_path("/tmp", "a" * 200, 0) != local_socket_path("/tmp", "a" * 199, 0)
    for bad, match in [(("rel/dir", "e", 0), "absolute"), (("/tmp", "", 0), "engine id is empty"),
                       (("/tmp", "e", 1024), r"tp_rank 1024 must be in \[0, 1024\)"),
                       (("/" + "d" * 100, "e", 0), "too long")]:
        with pytest.raises(errors.InvalidArgument, match=match) as ei:
            local_socket_path(*bad)
        assert ei.value.code == common_pb2.CODE_INVALID_ARGUMENT


def test_attach_alloc_write_free(cluster):
    s = cluster.start("eng", args=GEOM_FLAGS)
    with LocalClient(s.socket) as a, LocalClient(s.socket) as b:
        st = a.stats()
        assert not st.cache_ready and st.blocks_total == 0
        info = a.attach(geometry=GEOM, num_blocks=1024)
        assert (info.num_blocks, info.num_regions, info.block_len, info.heads_per_rank) == (1024, 4, 16 << 10, 8)
        assert info.page_size == 2 << 20 and not info.device_memory
        # b attaches without a geometry: it gets the sidecar's (--layers ...).
        assert b.attach(num_blocks=1024).geometry == info.geometry

        ids = a.alloc(400)  # 128 blocks a page: at least 4 pages, some mapped by this call
        assert len(set(ids)) == 400 and 0 not in ids, "block 0 is the null block, never allocated"
        # Which pages hold them is the pool's choice (its background refill
        # maps a page ahead when it can: page 4 on a loaded machine).
        assert len({a.packing.offset(b) // info.page_size for b in ids}) >= 4
        for r in range(info.num_regions):
            for k in (0, 399):
                a.block(r, ids[k])[:] = pattern(1, r, ids[k], info.block_len)
        # b sees the pages after any call (sync asks for nothing else).
        with pytest.raises(errors.InvalidArgument, match="not mapped in this process"):
            b.block(0, ids[399])
        b.sync()
        for r in range(info.num_regions):
            for k in (0, 399):
                assert bytes(b.block(r, ids[k])) == pattern(1, r, ids[k], info.block_len)
        assert a.packing.offset(129) == (2 << 20) + 1 * info.block_len
        assert a.stats().blocks_used == 400
        assert a.available().blocks == 1024 - 1 - 400

        a.free(ids)
        assert a.stats().blocks_used == 0
        with pytest.raises(errors.InvalidArgument) as ei:
            a.free(ids[:1])
        assert ei.value.code == common_pb2.CODE_INVALID_ARGUMENT
        assert str(ids[0]) in ei.value.message


def test_typed_errors(cluster):
    s = cluster.start("eng", args=GEOM_FLAGS)
    with LocalClient(s.socket) as c:
        with pytest.raises(errors.Unavailable, match="needs the KV cache") as ei:
            c.alloc(1)
        assert ei.value.code == common_pb2.CODE_UNAVAILABLE
        other = common_pb2.ModelGeometry()
        other.CopyFrom(GEOM)
        other.num_layers = 3
        with pytest.raises(errors.IncompatibleModel, match="num_layers:3") as ei:
            c.attach(geometry=other, num_blocks=64)
        assert ei.value.code == common_pb2.CODE_INCOMPATIBLE_MODEL
        info = c.attach(num_blocks=64)
        with LocalClient(s.socket) as d, pytest.raises(errors.AlreadyExists, match="num_blocks"):
            d.attach(num_blocks=128)
        with pytest.raises(errors.InvalidArgument, match="already attached"):
            c.attach(num_blocks=64)
        with pytest.raises(errors.InvalidArgument, match="alloc count 0"):
            c.alloc(0)
        with pytest.raises(errors.InvalidArgument, match=r"alloc count 64 must be in \[1, 64\)"):
            c.alloc(64)
        with pytest.raises(errors.InvalidArgument, match="accepted range"):
            c.set_memory_limit(1)
        with pytest.raises(errors.InvalidArgument, match="tp_size") as ei:
            c.start_load(params_pb2.ReqMeta(request_id="r", params=params_pb2.KVTransferParams(do_remote_prefill=True)))
        with pytest.raises(errors.InvalidArgument, match="block 64 outside"):
            c.block(0, 64)
        assert info.num_blocks == 64
        # Errors do not break the connection.
        assert c.stats().cache_ready


def test_memory_limit_unmaps_here(cluster):
    s = cluster.start("eng", args=GEOM_FLAGS)
    with LocalClient(s.socket) as c:
        info = c.attach(num_blocks=1024)
        per_page = info.page_size // info.block_len
        ids = c.alloc(3 * per_page)
        last = ids[-1]
        assert c.is_mapped(last)
        c.free(ids)
        # A limit of one page index (of every region) trims the pages the
        # freed blocks sat in; this process unmaps them at its next call.
        c.set_memory_limit(info.page_size * info.num_regions)
        c.sync()
        st = c.stats()
        assert st.pages_mapped <= 1 * info.num_regions, st
        assert not c.is_mapped(last)
        with pytest.raises(errors.InvalidArgument, match="not mapped"):
            c.block(0, last)
        with pytest.raises(errors.Busy):
            c.alloc(2 * per_page)


def test_transfer_python_only(cluster):
    pre = cluster.start("pre", role="prefill", args=GEOM_FLAGS)
    dec = cluster.start("dec", role="decode", args=GEOM_FLAGS)
    with LocalClient(pre.socket) as p, LocalClient(dec.socket) as d:
        info = p.attach(num_blocks=512)
        d.attach(num_blocks=512)
        src = p.alloc(20)
        for r in range(info.num_regions):
            for b in src:
                p.block(r, b)[:] = pattern(9, r, src.index(b), info.block_len)
        params = p.request_finished("req-1", src, local_pb2.FINISH_STATUS_LENGTH,
                                    params_pb2.KVTransferParams(do_remote_decode=True))
        assert params is not None and params.tp_size == 1 and list(params.remote_block_ids) == src
        # Through a proxy as JSON: 64-bit fields are strings, the rest keeps
        # NixlConnector's names.
        js = params_to_json(params)
        assert js["do_remote_prefill"] is True and js["tp_size"] == 1
        assert isinstance(js["lease_expires_unix_ms"], str)
        back = params_from_json({**js, "vllm_only_field": 1})
        assert back == params

        dst = d.alloc(20)
        d.start_load(params_pb2.ReqMeta(request_id="req-1", local_block_ids=dst, params=back, remote_hit_blocks=0))
        got = wait_finished(d, lambda f: f.done_recving or f.failed)
        assert list(got.done_recving) == ["req-1"] and not got.failed
        for r in range(info.num_regions):
            for k, b in enumerate(dst):
                assert bytes(d.block(r, b)) == pattern(9, r, k, info.block_len), (r, k)
        assert list(wait_finished(p, lambda f: f.done_sending).done_sending) == ["req-1"]
        assert p.stats().blocks_used == 0, "the lease ended: the sidecar freed the prefill blocks"
        d.free(dst)


def wait_finished(c: LocalClient, done, timeout: float = 30.0) -> local_pb2.GetFinishedReply:
    """Polls get_finished (as a scheduler loop does) until done(reply)."""
    import time

    from kvsidecar.dev.devserve import time_scale

    acc = local_pb2.GetFinishedReply()
    deadline = time.monotonic() + timeout * time_scale()
    while time.monotonic() < deadline:
        acc.MergeFrom(c.get_finished())
        if done(acc):
            return acc
        time.sleep(0.005)
    raise AssertionError(f"get_finished: nothing within {timeout}s: {acc}")


# -- stand-in servers: what a real sidecar cannot be made to do here ---------


class FakeServer:
    """A unix socket that answers each request frame with handler(req) ->
    (LocalReply, fds) or None (no answer)."""

    def __init__(self, path: str, handler) -> None:
        self.path = path
        self.handler = handler
        self.ln = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ln.bind(path)
        self.ln.listen(1)
        self.t = threading.Thread(target=self.serve, daemon=True)
        self.t.start()

    def serve(self) -> None:
        conn, _ = self.ln.accept()
        buf = b""
        with conn:
            while True:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
                size, i = 0, 0
                while True:
                    size |= (buf[i] & 0x7F) << (7 * i)
                    i += 1
                    if not buf[i - 1] & 0x80:
                        break
                if len(buf) < i + size:
                    continue
                req = local_pb2.LocalRequest.FromString(buf[i : i + size])
                buf = buf[i + size :]
                out = self.handler(req)
                if out is None:
                    continue
                rep, fds = out
                rep.call_id = req.call_id
                body = rep.SerializeToString()
                frame = _varint(len(body)) + body
                if not fds:
                    conn.sendall(frame)
                    continue
                # As the sidecar does: at most 250 fds per sendmsg, each
                # batch beside its own slice of the frame.
                batches = [fds[i:i + 250] for i in range(0, len(fds), 250)]
                step = len(frame) // len(batches)
                for i, batch in enumerate(batches):
                    chunk = frame[i * step:(i + 1) * step] if i < len(batches) - 1 else frame[i * step:]
                    socket.send_fds(conn, [chunk], batch)

    def close(self) -> None:
        self.ln.close()


def test_device_memory_fds_go_to_the_handler(tmp_path):
    # The CUDA backend passes one POSIX fd per page (cuMemExportToShareableHandle);
    # a memfd stands in for it here: the client must hand it over, not mmap it.
    memfd = os.memfd_create("stand-in-cuda-page")
    os.ftruncate(memfd, 2 << 20)

    def handler(req):
        if req.WhichOneof("call") == "create":
            rep = local_pb2.LocalReply()
            rep.cache.CopyFrom(local_pb2.KVCacheInfo(num_blocks=8, block_len=16 << 10, region_len=4 << 20,
                                                     num_regions=2, page_size=2 << 20, device_memory=True))
            rep.mappings.map.add(region=1, region_offset=2 << 20, len=2 << 20, fd_index=0, fd_offset=0)
            rep.mappings.num_fds = 1
            return rep, [memfd]
        rep = local_pb2.LocalReply()
        rep.mappings.unmapped_pages.append(1)
        return rep, []

    srv = FakeServer(str(tmp_path / "dev.sock"), handler)
    got = []

    def on_delta(d):
        # The fd is open during the call: import it (here: read its size).
        got.append((d, [os.fstat(fd).st_size for _, fd in d.mappings]))

    with LocalClient(srv.path, device_handler=on_delta) as c:
        info = c.attach()
        assert info.device_memory
        assert len(got) == 1
        delta, sizes = got[0]
        (m, _), = delta.mappings
        assert (m.region, m.region_offset, m.len) == (1, 2 << 20, 2 << 20) and sizes == [2 << 20]
        c.sync()
        assert got[1][0].unmapped_pages == (1,) and got[1][0].mappings == ()
        with pytest.raises(errors.InvalidArgument, match="no host mapping"):
            c.block(0, 1)
    srv.close()
    os.close(memfd)


def test_device_fds_over_several_sendmsgs_arrive_in_order(tmp_path):
    # The CUDA backend passes one fd per page: 300 pages arrive in two
    # sendmsg batches (250 + 50); mapping i must get the fd at fd_index i.
    n = 300
    memfds = [os.memfd_create(f"page-{i}") for i in range(n)]
    for i, fd in enumerate(memfds):
        os.ftruncate(fd, 4096 * (i + 1))  # the size tells the fds apart

    def handler(req):
        rep = local_pb2.LocalReply()
        rep.cache.CopyFrom(local_pb2.KVCacheInfo(num_blocks=8, block_len=4096, region_len=n * (2 << 20),
                                                 num_regions=1, page_size=2 << 20, device_memory=True))
        for i in range(n):
            rep.mappings.map.add(region=0, region_offset=i * (2 << 20), len=2 << 20, fd_index=n - 1 - i)
        rep.mappings.num_fds = n
        return rep, memfds

    srv = FakeServer(str(tmp_path / "many.sock"), handler)
    got = []
    with LocalClient(srv.path, device_handler=lambda d: got.extend(
            (m.region_offset // (2 << 20), os.fstat(fd).st_size // 4096 - 1) for m, fd in d.mappings)) as c:
        c.attach()
    assert got == [(i, n - 1 - i) for i in range(n)]
    srv.close()
    for fd in memfds:
        os.close(fd)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_device_memory_without_handler_is_unsupported(tmp_path):
    def handler(req):
        rep = local_pb2.LocalReply()
        rep.cache.CopyFrom(local_pb2.KVCacheInfo(num_blocks=8, block_len=4096, region_len=2 << 20, num_regions=1,
                                                 page_size=2 << 20, device_memory=True))
        return rep, []

    srv = FakeServer(str(tmp_path / "dev.sock"), handler)
    with LocalClient(srv.path) as c, pytest.raises(errors.Unsupported, match="cuMemImportFromShareableHandle"):
        c.attach()
    srv.close()


def test_silent_server_times_out_then_connection_is_broken(tmp_path):
    srv = FakeServer(str(tmp_path / "silent.sock"), lambda req: None)
    with LocalClient(srv.path, timeout=0.2) as c:
        with pytest.raises(errors.Timeout, match=r"no reply within 0.2s") as ei:
            c.stats()
        assert isinstance(ei.value, TimeoutError) and ei.value.code == common_pb2.CODE_TIMEOUT
        with pytest.raises(errors.BrokenConnection, match="broken by an earlier error"):
            c.stats()
    srv.close()


def test_wrong_call_id_breaks_the_connection(tmp_path):
    def handler(req):
        req.call_id = 7  # FakeServer echoes req.call_id: answer another call
        return local_pb2.LocalReply(), []

    srv = FakeServer(str(tmp_path / "odd.sock"), handler)
    with LocalClient(srv.path) as c:
        with pytest.raises(errors.BrokenConnection, match="reply for call 7, want 1"):
            c.stats()
        with pytest.raises(errors.BrokenConnection):
            c.stats()
    srv.close()


def test_unreachable_socket(tmp_path):
    with pytest.raises(errors.Unavailable, match="connect"):
        LocalClient(str(tmp_path / "nobody.sock"))


def test_merge_exports_and_req_meta():
    from kvsidecar.params import merge_exports, req_meta

    with pytest.raises(errors.InvalidArgument, match="at least one part"):
        merge_exports([])
    fields = params_pb2.KVTransferParams.DESCRIPTOR.fields_by_name
    if "rank_exports" not in fields:
        one = params_pb2.KVTransferParams(remote_request_id="r", tp_size=2, remote_block_ids=[1, 2])
        assert merge_exports([one, params_pb2.KVTransferParams()]) is one
        assert list(req_meta("r", [5, 6], one, remote_hit_blocks=0).local_block_ids) == [5, 6]
        return
    base = dict(remote_engine_id="p", remote_request_id="r", tp_size=2, remote_host="127.0.0.1", remote_port=5600)
    r0 = params_pb2.KVTransferParams(remote_block_ids=[1, 2, 3], lease_expires_unix_ms=2000, **base)
    r0.rank_exports.add(tp_rank=0, export_id=10, capability=b"c0")
    r1 = params_pb2.KVTransferParams(remote_block_ids=[7, 8, 9], lease_expires_unix_ms=1500, **base)
    r1.rank_exports.add(tp_rank=1, export_id=11, capability=b"c1")
    m = merge_exports([r1, r0])
    assert list(m.remote_block_ids) == [1, 2, 3], "rank 0's ids are remote_block_ids"
    assert m.lease_expires_unix_ms == 1500, "the earliest expiry"
    assert [(e.tp_rank, e.export_id, list(e.block_ids)) for e in m.rank_exports] == [(0, 10, []), (1, 11, [7, 8, 9])]
    with pytest.raises(errors.InvalidArgument, match="rank 0: part 0 exports the same rank"):
        merge_exports([r0, r0])
    other = params_pb2.KVTransferParams()
    other.CopyFrom(r1)
    other.remote_request_id = "s"
    with pytest.raises(errors.InvalidArgument, match="remote_request_id='s' differs"):
        merge_exports([r0, other])
    meta = req_meta("r", [5, 6], m, remote_hit_blocks=1)
    assert meta.remote_hit_blocks == 1 and meta.local_surplus_blocks == 0


def test_dial_waits_for_a_sidecar_started_later(cluster):
    # An engine whose sidecar is not up yet waits for its socket (logged
    # once, naming the path, the engine id and the rule), then attaches.
    engine = "late-e"
    path = local_socket_path(cluster.socket_dir, engine, 0)
    with LogWatch("test.dial_waiting") as logs:
        dial = Background(lambda: dial_waiting(path, engine_id=engine, tp_rank=0, wait_seconds=600,
                                               logger=logs.logger))
        try:
            assert logs.seen.wait(60 * time_scale()), "the client logs that it waits"
            s = cluster.start(engine, args=GEOM_FLAGS)
        finally:
            c = dial.result()
    with c:
        info = c.attach(geometry=GEOM, num_blocks=64)
        assert info.num_blocks == 64
        st = c.stats()
        assert st.engine_attached and st.engine_session == 1
    assert s.socket == path
    waits = logs.messages(logging.WARNING)
    assert len(waits) == 1, waits
    assert path in waits[0] and "'late-e' tp_rank 0" in waits[0]
    assert "must be a running sidecar's --engine-id" in waits[0]
    assert any("is up after" in m for m in logs.messages(logging.INFO))


def test_dial_wait_bound_names_the_rule(tmp_path):
    # No sidecar serves this engine id: after the bound the error names the
    # path, the engine id, the rule and the setting; a stale socket file
    # (nobody listening) counts as not up yet.
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    path = local_socket_path(str(d), "ghost", 1)
    for stale in (False, True):
        if stale:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.close()  # the file stays, nobody listens
        with pytest.raises(errors.Unavailable) as ei:
            dial_waiting(path, engine_id="ghost", tp_rank=1, wait_seconds=0.2, setting="sidecar_wait_seconds")
        msg = ei.value.message
        assert ei.value.code == common_pb2.CODE_UNAVAILABLE
        assert msg.startswith(f"connect {path}: no sidecar of engine 'ghost' tp_rank 1 answered within 0.2s")
        assert "the engine id must be a running sidecar's --engine-id" in msg
        assert "kvsidecar serve --engine-id ghost --tp-rank 1" in msg and msg.endswith("or raise sidecar_wait_seconds")
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(errors.InvalidArgument, match=r"must be a finite number of seconds >= 0"):
            dial_waiting(path, engine_id="ghost", tp_rank=1, wait_seconds=bad)
