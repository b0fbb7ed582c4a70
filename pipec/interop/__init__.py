"""Other formats: torch.distributed.pipelining's CSV and `.pipe` source writing."""
