"""What the demo shows: a per-step table, a summary line and a bytes-per-step plot.

Pure formatting over :class:`StepRow`; matplotlib is imported only by :func:`plot_bytes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class StepRow:
    """One published version as the trainer, the publisher and the engine saw it."""

    step: int
    version: int
    kind: str
    """``"keyframe"`` or ``"delta"``."""
    total_elements: int
    changed_elements: int
    bytes_shipped: int
    """Everything written to the store for this version (chunks and manifest)."""
    model_bytes: int
    """Size of the bf16 state dict: what shipping it whole would cost."""
    publish_seconds: float
    """Encode + upload + commit of this version (in the background unless publishing is synchronous)."""
    blocked_seconds: float
    """How long ``publish()`` held up the training loop."""
    latency_seconds: float | None
    """Publisher commit → the engine serving it; ``None`` if the engine never loaded it."""
    published_digest: str
    trainer_digest: str
    engine_digest: str | None
    """What the engine's loaded weights hash to; ``None`` if it never loaded this version (the
    daemon had a newer one by then and handed over only the newest)."""

    @property
    def verified(self) -> bool:
        """The engine's weights hash to what the trainer holds and the publisher committed."""
        return self.engine_digest is not None and (
            self.engine_digest == self.published_digest == self.trainer_digest)

    @property
    def skipped(self) -> bool:
        return self.engine_digest is None

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    @property
    def ratio(self) -> float:
        """How many times smaller than the full bf16 weights this version's bytes are."""
        return self.model_bytes / self.bytes_shipped if self.bytes_shipped else math.inf

    @property
    def bits_per_changed(self) -> float | None:
        """Bits shipped per changed element (per element for a keyframe, which ships them all)."""
        n = self.total_elements if self.kind == "keyframe" else self.changed_elements
        return 8 * self.bytes_shipped / n if n else None

    def to_json(self) -> dict:
        return asdict(self) | {"verified": self.verified}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_COLUMNS = ("step", "version", "kind", "changed", "bytes shipped", "vs full bf16",
            "bits/changed", "blocked ms", "publish ms", "commit→engine ms", "verified")


def _cells(row: StepRow) -> tuple[str, ...]:
    bits = row.bits_per_changed
    return (
        str(row.step),
        str(row.version),
        row.kind,
        f"{100 * row.changed_fraction:.3f}%",
        human_bytes(row.bytes_shipped),
        f"{row.ratio:.1f}× smaller",
        "—" if bits is None else f"{bits:.2f}",
        f"{1000 * row.blocked_seconds:.1f}",
        f"{1000 * row.publish_seconds:.0f}",
        "—" if row.latency_seconds is None else f"{1000 * row.latency_seconds:.0f}",
        "✓" if row.verified else ("skipped (newer one first)" if row.skipped else "✗"),
    )


def format_table(rows: Sequence[StepRow]) -> str:
    """A fixed-width table, one line per step; text columns left-aligned, numbers right."""
    body = [_cells(r) for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c)
              for i, c in enumerate(_COLUMNS)]
    left = {"kind", "verified"}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if name in left else c.rjust(w)
                         for c, w, name in zip(cells, widths, _COLUMNS)).rstrip()

    out = [line(_COLUMNS), line(["-" * w for w in widths])]
    out.extend(line(b) for b in body)
    return "\n".join(out)


@dataclass(frozen=True, slots=True)
class Summary:
    versions: int
    verified: int
    loaded: int
    """Versions the engine loaded (the rest were overtaken by a newer one before the hand-off)."""
    bytes_shipped: int
    bytes_full: int
    """What shipping the full bf16 weights at every step would have cost."""
    delta_bits_per_changed: float | None
    """Over all deltas: total delta bits / total changed elements."""

    @property
    def ratio(self) -> float:
        return self.bytes_full / self.bytes_shipped if self.bytes_shipped else math.inf


def summarize(rows: Sequence[StepRow]) -> Summary:
    deltas = [r for r in rows if r.kind == "delta"]
    changed = sum(r.changed_elements for r in deltas)
    return Summary(
        versions=len(rows),
        verified=sum(r.verified for r in rows),
        loaded=sum(not r.skipped for r in rows),
        bytes_shipped=sum(r.bytes_shipped for r in rows),
        bytes_full=sum(r.model_bytes for r in rows),
        delta_bits_per_changed=8 * sum(r.bytes_shipped for r in deltas) / changed if changed else None,
    )


def format_summary(s: Summary) -> str:
    bits = ("no deltas" if s.delta_bits_per_changed is None
            else f"deltas average {s.delta_bits_per_changed:.2f} bits per changed element")
    return (f"{s.versions} versions: {human_bytes(s.bytes_shipped)} shipped vs "
            f"{human_bytes(s.bytes_full)} for full bf16 every step ({s.ratio:.1f}× less); "
            f"{bits}; {s.verified}/{s.loaded} versions the engine loaded verified bit-exact")


def plot_bytes(rows: Sequence[StepRow], path: str | Path) -> Path:
    """Bar chart of bytes shipped per step (log scale), keyframes and deltas in two colours,
    with the full bf16 size as a dashed line. Written as PNG with the Agg backend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    fig = Figure(figsize=(9, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = {"keyframe": "#d62728", "delta": "#1f77b4"}
    ax.bar([r.step for r in rows], [r.bytes_shipped for r in rows],
           color=[colours.get(r.kind, "#7f7f7f") for r in rows], width=0.8)
    handles = [Patch(color=colours["keyframe"], label="keyframe"),
               Patch(color=colours["delta"], label="delta")]
    if rows:
        full = max(r.model_bytes for r in rows)
        handles.append(ax.axhline(full, color="black", linestyle="--", linewidth=1,
                                  label=f"full bf16 ({human_bytes(full)})"))
    ax.set_yscale("log")
    positive = [r.bytes_shipped for r in rows if r.bytes_shipped > 0]
    if positive:  # room below the smallest bar, so every bar has visible height
        ax.set_ylim(bottom=min(positive) / 4)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("bytes shipped to the store")
    ax.set_title("xcluster: bytes published per step")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", bbox_inches="tight")
    return path
