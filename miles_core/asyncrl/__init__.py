"""Asynchronous ADPO (ARCHITECTURE.md, "One asynchronous iteration"): sampler workers and one learner that share only
a store URI. Samplers hot-swap LoRA versions and commit batches; the learner consumes them within
a staleness bound, checkpoints its state with an exactly-once ledger and publishes adapters."""
