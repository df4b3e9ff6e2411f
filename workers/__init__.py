"""One worker per GPU: its shard of the model, its state pools, its collectives."""
