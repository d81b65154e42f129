# Internal building block of ../xcluster: one hardened bucket for an xcluster weight stream.
# Used twice (primary and replica) so both get exactly the same security controls and lifecycle.

variable "bucket_name" {
  description = "Name of the bucket to create."
  type        = string
}

variable "prefix" {
  description = "Run prefix inside the bucket (no leading or trailing slash). Lifecycle rules apply under it."
  type        = string
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds objects (and all their versions)."
  type        = bool
}

variable "versioning_enabled" {
  description = "Turn on S3 versioning."
  type        = bool
}

variable "kms_key_arn" {
  description = "KMS key ARN for SSE-KMS; null means SSE-S3 (AES256)."
  type        = string
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which an unfinished multipart upload under the prefix is aborted."
  type        = number
}

variable "delta_retention_days" {
  description = "Days after which objects tagged xcluster-kind=delta expire."
  type        = number
}

variable "keyframe_retention_days" {
  description = "Days after which objects tagged xcluster-kind=keyframe expire; null keeps them."
  type        = number
}

variable "noncurrent_version_retention_days" {
  description = "Days after which a noncurrent object version under the prefix expires."
  type        = number
}

variable "extra_policy_json" {
  description = "An IAM policy document (JSON) whose statements are added to the bucket policy; null for none."
  type        = string
}

variable "tags" {
  description = "Tags for the bucket."
  type        = map(string)
}
