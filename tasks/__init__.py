"""Prefect tasks around :mod:`miles_core`: paths, URIs and small dicts in and out (ARCHITECTURE.md).
MLflow is reached only through the ``tracking`` package."""
