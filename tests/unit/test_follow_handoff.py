"""Engine hand-off presets against real HTTP servers on 127.0.0.1, real commands and callbacks."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from xcluster.errors import ConfigError, HandoffError, TransientHandoffError
from xcluster.follow.handoff import (CallbackHandoff, ExecHandoff, HandoffConfig, HttpHandoff, SglangHandoff,
                                     VllmHandoff, make_handoff, render_template)
from xcluster.follow.slots import Slots
from tests.support.engines import sglang_stand_in, vllm_stand_in

FAST = HandoffConfig(timeout_s=5, attempts=3, backoff_s=0.5, backoff_max_s=10)


@pytest.fixture
def model_dir(tmp_path) -> Slots:
    md = Slots(tmp_path / "model")
    md.write("b", {"w": torch.ones(4)}, {"config.json": b"{}"})
    md.switch_current("b")
    return md


@pytest.fixture
def current(model_dir) -> Path:
    """The ``current`` symlink: hand-offs must pass on the real directory it names."""
    return model_dir.root / "current"


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


# --- vLLM ----------------------------------------------------------------------------------------
def test_vllm_pauses_reloads_resets_and_resumes_in_order(model_dir, current):
    with vllm_stand_in(workers=2) as engine:
        result = VllmHandoff(engine.url, config=FAST).hand_over(current, 12)
    assert engine.paths() == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                              "/resume"]
    assert all(c.method == "POST" for c in engine.calls)
    assert engine.calls[0].query == {"mode": ["keep"]}
    real = str(model_dir.path("b").resolve())
    assert engine.calls[1].body == {"method": "reload_weights", "kwargs": {"weights_path": real}}
    assert engine.calls[3].body == {"new_version": "12"}
    assert engine.state == {"paused": False, "loaded": real, "weight_version": "12"}
    assert "tagged weight_version 12" in result.detail
    assert result.version == 12 and result.path == real and result.attempts == 1
    assert result.pause_seconds is not None and 0 <= result.pause_seconds <= result.seconds
    assert "2 worker" in result.detail


def test_vllm_without_the_version_endpoint_is_still_served(current):
    with vllm_stand_in() as engine:
        engine.script("/update_weight_version", (404, {"detail": "Not Found"}))
        result = VllmHandoff(engine.url, config=FAST).hand_over(current, 12)
    assert engine.paths()[-1] == "/resume" and engine.state["loaded"] is not None
    assert "no version tag" in result.detail


def test_vllm_pause_mode_is_sent_and_checked(current):
    with vllm_stand_in() as engine:
        VllmHandoff(engine.url, pause_mode="wait", config=FAST).hand_over(current, 12)
    assert engine.calls[0].query == {"mode": ["wait"]}
    with pytest.raises(ConfigError, match="pause_mode"):
        VllmHandoff("http://127.0.0.1:1", pause_mode="drain")


def test_vllm_resumes_after_a_failed_reload_and_does_not_retry_it(tmp_path, current):
    with vllm_stand_in() as engine:
        engine.script("/collective_rpc", (200, {"results": [None, {"error": "shape mismatch in layer 3"}]}))
        with pytest.raises(HandoffError, match="shape mismatch in layer 3"):
            VllmHandoff(engine.url, config=FAST, sleep=Sleeps()).hand_over(current, 12)
    assert engine.paths() == ["/pause", "/collective_rpc", "/resume"]
    assert engine.state["paused"] is False


def test_vllm_reload_without_results_is_a_failure_and_still_resumes(current):
    with vllm_stand_in() as engine:
        engine.script("/collective_rpc", (200, b"oops"))
        with pytest.raises(HandoffError, match="without a results list"):
            VllmHandoff(engine.url, config=FAST).hand_over(current, 12)
    assert engine.paths()[-1] == "/resume" and engine.state["paused"] is False


def test_vllm_transient_503_on_reload_is_retried(current):
    sleeps = Sleeps()
    with vllm_stand_in() as engine:
        engine.script("/collective_rpc", (503, {"detail": "busy"}))
        result = VllmHandoff(engine.url, config=FAST, sleep=sleeps).hand_over(current, 12)
    assert engine.paths() == ["/pause", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache",
                              "/update_weight_version", "/resume"]
    assert result.attempts == 2 and sleeps == [0.5]


def test_vllm_failed_resume_says_the_engine_may_stay_paused(current):
    with vllm_stand_in() as engine:
        engine.script("/resume", (400, {"detail": "no"}))
        with pytest.raises(HandoffError, match="may stay paused"):
            VllmHandoff(engine.url, config=FAST).hand_over(current, 12)
    assert engine.state["loaded"] is not None


def test_vllm_without_dev_mode_is_refused_at_pause_and_resume_is_still_tried(current):
    with vllm_stand_in() as engine:
        engine.script("/pause", (404, {"detail": "Not Found"}))
        with pytest.raises(HandoffError, match="404"):
            VllmHandoff(engine.url, config=FAST, sleep=Sleeps()).hand_over(current, 12)
    assert engine.paths() == ["/pause", "/resume"]  # a 4xx is not retried


# --- SGLang --------------------------------------------------------------------------------------
def test_sglang_success(model_dir, current):
    with sglang_stand_in() as engine:
        result = SglangHandoff(engine.url, abort_all_requests=True, config=FAST).hand_over(current, 12)
    real = str(model_dir.path("b").resolve())
    assert engine.paths() == ["/update_weights_from_disk"]
    assert engine.calls[0].body == {"model_path": real, "weight_version": "12", "flush_cache": True,
                                    "abort_all_requests": True}
    assert engine.state == {"loaded": real, "weight_version": "12"}
    assert result.path == real and result.pause_seconds is None and "Succeeded" in result.detail


@pytest.mark.parametrize("status", [200, 400])
def test_sglang_success_false_is_refused_at_once(current, status):
    sleeps = Sleeps()
    with sglang_stand_in() as engine:
        engine.script("/update_weights_from_disk",
                      (status, {"success": False, "message": "model arch changed", "num_paused_requests": 0}))
        with pytest.raises(HandoffError, match="model arch changed"):
            SglangHandoff(engine.url, config=FAST, sleep=sleeps).hand_over(current, 12)
    assert len(engine.calls) == 1 and sleeps == []


# --- any HTTP endpoint ---------------------------------------------------------------------------
def test_http_template_escapes_awkward_paths(tmp_path):
    md = Slots(tmp_path / 'we"ird\\dir\nname')
    md.write("a", {"w": torch.ones(1)}, {})
    template = '{"model": {path}, "v": {version}, "note": "dir={path} v{version}", "tag": "{version}"}'
    with vllm_stand_in() as engine:  # any server that records the body will do
        engine.script("/load", (200, {"ok": True}))
        result = HttpHandoff(engine.url + "/load", body_template=template, config=FAST).hand_over(md.path("a"), 3)
    real = str(md.path("a").resolve())
    assert json.loads(engine.calls[0].raw) == {"model": real, "v": 3, "note": f"dir={real} v3", "tag": "3"}
    assert engine.calls[0].headers["Content-Type"] == "application/json"
    assert result.attempts == 1 and result.detail.startswith("200")


def test_render_template_cases():
    assert render_template('{"p": {path}}', 'a"b', 1) == '{"p": "a\\"b"}'
    assert render_template('{"p": "x\\"{path}"}', "c", 1) == '{"p": "x\\"c"}'
    assert json.loads(render_template('[{version}, "{version}"]', "/", 42)) == [42, "42"]
    with pytest.raises(ConfigError, match="not JSON"):
        HttpHandoff("http://127.0.0.1:1", body_template='{"p": {path')


def test_http_4xx_is_refused_and_5xx_then_2xx_is_retried(current):
    sleeps = Sleeps()
    with vllm_stand_in() as engine:
        engine.script("/hook", (503, {}), (429, {}), (204, b""))
        result = HttpHandoff(engine.url + "/hook", body_template='{"p": {path}}', method="PUT",
                             config=FAST, sleep=sleeps).hand_over(current, 12)
        assert result.attempts == 3 and sleeps == [0.5, 1.0]
        assert [c.method for c in engine.calls] == ["PUT"] * 3
        engine.script("/hook", (403, {"detail": "forbidden"}))
        with pytest.raises(HandoffError, match="403"):
            HttpHandoff(engine.url + "/hook", body_template='{"p": {path}}', config=FAST,
                        sleep=sleeps).hand_over(current, 12)
    assert len(engine.calls) == 4


def test_a_timed_out_request_is_retried(current):
    config = HandoffConfig(timeout_s=1.0, attempts=2, backoff_s=0.0, backoff_max_s=0.0)
    with vllm_stand_in() as engine:
        engine.script("/hook", (200, {}, 3.0), (200, {"ok": 1}))
        result = HttpHandoff(engine.url + "/hook", body_template="{}", config=config).hand_over(current, 12)
    assert result.attempts == 2


def test_refused_connection_exhausts_attempts_with_a_clear_error(current):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleeps = Sleeps()
    with pytest.raises(HandoffError, match="still failing after 3 attempts") as info:
        SglangHandoff(f"http://127.0.0.1:{port}", config=FAST, sleep=sleeps).hand_over(current, 12)
    assert isinstance(info.value.__cause__, TransientHandoffError)
    assert "ConnectionError" in str(info.value) and "sglang" in str(info.value)
    assert sleeps == [0.5, 1.0]


def test_a_missing_directory_is_refused_before_any_request(tmp_path):
    with vllm_stand_in() as engine:
        with pytest.raises(HandoffError, match="does not exist"):
            VllmHandoff(engine.url, config=FAST).hand_over(tmp_path / "nope", 1)
    assert engine.calls == []


# --- a command -----------------------------------------------------------------------------------
def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_exec_gets_the_real_directory_and_version_in_its_env(tmp_path, model_dir, current):
    out = tmp_path / "env.json"
    code = ("import json, os; json.dump({k: os.environ[k] for k in ('XCLUSTER_MODEL_DIR', 'XCLUSTER_VERSION', "
            f"'PATH')}}, open({str(out)!r}, 'w')); print('loaded')")
    result = ExecHandoff(py(code), config=FAST).hand_over(current, 12)
    env = json.loads(out.read_text())
    assert env["XCLUSTER_MODEL_DIR"] == str(model_dir.path("b").resolve())
    assert env["XCLUSTER_VERSION"] == "12"
    assert env["PATH"]  # the inherited environment is kept
    assert result.attempts == 1 and "loaded" in result.detail


def test_exec_failure_carries_the_stderr_tail_and_is_not_retried(tmp_path, current):
    count = tmp_path / "count"
    code = (f"import sys, pathlib; p = pathlib.Path({str(count)!r}); p.write_text(p.read_text() + 'x' "
            "if p.exists() else 'x'); sys.stderr.write('noise\\n' * 1000 + 'weights dir unreadable'); sys.exit(2)")
    with pytest.raises(HandoffError, match="(?s)exit status 2.*weights dir unreadable") as info:
        ExecHandoff(py(code), config=FAST, sleep=Sleeps()).hand_over(current, 12)
    assert count.read_text() == "x"
    assert str(info.value).count("noise") < 500  # a tail, not the whole stderr


def test_exec_exit_75_is_retried(tmp_path, current):
    count = tmp_path / "count"
    code = (f"import sys, pathlib; p = pathlib.Path({str(count)!r}); n = len(p.read_text()) if p.exists() else 0; "
            "p.write_text('x' * (n + 1)); sys.exit(75 if n == 0 else 0)")
    sleeps = Sleeps()
    result = ExecHandoff(py(code), config=FAST, sleep=sleeps).hand_over(current, 12)
    assert result.attempts == 2 and count.read_text() == "xx" and sleeps == [0.5]


def test_exec_timeout_kills_the_command_and_its_children(current):
    code = "import subprocess, sys; sys.stderr.write('starting\\n'); sys.stderr.flush(); subprocess.run(['sleep', '60'])"
    config = HandoffConfig(timeout_s=3.0, attempts=3, backoff_s=0, backoff_max_s=0)
    start = time.monotonic()
    with pytest.raises(HandoffError, match="ran past 3.0 s and was killed; stderr: starting"):
        ExecHandoff(py(code), config=config).hand_over(current, 12)
    assert time.monotonic() - start < 20  # not retried, and the grandchild holding the pipes died too


def test_exec_missing_program(current):
    with pytest.raises(HandoffError, match="cannot run"):
        ExecHandoff(["/nonexistent/engine-reload"], config=FAST).hand_over(current, 12)


# --- a callback ----------------------------------------------------------------------------------
def test_callback_gets_the_real_path_and_failures_are_wrapped(model_dir, current):
    seen = []
    result = CallbackHandoff(lambda p, v: seen.append((p, v))).hand_over(current, 12)
    assert seen == [(model_dir.path("b").resolve(), 12)] and result.attempts == 1

    def boom(p, v):
        raise RuntimeError("engine exploded")

    with pytest.raises(HandoffError, match="engine exploded"):
        CallbackHandoff(boom, sleep=Sleeps()).hand_over(current, 12)

    flaky = iter([TransientHandoffError("warming up"), None])

    def maybe(p, v):
        exc = next(flaky)
        if exc:
            raise exc

    sleeps = Sleeps()
    assert CallbackHandoff(maybe, config=FAST, sleep=sleeps).hand_over(current, 12).attempts == 2
    assert sleeps == [0.5]


# --- construction --------------------------------------------------------------------------------
def test_make_handoff_builds_each_preset_and_checks_its_arguments():
    assert isinstance(make_handoff("vllm", url="http://e:8000", pause_mode="abort"), VllmHandoff)
    assert isinstance(make_handoff("sglang", url="http://e:30000/"), SglangHandoff)
    assert isinstance(make_handoff("http", url="http://e/x", body='{"p": {path}}'), HttpHandoff)
    exec_handoff = make_handoff("exec", exec_cmd="reload --dir 'a b'")
    assert isinstance(exec_handoff, ExecHandoff) and exec_handoff.argv == ["reload", "--dir", "a b"]
    for kwargs in ({"engine": "vllm"}, {"engine": "http", "url": "http://e"}, {"engine": "exec"},
                   {"engine": "tgi", "url": "http://e"}, {"engine": "vllm", "url": "e:8000"}):
        with pytest.raises(ConfigError):
            make_handoff(**kwargs)


@pytest.mark.parametrize("kwargs", [{"timeout_s": 0}, {"attempts": 0}, {"backoff_s": -1},
                                    {"backoff_s": 20, "backoff_max_s": 10}])
def test_config_checks(kwargs):
    with pytest.raises(ConfigError):
        HandoffConfig(**kwargs)
