"""The Terraform module, applied for real: one `terraform apply` of terraform/examples/basic (replica
on) against a moto server, checked with boto3, then `terraform destroy`.

Also: `terraform fmt`, `terraform validate` of the example, the module's own plan-only
`terraform test` (input validation, preconditions), and a check that moto, with IAM enforcement
switched on, refuses a subscriber's write to the weights while allowing its read and its lease.

Only a missing `terraform` binary skips these tests. With /opt/tf-plugins present (a local mirror
of the AWS provider) init runs offline; otherwise init downloads the provider from the registry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.moto import TEST_CREDENTIALS, start_moto_server

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not on PATH"),
]

TERRAFORM_DIR = Path(__file__).resolve().parents[2] / "terraform"
PLUGIN_DIR = Path("/opt/tf-plugins")

ACCOUNT = "123456789012"  # moto's default account
REGION = "us-east-1"
REPLICA_REGION = "us-west-2"
BUCKET = "xcluster-tf-test"
REPLICA_BUCKET = f"{BUCKET}-replica"
PREFIX = "runs/exp1"
NAME = "xc-tf-test"
DELTA_DAYS = 5
KEYFRAME_DAYS = 40

TRAINER_ARN = f"arn:aws:iam::{ACCOUNT}:role/trainer"
ROLLOUT_ARN = f"arn:aws:iam::{ACCOUNT}:role/rollout"
FOREIGN_READER_ARN = "arn:aws:iam::210987654321:role/rollout"
OIDC_URL = "oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
OIDC_ARN = f"arn:aws:iam::{ACCOUNT}:oidc-provider/{OIDC_URL}"

TFVARS = {
    "region": REGION,
    "replica_region": REPLICA_REGION,
    "bucket_name": BUCKET,
    "prefix": PREFIX,
    "name": NAME,
    "force_destroy": True,
    "replica_enabled": True,
    "delta_retention_days": DELTA_DAYS,
    "keyframe_retention_days": KEYFRAME_DAYS,
    "publisher_principal_arns": [TRAINER_ARN],
    "subscriber_principal_arns": [ROLLOUT_ARN],
    "subscriber_oidc": [{
        "provider_arn": OIDC_ARN,
        "provider_url": f"https://{OIDC_URL}",
        "service_accounts": [{"namespace": "rollout", "name": "vllm"}],
    }],
    "cross_account_reader_arns": [FOREIGN_READER_ARN],
    "cross_account_reader_access": "both",
}


# --------------------------------------------------------------------------------------------------
# Running terraform
# --------------------------------------------------------------------------------------------------

def _terraform_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_PROFILE", "AWS_DEFAULT_PROFILE"))}
    env.update(TEST_CREDENTIALS)
    env.update({"TF_IN_AUTOMATION": "1", "TF_INPUT": "0", "CHECKPOINT_DISABLE": "1"})
    return env


def terraform(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run terraform; on failure, fail the test with the command and the end of its output."""
    proc = subprocess.run(
        ["terraform", *args, "-no-color"], cwd=cwd, env=_terraform_env(),
        capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"terraform {' '.join(args)} (in {cwd}) exited {proc.returncode}:\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}", pytrace=False)
    return proc


def terraform_init(cwd: Path) -> None:
    args = ["init", "-input=false"]
    if PLUGIN_DIR.is_dir():
        args.append(f"-plugin-dir={PLUGIN_DIR}")
    terraform(*args, cwd=cwd)


@pytest.fixture(scope="session")
def tf_tree(tmp_path_factory) -> Path:
    """A private copy of terraform/, so .terraform/ and state never land in the repository."""
    dest = tmp_path_factory.mktemp("tf") / "terraform"
    shutil.copytree(TERRAFORM_DIR, dest, ignore=shutil.ignore_patterns(
        ".terraform", "*.tfstate", "*.tfstate.*", ".terraform.lock.hcl", "*.tfvars.json"))
    return dest


@pytest.fixture(scope="session")
def example_dir(tf_tree) -> Path:
    cwd = tf_tree / "examples" / "basic"
    terraform_init(cwd)
    return cwd


# --------------------------------------------------------------------------------------------------
# The one apply
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Deployment:
    endpoint: str
    outputs: dict
    planned: dict  # resource address -> attribute values Terraform planned to send

    def client(self, service: str, *, region: str = REGION, credentials: dict | None = None):
        import boto3
        from botocore.config import Config

        creds = credentials or {
            "aws_access_key_id": TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        }
        return boto3.client(service, endpoint_url=self.endpoint, region_name=region,
                            config=Config(s3={"addressing_style": "path"}), **creds)


