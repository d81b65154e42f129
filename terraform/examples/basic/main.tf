# Example root configuration: one run's weight stream, optionally replicated to a second region.
# Credentials come from the standard AWS chain (environment, profile, SSO, instance role).

locals {
  custom_endpoint = var.endpoint != null
}

provider "aws" {
  region = var.region

  # Only for a local S3-compatible server (moto, MinIO); all false against AWS.
  s3_use_path_style           = local.custom_endpoint
  skip_credentials_validation = local.custom_endpoint
  skip_requesting_account_id  = local.custom_endpoint
  skip_metadata_api_check     = local.custom_endpoint

  dynamic "endpoints" {
    for_each = local.custom_endpoint ? [var.endpoint] : []
    content {
      s3  = endpoints.value
      iam = endpoints.value
      sts = endpoints.value
      kms = endpoints.value
    }
  }
}

provider "aws" {
  alias  = "replica"
  region = var.replica_region

  s3_use_path_style           = local.custom_endpoint
  skip_credentials_validation = local.custom_endpoint
  skip_requesting_account_id  = local.custom_endpoint
  skip_metadata_api_check     = local.custom_endpoint

  dynamic "endpoints" {
    for_each = local.custom_endpoint ? [var.endpoint] : []
    content {
      s3  = endpoints.value
      iam = endpoints.value
      sts = endpoints.value
      kms = endpoints.value
    }
  }
}

module "xcluster" {
  source = "../../modules/xcluster"

  providers = {
    aws         = aws
    aws.replica = aws.replica
  }

  bucket_name             = var.bucket_name
  prefix                  = var.prefix
  name                    = var.name
  force_destroy           = var.force_destroy
  replica_enabled         = var.replica_enabled
  delta_retention_days    = var.delta_retention_days
  keyframe_retention_days = var.keyframe_retention_days

  publisher_principal_arns    = var.publisher_principal_arns
  subscriber_principal_arns   = var.subscriber_principal_arns
  subscriber_oidc             = var.subscriber_oidc
  cross_account_reader_arns   = var.cross_account_reader_arns
  cross_account_reader_access = var.cross_account_reader_access

  tags = {
    "app" = "xcluster"
  }
}
