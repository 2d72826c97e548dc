"""Training data: the shard format (shards), documents from text files (sources), tokenizers
(tokenizer), memory-mapped windows (windows), a run's data found and checked (dataset) and the
resumable loader (loader). `fastpt.data.read_shard` / `write_shard`: the shard format's API."""

from fastpt.data.shards import read_shard, write_shard

__all__ = ["read_shard", "write_shard"]
