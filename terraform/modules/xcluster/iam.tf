# Publisher (trainer) and subscriber (rollout) roles. Each is trusted by IAM principals and/or
# Kubernetes service accounts through an OIDC provider (IRSA), and carries one managed policy that
# is limited to the run prefix.

locals {
  roles = {
    publisher = {
      principal_arns = var.publisher_principal_arns
      oidc           = var.publisher_oidc
    }
    subscriber = {
      principal_arns = concat(var.subscriber_principal_arns, local.cross_account_assume)
      oidc           = var.subscriber_oidc
    }
  }
}

data "aws_iam_policy_document" "trust" {
  for_each = local.roles

  dynamic "statement" {
    for_each = length(each.value.principal_arns) > 0 ? [each.value.principal_arns] : []
    content {
      sid     = "AssumeByPrincipals"
      actions = ["sts:AssumeRole"]

      principals {
        type        = "AWS"
        identifiers = statement.value
      }
    }
  }

  dynamic "statement" {
    for_each = each.value.oidc
    content {
      sid     = "AssumeByServiceAccounts${statement.key}"
      actions = ["sts:AssumeRoleWithWebIdentity"]

      principals {
        type        = "Federated"
        identifiers = [statement.value.provider_arn]
      }

      condition {
        test     = "StringEquals"
        variable = "${trimprefix(statement.value.provider_url, "https://")}:aud"
        values   = ["sts.amazonaws.com"]
      }

      condition {
        test     = "StringEquals"
        variable = "${trimprefix(statement.value.provider_url, "https://")}:sub"
        values   = [for sa in statement.value.service_accounts : "system:serviceaccount:${sa.namespace}:${sa.name}"]
      }
    }
  }
}

resource "aws_iam_role" "this" {
  for_each = local.roles

  name                 = "${local.name}-${each.key}"
  path                 = var.iam_path
  description          = "xcluster ${each.key} for s3://${var.bucket_name}/${var.prefix}"
  assume_role_policy   = data.aws_iam_policy_document.trust[each.key].json
  max_session_duration = var.max_session_duration_seconds
  permissions_boundary = var.permissions_boundary_arn
  tags                 = var.tags

  lifecycle {
    precondition {
      condition     = length(each.value.principal_arns) + length(each.value.oidc) > 0
      error_message = "The ${each.key} role would trust nobody: set ${each.key}_principal_arns and/or ${each.key}_oidc${each.key == "subscriber" ? " (or cross_account_reader_arns)" : ""}."
    }
  }
}

data "aws_iam_policy_document" "publisher" {
  statement {
    sid       = "ListRunPrefix"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = local.list_prefixes
    }
  }

  statement {
    sid       = "ListMultipartUploads"
    actions   = ["s3:ListBucketMultipartUploads"]
    resources = [local.bucket_arn]
  }

  # PutObjectTagging: the publisher tags objects xcluster-kind=delta|keyframe on upload
  # (x-amz-tagging), which S3 authorizes as a separate action.
  statement {
    sid = "ReadWriteRunObjects"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:PutObjectTagging",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = [local.run_objects_arn]
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]
    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

data "aws_iam_policy_document" "subscriber" {
  statement {
    sid       = "ListRunPrefix"
    actions   = ["s3:ListBucket"]
    resources = var.replica_enabled ? [local.bucket_arn, local.replica_bucket_arn] : [local.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = local.list_prefixes
    }
  }

  statement {
    sid       = "ReadRunObjects"
    actions   = ["s3:GetObject"]
    resources = var.replica_enabled ? [local.run_objects_arn, local.replica_run_objects_arn] : [local.run_objects_arn]
  }

  # The only writes a subscriber makes: its lease, in the primary bucket (where the publisher
  # looks for leases before deleting a version). Replication is one way, so never in the replica.
  statement {
    sid       = "WriteOwnLeases"
    actions   = ["s3:PutObject", "s3:DeleteObject"]
    resources = [local.lease_objects_arn]
  }

  # Cluster-local stores only: a subscriber run with --write-checkpoints writes checkpoints there
  # (docs/FORMAT.md §3a). Readers verify them against the signed chain, so this grants no trust.
  dynamic "statement" {
    for_each = var.rollout_writes_checkpoints ? [1] : []
    content {
      sid       = "WriteCheckpoints"
      actions   = ["s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject"]
      resources = [local.checkpoint_objects_arn]
    }
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]
    content {
      sid       = "UseBucketKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }

  dynamic "statement" {
    for_each = var.replica_enabled && var.replica_kms_key_arn != null ? [var.replica_kms_key_arn] : []
    content {
      sid       = "DecryptReplica"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]
    }
  }
}

locals {
  role_policy_json = {
    publisher  = data.aws_iam_policy_document.publisher.json
    subscriber = data.aws_iam_policy_document.subscriber.json
  }
}

resource "aws_iam_policy" "this" {
  for_each = local.roles

  name        = "${local.name}-${each.key}"
  path        = var.iam_path
  description = "xcluster ${each.key} access to s3://${var.bucket_name}/${var.prefix}"
  policy      = local.role_policy_json[each.key]
  tags        = var.tags
}

resource "aws_iam_role_policy_attachment" "this" {
  for_each = local.roles

  role       = aws_iam_role.this[each.key].name
  policy_arn = aws_iam_policy.this[each.key].arn
}
