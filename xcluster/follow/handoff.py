"""Tell an inference engine to switch to a freshly written model directory.

Every preset implements :class:`Handoff`: ``hand_over(path, version)`` returns a
:class:`HandoffResult` or raises :class:`~xcluster.errors.HandoffError`. The path handed over is
always the resolved slot directory (``slots/a`` or ``slots/b``), never the ``current`` symlink, so
the engine reads exactly the version it is told about even if ``current`` moves meanwhile.

Presets:

* :class:`VllmHandoff` — vLLM's dev-mode endpoints (the engine needs ``VLLM_SERVER_DEV_MODE=1``):
  ``POST /pause?mode=…``, ``POST /collective_rpc`` with ``reload_weights`` — or, with xcluster's
  worker extension in the engine (``vllm_worker.py``), ``xcluster_apply``: only the changed
  elements, in place — ``POST /reset_prefix_cache``, ``POST /update_weight_version`` (the engine
  then reports the xcluster version it serves: ``GET /weight_info``), ``POST /resume``; then, with
  the extension, the engine's own hashes of its parameters are checked against the slot. Resume
  is always attempted once pause was sent, even when the update fails, so a failed hand-off never
  leaves the engine paused silently.
* :class:`SglangHandoff` — SGLang's ``POST /update_weights_from_disk``.
* :class:`HttpHandoff` — any HTTP endpoint, with a JSON body template.
* :class:`ExecHandoff` — run a command with ``XCLUSTER_MODEL_DIR`` and ``XCLUSTER_VERSION`` set.
* :class:`CallbackHandoff` — call a Python function (tests, embedding the daemon).

Retries (tenacity) cover only transient failures: connection refused or reset, timeouts, HTTP 5xx
and 429, exit status 75 (``EX_TEMPFAIL``) of a command, or a :class:`TransientHandoffError` raised by
a callback. A definite refusal (a 4xx, SGLang ``success: false``, a vLLM result with an error, any
other exit status) raises at once. ``sleep`` is injectable so tests do not wait.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import tenacity

from ..errors import ConfigError, EngineWeightsMismatchError, HandoffError, TransientHandoffError
from ..format import ENGINE_UPDATES
from ..util.retry import call_with_retries
from .engine_update import WeightsUpdate, expected_digests

log = logging.getLogger(__name__)
T = TypeVar("T")

ENGINES = ("vllm", "sglang", "http", "exec")
VLLM_PAUSE_MODES = ("abort", "wait", "keep")
#: Exit status of a hand-off command that asks to be retried (sysexits.h EX_TEMPFAIL).
EXIT_TEMPFAIL = 75
_TAIL = 2000  # characters of stderr / a response body kept in an error message


@dataclass(frozen=True, kw_only=True)
class HandoffConfig:
    """Time limits and retries of one hand-off."""

    timeout_s: float = 120.0
    """Limit of one request or command run; a reload of a large model must fit in it."""
    attempts: int = 3
    """Most attempts of each request (1 = never retry); only transient failures are retried."""
    backoff_s: float = 0.5
    """Wait before the second attempt; it doubles with each further attempt."""
    backoff_max_s: float = 10.0
    """Cap of a single wait between attempts."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"HandoffConfig.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigError(f"HandoffConfig.attempts must be an int ≥ 1 (1 means no retry), got {self.attempts!r}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ConfigError("HandoffConfig needs 0 ≤ backoff_s ≤ backoff_max_s, got "
                              f"{self.backoff_s} and {self.backoff_max_s}")


@dataclass(frozen=True, slots=True)
class HandoffResult:
    """What one successful hand-off did."""

    version: int
    path: str
    """The resolved version directory the engine was told to load."""
    seconds: float
    """Wall time of the whole hand-off, retries included."""
    pause_seconds: float | None
    """How long generation was paused (vLLM: pause sent .. resume answered); None if not paused."""
    attempts: int
    """Attempts of the request that needed most (1 = everything succeeded at once)."""
    detail: str
    method: str = "reload"
    """How the engine got the weights: ``reload`` (from the directory), ``in-place`` (only the
    changed elements), or ``in-place, then reload (…)`` when the in-place result did not verify."""
    verified: bool | None = None
    """True when the engine's workers hashed their parameters and they matched; None: not checked."""
    update_seconds: float | None = None
    """vLLM: the weight update inside the pause (the in-place write or the reload), as the daemon
    timed its request."""


