terraform {
  # Cross-variable validation needs 1.9.
  required_version = ">= 1.9"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.46, < 6.0"
      # aws.replica places the optional replica bucket. Pass `aws.replica = aws` when replica_enabled = false.
      configuration_aliases = [aws.replica]
    }
  }
}
