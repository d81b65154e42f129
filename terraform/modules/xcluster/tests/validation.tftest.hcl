# Plan-only checks of the module's input validation and preconditions, with mocked AWS providers
# (no credentials, no network). Run with `terraform init && terraform test` in modules/xcluster.

# Mocked data sources return random strings; policy documents must at least be JSON policies.
mock_provider "aws" {
  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }

  mock_data "aws_partition" {
    defaults = {
      partition = "aws"
    }
  }
}

mock_provider "aws" {
  alias = "replica"

  mock_data "aws_iam_policy_document" {
    defaults = {
      json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}"
    }
  }

  mock_data "aws_partition" {
    defaults = {
      partition = "aws"
    }
  }
}

variables {
  bucket_name               = "example-weights"
  prefix                    = "runs/exp1"
  publisher_principal_arns  = ["arn:aws:iam::123456789012:role/trainer"]
  subscriber_principal_arns = ["arn:aws:iam::123456789012:role/rollout"]
}

run "defaults_plan" {
  command = plan

  assert {
    condition     = output.replica_url == null
    error_message = "replica_url must be null when the replica is off."
  }
}

run "replica_needs_versioning" {
  command = plan

  variables {
    replica_enabled    = true
    versioning_enabled = false
  }

  expect_failures = [var.replica_enabled]
}

run "keyframes_must_outlive_deltas" {
  command = plan

  variables {
    delta_retention_days    = 14
    keyframe_retention_days = 7
  }

  expect_failures = [var.keyframe_retention_days]
}

run "keyframes_may_be_kept_forever" {
  command = plan

  variables {
    keyframe_retention_days = null
  }
}

run "prefix_without_slashes_at_the_ends" {
  command = plan

  variables {
    prefix = "/runs/exp1/"
  }

  expect_failures = [var.prefix]
}

run "kms_source_needs_replica_key" {
  command = plan

  variables {
    replica_enabled = true
    kms_key_arn     = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
  }

  expect_failures = [var.replica_kms_key_arn]
}

run "role_must_trust_someone" {
  command = plan

  variables {
    publisher_principal_arns = []
  }

  expect_failures = [aws_iam_role.this["publisher"]]
}
