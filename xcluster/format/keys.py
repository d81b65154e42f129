"""keys: see docs/FORMAT.md."""

from __future__ import annotations

import re
from typing import Any


from ..errors import (FormatError, UnsafeNameError)



KIND_TAG = "xcluster-kind"
"""Object tag on every chunk and manifest: ``keyframe`` or ``delta`` (bucket lifecycle rules match it)."""

_TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-\[\]]{0,511}")
_CHUNK_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,99}")
_HEX128 = re.compile(r"[0-9a-f]{32}")
_MANIFEST_NAME = re.compile(r"manifest-[a-z0-9]{1,32}\.json\.zst")
_ENCODING_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{0,63}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_NODE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_RUN_ID = re.compile(r"[a-z0-9]{1,32}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
WEIGHT_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json")
"""A non-weight file's name never ends so: model directories hold weights (``*.safetensors``) and
their index (``model.safetensors.index.json``) written from the tensors, never from ``files``."""


def check_tensor_name(name: Any) -> str:
    if not isinstance(name, str) or not _TENSOR_NAME.fullmatch(name) or ".." in name:
        raise UnsafeNameError(
            f"tensor name {name!r} is not allowed: names are 1-512 characters of [A-Za-z0-9_.:-[]], "
            "do not start with '.', '-' or ':' and never contain '..' or '/'")
    return name


def check_chunk_name(name: Any) -> str:
    if not isinstance(name, str) or not _CHUNK_NAME.fullmatch(name) or ".." in name:
        raise UnsafeNameError(f"chunk name {name!r} is not allowed: [a-z0-9][a-z0-9_.-]*, no '..', no '/'")
    return name


def check_manifest_name(name: Any) -> str:
    if not isinstance(name, str) or not _MANIFEST_NAME.fullmatch(name):
        raise UnsafeNameError(f"manifest name {name!r} is not allowed: manifest-<1-32 of a-z0-9>.json.zst")
    return name


def is_manifest_name(name: str) -> bool:
    """Whether an object name under ``versions/<V>/`` is a manifest's (of any attempt)."""
    return bool(_MANIFEST_NAME.fullmatch(name))


def check_file_name(name: Any) -> str:
    """Names of non-weight files (config.json, tokenizer.json, …): plain file names, never paths,
    never a weight file's (``*.safetensors``, ``*.safetensors.index.json``). The one rule: the
    publisher checks it before uploading, manifests are parsed with it, the model directory writer
    applies it."""
    if (not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or ".." in name
            or name.endswith(WEIGHT_FILE_SUFFIXES)):
        raise UnsafeNameError(
            f"file name {name!r} is not allowed: 1-128 characters of [A-Za-z0-9_.-], not starting with '.' "
            "or '-', no '..', and not a weight file name (*.safetensors, *.safetensors.index.json: the "
            "weights travel as tensors)")
    return name


def check_node_id(node_id: Any) -> str:
    if not isinstance(node_id, str) or not _NODE_ID.fullmatch(node_id) or ".." in node_id:
        raise UnsafeNameError(f"node id {node_id!r} is not allowed: 1-128 characters of [A-Za-z0-9_.-], "
                              "not starting with '.' or '-', no '..'")
    return node_id


def version_dir(version: int) -> str:
    return f"versions/{version:012d}"


def manifest_key(version: int, name: str) -> str:
    """Key of version ``version``'s manifest called ``name`` (``manifest-<attempt>.json.zst``, named
    by HEAD or by the successor's ``base_manifest``)."""
    return f"{version_dir(version)}/{check_manifest_name(name)}"


def manifest_name_for(attempt: str) -> str:
    """The manifest object of a commit attempt: ``manifest-<attempt>.json.zst`` (the canonical JSON
    as one zstd frame, FORMAT.md §3)."""
    return check_manifest_name(f"manifest-{attempt}.json.zst")


def file_key(xxh3: str) -> str:
    """Non-weight files are content-addressed: ``files/<xxh3_128>``; re-sent only when they change."""
    if not isinstance(xxh3, str) or not _HEX128.fullmatch(xxh3):
        raise UnsafeNameError(f"file hash {xxh3!r} is not 32 lower-case hex digits")
    return f"files/{xxh3}"


INFLIGHT_PREFIX = "inflight/"


def inflight_key(attempt: str) -> str:
    """``inflight/<attempt>``: written by a publisher while it uploads a version's objects, kept
    fresh while it does, removed once done; retention keeps the attempt's objects while it is young."""
    if not isinstance(attempt, str) or not _RUN_ID.fullmatch(attempt):
        raise UnsafeNameError(f"attempt id {attempt!r} must be 1-32 of [a-z0-9]")
    return f"{INFLIGHT_PREFIX}{attempt}"


def lease_key(node_id: str) -> str:
    return f"leases/{check_node_id(node_id)}.json"


def chunk_key(version: int, name: str) -> str:
    return f"{version_dir(version)}/{check_chunk_name(name)}"


CHECKPOINT_PREFIX = "checkpoints/"


def checkpoint_dir(version: int) -> str:
    return f"checkpoints/{version:012d}"


def checkpoint_key(version: int, name: str) -> str:
    """Key of a checkpoint manifest of ``version`` (``manifest-<attempt>.json.zst``)."""
    return f"{checkpoint_dir(version)}/{check_manifest_name(name)}"


HEAD_KEY = "HEAD"


def check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise FormatError(f"run id {run_id!r} must be 1-32 characters of [a-z0-9]")
    return run_id


