"""Ed25519 signatures over manifests and HEAD (``cryptography`` imported lazily, torch-free).

A publisher holding a private key signs each manifest and each HEAD it writes; a subscriber
configured with trusted public keys accepts only objects signed by one of them. What a signature
covers and how keys are named is in docs/FORMAT.md §Signatures; what it protects against is in
docs/SECURITY.md.

Keys come from files or the environment, never from the bucket:

- private: ``PublisherConfig(signing_key=PATH)``, else ``$XCLUSTER_SIGNING_KEY`` (the PEM text)
  or ``$XCLUSTER_SIGNING_KEY_FILE`` (a path);
- trusted public keys: ``SubscriberConfig(trusted_keys=(PATH, ...))`` / ``--trust PATH``
  (several for a rotation), else ``$XCLUSTER_TRUSTED_KEYS`` (PEM text, one or more keys) or
  ``$XCLUSTER_TRUSTED_KEY_FILES`` (paths separated by ``os.pathsep``).

Keys are PEM: PKCS#8 for the private key, SubjectPublicKeyInfo for public keys (what
``xcluster keygen`` writes, and what ``openssl genpkey -algorithm ed25519`` produces).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..errors import ConfigError, SignatureError
from ..format import Head, Manifest, Signature

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ENV_SIGNING_KEY = "XCLUSTER_SIGNING_KEY"
ENV_SIGNING_KEY_FILE = "XCLUSTER_SIGNING_KEY_FILE"
ENV_TRUSTED_KEYS = "XCLUSTER_TRUSTED_KEYS"
ENV_TRUSTED_KEY_FILES = "XCLUSTER_TRUSTED_KEY_FILES"
MAX_KEY_FILE_BYTES = 64 << 10
_PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z ]+)-----.+?-----END \1-----", re.S)

T = TypeVar("T", Manifest, Head)


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ConfigError("signing needs the 'cryptography' package") from exc
    return ed25519, serialization, InvalidSignature


def key_id(public_key: Ed25519PublicKey) -> str:
    """First 16 hex digits of SHA-256 over the raw 32-byte public key."""
    _, serialization, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _read_key_file(path: str | os.PathLike) -> bytes:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_KEY_FILE_BYTES:
            raise ConfigError(f"{p}: {p.stat().st_size} bytes is too large for a key file")
        return p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {p}: {exc}") from exc


class Signer:
    """Signs manifests and HEADs with one Ed25519 private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    @classmethod
    def from_pem(cls, data: bytes, *, where: str = "private key") -> Signer:
        ed25519, serialization, _ = _crypto()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(f"{where}: a {type(key).__name__}; xcluster signs with Ed25519 keys only")
        return cls(key)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Signer:
        return cls.from_pem(_read_key_file(path), where=str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Signer | None:
        """The key in ``$XCLUSTER_SIGNING_KEY`` / ``$XCLUSTER_SIGNING_KEY_FILE``; None when neither is set."""
        if environ.get(ENV_SIGNING_KEY):
            return cls.from_pem(environ[ENV_SIGNING_KEY].encode(), where=f"${ENV_SIGNING_KEY}")
        if environ.get(ENV_SIGNING_KEY_FILE):
            return cls.from_file(environ[ENV_SIGNING_KEY_FILE])
        return None

    def sign(self, obj: T) -> T:
        """``obj`` (a Manifest or a Head) with its signature set."""
        unsigned = replace(obj, signature=None, signed_payload=None)
        value = self._key.sign(unsigned.payload())
        return replace(unsigned, signature=Signature("ed25519", self.key_id, value))

    def public_pem(self) -> bytes:
        _, serialization, _ = _crypto()
        return self._key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)


