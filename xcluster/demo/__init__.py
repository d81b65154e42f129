"""``xcluster demo``: the whole product on one CPU machine, in well under two minutes.

A small transformer trains for a few policy-gradient steps; after each step the
:class:`~xcluster.Publisher` ships its bf16 weights to a store. A follower in a separate
process subscribes, applies every version and hashes the weights it holds; the trainer
compares that digest with the one it published. The demo prints a per-step table, a summary
and writes a plot of bytes per step.

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
    keyframe_every: int = 10
    """Publisher keyframe interval; the default 10 makes 20 steps cross a keyframe."""
    seed: int = 0
    """Seeds the model init, prompts, sampling and rewards."""
    out: Path = Path("demo-out")
    """Directory for the plot, the per-step JSON and (by default) the store."""
    store: str | None = None
    """Store URL (local path, ``file://``, ``s3://``, any fsspec URL); default ``<out>/store``."""
    keep: bool = False
    """Keep what is already in the store instead of wiping it first."""
    model: str = "demo"
    """Model preset from :data:`xcluster.demo.model.PRESETS` (``demo`` ~9M params, ``tiny``)."""
    poll: float = 0.02
    """Follower poll interval in seconds."""
    threads: int = 1
    """Torch CPU threads for training. One by default: the follower runs beside the trainer,
    and on a small, busy machine two spinning OpenMP threads per process make each step
    10-20× slower instead of faster."""
    follower_timeout: float = 60.0
    """The follower gives up after this many seconds without a new version."""
    tamper_version: int | None = None
    """Test hook: the follower reports a digest of its weights with one bit flipped at this
    version, so the demo must show ✗ there and fail."""

    def __post_init__(self) -> None:
        from .model import PRESETS

        if self.steps < 1:
            raise ConfigError(f"DemoConfig.steps must be ≥ 1, got {self.steps}")
        if self.keyframe_every < 1:
            raise ConfigError(f"DemoConfig.keyframe_every must be ≥ 1, got {self.keyframe_every}")
        if not self.lr > 0:
            raise ConfigError(f"DemoConfig.lr must be > 0, got {self.lr}")
        if self.model not in PRESETS:
            raise ConfigError(f"DemoConfig.model must be one of {sorted(PRESETS)}, got {self.model!r}")
        if self.threads < 1:
            raise ConfigError(f"DemoConfig.threads must be ≥ 1, got {self.threads}")
        if not self.poll > 0 or not self.follower_timeout > 0:
            raise ConfigError("DemoConfig.poll and follower_timeout must be > 0")

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
    follower_pid: int | None
    """The pid the follower process reported for itself."""
    follower_returncode: int
    follower_output: str
    follower_error: str | None
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
    from .. import Publisher, PublisherConfig
    from ..digest import model_digest
    from .follow import Follower, read_results
    from .model import PRESETS, build_model
    from .report import StepRow, format_summary, format_table, plot_bytes, summarize
    from .train import PolicyGradientTrainer, TrainConfig, train_and_publish

    started = time.perf_counter()
    config.out.mkdir(parents=True, exist_ok=True)
    if not config.keep:
        _wipe(config)
    url = config.store_url
    publisher = Publisher(url, config=PublisherConfig(keyframe_every=config.keyframe_every))
    first_version = publisher.version + 1  # 0 on an empty store
    last_version = first_version + config.steps - 1

    follower = Follower(url, until_version=last_version, results=config.out / "follower.jsonl",
                        poll=config.poll, timeout=config.follower_timeout,
                        tamper_version=config.tamper_version)
    try:
        model = build_model(PRESETS[config.model], seed=config.seed)
        trainer = PolicyGradientTrainer(model, TrainConfig(steps=config.steps, lr=config.lr,
                                                           seed=config.seed))
        echo(f"xcluster demo: {model.num_parameters() / 1e6:.1f}M-parameter transformer "
             f"(fp32 master, bf16 shipped), {config.steps} steps of Adam lr {config.lr:g}, "
             f"keyframe every {config.keyframe_every}")
        echo(f"store: {url}")
        follower.wait_ready(timeout=120)
        echo(f"follower: pid {follower.pid} (trainer pid {os.getpid()}), following versions "
             f"{first_version}..{last_version}")
        published = []
        for p in train_and_publish(trainer, publisher, digest=model_digest):
            r = p.result
            published.append(p)
            echo(f"  step {p.stats.step:>3}: loss {p.stats.loss:+.4f}  published v{r.version:<4} "
                 f"{r.kind:<8} {r.bytes_written:>10,} B in {1000 * r.publish_seconds:.0f} ms")
        code, output = follower.join(timeout=config.follower_timeout + 30)
    finally:
        follower.stop()

    results = read_results(follower.results)
    rows = []
    for p in published:
        r = p.result
        applied = results.applied.get(r.version)
        rows.append(StepRow(
            step=p.stats.step, version=r.version, kind=r.kind, total_elements=r.total_elements,
            changed_elements=r.changed_elements, bytes_shipped=r.bytes_written,
            model_bytes=r.model_bytes, publish_seconds=r.publish_seconds,
            latency_seconds=None if applied is None else applied["applied_unix"] - r.committed_unix,
            published_digest=r.model_digest, trainer_digest=p.trainer_digest,
            follower_digest=None if applied is None else applied["model_digest"]))

    failures = []
    for row in rows:
        if row.follower_digest is None:
            failures.append(f"step {row.step}: version {row.version} was never applied by the follower")
        elif not row.verified:
            failures.append(
                f"step {row.step}: version {row.version} digest mismatch: trainer {row.trainer_digest}, "
                f"published {row.published_digest}, follower {row.follower_digest}")
    if code != 0:
        failures.append(f"follower exited with status {code}: {results.error or output.strip()}")
    if results.pid is None or results.pid == os.getpid() or results.pid != follower.pid:
        failures.append(f"follower reported pid {results.pid}, expected its own process {follower.pid}")

    summary = summarize(rows)
    table, summary_line = format_table(rows), format_summary(summary)
    plot_path = plot_bytes(rows, config.out / "bytes_per_step.png")
    steps_json = config.out / "steps.json"
    steps_json.write_text(json.dumps([row.to_json() for row in rows], indent=1) + "\n", encoding="utf-8")
    echo("")
    echo(table)
    echo("")
    echo(summary_line)
    echo(f"plot: {plot_path}   per-step data: {steps_json}")
    for f in failures:
        echo(f"FAILED: {f}")
    seconds = time.perf_counter() - started
    echo(f"{'ok' if not failures else 'FAILED'} in {seconds:.1f}s (training "
         f"{sum(p.stats.seconds for p in published):.1f}s, publishing "
         f"{sum(p.result.publish_seconds for p in published):.1f}s)")
    return DemoReport(rows=rows, summary=summary, table=table, summary_line=summary_line,
                      plot_path=plot_path, steps_json=steps_json, trainer_pid=os.getpid(),
                      follower_pid=results.pid, follower_returncode=code, follower_output=output,
                      follower_error=results.error, seconds=seconds, failures=failures)


# --- CLI ------------------------------------------------------------------------------------

def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to an ``argparse`` subparsers object.

    The handler is stored as ``func`` in the parsed namespace: ``sys.exit(args.func(args))``.
    """
    d = DemoConfig.__dataclass_fields__
    p = subparsers.add_parser(
        "demo", help="train a small model and ship every step to a follower process, bit-exact",
        description="Train a small transformer on CPU; after every step publish its bf16 weights "
                    "to a store, follow the store from a separate process, and prove every "
                    "version bit-exact there. Prints a per-step table and writes a plot.")
    p.add_argument("--steps", type=int, default=d["steps"].default,
                   help="optimizer steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=d["lr"].default,
                   help="Adam learning rate (default %(default)g)")
    p.add_argument("--keyframe-every", type=int, default=d["keyframe_every"].default,
                   help="publisher keyframe interval (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"].default,
                   help="random seed (default %(default)s)")
    p.add_argument("--out", type=Path, default=d["out"].default,
                   help="output directory for the plot and per-step data (default %(default)s)")
    p.add_argument("--store", default=None,
                   help="store URL (path, file://, s3://bucket/prefix, ...); default OUT/store")
    p.add_argument("--keep", action="store_true", help="do not wipe the store first")
    p.add_argument("--model", default=d["model"].default, choices=["demo", "tiny"],
                   help="model size: demo (~9M params) or tiny (for tests); default %(default)s")
    p.add_argument("--threads", type=int, default=d["threads"].default,
                   help="torch CPU threads for training (default %(default)s)")
    p.add_argument("--tamper-version", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)
    return p


def _cmd_demo(args: argparse.Namespace) -> int:
    try:
        config = DemoConfig(steps=args.steps, lr=args.lr, keyframe_every=args.keyframe_every,
                            seed=args.seed, out=args.out, store=args.store, keep=args.keep,
                            model=args.model, threads=args.threads,
                            tamper_version=args.tamper_version)
        report = run_demo(config)
    except XclusterError as exc:
        print(f"xcluster demo: {type(exc).__name__}: {exc}")
        return 1
    return 0 if report.ok else 1
