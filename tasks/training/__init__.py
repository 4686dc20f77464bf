"""Training: webdataset shards on storage, the torchrun entry point, checkpoints."""