class Handoff(Protocol):
    """Something that makes an engine serve a model directory. A preset whose ``takes_updates``
    is true (:class:`VllmHandoff`) is also passed ``update=`` (:class:`WeightsUpdate`): the
    installed tensors and what changed since the engine's version."""

    name: str

    def hand_over(self, path: Path, version: int) -> HandoffResult:
        """Make the engine serve ``path`` (version ``version``); raise HandoffError if it did not."""
        ...


# --- shared machinery ----------------------------------------------------------------------------
class _Retrying:
    """Retry transient failures of one step under a :class:`HandoffConfig`; count the attempts."""

    name = "engine"

    def __init__(self, config: HandoffConfig, sleep: Callable[[float], None]) -> None:
        if not isinstance(config, HandoffConfig):
            raise ConfigError(f"config must be a HandoffConfig, got {type(config).__name__}")
        self.config = config
        self._sleep = sleep
        self._clock = time.monotonic

    def _retry(self, what: str, fn: Callable[[], T]) -> tuple[T, int]:
        attempts = 0

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            return fn()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("%s hand-off: %s failed (attempt %d of %d), retrying: %s", self.name, what,
                        state.attempt_number, self.config.attempts, str(exc))  # text: a kept record holds no stack

        retryer = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientHandoffError),
            stop=tenacity.stop_after_attempt(self.config.attempts),
            wait=tenacity.wait_exponential(multiplier=self.config.backoff_s, max=self.config.backoff_max_s),
            sleep=self._sleep, before_sleep=before_sleep, reraise=False)
        result = call_with_retries(what, attempt, retryer,
                                   exhausted=lambda last: self._exhausted(what, last))
        return result, attempts

    def _exhausted(self, what: str, last: tenacity.Future) -> HandoffError:
        return HandoffError(f"{self.name} hand-off: {what} still failing after {last.attempt_number} attempts "
                            f"({last.exception()}); check that the engine is up and reachable, or raise "
                            "HandoffConfig.attempts/timeout_s")


def _real_dir(path: Path | str) -> Path:
    """The resolved version directory (a ``current`` symlink resolves to the version it names)."""
    try:
        real = Path(path).resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise HandoffError(f"model directory {path} does not exist ({exc}); write the version first") from exc
    if not real.is_dir():
        raise HandoffError(f"model directory {path} resolves to {real}, which is not a directory")
    return real


