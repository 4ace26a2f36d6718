"""Prefect tasks around :mod:`miles_core`, and the one module that talks to MLflow.

Kept import-free on purpose: the registered MLflow model ships ``tasks/pyfunc_model.py`` inside
its own code folder, and loading it must not pull in Prefect or the training tasks.
"""
