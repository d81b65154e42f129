"""``xcluster demo``: the whole production loop on one CPU machine, in about a minute.

A small Llama (built in code, random init, a locally trained tokenizer) trains for a few
policy-gradient steps; after each step the trainer hook publishes its bf16 weights in the
background (``publish()`` only snapshots them) together with config.json and the tokenizer
files. On the "rollout node", the real daemon (``xcluster subscribe``, a separate process)
applies every version, writes a Hugging Face model directory and hands it to an engine process
that loads it with transformers and hashes what it serves; the demo compares that digest with
the trainer's. It prints a per-step table, a summary, and writes a plot of bytes per step.

Torch and matplotlib are imported only when the demo runs, not when the CLI is built.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, XclusterError

if TYPE_CHECKING:  # pragma: no cover
    from .report import StepRow, Summary

__all__ = ["DemoConfig", "DemoReport", "run_demo", "register"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What ``xcluster demo`` does; the CLI only fills this in."""

    steps: int = 20
    """Optimizer steps, one published version each."""
    lr: float = 1e-6
    """Adam learning rate."""
    checkpoint_every: int = 10
    """Publisher checkpoint interval; the default 10 makes 20 steps write a checkpoint (followers never download it)."""
    seed: int = 0
    """Seeds the model init, prompts, sampling and rewards."""
    out: Path = Path("demo-out")
    """Directory for the plot, the per-step JSON and (by default) the store."""
    store: str | None = None
    """Store URL (local path, ``file://``, ``s3://``, any fsspec URL); default ``<out>/store``."""
    keep: bool = False
    """Keep what is already in the store instead of wiping it first."""
    model: str = "demo"
    """Model preset from :data:`xcluster.demo.hfmodel.PRESETS` (``demo`` ~14M params, ``tiny`` ~1.4M)."""
    poll: float = 0.05
    """Daemon poll interval in seconds."""
    background: bool = True
    """Publish in the background (``publish()`` returns once the weights are snapshotted)."""
    threads: int = 1
    """Torch CPU threads for training. One by default: the follower runs beside the trainer,
    and on a small, busy machine two spinning OpenMP threads per process make each step
    10-20× slower instead of faster."""
    rollout_timeout: float = 120.0
    """Give up when the engine has not loaded the last version this many seconds after training."""
    tamper_version: int | None = None
    """Test hook: from this version on, the engine flips one bit of the weights it loaded, so
    the demo must show ✗ there and fail."""

    def __post_init__(self) -> None:
        from .hfmodel import PRESETS

        if self.steps < 1:
            raise ConfigError(f"DemoConfig.steps must be ≥ 1, got {self.steps}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"DemoConfig.checkpoint_every must be ≥ 1, got {self.checkpoint_every}")
        if not self.lr > 0:
            raise ConfigError(f"DemoConfig.lr must be > 0, got {self.lr}")
        if self.model not in PRESETS:
            raise ConfigError(f"DemoConfig.model must be one of {sorted(PRESETS)}, got {self.model!r}")
        if self.threads < 1:
            raise ConfigError(f"DemoConfig.threads must be ≥ 1, got {self.threads}")
        if not self.poll > 0 or not self.rollout_timeout > 0:
            raise ConfigError("DemoConfig.poll and rollout_timeout must be > 0")

    @property
    def store_url(self) -> str:
        return self.store if self.store is not None else str(self.out / "store")


@dataclass
class DemoReport:
    """What one demo run produced."""

    rows: list[StepRow]
    summary: Summary
    table: str
    summary_line: str
    plot_path: Path
    steps_json: Path
    trainer_pid: int
    engine_pid: int | None
    """The pid the engine process reported for itself."""
    daemon_returncode: int
    daemon_log: Path
    final_dir: Path | None
    """The rollout node's ``current`` model directory at the end."""
    greedy: str | None
    """The engine's greedy continuation of a fixed prompt at the last version."""
    seconds: float
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _looks_like_xcluster(keys: list[str]) -> bool:
    """HEAD present, or only version objects (a first publish that died before HEAD)."""
    from ..format import HEAD_KEY

    return HEAD_KEY in keys or all(k.startswith("versions/") for k in keys)


def _wipe(config: DemoConfig) -> None:
    """Empty the store, refusing anything that does not look like an xcluster store."""
    from ..store import open_store

    store = open_store(config.store_url)
    keys = store.list()
    if not keys:
        return
    if config.store is not None and not _looks_like_xcluster(keys):
        raise ConfigError(
            f"{config.store_url}: refusing to wipe: it holds {len(keys)} objects but no xcluster "
            "HEAD or versions/; point --store at an empty location or an xcluster store, or pass --keep")
    url = config.store_url
    local = "://" not in url or url.startswith("file://")
    if local:
        shutil.rmtree(url.removeprefix("file://"))
    else:
        for key in keys:
            store.delete(key)


def run_demo(config: DemoConfig = DemoConfig(), *, echo: Callable[[str], Any] = print) -> DemoReport:
    """Train, publish, follow in another process, verify; print as it goes; return the report."""
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run(config, echo)
    finally:
        torch.set_num_threads(threads_before)


def _run(config: DemoConfig, echo: Callable[[str], Any]) -> DemoReport:

    from .. import BackgroundPublisher, Publisher, PublisherConfig
    from ..codec.digest import model_digest
    from .hfmodel import PRESETS, build_model, non_weight_files
    from .report import StepRow, format_summary, format_table, plot_bytes, summarize
    from .rollout import RolloutNode
    from .train import PolicyGradientTrainer, TrainConfig, train_and_publish

    started = time.perf_counter()
    config.out.mkdir(parents=True, exist_ok=True)
    if not config.keep:
        _wipe(config)
    url = config.store_url
    hf_cfg = PRESETS[config.model]
    model, tokenizer = build_model(hf_cfg, seed=config.seed)
    model = model.float().train()  # fp32 master weights; bf16 is what ships
    files = non_weight_files(tokenizer, hf_cfg)
    publisher_cls = BackgroundPublisher if config.background else Publisher
    publisher = publisher_cls(url, files=files, config=PublisherConfig(checkpoint_every=config.checkpoint_every))
    first_version = publisher.version + 1
    node = RolloutNode(url, config.out, poll=config.poll, tamper_version=config.tamper_version)
    published = []
    failures: list[str] = []
    try:
        node.start()
        node.wait_ready()
        trainer = PolicyGradientTrainer(model, TrainConfig(steps=config.steps, lr=config.lr, seed=config.seed))
        n_params = sum(p.numel() for p in model.parameters())
        echo(f"xcluster demo: {n_params / 1e6:.1f}M-parameter Llama (fp32 master, bf16 shipped with config.json and "
             f"tokenizer), {config.steps} steps of Adam lr {config.lr:g}, checkpoint every {config.checkpoint_every}, "
             f"{'background' if config.background else 'synchronous'} publishing")
        echo(f"store: {url}")
        echo(f"rollout node: xcluster subscribe (pid {node.daemon.pid}) → {node.model_dir}/current → engine "
             f"(pid {node.engine.pid}, transformers); trainer pid {os.getpid()}")
        for p in train_and_publish(trainer, publisher, digest=model_digest):
            published.append(p)
            echo(f"  step {p.stats.step:>3}: loss {p.stats.loss:+.4f}  publish() returned in "
                 f"{1000 * p.blocked_seconds:.1f} ms")
        if config.background:
            publisher.flush()
        results = [_result_of(p.result) for p in published]
        last = max((r.version for r in results if r is not None), default=first_version)
        engine = node.wait_for_engine(last, timeout=config.rollout_timeout)
    except XclusterError as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        results = [_result_of(p.result) for p in published] if published else []
        from .rollout import read_engine_results
        engine = read_engine_results(node.results)
    finally:
        code = node.stop()
        publisher.close()

    rows = []
    for p, r in zip(published, results):
        if r is None:  # coalesced: a newer snapshot replaced it before it was published
            continue
        loaded = engine.loaded.get(r.version)
        rows.append(StepRow(
            step=p.stats.step, version=r.version, kind=r.kind, total_elements=r.total_elements,
            changed_elements=r.changed_elements, bytes_shipped=r.bytes_written, model_bytes=r.model_bytes,
            publish_seconds=r.publish_seconds, blocked_seconds=p.blocked_seconds,
            latency_seconds=None if loaded is None else loaded["unix"] - r.committed_unix,
            published_digest=r.model_digest, trainer_digest=p.trainer_digest,
            engine_digest=None if loaded is None else loaded["model_digest"]))
    for row in rows:
        if not row.skipped and not row.verified:
            failures.append(f"step {row.step}: version {row.version} digest mismatch: trainer {row.trainer_digest}, "
                            f"published {row.published_digest}, engine {row.engine_digest}")
    if rows and not rows[-1].verified:
        failures.append(f"the engine does not serve the last version ({rows[-1].version}) bit-exactly")
    if code != 0:
        failures.append(f"the daemon exited with status {code} on SIGTERM (see {node.daemon_log})")
    if engine.pid is None or engine.pid == os.getpid():
        failures.append(f"engine reported pid {engine.pid}, expected a process of its own")

    final_dir = node.model_dir / "current"
    greedy = engine.loaded[max(engine.loaded)]["greedy"] if engine.loaded else None
    summary = summarize(rows)
    table, summary_line = format_table(rows), format_summary(summary)
    plot_path = plot_bytes(rows, config.out / "bytes_per_step.png")
    steps_json = config.out / "steps.json"
    steps_json.write_text(json.dumps([row.to_json() for row in rows], indent=1) + "\n", encoding="utf-8")
    echo("")
    echo(table)
    echo("")
    echo(summary_line)
    blocked = sorted(p.blocked_seconds for p in published)
    pubs = sorted(r.publish_seconds for r in results if r is not None)
    lat = sorted(r.latency_seconds for r in rows if r.latency_seconds is not None)
    if blocked and pubs:
        echo(f"trainer blocked by publish(): median {1000 * blocked[len(blocked) // 2]:.1f} ms "
             f"(encode+upload+commit ran {1000 * pubs[len(pubs) // 2]:.0f} ms median in the background); "
             f"commit → engine serving: median {1000 * lat[len(lat) // 2]:.0f} ms" if lat else "")
    if greedy is not None:
        echo(f"engine (transformers) loaded {final_dir.resolve() if final_dir.exists() else final_dir}: "
             f"greedy continuation {greedy!r}")
    echo(f"plot: {plot_path}   per-step data: {steps_json}   daemon log: {node.daemon_log}")
    for f in failures:
        echo(f"FAILED: {f}")
    seconds = time.perf_counter() - started
    echo(f"{'ok' if not failures else 'FAILED'} in {seconds:.1f}s (training "
         f"{sum(p.stats.seconds for p in published):.1f}s)")
    return DemoReport(rows=rows, summary=summary, table=table, summary_line=summary_line,
                      plot_path=plot_path, steps_json=steps_json, trainer_pid=os.getpid(),
                      engine_pid=engine.pid, daemon_returncode=code, daemon_log=node.daemon_log,
                      final_dir=final_dir if final_dir.exists() else None, greedy=greedy,
                      seconds=seconds, failures=failures)


def _result_of(ret: Any):
    """A PublishResult from what ``publish()`` returned; None for a snapshot coalesced away."""
    if hasattr(ret, "result"):  # a background ticket
        if getattr(ret, "superseded", False):
            return None
        return ret.result()
    return ret


# --- CLI ------------------------------------------------------------------------------------

def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to an ``argparse`` subparsers object.

    The handler is stored as ``func`` in the parsed namespace: ``sys.exit(args.func(args))``.
    """
    d = DemoConfig.__dataclass_fields__
    p = subparsers.add_parser(
        "demo", help="train a small Llama and ship every step through the daemon to an engine, bit-exact",
        description="Train a small Llama on CPU; after every step publish its bf16 weights (in the "
                    "background) to a store; a separate daemon process applies each version, writes a "
                    "Hugging Face model directory and hands it to an engine process, which loads it with "
                    "transformers; every version the engine serves is proven bit-exact. Prints a "
                    "per-step table and writes a plot.")
    p.add_argument("--steps", type=int, default=d["steps"].default,
                   help="optimizer steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=d["lr"].default,
                   help="Adam learning rate (default %(default)g)")
    p.add_argument("--checkpoint-every", type=int, default=d["checkpoint_every"].default,
                   help="publisher checkpoint interval (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"].default,
                   help="random seed (default %(default)s)")
    p.add_argument("--out", type=Path, default=d["out"].default,
                   help="output directory for the plot and per-step data (default %(default)s)")
    p.add_argument("--store", default=None,
                   help="store URL (path, file://, s3://bucket/prefix, ...); default OUT/store")
    p.add_argument("--keep", action="store_true", help="do not wipe the store first")
    p.add_argument("--model", default=d["model"].default, choices=["demo", "tiny"],
                   help="model size: demo (~14M params) or tiny (for tests); default %(default)s")
    p.add_argument("--sync", action="store_true", help="publish synchronously (publish() blocks until committed)")
    p.add_argument("--threads", type=int, default=d["threads"].default,
                   help="torch CPU threads for training (default %(default)s)")
    p.add_argument("--tamper-version", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)
    return p


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        config = DemoConfig(steps=args.steps, lr=args.lr, checkpoint_every=args.checkpoint_every,
                            seed=args.seed, out=args.out, store=args.store, keep=args.keep,
                            model=args.model, threads=args.threads, background=not args.sync,
                            tamper_version=args.tamper_version)
        report = run_demo(config)
    except XclusterError as exc:
        print(f"xcluster demo: {type(exc).__name__}: {exc}")
        return 1
    return 0 if report.ok else 1
