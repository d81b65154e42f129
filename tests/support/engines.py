"""Real HTTP servers on 127.0.0.1 that speak the engines' weight-reload protocols and record calls.

* :func:`vllm_stand_in` — vLLM's dev-mode endpoints (``/pause``, ``/collective_rpc``,
  ``/reset_prefix_cache``, ``/resume``, ``/is_paused``) as documented in vLLM's
  ``entrypoints/serve`` routers; ``reload_weights`` reads the index of the directory it is given.
* :func:`sglang_stand_in` — SGLang's ``/update_weights_from_disk``. A stand-in, not SGLang itself:
  SGLang's PyPI build needs CUDA. It answers ``{success, message, num_paused_requests}`` with 200
  on success and 400 on failure, like SGLang's HTTP server.

Any path's next answers can be scripted (``stub.script("/resume", (503, {...}))``), with a delay to
provoke client timeouts. Servers stop in ``close()`` (context manager).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    raw: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Scripted:
    status: int
    body: Any
    delay_s: float = 0.0


Reply = Callable[[Call], tuple[int, Any]]


class EngineStub:
    """A threaded HTTP server whose answers come from ``reply(call)`` unless scripted."""

    def __init__(self, reply: Reply) -> None:
        self.calls: list[Call] = []
        self._reply = reply
        self._scripts: dict[str, list[Scripted]] = {}
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _handle(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                parts = urlsplit(self.path)
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = "<not json>"
                call = Call(self.command, parts.path, parse_qs(parts.query), body, raw, dict(self.headers))
                with stub._lock:
                    stub.calls.append(call)
                    queue = stub._scripts.get(parts.path)
                    scripted = queue.pop(0) if queue else None
                if scripted is not None:
                    time.sleep(scripted.delay_s)
                    status, answer = scripted.status, scripted.body
                else:
                    status, answer = stub._reply(call)
                data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            do_GET = do_POST = do_PUT = do_PATCH = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def script(self, path: str, *answers: Scripted | tuple) -> None:
        """Answer the next requests to ``path`` with these (status, body[, delay_s]) first."""
        with self._lock:
            self._scripts.setdefault(path, []).extend(a if isinstance(a, Scripted) else Scripted(*a)
                                                      for a in answers)

    def paths(self) -> list[str]:
        return [c.path for c in self.calls]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> EngineStub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _has_index(path: str) -> bool:
    return (Path(path) / "model.safetensors.index.json").is_file()


class StandInWorker:
    """One tensor-parallel worker of :func:`vllm_stand_in` with ``params``: it holds rows
    ``[rank·n/W, (rank+1)·n/W)`` of every 2-D tensor whose rows divide evenly, the whole of the others."""

    def __init__(self, rank: int, workers: int) -> None:
        self.rank, self.workers = rank, workers
        self.params: dict[str, Any] = {}

    def rows(self, shape) -> tuple[int, int]:
        n = shape[0] if len(shape) else 1
        if len(shape) != 2 or n % self.workers:
            return 0, n
        return self.rank * n // self.workers, (self.rank + 1) * n // self.workers

    def load(self, weights: dict) -> None:
        self.params = {name: t[slice(*self.rows(tuple(t.shape)))].clone() for name, t in weights.items()}

    def named_parameters(self):
        return iter(self.params.items())

    def layout(self, tensors: list) -> dict:
        import math

        regions = []
        for name, shape, _ in tensors:
            width = math.prod(shape[1:]) if len(shape) > 1 else 1
            r0, r1 = self.rows(tuple(shape))
            regions.append({"tensor": name, "param": name, "rows": [r0, r1], "cols": [0, width], "at": [0, 0],
                            "width": width, "nrows": shape[0] if shape else 1})
        self.regions = regions
        return {"regions": regions, "ignored": [], "unsupported": {}, "rank": self.rank, "digest": "blake2b-128"}


def _read_dir(path: str) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def vllm_stand_in(workers: int = 2, params: dict | None = None) -> EngineStub:
    """vLLM's dev-mode weight-reload endpoints; ``state`` holds paused/loaded as the engine would.

    With ``params`` (the weights it starts with, by checkpoint name) it also has xcluster's worker
    extension, over ``workers`` :class:`StandInWorker` (``state["workers"]``) that really hold
    their slices: ``xcluster_layout``, ``xcluster_apply`` and ``xcluster_digests`` run the
    extension's own code on them, ``reload_weights`` reads the directory's safetensors. A method a
    worker lacks answers 500, as vLLM does."""
    from xcluster.follow import vllm_worker

    state: dict[str, Any] = {"paused": False, "loaded": None, "weight_version": None}
    pool = [StandInWorker(rank, workers) for rank in range(workers)]
    if params is not None:
        for w in pool:
            w.load(params)

    def reply(call: Call) -> tuple[int, Any]:
        if call.path == "/pause" and call.method == "POST":
            mode = call.query.get("mode", ["abort"])[0]
            if mode not in ("abort", "wait", "keep"):
                return 422, {"detail": f"bad mode {mode}"}
            state["paused"] = True
            return 200, {"status": "paused"}
        if call.path == "/resume" and call.method == "POST":
            state["paused"] = False
            return 200, {"status": "resumed"}
        if call.path == "/is_paused":
            return 200, {"is_paused": state["paused"]}
        if call.path == "/reset_prefix_cache" and call.method == "POST":
            return 200, b""
        if call.path == "/update_weight_version" and call.method == "POST":
            state["weight_version"] = call.body["new_version"]
            return 200, {"success": True, "new_version": call.body["new_version"]}
        if call.path == "/weight_info":
            return 200, {"weight_version": state["weight_version"]}
        if call.path == "/collective_rpc" and call.method == "POST":
            if not isinstance(call.body, dict) or "method" not in call.body:
                return 400, {"detail": "Missing 'method' in request body"}
            method, kwargs = call.body["method"], call.body.get("kwargs", {})
            if params is not None and method == "xcluster_layout":
                return 200, {"results": [w.layout(kwargs["tensors"]) for w in pool]}
            if params is not None and method == "xcluster_apply":
                return 200, {"results": [vllm_worker.apply_patch(w, w.regions, kwargs["path"]) for w in pool]}
            if params is not None and method == "xcluster_digests":
                return 200, {"results": [vllm_worker.digests(w, w.regions) for w in pool]}
            if method != "reload_weights":
                return 500, {"error": {"message": f"Call to collective_rpc method failed: Worker failed with "
                                                  f"error ''CPUWorker' object has no attribute '{method}''"}}
            path = kwargs.get("weights_path", "")
            if not _has_index(path):
                return 200, {"results": [{"error": f"no weights at {path}"}] * workers}
            state["loaded"] = path
            if params is not None:
                for w in pool:
                    w.load(_read_dir(path))
            return 200, {"results": [None] * workers}
        return 404, {"detail": "Not Found"}

    stub = EngineStub(reply)
    stub.state = state  # type: ignore[attr-defined]
    stub.workers = pool  # type: ignore[attr-defined]
    return stub


def sglang_stand_in() -> EngineStub:
    """SGLang's ``/update_weights_from_disk`` (a stand-in: SGLang's PyPI build needs CUDA)."""
    state: dict[str, Any] = {"loaded": None, "weight_version": None}

    def reply(call: Call) -> tuple[int, Any]:
        if call.path != "/update_weights_from_disk" or call.method != "POST":
            return 404, {"detail": "Not Found"}
        body = call.body if isinstance(call.body, dict) else {}
        path = body.get("model_path", "")
        if not _has_index(path):
            return 400, {"success": False, "message": f"Failed to get weights iterator: {path} not found",
                         "num_paused_requests": 0}
        state.update(loaded=path, weight_version=body.get("weight_version"))
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    stub = EngineStub(reply)
    stub.state = state  # type: ignore[attr-defined]
    return stub
