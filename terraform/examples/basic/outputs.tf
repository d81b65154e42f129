output "xcluster_url" {
  description = "Pass to xcluster.Publisher(url) / `xcluster ls`: s3://<bucket>/<prefix>."
  value       = module.xcluster.xcluster_url
}

output "bucket" {
  description = "Primary bucket."
  value       = module.xcluster.bucket
}

output "prefix" {
  description = "Run prefix."
  value       = module.xcluster.prefix
}

output "region" {
  description = "Primary region (AWS_REGION for xcluster)."
  value       = module.xcluster.region
}

output "publisher_role_arn" {
  description = "Role for the trainer."
  value       = module.xcluster.publisher_role_arn
}

output "subscriber_role_arn" {
  description = "Role for rollout nodes."
  value       = module.xcluster.subscriber_role_arn
}

output "publisher_policy_arn" {
  description = "Managed policy of the publisher role."
  value       = module.xcluster.publisher_policy_arn
}

output "subscriber_policy_arn" {
  description = "Managed policy of the subscriber role."
  value       = module.xcluster.subscriber_policy_arn
}

output "replica_url" {
  description = "Replicated stream for rollout nodes in replica_region; null when off."
  value       = module.xcluster.replica_url
}

output "replica_region" {
  description = "Replica region; null when off."
  value       = module.xcluster.replica_region
}

output "replication_role_arn" {
  description = "Replication role; null when off."
  value       = module.xcluster.replication_role_arn
}
