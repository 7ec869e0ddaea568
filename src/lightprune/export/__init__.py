"""``lightprune.export``: take a pruned model somewhere smaller and faster.

* :func:`save_sparse` / :func:`load_sparse` - a safetensors checkpoint storing each tensor dense or as a packed
  bitmask plus its kept values, whichever is smaller; loads back bit for bit into a plain state_dict.
"""

from lightprune.export.sparse_file import SparseFileError, load_sparse, save_sparse, stored_layouts

__all__ = ["SparseFileError", "load_sparse", "save_sparse", "stored_layouts"]
