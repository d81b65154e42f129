data "aws_partition" "current" {}

locals {
  bucket_arn = "arn:${data.aws_partition.current.partition}:s3:::${var.bucket_name}"
}

resource "aws_s3_bucket" "this" {
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# ACLs are disabled: the bucket owner owns every object, including ones written by other accounts.
resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = var.kms_key_arn == null ? "AES256" : "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = var.kms_key_arn != null
  }
}

resource "aws_s3_bucket_versioning" "this" {
  count  = var.versioning_enabled ? 1 : 0
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

# Designed around the layout xcluster writes (docs/FORMAT.md):
#   <prefix>/HEAD, <prefix>/versions/<12-digit version>/{manifest-<attempt>.json[.zst],c<attempt>-NNNNNN.xc},
#   <prefix>/files/<xxh3>, <prefix>/leases/...
# The publisher tags every object of a version with xcluster-kind=delta or xcluster-kind=keyframe;
# HEAD, files/ (shared by versions, content-addressed) and leases carry no kind tag, so no expiry
# rule ever touches them (`xcluster gc` removes files no kept manifest names).
#
# The expiry rules match on the tag alone, not on prefix AND tag: the bucket is dedicated to the
# stream and only the xcluster publisher sets xcluster-kind, and only on version objects. (An
# `and {}` filter also makes the AWS provider send ObjectSizeGreaterThan=0, which S3 emulators such
# as moto drop, so the provider waits forever for its configuration to read back.)
resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  # A rule with a tag filter may not abort multipart uploads, hence a rule of its own.
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {
      prefix = "${var.prefix}/"
    }

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  rule {
    id     = "expire-delta-versions"
    status = "Enabled"

    filter {
      tag {
        key   = "xcluster-kind"
        value = "delta"
      }
    }

    expiration {
      days = var.delta_retention_days
    }
  }

  dynamic "rule" {
    for_each = var.keyframe_retention_days == null ? [] : [var.keyframe_retention_days]
    content {
      id     = "expire-keyframe-versions"
      status = "Enabled"

      filter {
        tag {
          key   = "xcluster-kind"
          value = "keyframe"
        }
      }

      expiration {
        days = rule.value
      }
    }
  }

  rule {
    id     = "expire-noncurrent-versions"
    status = "Enabled"

    filter {
      prefix = "${var.prefix}/"
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_retention_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  # Lifecycle rules on a versioned bucket act on versions: set them after versioning.
  depends_on = [aws_s3_bucket_versioning.this]
}

data "aws_iam_policy_document" "bucket" {
  source_policy_documents = var.extra_policy_json == null ? [] : [var.extra_policy_json]

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [local.bucket_arn, "${local.bucket_arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # S3 rejects a bucket policy while the public access block is still being applied.
  depends_on = [aws_s3_bucket_public_access_block.this]
}
