"""Miles command-line front end (``miles``); the algorithm library is :mod:`miles_core`.

This package stays import-light on purpose: ``miles --help`` must not pay for torch, prefect or
mlflow, so everything heavy is imported inside the subcommand that needs it.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__: str = metadata.version("miles")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