@pytest.fixture(scope="session")
def deployed(example_dir) -> Iterator[Deployment]:
    """`terraform apply` of the example (replica on) against a fresh moto server; destroy after."""
    with ExitStack() as stack:
        endpoint = stack.enter_context(start_moto_server())
        (example_dir / "test.tfvars.json").write_text(json.dumps({**TFVARS, "endpoint": endpoint}))
        var_file = "-var-file=test.tfvars.json"
        terraform("plan", "-input=false", var_file, "-out=tfplan", cwd=example_dir)
        plan = json.loads(terraform("show", "-json", "tfplan", cwd=example_dir).stdout)
        terraform("apply", "-input=false", "tfplan", cwd=example_dir, timeout=480)
        raw = json.loads(terraform("output", "-json", cwd=example_dir).stdout)
        yield Deployment(endpoint=endpoint, outputs={k: v["value"] for k, v in raw.items()},
                         planned=dict(_resources(plan["planned_values"]["root_module"])))
        # -refresh=false: the state was just written by this session; refreshing 23 resources on moto
        # costs half a minute and changes nothing.
        terraform("destroy", "-auto-approve", "-input=false", "-refresh=false", var_file,
                  cwd=example_dir, timeout=300)
        buckets = {b["Name"] for b in Deployment(endpoint, {}, {}).client("s3").list_buckets()["Buckets"]}
        assert not buckets & {BUCKET, REPLICA_BUCKET}, f"destroy left buckets behind: {buckets}"


def _resources(module: dict) -> Iterator[tuple[str, dict]]:
    for resource in module.get("resources", []):
        yield resource["address"], resource["values"]
    for child in module.get("child_modules", []):
        yield from _resources(child)


def policy_of_role(iam, role_name: str) -> dict:
    """The (single) managed policy document attached to a role."""
    attached = iam.list_attached_role_policies(RoleName=role_name)["AttachedPolicies"]
    assert len(attached) == 1, attached
    arn = attached[0]["PolicyArn"]
    version = iam.get_policy(PolicyArn=arn)["Policy"]["DefaultVersionId"]
    doc = iam.get_policy_version(PolicyArn=arn, VersionId=version)["PolicyVersion"]["Document"]
    return json.loads(doc) if isinstance(doc, str) else doc


def as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def grants(policy: dict) -> list[tuple[str, str, dict]]:
    """(action, resource, condition) for every Allow in a policy document."""
    out = []
    for st in as_list(policy["Statement"]):
        assert st["Effect"] == "Allow", st
        for action in as_list(st["Action"]):
            for resource in as_list(st["Resource"]):
                out.append((action, resource, st.get("Condition", {})))
    return out


BUCKET_ARN = f"arn:aws:s3:::{BUCKET}"
REPLICA_ARN = f"arn:aws:s3:::{REPLICA_BUCKET}"


# --------------------------------------------------------------------------------------------------
# Static checks
# --------------------------------------------------------------------------------------------------

