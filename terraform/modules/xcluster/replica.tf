# Optional replica of <prefix>/ in a second region, through the aws.replica provider. Object tags
# replicate with the objects, so the replica's tag-based lifecycle expires the same versions.

module "replica" {
  source = "../bucket"
  count  = var.replica_enabled ? 1 : 0

  providers = {
    aws = aws.replica
  }

  bucket_name        = local.replica_bucket_name
  prefix             = var.prefix
  force_destroy      = var.force_destroy
  versioning_enabled = true
  kms_key_arn        = var.replica_kms_key_arn
  extra_policy_json  = null
  tags               = var.tags

  abort_incomplete_multipart_days   = local.lifecycle_days.abort_incomplete_multipart_days
  delta_retention_days              = local.lifecycle_days.delta_retention_days
  keyframe_retention_days           = local.lifecycle_days.keyframe_retention_days
  noncurrent_version_retention_days = local.lifecycle_days.noncurrent_version_retention_days
}

data "aws_iam_policy_document" "replication_trust" {
  count = var.replica_enabled ? 1 : 0

  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["s3.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "replication" {
  count = var.replica_enabled ? 1 : 0

  statement {
    sid       = "ReadReplicationConfiguration"
    actions   = ["s3:GetReplicationConfiguration", "s3:ListBucket"]
    resources = [local.bucket_arn]
  }

  statement {
    sid = "ReadSourceVersions"
    actions = [
      "s3:GetObjectVersionForReplication",
      "s3:GetObjectVersionAcl",
      "s3:GetObjectVersionTagging",
    ]
    resources = [local.run_objects_arn]
  }

  statement {
    sid       = "WriteReplica"
    actions   = ["s3:ReplicateObject", "s3:ReplicateDelete", "s3:ReplicateTags"]
    resources = [local.replica_run_objects_arn]
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]
    content {
      sid       = "DecryptSource"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]
    }
  }

  dynamic "statement" {
    for_each = var.replica_kms_key_arn == null ? [] : [var.replica_kms_key_arn]
    content {
      sid       = "EncryptReplica"
      actions   = ["kms:Encrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role" "replication" {
  count = var.replica_enabled ? 1 : 0

  name                 = "${local.name}-replication"
  path                 = var.iam_path
  description          = "S3 replication of s3://${var.bucket_name}/${var.prefix} to s3://${local.replica_bucket_name}"
  assume_role_policy   = data.aws_iam_policy_document.replication_trust[0].json
  permissions_boundary = var.permissions_boundary_arn
  tags                 = var.tags
}

resource "aws_iam_role_policy" "replication" {
  count = var.replica_enabled ? 1 : 0

  name   = "replicate-run-prefix"
  role   = aws_iam_role.replication[0].id
  policy = data.aws_iam_policy_document.replication[0].json
}

resource "aws_s3_bucket_replication_configuration" "this" {
  count = var.replica_enabled ? 1 : 0

  bucket = module.primary.id
  role   = aws_iam_role.replication[0].arn

  rule {
    id     = "replicate-run-prefix"
    status = "Enabled"

    filter {
      prefix = "${var.prefix}/"
    }

    delete_marker_replication {
      status = "Enabled"
    }

    dynamic "source_selection_criteria" {
      for_each = var.kms_key_arn == null ? [] : [1]
      content {
        sse_kms_encrypted_objects {
          status = "Enabled"
        }
      }
    }

    destination {
      bucket        = module.replica[0].arn
      storage_class = var.replica_storage_class

      dynamic "encryption_configuration" {
        for_each = var.replica_kms_key_arn == null ? [] : [var.replica_kms_key_arn]
        content {
          replica_kms_key_id = encryption_configuration.value
        }
      }
    }
  }

  lifecycle {
    precondition {
      condition     = module.primary.versioning_enabled && module.replica[0].versioning_enabled
      error_message = "S3 replication requires versioning on both buckets; set versioning_enabled = true."
    }
  }

  # Versioning must be on, and the role able to act, before S3 accepts the configuration.
  depends_on = [module.primary, module.replica, aws_iam_role_policy.replication]
}
