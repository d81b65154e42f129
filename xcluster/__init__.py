"""xcluster: lossless delta transport of model weights over object storage."""
