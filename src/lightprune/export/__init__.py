"""``lightprune.export``: take a pruned model somewhere smaller and faster.

* :func:`save_sparse` / :func:`load_sparse` - a safetensors checkpoint storing each tensor dense or as a packed
  bitmask plus its kept values, whichever is smaller; loads back bit for bit into a plain state_dict.
* :func:`compact` - a smaller model with the pruned channels of Linear/Conv layers physically removed, computing
  the same function (constants of removed channels folded into the next layer's bias).
"""

from lightprune.export.compact import CompactError, compact
from lightprune.export.sparse_file import SparseFileError, load_sparse, save_sparse, stored_layouts

__all__ = ["CompactError", "SparseFileError", "compact", "load_sparse", "save_sparse", "stored_layouts"]
