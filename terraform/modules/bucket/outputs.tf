output "id" {
  description = "Bucket name."
  value       = aws_s3_bucket.this.id
}

output "arn" {
  description = "Bucket ARN."
  value       = aws_s3_bucket.this.arn
}

output "region" {
  description = "Region the bucket lives in."
  value       = aws_s3_bucket.this.region
}

output "versioning_enabled" {
  description = "Whether versioning is on (replication needs it on both sides)."
  value       = length(aws_s3_bucket_versioning.this) == 1
}
