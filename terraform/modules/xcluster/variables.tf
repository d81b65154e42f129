# ---------------------------------------------------------------------------------------------------
# Bucket and layout
# ---------------------------------------------------------------------------------------------------

variable "bucket_name" {
  description = "Name of the bucket that holds the weight stream (created by this module)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name)) && !strcontains(var.bucket_name, "..")
    error_message = "bucket_name must be a valid S3 bucket name: 3-63 characters of a-z, 0-9, '.' and '-', starting and ending with a letter or digit."
  }
}

variable "prefix" {
  description = "Run prefix inside the bucket; xcluster writes <prefix>/HEAD, <prefix>/versions/... and <prefix>/leases/... under it. No leading or trailing slash."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*$", var.prefix))
    error_message = "prefix must be one or more non-empty path segments separated by single '/', without a leading or trailing '/', using only S3-safe characters (letters, digits, ! _ . * ' ( ) -)."
  }
}

variable "name" {
  description = "Short name used for the IAM roles and policies (<name>-publisher, <name>-subscriber, <name>-replication). Defaults to the bucket name (cut to 50 characters)."
  type        = string
  default     = null

  validation {
    condition     = var.name == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,50}$", var.name))
    error_message = "name must be 1-50 characters of A-Z a-z 0-9 + = , . @ _ - (IAM role names are at most 64 characters and get a suffix)."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete buckets that still hold objects. Keep false in production."
  type        = bool
  default     = false
}

variable "versioning_enabled" {
  description = "Turn on S3 versioning for the primary bucket. Required when replica_enabled is true."
  type        = bool
  default     = true
}

variable "kms_key_arn" {
  description = "ARN of a KMS key for SSE-KMS on the primary bucket. Null (default) uses SSE-S3 (AES256). The roles get kms:Decrypt/GenerateDataKey on this key; the key policy must allow them."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/.+$", var.kms_key_arn))
    error_message = "kms_key_arn must be a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>) or null."
  }
}

variable "tags" {
  description = "Tags added to every taggable resource."
  type        = map(string)
  default     = {}
}

# ---------------------------------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------------------------------

variable "abort_incomplete_multipart_days" {
  description = "Days after which an unfinished multipart upload under the prefix is aborted (a crashed trainer leaves parts that are billed but invisible)."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1 && floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days
    error_message = "abort_incomplete_multipart_days must be a whole number >= 1."
  }
}

variable "delta_retention_days" {
  description = "Days after which the objects of delta versions expire (the publisher tags every object of a delta version xcluster-kind=delta; the rule matches that tag)."
  type        = number
  default     = 7

  validation {
    condition     = var.delta_retention_days >= 1 && floor(var.delta_retention_days) == var.delta_retention_days
    error_message = "delta_retention_days must be a whole number >= 1."
  }
}

variable "keyframe_retention_days" {
  description = "Days after which objects of keyframe versions (tagged xcluster-kind=keyframe) expire. Null keeps keyframes forever. Must be >= delta_retention_days: a delta is useless without the keyframe it applies to."
  type        = number
  default     = 30

  validation {
    condition     = var.keyframe_retention_days == null || (try(var.keyframe_retention_days >= var.delta_retention_days, false) && try(floor(var.keyframe_retention_days) == var.keyframe_retention_days, false))
    error_message = "keyframe_retention_days must be null (keep forever) or a whole number >= delta_retention_days: deltas are applied on top of keyframes, so keyframes must outlive them."
  }
}

variable "noncurrent_version_retention_days" {
  description = "Days after which a noncurrent (overwritten or deleted) object version under the prefix expires, when versioning is on."
  type        = number
  default     = 3

  validation {
    condition     = var.noncurrent_version_retention_days >= 1 && floor(var.noncurrent_version_retention_days) == var.noncurrent_version_retention_days
    error_message = "noncurrent_version_retention_days must be a whole number >= 1."
  }
}

# ---------------------------------------------------------------------------------------------------
# Who may assume the roles
# ---------------------------------------------------------------------------------------------------

variable "publisher_principal_arns" {
  description = "IAM principal ARNs (roles, users or account roots) allowed to assume the publisher (trainer) role."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for arn in var.publisher_principal_arns : can(regex("^arn:aws[a-z-]*:(iam|sts)::[0-9]{12}:.+$", arn))])
    error_message = "publisher_principal_arns must be IAM ARNs such as arn:aws:iam::123456789012:role/trainer."
  }
}

variable "publisher_oidc" {
  description = "OIDC identity providers (for example an EKS cluster's) whose Kubernetes service accounts may assume the publisher role with a web identity token. provider_url is the issuer URL (https:// optional)."
  type = list(object({
    provider_arn = string
    provider_url = string
    service_accounts = list(object({
      namespace = string
      name      = string
    }))
  }))
  default = []

  validation {
    condition     = alltrue([for p in var.publisher_oidc : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:oidc-provider/.+$", p.provider_arn)) && length(p.service_accounts) > 0])
    error_message = "each publisher_oidc entry needs provider_arn = arn:aws:iam::<account>:oidc-provider/<url> and at least one service account."
  }
}

variable "subscriber_principal_arns" {
  description = "IAM principal ARNs allowed to assume the subscriber (rollout) role."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for arn in var.subscriber_principal_arns : can(regex("^arn:aws[a-z-]*:(iam|sts)::[0-9]{12}:.+$", arn))])
    error_message = "subscriber_principal_arns must be IAM ARNs such as arn:aws:iam::123456789012:role/rollout."
  }
}

