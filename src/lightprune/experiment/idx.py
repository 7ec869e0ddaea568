"""The MNIST IDX file format, gzip-compressed or not: :func:`read_idx` and :func:`write_idx`.

An IDX file is a big-endian header (two zero bytes, a type code, the number of dimensions, each size as a 32-bit
integer) followed by the values. MNIST, Fashion-MNIST, KMNIST and others ship their images and labels this way.
Only torch and numpy are needed (no Lightning): :mod:`lightprune.experiment.data` builds data sets on it.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["read_idx", "write_idx"]

# IDX type code -> (big-endian numpy dtype, torch dtype)
_IDX_DTYPES: dict[int, tuple[str, torch.dtype]] = {
    0x08: (">u1", torch.uint8),
    0x09: (">i1", torch.int8),
    0x0B: (">i2", torch.int16),
    0x0C: (">i4", torch.int32),
    0x0D: (">f4", torch.float32),
    0x0E: (">f8", torch.float64),
}
_TORCH_TO_IDX = {torch_dtype: code for code, (_, torch_dtype) in _IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | Path) -> Tensor:
    """Reads an IDX file (the MNIST format), plain or gzip-compressed.

    Compression is detected from the file's first bytes, not from its name. The header is two zero bytes, a type
    code (``0x08`` uint8, ``0x09`` int8, ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32, ``0x0E`` float64), the
    number of dimensions, then each dimension as a big-endian uint32; the big-endian data follow.

    Args:
        path: The file.

    Returns:
        A tensor of the file's shape and dtype (native byte order).

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: The file is not valid IDX: bad magic, unknown type code, truncated or with trailing bytes, or a
            corrupt gzip stream. The message names the file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = write_idx(Path(tmp) / "x-idx2-ubyte.gz", torch.arange(6, dtype=torch.uint8).reshape(2, 3))
        ...     read_idx(path)
        tensor([[0, 1, 2],
                [3, 4, 5]], dtype=torch.uint8)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise ValueError(f"{path}: corrupt or truncated gzip stream ({err})") from err
    if len(raw) < 4:
        raise ValueError(f"{path}: too short for an IDX header ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (the first two bytes are {raw[:2].hex()}, expected 0000)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise ValueError(f"{path}: unknown IDX type code 0x{code:02X} (known: {known})")
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, {ndim} dimensions need {header_size})")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    np_dtype, torch_dtype = _IDX_DTYPES[code]
    expected = math.prod(shape) * np.dtype(np_dtype).itemsize
    found = len(raw) - header_size
    if found != expected:
        problem = "truncated" if found < expected else "has trailing bytes"
        raise ValueError(f"{path}: {problem}: shape {shape} needs {expected} data bytes, found {found}")
    data = np.frombuffer(raw, dtype=np_dtype, offset=header_size).reshape(shape)
    array = data.astype(np.dtype(np_dtype).newbyteorder("="))  # native byte order, and a writable copy
    return torch.from_numpy(array).to(torch_dtype)


def write_idx(path: str | Path, tensor: Tensor, compress: bool | None = None) -> Path:
    """Writes a tensor as an IDX file, the inverse of :func:`read_idx`.

    Args:
        path: Destination; parent directories are created.
        tensor: uint8, int8, int16, int32, float32 or float64 data with at most 255 dimensions.
        compress: gzip the file; default: when ``path`` ends in ``.gz``. The gzip header carries no timestamp, so
            the same tensor always gives the same bytes.

    Returns:
        ``path`` as a ``Path``.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = write_idx(Path(tmp) / "labels-idx1-ubyte", torch.tensor([7, 2], dtype=torch.uint8))
        ...     path.read_bytes().hex()
        '00000801000000020702'
    """
    path = Path(path)
    tensor = torch.as_tensor(tensor).detach().cpu()
    if tensor.dtype not in _TORCH_TO_IDX:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in _TORCH_TO_IDX)
        raise ValueError(f"IDX cannot store {tensor.dtype}; use one of {allowed}")
    if tensor.ndim > 255:
        raise ValueError(f"IDX stores at most 255 dimensions, got {tensor.ndim}")
    code = _TORCH_TO_IDX[tensor.dtype]
    header = bytes([0, 0, code, tensor.ndim]) + np.asarray(tensor.shape, dtype=">u4").tobytes()
    body = tensor.numpy().astype(_IDX_DTYPES[code][0]).tobytes()
    payload = header + body
    if compress is None:
        compress = path.suffix == ".gz"
    if compress:
        payload = gzip.compress(payload, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    return path
