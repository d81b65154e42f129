"""The demo's inference engine: a small HTTP server that loads model directories with transformers.

It stands where vLLM stands in production (the real-engine test drives vLLM itself): the daemon
hands it each new version's slot directory (``OUT/slots/a`` or ``b``) with ``--engine http``; it loads the directory the way
any engine would (``AutoModelForCausalLM.from_pretrained`` + ``AutoTokenizer``, bf16), hashes the
weights it now serves, generates a few greedy tokens, and appends one JSON line to ``--results``::

    {"event": "ready", "pid": 1234, "port": 40123}
    {"event": "loaded", "version": 3, "path": "...", "unix": 1.7e9, "model_digest": "…",
     "load_seconds": 0.4, "greedy": " the store"}

``--tamper-version V`` is a test hook: from version V on it flips one bit of the weights it
loaded, so the demo must report a mismatch there.

Run as ``python -m xcluster.demo.engine --results FILE``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPT = "the trainer sends weights to the"


class _Engine:
    def __init__(self, results: Path, tamper_version: int | None) -> None:
        self.results = results
        self.tamper_version = tamper_version
        self.lock = threading.Lock()
        self.model = None

    def record(self, obj: dict[str, Any]) -> None:
        with self.lock, open(self.results, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")

    def load(self, path: str, version: int) -> dict[str, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..codec.digest import model_digest

        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        tok = AutoTokenizer.from_pretrained(path)
        load_s = time.perf_counter() - t0
        state = {k: v.detach() for k, v in model.state_dict().items()}
        if self.tamper_version is not None and version >= self.tamper_version:
            name = sorted(state)[0]
            raw = state[name].clone().contiguous().view(-1).view(torch.uint8)
            raw[0] ^= 1
            state[name] = raw.view(state[name].dtype).view(state[name].shape)
        digest = model_digest(state)
        ids = tok(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        self.model = model
        rec = {"event": "loaded", "version": version, "path": path, "unix": time.time(), "pid": os.getpid(),
               "model_digest": digest, "load_seconds": load_s,
               "greedy": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}
        self.record(rec)
        return rec


def serve(results: Path, *, tamper_version: int | None = None, port: int = 0) -> None:
    engine = _Engine(results, tamper_version)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                rec = engine.load(str(body["path"]), int(body["version"]))
                self._answer(200, rec)
            except Exception as exc:  # an engine that cannot load says so: the daemon retries
                self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})

        def _answer(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    engine.record({"event": "ready", "pid": os.getpid(), "port": server.server_address[1]})
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tamper-version", type=int, default=None)
    args = ap.parse_args(argv)
    import signal

    import torch

    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(args.results, tamper_version=args.tamper_version, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