variable "subscriber_oidc" {
  description = "OIDC identity providers whose Kubernetes service accounts may assume the subscriber role (same shape as publisher_oidc)."
  type = list(object({
    provider_arn = string
    provider_url = string
    service_accounts = list(object({
      namespace = string
      name      = string
    }))
  }))
  default = []

  validation {
    condition     = alltrue([for p in var.subscriber_oidc : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:oidc-provider/.+$", p.provider_arn)) && length(p.service_accounts) > 0])
    error_message = "each subscriber_oidc entry needs provider_arn = arn:aws:iam::<account>:oidc-provider/<url> and at least one service account."
  }
}

variable "cross_account_reader_arns" {
  description = "Principal ARNs in other accounts that read the stream like a subscriber (read the prefix, write only <prefix>/leases/). How they get access is set by cross_account_reader_access. Their own account must also allow them the actions (or sts:AssumeRole)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for arn in var.cross_account_reader_arns : can(regex("^arn:aws[a-z-]*:(iam|sts)::[0-9]{12}:.+$", arn))])
    error_message = "cross_account_reader_arns must be IAM ARNs such as arn:aws:iam::210987654321:role/rollout."
  }
}

variable "rollout_writes_checkpoints" {
  description = "Let the rollout role also write <prefix>/checkpoints/ (a cluster-local store whose subscribers run with --write-checkpoints, so joiners there start from a checkpoint that never crossed the WAN). Readers verify checkpoints against the signed chain."
  type        = bool
  default     = false
}

variable "cross_account_reader_access" {
  description = "How cross_account_reader_arns get access: \"assume_role\" (trusted by the subscriber role), \"bucket_policy\" (granted directly in the bucket policy) or \"both\"."
  type        = string
  default     = "assume_role"

  validation {
    condition     = contains(["assume_role", "bucket_policy", "both"], var.cross_account_reader_access)
    error_message = "cross_account_reader_access must be \"assume_role\", \"bucket_policy\" or \"both\"."
  }
}

# ---------------------------------------------------------------------------------------------------
# IAM details
# ---------------------------------------------------------------------------------------------------

variable "iam_path" {
  description = "Path for the IAM roles and policies."
  type        = string
  default     = "/"

  validation {
    condition     = can(regex("^/([A-Za-z0-9+=,.@_-]+/)*$", var.iam_path))
    error_message = "iam_path must start and end with '/' (for example \"/\" or \"/xcluster/\")."
  }
}

variable "permissions_boundary_arn" {
  description = "ARN of a managed policy set as permissions boundary on every role; null for none."
  type        = string
  default     = null
}

variable "max_session_duration_seconds" {
  description = "Longest session, in seconds, that assuming the publisher or subscriber role may request (3600-43200)."
  type        = number
  default     = 3600

  validation {
    condition     = var.max_session_duration_seconds >= 3600 && var.max_session_duration_seconds <= 43200
    error_message = "max_session_duration_seconds must be between 3600 and 43200."
  }
}

# ---------------------------------------------------------------------------------------------------
# Replica in a second region (provider aws.replica)
# ---------------------------------------------------------------------------------------------------

variable "replica_enabled" {
  description = "Create a replica bucket through the aws.replica provider (a second region) and replicate <prefix>/ to it. Requires versioning_enabled = true."
  type        = bool
  default     = false

  validation {
    condition     = !var.replica_enabled || var.versioning_enabled
    error_message = "replica_enabled = true needs versioning_enabled = true: S3 replication requires versioning on both the source and the replica bucket."
  }
}

variable "replica_bucket_name" {
  description = "Name of the replica bucket; null (default) uses \"<bucket_name>-replica\"."
  type        = string
  default     = null

  validation {
    condition     = var.replica_bucket_name == null || (can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.replica_bucket_name)) && !strcontains(coalesce(var.replica_bucket_name, "x"), ".."))
    error_message = "replica_bucket_name must be a valid S3 bucket name or null."
  }

  validation {
    condition     = !var.replica_enabled || var.replica_bucket_name != null || length(var.bucket_name) <= 55
    error_message = "bucket_name is too long to derive \"<bucket_name>-replica\" (63 characters at most): set replica_bucket_name."
  }
}

variable "replica_kms_key_arn" {
  description = "KMS key ARN in the replica region for SSE-KMS on the replica; null uses SSE-S3. Required when kms_key_arn is set and replica_enabled is true (KMS keys are regional)."
  type        = string
  default     = null

  validation {
    condition     = var.replica_kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/.+$", var.replica_kms_key_arn))
    error_message = "replica_kms_key_arn must be a KMS key ARN or null."
  }

  validation {
    condition     = !(var.replica_enabled && var.kms_key_arn != null && var.replica_kms_key_arn == null)
    error_message = "replica_kms_key_arn is required when kms_key_arn is set and replica_enabled is true: SSE-KMS objects are re-encrypted with a key in the replica region."
  }
}

variable "replica_storage_class" {
  description = "Storage class of replicated objects."
  type        = string
  default     = "STANDARD"

  validation {
    condition     = contains(["STANDARD", "STANDARD_IA", "INTELLIGENT_TIERING", "ONEZONE_IA", "GLACIER_IR"], var.replica_storage_class)
    error_message = "replica_storage_class must be STANDARD, STANDARD_IA, INTELLIGENT_TIERING, ONEZONE_IA or GLACIER_IR (weights must stay instantly readable)."
  }
}