def test_terraform_files_are_formatted():
    proc = subprocess.run(["terraform", "fmt", "-check", "-recursive", "-diff", "-no-color", str(TERRAFORM_DIR)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"terraform fmt would change:\n{proc.stdout}{proc.stderr}"


def test_example_validates(example_dir):
    assert "Success" in terraform("validate", cwd=example_dir).stdout


def test_module_validation_rules_and_preconditions(tf_tree):
    """modules/xcluster/tests/*.tftest.hcl: plan-only runs with mocked providers. (`terraform
    validate` cannot run on the module alone: it needs the aws.replica configuration alias.)"""
    cwd = tf_tree / "modules" / "xcluster"
    terraform_init(cwd)
    out = terraform("test", cwd=cwd, timeout=300).stdout
    assert "0 failed" in out and " passed" in out, out
    assert 'run "replica_needs_versioning"... pass' in out, out


# --------------------------------------------------------------------------------------------------
# What the apply created
# --------------------------------------------------------------------------------------------------

def test_outputs_fill_xcluster_config(deployed):
    out = deployed.outputs
    assert out["xcluster_url"] == f"s3://{BUCKET}/{PREFIX}"
    assert (out["bucket"], out["prefix"], out["region"]) == (BUCKET, PREFIX, REGION)
    assert out["replica_url"] == f"s3://{REPLICA_BUCKET}/{PREFIX}"
    assert out["replica_region"] == REPLICA_REGION
    iam = deployed.client("iam")
    for role in ("publisher", "subscriber"):
        arn = out[f"{role}_role_arn"]
        assert arn == f"arn:aws:iam::{ACCOUNT}:role/{NAME}-{role}"
        assert iam.get_role(RoleName=f"{NAME}-{role}")["Role"]["Arn"] == arn


@pytest.mark.parametrize("bucket,region", [(BUCKET, REGION), (REPLICA_BUCKET, REPLICA_REGION)])
def test_bucket_is_hardened(deployed, bucket, region):
    s3 = deployed.client("s3", region=region)
    location = s3.get_bucket_location(Bucket=bucket)["LocationConstraint"] or "us-east-1"
    assert location == region

    rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
    assert [r["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] for r in rules] == ["AES256"]

    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert block == {"BlockPublicAcls": True, "IgnorePublicAcls": True,
                     "BlockPublicPolicy": True, "RestrictPublicBuckets": True}

    ownership = s3.get_bucket_ownership_controls(Bucket=bucket)["OwnershipControls"]["Rules"]
    assert ownership == [{"ObjectOwnership": "BucketOwnerEnforced"}]

    assert s3.get_bucket_versioning(Bucket=bucket).get("Status") == "Enabled"

    policy = json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"])
    deny = [st for st in policy["Statement"] if st["Effect"] == "Deny"]
    assert len(deny) == 1, policy
    assert deny[0]["Principal"] in ("*", {"AWS": "*"})
    assert as_list(deny[0]["Action"]) == ["s3:*"]
    bucket_arn = f"arn:aws:s3:::{bucket}"
    assert sorted(as_list(deny[0]["Resource"])) == [bucket_arn, f"{bucket_arn}/*"]
    assert deny[0]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


@pytest.mark.parametrize("bucket,region", [(BUCKET, REGION), (REPLICA_BUCKET, REPLICA_REGION)])
def test_lifecycle_follows_the_xcluster_layout(deployed, bucket, region):
    s3 = deployed.client("s3", region=region)
    rules = {r["ID"]: r for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    assert all(r["Status"] == "Enabled" for r in rules.values())

    abort = rules["abort-incomplete-multipart-uploads"]
    assert abort["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
    assert abort["Filter"] == {"Prefix": f"{PREFIX}/"}

    delta = rules["expire-delta-versions"]
    assert delta["Filter"] == {"Tag": {"Key": "xcluster-kind", "Value": "delta"}}
    assert delta["Expiration"] == {"Days": DELTA_DAYS}

    keyframe = rules["expire-keyframe-versions"]
    assert keyframe["Filter"] == {"Tag": {"Key": "xcluster-kind", "Value": "keyframe"}}
    assert keyframe["Expiration"] == {"Days": KEYFRAME_DAYS}

    noncurrent = rules["expire-noncurrent-versions"]
    assert noncurrent["Filter"] == {"Prefix": f"{PREFIX}/"}
    assert noncurrent["NoncurrentVersionExpiration"]["NoncurrentDays"] >= 1

    # Nothing expires HEAD or leases: every expiring rule is scoped to a version-kind tag.
    for rule in rules.values():
        if "Days" in rule.get("Expiration", {}):
            assert "Tag" in rule["Filter"], rule


def test_replication_to_the_replica_region(deployed):
    s3 = deployed.client("s3")
    config = s3.get_bucket_replication(Bucket=BUCKET)["ReplicationConfiguration"]
    assert config["Role"] == deployed.outputs["replication_role_arn"]
    [rule] = config["Rules"]
    assert rule["Status"] == "Enabled"
    assert rule["Destination"]["Bucket"] == REPLICA_ARN
    # moto's GetBucketReplication answers a fixed Filter (Prefix "") and DeleteMarkerReplication
    # (Disabled) whatever was put, so those two are checked in the plan Terraform applied.
    [applied] = deployed.planned["module.xcluster.aws_s3_bucket_replication_configuration.this[0]"]["rule"]
    assert applied["filter"][0]["prefix"] == f"{PREFIX}/"
    assert applied["delete_marker_replication"] == [{"status": "Enabled"}]

    iam = deployed.client("iam")
    role_name = deployed.outputs["replication_role_arn"].rsplit("/", 1)[1]
    trust = iam.get_role(RoleName=role_name)["Role"]["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    assert [st["Principal"] for st in as_list(trust["Statement"])] == [{"Service": "s3.amazonaws.com"}]
    [policy_name] = iam.list_role_policies(RoleName=role_name)["PolicyNames"]
    doc = iam.get_role_policy(RoleName=role_name, PolicyName=policy_name)["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    writes = {(a, r) for a, r, _ in grants(doc) if a.startswith("s3:Replicate")}
    assert writes == {(a, f"{REPLICA_ARN}/{PREFIX}/*")
                      for a in ("s3:ReplicateObject", "s3:ReplicateDelete", "s3:ReplicateTags")}


def test_publisher_policy_is_limited_to_the_prefix(deployed):
    policy = policy_of_role(deployed.client("iam"), f"{NAME}-publisher")
    granted = grants(policy)
    object_actions = {a for a, r, _ in granted if r == f"{BUCKET_ARN}/{PREFIX}/*"}
    assert object_actions >= {"s3:PutObject", "s3:GetObject", "s3:DeleteObject",
                              "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"}
    for action, resource, condition in granted:
        assert resource in (BUCKET_ARN, f"{BUCKET_ARN}/{PREFIX}/*"), (action, resource)
        if action == "s3:ListBucket":
            assert condition == {"StringLike": {"s3:prefix": [PREFIX, f"{PREFIX}/*"]}}
        elif resource == BUCKET_ARN:
            assert action == "s3:ListBucketMultipartUploads", action
    assert ("s3:ListBucketMultipartUploads", BUCKET_ARN, {}) in granted


def test_subscriber_policy_writes_only_leases(deployed):
    policy = policy_of_role(deployed.client("iam"), f"{NAME}-subscriber")
    granted = grants(policy)
    writes = {(a, r) for a, r, _ in granted if a not in ("s3:GetObject", "s3:ListBucket")}
    assert writes == {("s3:PutObject", f"{BUCKET_ARN}/{PREFIX}/leases/*"),
                      ("s3:DeleteObject", f"{BUCKET_ARN}/{PREFIX}/leases/*")}
    reads = {r for a, r, _ in granted if a == "s3:GetObject"}
    assert reads == {f"{BUCKET_ARN}/{PREFIX}/*", f"{REPLICA_ARN}/{PREFIX}/*"}
    for action, _, condition in granted:
        if action == "s3:ListBucket":
            assert condition == {"StringLike": {"s3:prefix": [PREFIX, f"{PREFIX}/*"]}}


def test_trust_policies(deployed):
    iam = deployed.client("iam")

    def trust(role):
        doc = iam.get_role(RoleName=f"{NAME}-{role}")["Role"]["AssumeRolePolicyDocument"]
        return as_list((json.loads(doc) if isinstance(doc, str) else doc)["Statement"])

    [publisher] = trust("publisher")
    assert publisher["Action"] == "sts:AssumeRole"
    assert as_list(publisher["Principal"]["AWS"]) == [TRAINER_ARN]

    by_action = {st["Action"]: st for st in trust("subscriber")}
    assert sorted(as_list(by_action["sts:AssumeRole"]["Principal"]["AWS"])) == sorted(
        [ROLLOUT_ARN, FOREIGN_READER_ARN])
    web = by_action["sts:AssumeRoleWithWebIdentity"]
    assert web["Principal"] == {"Federated": OIDC_ARN}
    assert web["Condition"]["StringEquals"] == {
        f"{OIDC_URL}:aud": "sts.amazonaws.com",
        f"{OIDC_URL}:sub": "system:serviceaccount:rollout:vllm",
    }


def test_cross_account_reader_granted_in_bucket_policy(deployed):
    policy = json.loads(deployed.client("s3").get_bucket_policy(Bucket=BUCKET)["Policy"])
    allowed = {}
    for st in policy["Statement"]:
        if st["Effect"] == "Allow":
            assert as_list(st["Principal"]["AWS"]) == [FOREIGN_READER_ARN], st
            for action in as_list(st["Action"]):
                allowed.setdefault(action, set()).update(as_list(st["Resource"]))
    assert allowed == {
        "s3:ListBucket": {BUCKET_ARN},
        "s3:GetObject": {f"{BUCKET_ARN}/{PREFIX}/*"},
        "s3:PutObject": {f"{BUCKET_ARN}/{PREFIX}/leases/*"},
        "s3:DeleteObject": {f"{BUCKET_ARN}/{PREFIX}/leases/*"},
    }


# --------------------------------------------------------------------------------------------------
# Enforcement: moto evaluates the roles' identity policies once IAM auth is switched on
# --------------------------------------------------------------------------------------------------

def _reset_auth(endpoint: str, count: str) -> None:
    """moto's /moto-api/reset-auth: after `count` more requests, every AWS request is authorized."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count.encode(),
                                 method="POST", headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


@contextmanager
def tls_deny_lifted(deployed: Deployment) -> Iterator[None]:
    """Remove the bucket policy for the block and put it back verbatim afterwards.

    moto evaluates bucket policies but not the aws:SecureTransport condition, so over its plain
    HTTP the DenyInsecureTransport statement refuses every object request, permitted or not.
    Lifting it leaves the roles' identity policies as the only thing being checked.
    """
    s3 = deployed.client("s3")
    policy = s3.get_bucket_policy(Bucket=BUCKET)["Policy"]
    s3.delete_bucket_policy(Bucket=BUCKET)
    try:
        yield
    finally:
        s3.put_bucket_policy(Bucket=BUCKET, Policy=policy)


@contextmanager
def iam_enforced(endpoint: str) -> Iterator[None]:
    """Switch on moto's IAM enforcement for the block (every request is signed and authorized)."""
    _reset_auth(endpoint, "0")
    try:
        yield
    finally:
        _reset_auth(endpoint, "inf")


def _delete_all_versions(s3, bucket: str) -> None:
    listing = s3.list_object_versions(Bucket=bucket)
    for item in listing.get("Versions", []) + listing.get("DeleteMarkers", []):
        s3.delete_object(Bucket=bucket, Key=item["Key"], VersionId=item["VersionId"])


def _error_code(call) -> str:
    from botocore.exceptions import ClientError

    try:
        call()
    except ClientError as exc:
        return exc.response["Error"]["Code"]
    return "OK"


def test_roles_are_enforced_by_moto(deployed):
    sts = deployed.client("sts")

    def assume(role: str) -> dict:
        c = sts.assume_role(RoleArn=deployed.outputs[f"{role}_role_arn"], RoleSessionName=f"test-{role}")
        c = c["Credentials"]
        return {"aws_access_key_id": c["AccessKeyId"], "aws_secret_access_key": c["SecretAccessKey"],
                "aws_session_token": c["SessionToken"]}

    publisher = deployed.client("s3", credentials=assume("publisher"))
    subscriber = deployed.client("s3", credentials=assume("subscriber"))
    head = f"{PREFIX}/HEAD"
    chunk = f"{PREFIX}/versions/000000000001/chunk-000000.xc"
    lease = f"{PREFIX}/leases/rollout-0"

    with tls_deny_lifted(deployed), ExitStack() as cleanup:
        cleanup.callback(_delete_all_versions, deployed.client("s3"), BUCKET)
        cleanup.enter_context(iam_enforced(deployed.endpoint))
        results = {
            "publisher puts HEAD": _error_code(lambda: publisher.put_object(
                Bucket=BUCKET, Key=head, Body=b'{"version": 1}')),
            "publisher puts a tagged chunk": _error_code(lambda: publisher.put_object(
                Bucket=BUCKET, Key=chunk, Body=b"x", Tagging="xcluster-kind=delta")),
            "publisher writes outside the prefix": _error_code(lambda: publisher.put_object(
                Bucket=BUCKET, Key="runs/other/HEAD", Body=b"x")),
            "subscriber gets HEAD": _error_code(lambda: subscriber.get_object(Bucket=BUCKET, Key=head)),
            "subscriber puts a chunk": _error_code(lambda: subscriber.put_object(
                Bucket=BUCKET, Key=chunk, Body=b"y")),
            "subscriber overwrites HEAD": _error_code(lambda: subscriber.put_object(
                Bucket=BUCKET, Key=head, Body=b"{}")),
            "subscriber deletes a chunk": _error_code(lambda: subscriber.delete_object(Bucket=BUCKET, Key=chunk)),
            "subscriber puts its lease": _error_code(lambda: subscriber.put_object(
                Bucket=BUCKET, Key=lease, Body=b"{}")),
            "subscriber deletes its lease": _error_code(lambda: subscriber.delete_object(
                Bucket=BUCKET, Key=lease)),
        }
        head_body = subscriber.get_object(Bucket=BUCKET, Key=head)["Body"].read()
        chunk_body = publisher.get_object(Bucket=BUCKET, Key=chunk)["Body"].read()

    assert results == {
        "publisher puts HEAD": "OK",
        "publisher puts a tagged chunk": "OK",
        "publisher writes outside the prefix": "AccessDenied",
        "subscriber gets HEAD": "OK",
        "subscriber puts a chunk": "AccessDenied",
        "subscriber overwrites HEAD": "AccessDenied",
        "subscriber deletes a chunk": "AccessDenied",
        "subscriber puts its lease": "OK",
        "subscriber deletes its lease": "OK",
    }
    # The refused writes changed nothing.
    assert (head_body, chunk_body) == (b'{"version": 1}', b"x")
