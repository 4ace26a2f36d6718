"""Evaluation: pass@k and the config record that travels with every number."""

from miles_core.eval.passk import EvalConfig, EvalResult, aggregate_pass_at_k, pass_at_k

__all__ = ["EvalConfig", "EvalResult", "aggregate_pass_at_k", "pass_at_k"]
