"""Generation from a checkpoint (tools/generate.py): the KV-cache decode loop, token choice, the command line."""
