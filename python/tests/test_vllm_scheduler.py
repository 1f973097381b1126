"""KVSidecarConnector's scheduler side against a fake rank set, fed vLLM
0.32.0's own request, block and scheduler-output objects: which blocks an
export saves through chunked prefill, preemption and resumption, what a
decode loads after a local prefix hit, and what a refused allocation or an
abort leaves. (The rank set itself runs against real sidecars in
test_vllm_connector.py and test_vllm_engines.py.)"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from kvsidecar import errors, reasons
from kvsidecar.params import params_to_json, token_digests
from kvsidecar.v1 import local_pb2, params_pb2
from kvsidecar.vllm.connector import KVConnectorRole, KVSidecarConnector
from kvsidecar.vllm.zerocopy import ModeHandshake

BS = 32


class FakeRankSet:
    """Stands in for kvsidecar.rankset.RankSet (two ranks): allocates from
    a counter per rank, records every call, refuses alloc when told."""

    def __init__(self) -> None:
        self.next = [100, 200]
        self.allocs: list[int] = []
        self.finished: list[tuple[str, list[list[int]], int]] = []
        self.refuse: errors.KVSidecarError | None = None
        self.keeps: list[params_pb2.KVTransferParams] = []

    def alloc(self, n: int) -> list[list[int]]:
        if self.refuse is not None:
            raise self.refuse
        self.allocs.append(n)
        out = []
        for r in range(2):
            out.append(list(range(self.next[r], self.next[r] + n)))
            self.next[r] += n
        return out

    def finish(self, request_id: str, per_rank: Any, status: int, keep: Any,
               engine_owned: bool = False) -> params_pb2.KVTransferParams | None:
        self.finished.append((request_id, [list(x) for x in per_rank], status))
        self.keeps.append(keep)
        if status != local_pb2.FINISH_STATUS_LENGTH:
            return None
        # The sidecar carries what the engine says the blocks encode.
        return params_pb2.KVTransferParams(do_remote_prefill=True, remote_request_id=request_id, tp_size=2,
                                           remote_block_ids=per_rank[0], prompt_tokens=keep.prompt_tokens,
                                           token_digests=keep.token_digests)

    def close(self) -> None:
        return


#: The model path of the engines connector() stands in for.
MODEL = "/models/tiny"


def connector(role: str, extra: dict[str, Any] | None = None, model: str = MODEL,
              cache_dtype: str = "auto") -> tuple[KVSidecarConnector, FakeRankSet]:
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role=role,
                                           kv_connector_extra_config={"socket_dir": "/x", **(extra or {})}),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype=cache_dtype),
        model_config=SimpleNamespace(model=model, dtype=torch.float32))
    c = KVSidecarConnector(cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=512))
    fake = FakeRankSet()
    assert c._scheduler is not None
    c._scheduler.ranks = fake  # type: ignore[assignment]
    return c, fake


def request(rid: str, n: int, params: dict[str, Any]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(3, 3 + n)), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))


def new_req(r: Request, blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, mm_features=[],
                          sampling_params=r.sampling_params, pooling_params=None, block_ids=(blocks,),
                          num_computed_tokens=computed, lora_request=None)


def output(new: list[NewRequestData] = (), cached: CachedRequestData | None = None,  # type: ignore[assignment]
           scheduled: dict[str, int] | None = None, preempted: set[str] | None = None) -> SchedulerOutput:
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = list(new)
    if cached is not None:
        so.scheduled_cached_reqs = cached
    so.num_scheduled_tokens = dict(scheduled or {})
    so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    so.preempted_req_ids = preempted
    return so


def cached(rid: str, new_blocks: list[int] | None, computed: int, resumed: bool = False) -> CachedRequestData:
    c = CachedRequestData.make_empty()
    c.req_ids = [rid]
    c.resumed_req_ids = {rid} if resumed else set()
    c.new_block_ids = [(new_blocks,) if new_blocks is not None else None]
    c.num_computed_tokens = [computed]
    c.num_output_tokens = [0]
    return c


def test_chunked_prefill_saves_every_block_once_the_prompt_completes():
    c, fake = connector("kv_producer")
    r = request("p1", 100, {"do_remote_decode": True})
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(5), KVCacheBlock(6)],)), 0)
    m = c.build_connector_meta(output([new_req(r, [5, 6])], scheduled={"p1": 64}))
    assert m.saves == [] and fake.allocs == [], "nothing is saved before the prompt's last chunk"
    m = c.build_connector_meta(output(cached=cached("p1", [7, 8], 64), scheduled={"p1": 36}))
    assert [(s.req_id, s.block_ids, s.staging) for s in m.saves] == [("p1", [5, 6, 7, 8], [[100, 101, 102, 103],
                                                                                          [200, 201, 202, 203]])]
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = c.request_finished(r, [5, 6, 7, 8])
    assert delay is False, "vLLM's blocks are never held: the sidecar keeps its own copy"
    assert params is not None and params["remote_block_ids"] == [100, 101, 102, 103]
    assert params["prompt_tokens"] == 100, "the decode claims at most the prompt the export holds"
    assert fake.keeps[0].token_digests == token_digests(r.prompt_token_ids, BS), "what the blocks encode"
    assert fake.finished == [("p1", [[100, 101, 102, 103], [200, 201, 202, 203]], local_pb2.FINISH_STATUS_LENGTH)]
    assert fake.keeps[0].do_remote_decode and not fake.keeps[0].HasField("checksums"), "the sidecar's --checksums"


@pytest.mark.parametrize("checksums", [False, True])
def test_a_requests_checksums_choice_reaches_request_finished(checksums):
    # The reported input: "checksums": false on the request to prefill was
    # dropped, and the export carried checksums the sidecar's flag chose.
    c, fake = connector("kv_producer")
    r = request("p2", 40, {"do_remote_decode": True, "checksums": checksums})
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(5), KVCacheBlock(6)],)), 0)
    c.build_connector_meta(output([new_req(r, [5, 6])], scheduled={"p2": 40}))
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    c.request_finished(r, [5, 6])
    assert fake.keeps[0].HasField("checksums") and fake.keeps[0].checksums is checksums


def test_a_preempted_and_resumed_prefill_saves_its_new_blocks():
    c, fake = connector("kv_producer")
    r = request("p2", 70, {"do_remote_decode": True})
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2)],)), 0)
    c.build_connector_meta(output([new_req(r, [1, 2])], scheduled={"p2": 64}))
    # Preempted: vLLM frees its blocks and calls handle_preemptions on the
    # workers with this step's metadata (a no-op here: the saves are
    # synchronous, nothing of this request was being written).
    m = c.build_connector_meta(output(scheduled={}, preempted={"p2"}))
    assert m.saves == []
    worker, _ = connector("kv_producer")
    worker.handle_preemptions(m)
    # Resumed from scratch in new blocks: the whole list replaces the old.
    m = c.build_connector_meta(output(cached=cached("p2", [9, 10, 11], 0, resumed=True), scheduled={"p2": 70}))
    assert [(s.block_ids, s.staging[0]) for s in m.saves] == [([9, 10, 11], [100, 101, 102])]
    assert fake.allocs == [3]


def test_a_refused_allocation_exports_nothing():
    c, fake = connector("kv_producer")
    fake.refuse = errors.Busy("over the memory limit")
    r = request("p3", 40, {"do_remote_decode": True})
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(3), KVCacheBlock(4)],)), 0)
    m = c.build_connector_meta(output([new_req(r, [3, 4])], scheduled={"p3": 40}))
    assert m.saves == []
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(r, [3, 4]) == (False, None)
    assert fake.finished == [], "RequestFinished is not called for an export that has no blocks"


def decode_params(**over: Any) -> dict[str, Any]:
    """kv_transfer_params a prefill of two ranks returns (what a load needs)."""
    return {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r-1", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 2, **over}


UNUSABLE = [
    # The reported inputs: vLLM took the claimed tokens as loaded though
    # no block held them, and the decode answered with wrong tokens.
    ("no remote blocks", {}, 100, 0),
    ("empty remote blocks", {"remote_block_ids": []}, 100, 0),
    ("no tp_size", {"remote_block_ids": [1, 2, 3, 4], "tp_size": None}, 100, 0),
    ("prompt longer than the prefill's", {"remote_block_ids": [1, 2], "prompt_tokens": 40}, 100, 40),
    ("prompt longer than the remote blocks", {"remote_block_ids": [1, 2]}, 100, 2 * BS),
    ("prompt shorter than the prefill's", {"remote_block_ids": [1, 2, 3, 4], "prompt_tokens": 120}, 70, 70),
]


# fault-matrix: vllm-params-unusable
@pytest.mark.parametrize("name, over, prompt, want", UNUSABLE)
def test_decode_claims_only_what_the_export_holds(name, over, prompt, want, caplog):
    c, _ = connector("kv_consumer")
    params = decode_params(**over)
    if params.get("tp_size") is None:
        del params["tp_size"]
    r = request("d1", prompt, params)
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        assert c.get_num_new_matched_tokens(r, 0) == (want, want > 0), name
        c.get_num_new_matched_tokens(r, 0)  # vLLM may ask again
    refused = [x.getMessage() for x in caplog.records if "kv_transfer_params refused" in x.getMessage()]
    assert len(refused) == (1 if want == 0 else 0), refused
    n = -(-min(prompt, want) // BS)
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(60 + i) for i in range(-(-prompt // BS))],)), want)
    m = c.build_connector_meta(output())
    if want == 0:
        assert m.loads == [], "refused params load nothing and notify nobody"
    else:
        assert [(ld.block_ids, ld.hit_blocks) for ld in m.loads] == [([60 + i for i in range(n)], 0)]


@pytest.mark.parametrize("hit", [0, 2])
def test_decode_loads_the_blocks_after_its_local_hit_and_an_abort_is_passed_on(hit):
    c, _ = connector("kv_consumer")
    params = decode_params(remote_block_ids=[11, 12, 13, 14])
    r = request("d1", 4 * BS - 5, params)
    n, is_async = c.get_num_new_matched_tokens(r, hit * BS)
    assert (n, is_async) == (4 * BS - 5 - hit * BS, True)
    hashed = [KVCacheBlock(50 + i) for i in range(hit)]
    for i, b in enumerate(hashed):
        b.set_block_hash(f"h{i}".encode(), BS)  # type: ignore[arg-type]
    fresh = [KVCacheBlock(60 + i) for i in range(4 - hit)]
    c.update_state_after_alloc(r, KVCacheBlocks((hashed + fresh,)), n)
    m = c.build_connector_meta(output())
    assert [(ld.req_id, ld.block_ids, ld.hit_blocks) for ld in m.loads] == [("d1", [60 + i for i in range(4 - hit)],
                                                                               hit)]
    assert list(m.loads[0].params.remote_block_ids) == [11, 12, 13, 14]
    # The client aborts while the load runs: the workers abort it next step.
    r.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(r, []) == (False, None)
    m = c.build_connector_meta(output())
    assert m.aborts == ["d1"] and m.loads == []



def test_params_are_parsed_once_and_reach_the_worker_parsed(monkeypatch):
    # vLLM asks get_num_new_matched_tokens again every step a request
    # waits; the params were parsed (and their token digests computed) on
    # each ask, then again in the worker.
    import kvsidecar.vllm.scheduler as vs

    parsed = []
    real = vs.params_from_json
    monkeypatch.setattr(vs, "params_from_json", lambda d: parsed.append(d) or real(d))
    c, _ = connector("kv_consumer")
    r = request("d2", 4 * BS, decode_params(remote_block_ids=[11, 12, 13, 14]))
    for _ in range(3):
        assert c.get_num_new_matched_tokens(r, 0) == (4 * BS, True)
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(60 + i) for i in range(4)],)), 4 * BS)
    m = c.build_connector_meta(output())
    assert len(parsed) == 1
    p = m.loads[0].params
    assert isinstance(p, params_pb2.KVTransferParams) and (p.remote_engine_id, p.tp_size) == ("p", 2)
    assert m.loads[0].token_digests == token_digests(r.prompt_token_ids, BS)


def test_a_request_finished_before_its_load_notifies_with_its_params_or_logs_why_not(caplog):
    c, _ = connector("kv_consumer")
    r = request("d3", 4 * BS, decode_params(remote_block_ids=[11, 12, 13, 14]))
    r.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(r, []) == (False, None)
    m = c.build_connector_meta(output())
    assert [(ld.req_id, ld.notify_only, ld.params.remote_request_id) for ld in m.loads] == [("d3", True, "r-1")]
    bad = request("d4", 4 * BS, decode_params(remote_block_ids=[11, 12], tp_size="two"))
    bad.status = RequestStatus.FINISHED_ABORTED
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        assert c.request_finished(bad, []) == (False, None)
    assert c.build_connector_meta(output()).loads == []
    assert any("d4" in x.getMessage() and "tp_size" in x.getMessage() for x in caplog.records), caplog.records


# fault-matrix: token-digest-mismatch
def test_params_of_another_prompt_are_refused_by_name(caplog):
    """The reported input: a prompt list [p0, p1] sent to the decode with
    p0's kv_transfer_params; p1 was answered over p0's KV. Params whose
    token digests differ from the prompt's own are refused by name and the
    prompt computed here; matching ones are claimed, their digests passed to
    the load (the sidecar checks them again before a byte is read)."""
    p0 = list(range(3, 3 + 3 * BS + 7))
    p1 = p0[:BS] + [t + 1 for t in p0[BS:]]  # the same first block
    base = decode_params(remote_block_ids=[11, 12, 13, 14], prompt_tokens=len(p0))
    params = {**base, "token_digests": params_to_json(params_pb2.KVTransferParams(
        token_digests=token_digests(p0, BS)))["token_digests"]}
    c, _ = connector("kv_consumer")
    other = request("d-p1", len(p1), dict(params))
    other.prompt_token_ids[:] = p1
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        assert c.get_num_new_matched_tokens(other, 0) == (0, False)
    lines = [x.getMessage() for x in caplog.records if "kv_transfer_params refused" in x.getMessage()]
    assert len(lines) == 1 and reasons.TOKEN_DIGEST_MISMATCH in lines[0] and "block 1" in lines[0], lines
    c.update_state_after_alloc(other, KVCacheBlocks(([KVCacheBlock(60 + i) for i in range(4)],)), 0)
    assert c.build_connector_meta(output()).loads == [], "nothing is read or notified"
    # Counted once for vLLM's /metrics (vllm:kvsidecar_num_refused_params_total).
    st = c.get_kv_connector_stats()
    assert st is not None and st.data["num_refused_params"] == 1 and c.get_kv_connector_stats() is None

    same = request("d-p0", len(p0), dict(params))
    assert c.get_num_new_matched_tokens(same, 0) == (len(p0), True)
    c.update_state_after_alloc(same, KVCacheBlocks(([KVCacheBlock(70 + i) for i in range(4)],)), len(p0))
    (ld,) = c.build_connector_meta(output()).loads
    assert ld.block_ids == [70, 71, 72, 73] and ld.token_digests == token_digests(p0, BS)

    # Another adapter or cache salt: the same tokens, other KV.
    salted = request("d-salt", len(p0), dict(params))
    salted.cache_salt = "tenant-b"
    assert c.get_num_new_matched_tokens(salted, 0) == (0, False)


def test_a_load_given_fewer_blocks_than_it_claimed_fails_whole():
    # vLLM counts every claimed token as loaded: were fewer blocks loaded,
    # the rest would be attended over unwritten. The load is refused and
    # every block reported for recompute.
    c, _ = connector("kv_consumer")
    r = request("d1", 4 * BS, decode_params(remote_block_ids=[11, 12, 13, 14]))
    assert c.get_num_new_matched_tokens(r, 0) == (4 * BS, True)
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(60 + i) for i in range(3)],)), 4 * BS)
    (ld,) = c.build_connector_meta(output()).loads
    assert ld.block_ids == [60, 61, 62] and "3 local blocks for the 4 to load" in ld.refused


def workers_report(c: KVSidecarConnector, *backends: str) -> None:
    """What vLLM hands the scheduler side at start: each rank's handshake
    (staging, the attention backend the rank runs)."""
    c.set_xfer_handshake_metadata({r: ModeHandshake(zero_copy=False, why="not asked for", attention_backend=b)
                                   for r, b in enumerate(backends)})


#: What a prefill of connector()'s kind states (the decode's own facts).
FACTS = {"engine": "vllm", "engine_version": vllm.__version__, "model": MODEL, "attention_backend": "CPU_ATTN",
         "kv_cache_dtype": "float32"}


def test_a_prefill_states_its_engine_facts_in_the_params():
    c, _ = connector("kv_producer")
    workers_report(c, "CPU_ATTN", "CPU_ATTN")
    r = request("p-facts", 40, {"do_remote_decode": True})
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(5), KVCacheBlock(6)],)), 0)
    c.build_connector_meta(output([new_req(r, [5, 6])], scheduled={"p-facts": 40}))
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = c.request_finished(r, [5, 6])
    assert params is not None and params["engine_facts"] == FACTS
    # An fp8 cache is stated as such, not as the model's dtype; ranks that
    # report other backends are all named.
    c, _ = connector("kv_producer", cache_dtype="fp8_e4m3")
    workers_report(c, "FLASH_ATTN", "CPU_ATTN", "")
    assert c._scheduler is not None
    assert (c._scheduler.facts.kv_cache_dtype, c._scheduler.facts.attention_backend) == ("fp8_e4m3",
                                                                                          "CPU_ATTN,FLASH_ATTN")


def facts_params(rid: str, facts: dict[str, str] | None, **over: Any) -> dict[str, Any]:
    """A decode's kv_transfer_params for a 4-block prompt, stating ``facts``
    (none when None) as a prefill does."""
    p = decode_params(remote_request_id=rid, **{"remote_block_ids": [11, 12, 13, 14], **over})
    if facts is not None:
        p["engine_facts"] = dict(facts)
    return p


def refusals(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [x.getMessage() for x in caplog.records
            if "kv_transfer_params refused" in x.getMessage() and x.levelno == level]


DIFFERENT = [
    # field, the prefill's value, the line's words for it
    ("engine", "sglang", "engine: prefill 'sglang', decode 'vllm'"),
    ("engine_version", "0.31.1", f"engine_version: prefill '0.31.1', decode '{vllm.__version__}'"),
    ("model", "/other/tiny", f"model: prefill '/other/tiny', decode '{MODEL}'"),
    ("attention_backend", "FLASH_ATTN", "attention_backend: prefill 'FLASH_ATTN', decode 'CPU_ATTN'"),
    ("kv_cache_dtype", "bfloat16", "kv_cache_dtype: prefill 'bfloat16', decode 'float32'"),
    ("block_size", 16, f"block_size: prefill 16, decode {BS}"),
]


# fault-matrix: vllm-engine-incompatible
@pytest.mark.parametrize("field, theirs, says", DIFFERENT)
def test_a_prefill_of_another_kind_is_refused_naming_the_field_and_both_values(field, theirs, says, caplog):
    """Each fact that decides whether the decode can attend over the
    prefill's KV, alone: the params are refused before a token is claimed,
    one line names the field and both values, nothing is loaded or
    notified; the same params of an equal prefill load."""
    c, _ = connector("kv_consumer")
    workers_report(c, "CPU_ATTN", "CPU_ATTN")
    facts, over = dict(FACTS), {}
    if field == "block_size":
        over = {"block_size": theirs}
    else:
        facts[field] = theirs
    r = request("d-odd", 4 * BS, facts_params("r-odd", facts, **over))
    with caplog.at_level(logging.DEBUG, logger="vllm.kvsidecar"):
        assert c.get_num_new_matched_tokens(r, 0) == (0, False)
        # A second request of the same prefill: refused too, logged at DEBUG.
        again = request("d-odd-2", 4 * BS, facts_params("r-odd-2", facts, **over))
        assert c.get_num_new_matched_tokens(again, 0) == (0, False)
    (line,) = refusals(caplog)
    assert "(CODE_INCOMPATIBLE_MODEL)" in line and "prefill engine p is not this engine's kind: " + says in line, line
    assert len(refusals(caplog, logging.DEBUG)) == 1
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(60 + i) for i in range(4)],)), 0)
    assert c.build_connector_meta(output()).loads == [], "nothing is read or notified"

    same = request("d-same", 4 * BS, facts_params("r-same", FACTS, block_size=BS))
    assert c.get_num_new_matched_tokens(same, 0) == (4 * BS, True)


def test_block_size_is_refused_by_name_before_the_token_digests(caplog):
    """Digests over blocks of 16 never equal the decode's over blocks of
    32: the refusal names the block size, not the tokens (before, the line
    said the KV encoded other tokens)."""
    c, _ = connector("kv_consumer")
    prompt = list(range(3, 3 + 4 * BS))
    over = {"block_size": 16, "remote_block_ids": list(range(8)), "prompt_tokens": len(prompt),
            "token_digests": params_to_json(params_pb2.KVTransferParams(
                token_digests=token_digests(prompt, 16)))["token_digests"]}
    r = request("d-bs", len(prompt), facts_params("r-bs", FACTS, **over))
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    (line,) = refusals(caplog)
    assert f"block_size: prefill 16, decode {BS}" in line and reasons.TOKEN_DIGEST_MISMATCH not in line, line


def test_a_fact_one_side_does_not_state_is_not_compared(caplog):
    c, _ = connector("kv_consumer", model="")  # a decode that cannot name its model
    workers_report(c, "CPU_ATTN")
    theirs = {**FACTS, "attention_backend": ""}  # a prefill whose workers named none
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        r = request("d-part", 4 * BS, facts_params("r-part", theirs))
        assert c.get_num_new_matched_tokens(r, 0) == (4 * BS, True)
    assert refusals(caplog) == []


def test_params_without_engine_facts_load_unchecked_said_once_per_prefill(caplog):
    """An older prefill connector states no facts: the params load (the
    sidecars still compare the KV geometry), and one INFO line per prefill
    engine says they were not compared."""
    c, _ = connector("kv_consumer")
    workers_report(c, "CPU_ATTN")
    with caplog.at_level(logging.INFO, logger="vllm.kvsidecar"):
        for i in range(3):
            r = request(f"d-old-{i}", 4 * BS, facts_params(f"r-old-{i}", None))
            assert c.get_num_new_matched_tokens(r, 0) == (4 * BS, True)
        other = request("d-old-q", 4 * BS, facts_params("r-old-q", None, remote_engine_id="q"))
        assert c.get_num_new_matched_tokens(other, 0) == (4 * BS, True)
    said = [x.getMessage() for x in caplog.records if "states no engine facts" in x.getMessage()]
    assert [("prefill engine p " in m, "prefill engine q " in m) for m in said] == [(True, False), (False, True)]
    # block_size is still checked on params without facts.
    r = request("d-old-bs", 4 * BS, facts_params("r-old-bs", None, block_size=2 * BS))
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)


def test_enforce_handshake_compat_off_loads_a_differing_prefill_and_says_so(caplog):
    c, _ = connector("kv_consumer", extra={"enforce_handshake_compat": False})
    workers_report(c, "CPU_ATTN")
    theirs = {**FACTS, "model": "/other/tiny"}
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        r = request("d-lax", 4 * BS, facts_params("r-lax", theirs))
        assert c.get_num_new_matched_tokens(r, 0) == (4 * BS, True)
        bs = request("d-lax-bs", 4 * BS, facts_params("r-lax-bs", FACTS, block_size=16))
        assert c.get_num_new_matched_tokens(bs, 0) == (0, False), "block_size is never loosened"
    lines = [x.getMessage() for x in caplog.records if x.name == "vllm.kvsidecar"]
    assert len(lines) == 2 and f"(model: prefill '/other/tiny', decode '{MODEL}'); loaded anyway" in lines[0], lines
    assert "block_size: prefill 16" in lines[1]


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_enforce_handshake_compat_must_be_a_bool(bad):
    with pytest.raises(errors.InvalidArgument, match=rf"enforce_handshake_compat {bad!r} must be true or false"):
        connector("kv_consumer", extra={"enforce_handshake_compat": bad})


@pytest.mark.parametrize("extra, message", [
    ({"zero_copy": "yes"}, "kv_connector_extra_config.zero_copy 'yes' must be true or false"),
    ({"zero_copy": 1}, "kv_connector_extra_config.zero_copy 1 must be true or false"),
    ({"free_hold_seconds": -1}, "kv_connector_extra_config.free_hold_seconds -1 must be a number of seconds >= 0 "
                                "(how long zero copy keeps a freed prefix-cache block mapped"),
    ({"free_hold_seconds": "soon"}, "free_hold_seconds 'soon' must be a number of seconds >= 0"),
])
def test_extra_config_values_are_refused_by_name(extra, message):
    """The reported inputs (a fresh user's review): ``"zero_copy": "yes"``
    was taken as on and ``"free_hold_seconds": -1`` as given, where
    ``enforce_handshake_compat`` refused a string."""
    with pytest.raises(errors.InvalidArgument, match=re.escape(message)):
        connector("kv_consumer", extra=extra)


def test_a_misspelt_extra_config_key_is_named_with_the_nearest_one(caplog):
    """The reported input: ``socket_dirr`` was silently ignored and the
    worker then waited on the default socket dir."""
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        c, _ = connector("kv_consumer", extra={"socket_dirr": "/y", "zero_copy": False})
    lines = [x.getMessage() for x in caplog.records if "kv_connector_extra_config key" in x.getMessage()]
    assert len(lines) == 1 and "'socket_dirr' is not one it reads (did you mean 'socket_dir'?)" in lines[0], lines
    assert c._scheduler is not None and c._scheduler.cfg.socket_dir == "/x"
