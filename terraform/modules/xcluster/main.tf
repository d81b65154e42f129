data "aws_partition" "current" {}

data "aws_region" "current" {}

data "aws_region" "replica" {
  provider = aws.replica
}

locals {
  partition = data.aws_partition.current.partition
  name      = var.name != null ? var.name : substr(var.bucket_name, 0, 50)

  bucket_arn          = "arn:${local.partition}:s3:::${var.bucket_name}"
  replica_bucket_name = var.replica_bucket_name != null ? var.replica_bucket_name : "${var.bucket_name}-replica"
  replica_bucket_arn  = "arn:${local.partition}:s3:::${local.replica_bucket_name}"

  # Object ARNs for the xcluster layout under the run prefix.
  run_objects_arn         = "${local.bucket_arn}/${var.prefix}/*"
  lease_objects_arn       = "${local.bucket_arn}/${var.prefix}/leases/*"
  checkpoint_objects_arn  = "${local.bucket_arn}/${var.prefix}/checkpoints/*"
  replica_run_objects_arn = "${local.replica_bucket_arn}/${var.prefix}/*"

  # s3:prefix values a lister of the run may send (xcluster lists "<prefix>/..." sub-prefixes).
  list_prefixes = [var.prefix, "${var.prefix}/*"]

  cross_account_assume = contains(["assume_role", "both"], var.cross_account_reader_access) ? var.cross_account_reader_arns : []
  cross_account_direct = contains(["bucket_policy", "both"], var.cross_account_reader_access) ? var.cross_account_reader_arns : []

  lifecycle_days = {
    abort_incomplete_multipart_days   = var.abort_incomplete_multipart_days
    delta_retention_days              = var.delta_retention_days
    keyframe_retention_days           = var.keyframe_retention_days
    noncurrent_version_retention_days = var.noncurrent_version_retention_days
  }
}

# Cross-account readers granted in the bucket policy get exactly the subscriber's S3 permissions.
data "aws_iam_policy_document" "cross_account_readers" {
  count = length(local.cross_account_direct) > 0 ? 1 : 0

  statement {
    sid       = "CrossAccountListRunPrefix"
    actions   = ["s3:ListBucket"]
    resources = [local.bucket_arn]

    principals {
      type        = "AWS"
      identifiers = local.cross_account_direct
    }

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = local.list_prefixes
    }
  }

  statement {
    sid       = "CrossAccountReadRunObjects"
    actions   = ["s3:GetObject"]
    resources = [local.run_objects_arn]

    principals {
      type        = "AWS"
      identifiers = local.cross_account_direct
    }
  }

  statement {
    sid       = "CrossAccountWriteLeases"
    actions   = ["s3:PutObject", "s3:DeleteObject"]
    resources = [local.lease_objects_arn]

    principals {
      type        = "AWS"
      identifiers = local.cross_account_direct
    }
  }
}

module "primary" {
  source = "../bucket"

  bucket_name        = var.bucket_name
  prefix             = var.prefix
  force_destroy      = var.force_destroy
  versioning_enabled = var.versioning_enabled
  kms_key_arn        = var.kms_key_arn
  extra_policy_json  = one(data.aws_iam_policy_document.cross_account_readers[*].json)
  tags               = var.tags

  abort_incomplete_multipart_days   = local.lifecycle_days.abort_incomplete_multipart_days
  delta_retention_days              = local.lifecycle_days.delta_retention_days
  keyframe_retention_days           = local.lifecycle_days.keyframe_retention_days
  noncurrent_version_retention_days = local.lifecycle_days.noncurrent_version_retention_days
}