class Verifier:
    """Checks that HEADs and manifests are signed by one of a set of trusted public keys."""

    def __init__(self, public_keys: Iterable[Ed25519PublicKey]) -> None:
        self.keys = {key_id(k): k for k in public_keys}
        if not self.keys:
            raise ConfigError("a Verifier needs at least one trusted public key")

    @classmethod
    def from_pem(cls, data: bytes, *, where: str = "trusted keys") -> Verifier:
        """Every PEM public key in ``data`` (one or more blocks)."""
        ed25519, serialization, _ = _crypto()
        keys = []
        blocks = [m.group(0) for m in _PEM_BLOCK.finditer(data)]
        if not blocks:
            raise ConfigError(f"{where}: no PEM public key found")
        for block in blocks:
            try:
                key = serialization.load_pem_public_key(block)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{where}: not a PEM public key ({exc}); pass the .pub file, not the "
                                  "private key") from None
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise ConfigError(f"{where}: a {type(key).__name__}; xcluster verifies Ed25519 keys only")
            keys.append(key)
        return cls(keys)

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike]) -> Verifier:
        keys = []
        for p in paths:
            keys.extend(cls.from_pem(_read_key_file(p), where=str(p)).keys.values())
        return cls(keys)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Verifier | None:
        """The keys in ``$XCLUSTER_TRUSTED_KEYS`` / ``$XCLUSTER_TRUSTED_KEY_FILES``; None when neither is set."""
        if environ.get(ENV_TRUSTED_KEYS):
            return cls.from_pem(environ[ENV_TRUSTED_KEYS].encode(), where=f"${ENV_TRUSTED_KEYS}")
        if environ.get(ENV_TRUSTED_KEY_FILES):
            return cls.from_files(p for p in environ[ENV_TRUSTED_KEY_FILES].split(os.pathsep) if p)
        return None

    def verify(self, obj: Manifest | Head, *, where: str) -> str:
        """Raise :class:`SignatureError` unless ``obj`` carries a valid signature by a trusted
        key; returns that key's id."""
        _, _, invalid = _crypto()
        sig = obj.signature
        if sig is None:
            raise SignatureError(f"{where} is not signed, and this reader trusts only versions signed by "
                                 f"{self._names()}")
        key = self.keys.get(sig.key_id)
        if key is None:
            raise SignatureError(f"{where} is signed by key {sig.key_id}, which is not trusted here "
                                 f"(trusted: {self._names()})")
        payload = obj.signed_payload if obj.signed_payload is not None else obj.payload()
        try:
            key.verify(sig.value, payload)
        except invalid:
            raise SignatureError(f"{where}: the signature by key {sig.key_id} does not verify: the object was "
                                 "altered after signing, or forged") from None
        return sig.key_id

    def _names(self) -> str:
        return ", ".join(sorted(self.keys))


def load_verifier(paths: Iterable[str | os.PathLike] = ()) -> Verifier | None:
    """Trusted keys from ``paths`` when given, else from the environment, else None (no checks)."""
    paths = list(paths)
    return Verifier.from_files(paths) if paths else Verifier.from_env()


def load_signer(path: str | os.PathLike | None = None) -> Signer | None:
    """The signing key at ``path`` when given, else from the environment, else None (unsigned)."""
    return Signer.from_file(path) if path is not None else Signer.from_env()


def generate_keypair(path: str | os.PathLike) -> tuple[Path, Path, str]:
    """Write a new Ed25519 private key to ``path`` (PEM, mode 0600, never overwriting) and its
    public key to ``path.pub``; returns (private path, public path, key id)."""
    ed25519, serialization, _ = _crypto()
    priv_path, pub_path = Path(path), Path(str(path) + ".pub")
    for p in (priv_path, pub_path):
        if p.exists():
            raise ConfigError(f"{p} exists; keygen never overwrites a key")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    signer = Signer(key)
    pub_path.write_bytes(signer.public_pem())
    return priv_path, pub_path, signer.key_id


__all__ = ["Signer", "Verifier", "generate_keypair", "key_id", "load_signer", "load_verifier"]
