"""Fixtures for integration tests that need real servers."""

# --- S3 servers (SeaweedFS, moto) ---------------------------------------------------------------
# Session-scoped real servers on 127.0.0.1, a shared-credentials file with one profile per
# server (the standard AWS chain is how S3Store gets credentials), and ``s3_server``,
# parametrized over both.
from __future__ import annotations

import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest

from tests.support.moto import start_moto_server
from tests.support.seaweed import start_seaweedfs


@dataclass(frozen=True)
class S3Server:
    name: str
    endpoint: str
    profile: str
    bucket: str
    checks_signatures: bool

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.endpoint)
        return parts.hostname, parts.port

    def config(self, *, endpoint: str | None = None, **overrides):
        from xcluster.store.s3.config import MiB, S3Config

        kw = dict(endpoint_url=endpoint or self.endpoint, profile=self.profile, region="us-east-1",
                  addressing_style="path", part_size=5 * MiB, multipart_threshold=5 * MiB,
                  max_concurrency=4)
        kw.update(overrides)
        return S3Config(**kw)

    def store(self, *, endpoint: str | None = None, sleep=None, **overrides):
        from xcluster.store.s3.store import S3Store

        extra = {"sleep": sleep} if sleep is not None else {}
        return S3Store.from_url(f"s3://{self.bucket}/t-{uuid.uuid4().hex[:12]}",
                                config=self.config(endpoint=endpoint, **overrides), **extra)

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.session.Session(profile_name=self.profile).client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}))


@pytest.fixture(scope="session")
def aws_profiles(tmp_path_factory):
    """A shared credentials file with profiles ``xc-seaweedfs``, ``xc-moto`` and ``xc-bad``."""
    from tests.support.moto import TEST_CREDENTIALS
    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY

    root = tmp_path_factory.mktemp("aws")
    (root / "credentials").write_text(
        f"[xc-seaweedfs]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
        f"[xc-moto]\naws_access_key_id = {TEST_CREDENTIALS['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {TEST_CREDENTIALS['AWS_SECRET_ACCESS_KEY']}\n"
        f"[xc-bad]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = wrong-secret\n")
    (root / "config").write_text("")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(root / "credentials"))
        mp.setenv("AWS_CONFIG_FILE", str(root / "config"))
        yield root


def _with_bucket(server: S3Server) -> S3Server:
    server.client().create_bucket(Bucket=server.bucket)
    return server


@pytest.fixture(scope="session")
def seaweedfs(aws_profiles):
    with start_seaweedfs() as sw:
        yield _with_bucket(S3Server("seaweedfs", sw.endpoint, "xc-seaweedfs", "xc-test", True))


@pytest.fixture(scope="session")
def moto_s3(aws_profiles):
    with start_moto_server() as endpoint:
        yield _with_bucket(S3Server("moto", endpoint, "xc-moto", "xc-test", False))


@pytest.fixture(params=["seaweedfs", "moto"])
def s3_server(request) -> S3Server:
    return request.getfixturevalue("moto_s3" if request.param == "moto" else request.param)
