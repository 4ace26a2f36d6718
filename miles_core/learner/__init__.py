"""What a training run drives: the policy state (policy.py), the run around it with its ledger,
checkpoints and published adapters (runtime.py), and the SFT baseline it starts from (baseline.py)."""
