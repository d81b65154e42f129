variable "region" {
  description = "Region of the primary bucket (where the trainer runs)."
  type        = string
  default     = "us-east-1"
}

variable "replica_region" {
  description = "Region of the replica bucket (used only when replica_enabled is true)."
  type        = string
  default     = "us-west-2"
}

variable "endpoint" {
  description = "Custom endpoint for S3, IAM, STS and KMS, e.g. http://127.0.0.1:5000 for a local moto server. Leave null for AWS; when set, path-style S3 is used and AWS account checks are skipped."
  type        = string
  default     = null

  validation {
    condition     = var.endpoint == null || can(regex("^https?://", var.endpoint))
    error_message = "endpoint must be null or an http(s):// URL."
  }
}

variable "bucket_name" {
  description = "Name of the bucket to create for the weight stream."
  type        = string
}

variable "prefix" {
  description = "Run prefix inside the bucket."
  type        = string
  default     = "runs/demo"
}

variable "name" {
  description = "Short name for the IAM roles and policies; null uses the bucket name."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete buckets that still hold objects."
  type        = bool
  default     = false
}

variable "replica_enabled" {
  description = "Create a replica bucket in replica_region."
  type        = bool
  default     = false
}

variable "delta_retention_days" {
  description = "Days before delta versions expire."
  type        = number
  default     = 7
}

variable "keyframe_retention_days" {
  description = "Days before keyframe versions expire; null keeps them."
  type        = number
  default     = 30
}

variable "publisher_principal_arns" {
  description = "Principals (the trainer's role or user) allowed to assume the publisher role."
  type        = list(string)
  default     = []
}

variable "subscriber_principal_arns" {
  description = "Principals (rollout nodes' roles) allowed to assume the subscriber role."
  type        = list(string)
  default     = []
}

variable "subscriber_oidc" {
  description = "EKS/Kubernetes OIDC providers and service accounts allowed to assume the subscriber role."
  type = list(object({
    provider_arn = string
    provider_url = string
    service_accounts = list(object({
      namespace = string
      name      = string
    }))
  }))
  default = []
}

variable "cross_account_reader_arns" {
  description = "Principals in other accounts that read like subscribers."
  type        = list(string)
  default     = []
}

variable "cross_account_reader_access" {
  description = "\"assume_role\", \"bucket_policy\" or \"both\" (see the module)."
  type        = string
  default     = "assume_role"
}
