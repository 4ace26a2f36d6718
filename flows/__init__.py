"""Prefect flows: SFT baseline, synchronous ADPO training, evaluation. ARCHITECTURE.md.

Each flow reads top-down, calls tasks from :mod:`tasks` (which own the models and MLflow), and also
runs as ``python -m flows.<name>``. Entry points for deployments: ``flows/sft.py:sft_flow``,
``flows/train.py:train_flow``, ``flows/evaluate.py:evaluate_flow``.
"""