def _tail(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return text if len(text) <= _TAIL else "…" + text[-_TAIL:]


def _check_url(url: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


class _HttpEngine(_Retrying):
    """Requests to one engine base URL, with transient failures turned into TransientHandoffError."""

    def __init__(self, url: str, config: HandoffConfig, sleep: Callable[[float], None]) -> None:
        super().__init__(config, sleep)
        import requests

        self.url = _check_url(url)
        self._requests = requests
        self._session = requests.Session()

    def _send(self, method: str, url: str, **kwargs: Any):
        """One request; raise TransientHandoffError for what is worth retrying, else return the response."""
        requests = self._requests
        timeout = (min(10.0, self.config.timeout_s), self.config.timeout_s)
        try:
            response = self._session.request(method, url, timeout=timeout, **kwargs)
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as exc:
            raise TransientHandoffError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        except requests.RequestException as exc:
            raise HandoffError(f"{method} {url}: {exc}; check the engine URL") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise TransientHandoffError(f"{method} {url} answered {response.status_code}: {_tail(response.text)}")
        return response

    def _post_ok(self, endpoint: str, **kwargs: Any) -> tuple[Any, int]:
        """POST to an endpoint that must answer 2xx; return (response, attempts)."""
        url = self.url + endpoint

        def call():
            response = self._send("POST", url, **kwargs)
            if not 200 <= response.status_code < 300:
                raise HandoffError(f"{self.name} refused POST {url} with {response.status_code}: "
                                   f"{_tail(response.text)}")
            return response

        return self._retry(f"POST {endpoint}", call)


# --- vLLM ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Layout:
    """Where the engine's workers hold each checkpoint tensor (``vllm_worker.layout``)."""

    regions: list[list[dict]]
    """Per worker, the regions in the order its digests come."""
    unsupported: dict[str, str]
    ignored: list[str]

    @property
    def in_place(self) -> bool:
        return not self.unsupported


class VllmHandoff(_HttpEngine):
    """vLLM: pause, update the weights, reset the prefix cache, tag the version, resume; then
    check what the engine holds.

    Needs ``VLLM_SERVER_DEV_MODE=1`` on the engine (the endpoints are dev-mode only). ``pause_mode``
    is vLLM's: ``keep`` freezes in-flight requests and continues them on resume, ``wait`` lets them
    finish first, ``abort`` aborts them. Resume is attempted whenever pause was sent — also when
    pause itself failed (its answer may have been lost after the engine paused) — and a resume
    that fails is reported in the error, since the engine may then stay paused.

    With xcluster's worker extension in the engine (``--worker-extension-cls
    xcluster.follow.vllm_worker.XclusterWorkerExtension``) and a :class:`WeightsUpdate` from the
    daemon, a delta goes **in place**: only the changed elements are written into the loaded
    parameters (``collective_rpc xcluster_apply``), O(changed) inside the pause. Otherwise — no
    extension, a tensor the extension cannot place, a keyframe, a restart, an engine more than
    the daemon's change log behind — the weights are reloaded from the directory
    (``collective_rpc reload_weights``). Either way, with the extension, the workers then hash
    their parameters (``xcluster_digests``) and the daemon compares them with the installed slot:
    after an in-place update a mismatch (:class:`EngineWeightsMismatchError`) is repaired by a
    reload; after a reload it fails the hand-off.
    """

    name = "vllm"
    takes_updates = True

    def __init__(self, url: str, *, pause_mode: str = "keep", in_place: bool = True, verify: bool = True,
                 config: HandoffConfig = HandoffConfig(), sleep: Callable[[float], None] = time.sleep) -> None:
        if pause_mode not in VLLM_PAUSE_MODES:
            raise ConfigError(f"vLLM pause_mode must be one of {', '.join(VLLM_PAUSE_MODES)}, got {pause_mode!r}")
        super().__init__(url, config, sleep)
        self.pause_mode = pause_mode
        self.in_place = bool(in_place)
        self.verify = bool(verify)
        self._layout: _Layout | None = None
        self._layout_of_tensors: tuple | None = None
        self.mismatches = 0
        """In-place updates whose weights did not verify (each was repaired by a reload)."""
        self._tagged = ""
        self._update_s: float | None = None

    @property
    def wants_patch(self) -> bool:
        """Whether a patch of the changed elements may be used: in place is on, and the engine's
        layout (once known) places every tensor. False spares the daemon writing one."""
        return self.in_place and (self._layout_of_tensors is None or
                                  (self._layout is not None and self._layout.in_place))

    def hand_over(self, path: Path, version: int, update: WeightsUpdate | None = None) -> HandoffResult:
        real = _real_dir(path)
        start = self._clock()
        layout = self._layout_for(update) if update is not None and (self.in_place or self.verify) else None
        in_place = self.in_place and layout is not None and layout.in_place and update.patch is not None
        if in_place:
            method = "in-place"
            most, pause, what = self._paused(version, lambda: self._apply(update))
        else:
            method = "reload"
            most, pause, what = self._paused(version, lambda: self._reload(real))
        verified = None
        if self.verify and layout is not None:
            bad = self._mismatches(layout, update)
            if bad and in_place:
                self.mismatches += 1
                log.error("vLLM at %s does not hold version %d after the in-place update (%s): reloading it "
                          "from %s", self.url, version, bad, real)
                n, p2, what = self._paused(version, lambda: self._reload(real))
                most, pause, method = max(most, n), pause + p2, "in-place, then reload (engine weights did not verify)"
                bad = self._mismatches(layout, update)
            if bad:
                raise EngineWeightsMismatchError(
                    f"vLLM at {self.url} reloaded {real} but its workers do not hold version {version}: {bad}")
            # proven only if every tensor the engine loads was checked
            verified = True if layout.in_place else None
        end = self._clock()
        check = ", workers' weights verified" if verified else \
            "" if layout is None or not self.verify else \
            f", the {len(layout.unsupported)} tensor(s) it cannot place not verified (the rest matched)"
        return HandoffResult(version=version, path=str(real), seconds=end - start, pause_seconds=pause,
                             attempts=most, method=method, verified=verified, update_seconds=self._update_s,
                             detail=f"paused (mode={self.pause_mode}), {what}, prefix cache reset, "
                                    f"{self._tagged}, resumed{check}")

    def _paused(self, version: int, update: Callable[[], tuple[str, int]]) -> tuple[int, float, str]:
        """Pause, ``update()``, reset the prefix cache, tag the version, resume: (most attempts,
        seconds paused, what the update did); ``update()``'s own seconds go to ``_update_s``."""
        t0 = self._clock()
        most = 0
        failure: BaseException | None = None
        what = ""
        try:
            _, n = self._post_ok("/pause", params={"mode": self.pause_mode})
            most = max(most, n)
            t1 = self._clock()
            what, n = update()
            self._update_s = self._clock() - t1
            most = max(most, n)
            _, n = self._post_ok("/reset_prefix_cache")
            most = max(most, n)
            self._tagged, n = self._tag(version)
            most = max(most, n)
        except BaseException as exc:  # resume below, whatever went wrong, then re-raise
            failure = exc
        try:
            _, n = self._post_ok("/resume")
            most = max(most, n)
        except HandoffError as exc:
            if failure is None:
                raise HandoffError(f"vLLM at {self.url} took version {version} but did not resume ({exc}); it "
                                   f"may stay paused: POST {self.url}/resume by hand") from exc
            raise HandoffError(f"{failure}; resuming failed too ({exc}): the engine may stay paused, "
                               f"POST {self.url}/resume by hand") from failure
        if failure is not None:
            raise failure
        return most, self._clock() - t0, what

    def _tag(self, version: int) -> tuple[str, int]:
        """``POST /update_weight_version``: requests can then be attributed to the version (vLLM's
        RL endpoints, dev mode). An engine without the endpoint (404) is served all the same."""
        url = self.url + "/update_weight_version"

        def call() -> str:
            response = self._send("POST", url, json={"new_version": str(version)})
            if response.status_code == 404:
                return "no version tag (the engine lacks /update_weight_version)"
            if not 200 <= response.status_code < 300:
                raise HandoffError(f"vLLM refused POST {url} with {response.status_code}: {_tail(response.text)}")
            return f"tagged weight_version {version}"

        return self._retry("update_weight_version", call)

    def _rpc(self, method: str, kwargs: dict, *, retry: bool = True) -> tuple[list, int]:
        """``POST /collective_rpc``: every worker's result (none may carry an error), and attempts."""
        url = self.url + "/collective_rpc"
        body = {"method": method, "kwargs": kwargs}

        def call() -> list:
            response = self._send("POST", url, json=body)
            if response.status_code != 200:
                raise HandoffError(f"vLLM refused {method} with {response.status_code}: {_tail(response.text)}")
            try:
                results = response.json()["results"]
                if not isinstance(results, list):
                    raise TypeError("results is not a list")
            except (ValueError, KeyError, TypeError) as exc:
                raise HandoffError(f"vLLM answered {method} without a results list ({exc!r}): "
                                   f"{_tail(response.text)}") from None
            errors = [r for r in results if isinstance(r, dict) and r.get("error")]
            if errors:
                raise HandoffError(f"vLLM failed {method}: {_tail(json.dumps(errors))}")
            return results

        if retry:
            return self._retry(method, call)
        return call(), 1

    def _reload(self, real: Path) -> tuple[str, int]:
        """``collective_rpc reload_weights``; every worker's result must be free of errors."""
        results, n = self._rpc("reload_weights", {"weights_path": str(real)})
        return f"reloaded {real} on {len(results)} worker(s)", n

    def _apply(self, update: WeightsUpdate) -> tuple[str, int]:
        """``collective_rpc xcluster_apply``: the changed elements written into the parameters."""
        results, n = self._rpc("xcluster_apply", {"path": str(update.patch)})
        wrote = sum(int(r.get("written", 0)) for r in results if isinstance(r, dict))
        return (f"{update.patch_elements} changed elements since version {update.base_version} written in place "
                f"({wrote} parameter elements on {len(results)} worker(s))"), n

    def _layout_for(self, update: WeightsUpdate) -> _Layout | None:
        """The engine's layout for these tensors, asked once per set of tensors; None when the
        engine has no xcluster extension (then every version is reloaded, unverified)."""
        if update.tensors == self._layout_of_tensors:
            return self._layout
        self._layout_of_tensors = update.tensors
        self._layout = None
        try:
            results, _ = self._rpc("xcluster_layout", {"tensors": [[n, list(s), d] for n, s, d in update.tensors]},
                                   retry=False)
        except HandoffError as exc:
            log.warning("vLLM at %s has no usable xcluster worker extension (%s): every version is reloaded from "
                        "its directory and the engine's weights are not verified; start it with "
                        "--worker-extension-cls xcluster.follow.vllm_worker.XclusterWorkerExtension", self.url,
                        str(exc)[:300])
            return None
        try:
            regions = [list(r["regions"]) for r in results]
            unsupported = {k: str(v) for r in results for k, v in r["unsupported"].items()}
            ignored = sorted({n for r in results for n in r["ignored"]})
        except (TypeError, KeyError) as exc:
            log.warning("vLLM at %s answered xcluster_layout without a layout (%r): reloading, unverified",
                        self.url, exc)
            return None
        self._layout = _Layout(regions=regions, unsupported=unsupported, ignored=ignored)
        if unsupported:
            name, why = next(iter(unsupported.items()))
            log.warning("vLLM at %s: %d tensor(s) cannot be updated in place (%s: %s, …): every version is "
                        "reloaded, then verified", self.url, len(unsupported), name, why)
        if ignored:
            log.info("vLLM at %s does not load %d tensor(s) of the checkpoint (%s, …; tied or unused)", self.url,
                     len(ignored), ignored[0])
        return self._layout

    def _mismatches(self, layout: _Layout, update: WeightsUpdate) -> str:
        """The workers' digests against the installed slot's: '' when all agree, else which differ.
        The slot is hashed on a thread of its own while the workers hash theirs (hashlib lets go of
        the GIL)."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="xc-engine-digests") as pool:
            wanted = [pool.submit(expected_digests, regions, update.weights) for regions in layout.regions]
            got, _ = self._rpc("xcluster_digests", {})
            wants = [f.result() for f in wanted]
        if len(got) != len(layout.regions):
            return f"{len(got)} worker(s) answered, the layout has {len(layout.regions)}"
        bad = []
        for rank, (regions, digests, want) in enumerate(zip(layout.regions, got, wants)):
            if not isinstance(digests, list) or len(digests) != len(want):
                return f"worker {rank} answered {len(digests) if isinstance(digests, list) else digests!r} digests"
            bad += [f"{r['tensor']} in {r['param']} (worker {rank})" for r, a, b in zip(regions, digests, want)
                    if a != b]
        if not bad:
            return ""
        return f"{len(bad)} region(s) differ: " + ", ".join(bad[:5]) + (" …" if len(bad) > 5 else "")


# --- SGLang --------------------------------------------------------------------------------------
class SglangHandoff(_HttpEngine):
    """SGLang: ``POST /update_weights_from_disk``; the answer's ``success`` decides (200 or 400)."""

    name = "sglang"

    def __init__(self, url: str, *, abort_all_requests: bool = False, config: HandoffConfig = HandoffConfig(),
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(url, config, sleep)
        self.abort_all_requests = bool(abort_all_requests)

    def hand_over(self, path: Path, version: int) -> HandoffResult:
        real = _real_dir(path)
        start = self._clock()
        url = self.url + "/update_weights_from_disk"
        body = {"model_path": str(real), "weight_version": str(version), "flush_cache": True,
                "abort_all_requests": self.abort_all_requests}

        def call() -> dict:
            response = self._send("POST", url, json=body)
            try:
                answer = response.json()
                success = answer["success"]
            except (ValueError, KeyError, TypeError):
                raise HandoffError(f"SGLang answered update_weights_from_disk of {real} with "
                                   f"{response.status_code} and no success flag: {_tail(response.text)}") from None
            if success is not True:
                raise HandoffError(f"SGLang refused to load {real} (version {version}): "
                                   f"{answer.get('message', '(no message)')}")
            return answer

        answer, attempts = self._retry("update_weights_from_disk", call)
        return HandoffResult(version=version, path=str(real), seconds=self._clock() - start, pause_seconds=None,
                             attempts=attempts, detail=f"{answer.get('message', '')} (paused requests: "
                                                       f"{answer.get('num_paused_requests', 'n/a')})")


# --- any HTTP endpoint ---------------------------------------------------------------------------
def render_template(template: str, path: str, version: int) -> str:
    """Substitute ``{path}`` and ``{version}`` in a JSON body template, JSON-escaped.

    Inside a JSON string (``"dir: {path}"``) a placeholder becomes the escaped text of the value;
    outside one it becomes a whole JSON value: ``{path}`` a string, ``{version}`` a number. Quotes,
    backslashes or newlines in the path therefore never break the JSON.
    """
    values = {"{path}": str(path), "{version}": str(int(version))}
    out: list[str] = []
    in_string = escaped = False
    i = 0
    while i < len(template):
        ch = template[i]
        if in_string and escaped:
            escaped = False
        elif in_string and ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
        else:
            token = next((t for t in values if template.startswith(t, i)), None)
            if token is not None:
                value = values[token]
                if in_string:
                    out.append(json.dumps(value)[1:-1])
                else:
                    out.append(value if token == "{version}" else json.dumps(value))
                i += len(token)
                continue
        out.append(ch)
        i += 1
    return "".join(out)


class HttpHandoff(_HttpEngine):
    """Any HTTP endpoint: send the rendered JSON ``body_template``; any 2xx is success."""

    name = "http"

    def __init__(self, url: str, *, body_template: str, method: str = "POST",
                 config: HandoffConfig = HandoffConfig(), sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(url, config, sleep)
        if method.upper() not in ("POST", "PUT", "PATCH"):
            raise ConfigError(f"HTTP hand-off method must be POST, PUT or PATCH, got {method!r}")
        try:
            json.loads(render_template(body_template, '/a "quoted"\\ path\n', 0))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"HTTP hand-off body template is not JSON once {{path}} and {{version}} are "
                              f"filled in ({exc}): {body_template!r}") from None
        self.body_template = body_template
        self.method = method.upper()

    def hand_over(self, path: Path, version: int) -> HandoffResult:
        real = _real_dir(path)
        start = self._clock()
        body = render_template(self.body_template, str(real), version).encode()

        def call():
            response = self._send(self.method, self.url, data=body, headers={"Content-Type": "application/json"})
            if not 200 <= response.status_code < 300:
                raise HandoffError(f"{self.method} {self.url} refused {real} with {response.status_code}: "
                                   f"{_tail(response.text)}")
            return response

        response, attempts = self._retry(f"{self.method} {self.url}", call)
        return HandoffResult(version=version, path=str(real), seconds=self._clock() - start, pause_seconds=None,
                             attempts=attempts, detail=f"{response.status_code} {_tail(response.text)[:200]}")


# --- a command -----------------------------------------------------------------------------------
class ExecHandoff(_Retrying):
    """Run ``argv`` with ``XCLUSTER_MODEL_DIR`` and ``XCLUSTER_VERSION`` added to the inherited
    environment. Exit 0 is success; exit 75 (EX_TEMPFAIL) asks for a retry; anything else is a
    refusal. Past ``timeout_s`` the command's whole process group is killed (not retried: it may
    have half-done its work)."""

    name = "exec"

    def __init__(self, argv: Sequence[str], *, config: HandoffConfig = HandoffConfig(),
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(config, sleep)
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError(f"exec hand-off needs a non-empty list of argument strings, got {argv!r}")
        self.argv = list(argv)

    def hand_over(self, path: Path, version: int) -> HandoffResult:
        real = _real_dir(path)
        start = self._clock()
        env = {**os.environ, "XCLUSTER_MODEL_DIR": str(real), "XCLUSTER_VERSION": str(version)}
        stdout, attempts = self._retry(f"command {self.argv[0]}", lambda: self._run(env))
        return HandoffResult(version=version, path=str(real), seconds=self._clock() - start, pause_seconds=None,
                             attempts=attempts, detail=f"exit 0 {_tail(stdout)[-200:]}".strip())

    def _run(self, env: dict[str, str]) -> bytes:
        try:
            proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise HandoffError(f"cannot run hand-off command {self.argv!r}: {exc}") from exc
        try:
            stdout, stderr = proc.communicate(timeout=self.config.timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: children would hold the pipes open
            except ProcessLookupError:  # it ended just now
                pass
            _, stderr = proc.communicate()
            raise HandoffError(f"hand-off command {self.argv!r} ran past {self.config.timeout_s} s and was "
                               f"killed; stderr: {_tail(stderr)}") from None
        if proc.returncode == EXIT_TEMPFAIL:
            raise TransientHandoffError(f"hand-off command {self.argv!r} asked for a retry (exit 75): "
                                        f"{_tail(stderr)}")
        if proc.returncode != 0:
            raise HandoffError(f"hand-off command {self.argv!r} failed with exit status {proc.returncode}; "
                               f"stderr: {_tail(stderr)}")
        return stdout


# --- a Python function ---------------------------------------------------------------------------
class CallbackHandoff(_Retrying):
    """Call ``fn(path, version)``. It signals failure by raising; a TransientHandoffError is retried,
    any other exception becomes a HandoffError at once."""

    def __init__(self, fn: Callable[[Path, int], None], *, name: str = "callback",
                 config: HandoffConfig = HandoffConfig(), sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(config, sleep)
        if not callable(fn):
            raise ConfigError(f"CallbackHandoff needs a callable, got {fn!r}")
        self.fn = fn
        self.name = name

    def hand_over(self, path: Path, version: int) -> HandoffResult:
        real = _real_dir(path)
        start = self._clock()

        def call() -> None:
            try:
                self.fn(real, version)
            except HandoffError:
                raise
            except Exception as exc:
                raise HandoffError(f"{self.name} hand-off of {real} failed: {exc!r}") from exc

        _, attempts = self._retry(f"{self.name}()", call)
        return HandoffResult(version=version, path=str(real), seconds=self._clock() - start, pause_seconds=None,
                             attempts=attempts, detail="callback returned")


def make_handoff(engine: str, *, url: str | None = None, body: str | None = None,
                 exec_cmd: Sequence[str] | None = None, pause_mode: str = "keep", engine_update: str = "in-place",
                 config: HandoffConfig = HandoffConfig()) -> Handoff:
    """Build the preset for ``engine`` (``vllm``, ``sglang``, ``http``, ``exec``) from CLI-style values;
    ``exec_cmd`` may be one string, split like a shell would (no shell runs it)."""
    if engine in ("vllm", "sglang", "http") and not url:
        raise ConfigError(f"engine {engine!r} needs an engine URL (--engine-url)")
    if engine_update not in ENGINE_UPDATES:
        raise ConfigError(f"engine_update must be one of {', '.join(ENGINE_UPDATES)}, got {engine_update!r}")
    if engine == "vllm":
        return VllmHandoff(url, pause_mode=pause_mode, in_place=engine_update == "in-place", config=config)
    if engine == "sglang":
        return SglangHandoff(url, config=config)
    if engine == "http":
        if not body:
            raise ConfigError("engine 'http' needs a JSON body template with {path} and/or {version}")
        return HttpHandoff(url, body_template=body, config=config)
    if engine == "exec":
        if not exec_cmd:
            raise ConfigError("engine 'exec' needs a command to run")
        return ExecHandoff(shlex.split(exec_cmd) if isinstance(exec_cmd, str) else exec_cmd, config=config)
    raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
