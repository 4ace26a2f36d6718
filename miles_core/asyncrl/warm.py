"""What an asynchronous worker imports, paid before its loop instead of inside its first batch.

py-spy on the forked workers found pyarrow importing pandas the first time it builds
an array from numpy (it checks whether the object is a pandas one): 0.5 s alone, 1 to 1.5 s with
the other worker computing, inside the first commit of the learner and of every sampler, so
inside the learner's loop. Importing this module does it once. The local launcher's fork server
preloads this module, so every forked worker starts with it done. A fresh interpreter
(``python -m miles_core.asyncrl``) imports it before it builds its worker.

Nothing here runs Parquet I/O or starts a thread pool: the fork server forks after importing
this, and a pool's threads would not exist in the children.
"""

from __future__ import annotations

import numpy as np
import peft  # noqa: F401  (with transformers: most of a worker's ~10 s of imports)
import pyarrow as pa
import pyarrow.dataset  # noqa: F401  (the store's reads go through it)
import pyarrow.parquet  # noqa: F401
import torch  # noqa: F401

import miles_core.asyncrl.learner  # noqa: F401
import miles_core.asyncrl.sampler  # noqa: F401


def warm_arrow() -> None:
    """Build one Arrow array from numpy: pyarrow's lazy pandas import happens here."""
    pa.array(np.zeros(1, dtype=np.int64), type=pa.int64())


warm_arrow()
