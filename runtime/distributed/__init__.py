"""Process groups of tensor parallelism and the collectives the model calls (torch.distributed)."""
