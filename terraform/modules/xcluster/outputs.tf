# The first outputs fill xcluster's configuration directly (see ../../README.md).

output "xcluster_url" {
  description = "URL of the weight stream for xcluster: s3://<bucket>/<prefix>."
  value       = "s3://${module.primary.id}/${var.prefix}"
}

output "bucket" {
  description = "Name of the primary bucket."
  value       = module.primary.id
}

output "prefix" {
  description = "Run prefix inside the bucket."
  value       = var.prefix
}

output "region" {
  description = "Region of the primary bucket."
  value       = data.aws_region.current.name
}

output "publisher_role_arn" {
  description = "Role the trainer assumes to publish (read/write/delete under the prefix)."
  value       = aws_iam_role.this["publisher"].arn
}

output "subscriber_role_arn" {
  description = "Role a rollout node assumes to subscribe (read the prefix, write only <prefix>/leases/)."
  value       = aws_iam_role.this["subscriber"].arn
}

output "publisher_policy_arn" {
  description = "Managed policy of the publisher role, to attach to other principals if needed."
  value       = aws_iam_policy.this["publisher"].arn
}

output "subscriber_policy_arn" {
  description = "Managed policy of the subscriber role, to attach to other principals if needed."
  value       = aws_iam_policy.this["subscriber"].arn
}

output "bucket_arn" {
  description = "ARN of the primary bucket."
  value       = module.primary.arn
}

output "replica_url" {
  description = "URL of the replicated stream (s3://<replica bucket>/<prefix>) for rollout nodes in the replica region; null when replica_enabled is false."
  value       = var.replica_enabled ? "s3://${module.replica[0].id}/${var.prefix}" : null
}

output "replica_bucket" {
  description = "Name of the replica bucket; null when replica_enabled is false."
  value       = var.replica_enabled ? module.replica[0].id : null
}

output "replica_region" {
  description = "Region of the replica bucket; null when replica_enabled is false."
  value       = var.replica_enabled ? data.aws_region.replica.name : null
}

output "replication_role_arn" {
  description = "Role S3 uses to replicate; null when replica_enabled is false."
  value       = var.replica_enabled ? aws_iam_role.replication[0].arn : null
}
