"""Sparse checkpoints: a safetensors file in which each tensor is stored dense or as a bitmask plus its kept values.

Layout on disk, format version 2 (an ordinary safetensors file, no pickle):

* the file holds **one** safetensors entry, ``data``: ``uint8``, every tensor's bytes back to back;
* the header metadata key ``lightprune.sparse`` holds compact JSON: ``{"version":2,"tensors":[[name, dtype, shape,
  bitmask], ...]}`` in save order, ``dtype`` a safetensors code (``"F32"``, ``"BF16"``, ``"I8"``, ``"BOOL"``...),
  ``bitmask`` 1 for a tensor stored as bitmask plus values, 0 for one stored dense; a tensor held under several
  names (tied weights) is stored under the first, and the JSON's optional ``"aliases"`` lists the others as
  ``[name, stored name, position in the saved order]``;
* the entry's bytes: first one little-endian ``uint32`` CRC-32 per tensor, in table order; then each tensor in
  table order. A dense tensor is its ``n`` entries (row-major, its own dtype). A bitmask tensor is its packed mask,
  ``ceil(n / 8)`` bytes, entry ``i`` at bit ``i % 8`` of byte ``i // 8`` (least significant bit first, as
  ``numpy.unpackbits(..., bitorder="little")`` reads it), then the entries whose bit is set, in row-major order.
  Before each run of entries come zero bytes up to a multiple of the dtype's size (from the start of the entry),
  so every run can be viewed as its dtype in place.

An entry is "set" when its bit pattern is not all zeros, so ``-0.0`` and NaN are kept values and every tensor comes
back bit for bit. Each tensor is stored in whichever layout is smaller. The CRC-32 of each tensor is
``zlib.crc32`` of its table record as compact JSON (``json.dumps(record, separators=(",", ":"))``) continued over
its stored bytes (mask then values; padding excluded), so a tampered or truncated file fails with an error naming
the tensor.

One entry and a terse table keep the header to about 40 bytes per tensor: a 0.2 MB checkpoint of six tensors
stays within 2% of the information limit. Version 1 (one safetensors entry per tensor, a layout of development
versions before 0.1.0, never released) is refused with a message that says so.

Every tensor is packed, selected, unpacked and scattered by NumPy in chunks of :data:`CHUNK` entries (``packbits``,
``flatnonzero`` and an index gather or scatter, intermediates that stay in cache), and written or read with one
system call per run of bytes, no intermediate copy. Finding the kept entries (``flatnonzero``) is most of a load's
time; every other NumPy or torch route measured slower (BENCHMARKS.md, export section).
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor, nn

from lightprune.export._pruned import effective_state_dict, tensor_place

__all__ = ["SparseFileError", "load_sparse", "save_sparse", "stored_layouts"]

METADATA_KEY = "lightprune.sparse"
DATA_KEY = "data"
"""The one safetensors entry of a file (a ``uint8`` tensor holding every tensor's bytes)."""
FORMAT_VERSION = 2
CHUNK = 1 << 16
"""Entries handled at a time (a multiple of 8): the mask, index and scratch of a chunk stay in cache, and a large
tensor costs no more fresh memory than its own output."""

_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
"""Version 2's dtype codes: safetensors' own."""
_CODE_OF = {dtype: code for code, dtype in _CODES.items()}
_SUPPORTED = ", ".join(str(dtype).removeprefix("torch.") for dtype in _CODES.values())
_CODE_SIZES = {code: torch.empty((), dtype=dtype).element_size() for code, dtype in _CODES.items()}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LAYOUT_NAMES = {0: "dense", 1: "bitmask"}


class SparseFileError(ValueError):
    """A file that :func:`load_sparse` cannot read back exactly: not a lightprune sparse file, truncated or altered."""


def _bit_view(t: Tensor) -> Tensor:
    """``t`` viewed as unsigned/signed integers of the same width, so ``!= 0`` tests the bit pattern."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(_BITS[t.element_size()])


def _bits(t: Tensor) -> np.ndarray:
    """The flat NumPy integer view of a contiguous CPU tensor's bit patterns (no copy)."""
    return _bit_view(t.reshape(-1)).numpy()


def pack_bits(keep: Tensor) -> Tensor:
    """Pack a flat bool tensor into ``uint8``, 8 entries a byte, least significant bit first.

    Example:
        >>> pack_bits(torch.tensor([True, False, False, False, False, False, False, False, True]))
        tensor([1, 1], dtype=torch.uint8)
    """
    return torch.from_numpy(np.packbits(keep.reshape(-1).numpy(), bitorder="little"))


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits of ``packed`` as a flat bool tensor.

    Example:
        >>> unpack_bits(torch.tensor([1, 1], dtype=torch.uint8), 9).nonzero().flatten()
        tensor([0, 8])
    """
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(np.bool_))


def popcount(packed: Tensor | np.ndarray) -> int:
    """Number of set bits in a ``uint8`` tensor or array.

    Example:
        >>> popcount(torch.tensor([255, 1, 0], dtype=torch.uint8))
        9
    """
    array = packed.numpy() if isinstance(packed, Tensor) else packed
    return sum(
        int(np.count_nonzero(np.unpackbits(array[i : i + CHUNK]).view(np.bool_))) for i in range(0, array.size, CHUNK)
    )


def _pack_select(bits: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The packed bitmask of ``bits != 0`` (a flat integer array with ``count`` such entries) and those entries in
    order: per chunk, ``packbits`` of the test and a gather at its ``flatnonzero``."""
    n = bits.size
    packed = np.empty(-(-n // 8), dtype=np.uint8)
    values = np.empty(count, dtype=bits.dtype)
    keep = np.empty(min(n, CHUNK), dtype=np.bool_)
    offset = 0
    for start in range(0, n, CHUNK):
        part = bits[start : start + CHUNK]
        mask = np.not_equal(part, 0, out=keep[: part.size])
        packed[start // 8 : -(-(start + part.size) // 8)] = np.packbits(mask, bitorder="little")
        index = np.flatnonzero(mask)
        np.take(part, index, out=values[offset : offset + index.size], mode="clip")
        offset += index.size
    return packed, values


def _scatter(out: np.ndarray, packed: np.ndarray, values: np.ndarray) -> None:
    """Fill the flat integer array ``out``: zeros where the bit is clear, the next value where it is set."""
    offset = 0
    for start in range(0, out.size, CHUNK):
        part = out[start : start + CHUNK]
        index = np.flatnonzero(
            np.unpackbits(packed[start // 8 : -(-(start + part.size) // 8)], count=part.size, bitorder="little").view(
                np.bool_
            )
        )
        part.fill(0)
        part[index] = values[offset : offset + index.size]
        offset += index.size


def _empty(n: int, dtype: torch.dtype) -> Tensor:
    """A flat tensor in fresh NumPy memory, which NumPy advises the kernel to back with huge pages when large:
    filling 16 MB of it took 520 page faults here, against 4,100 for ``torch.empty`` (one per 4 kB page)."""
    size = _CODE_SIZES[_CODE_OF[dtype]]
    return torch.from_numpy(np.empty(n, dtype=np.uint8 if dtype == torch.bool else f"i{size}")).view(dtype)


def _record_crc(record: list[Any]) -> int:
    return zlib.crc32(json.dumps(record, separators=(",", ":")).encode())


class _Encoded:
    """One tensor as stored: its table record, the runs of bytes (with their alignment) and their CRC-32."""

    def __init__(self, name: str, tensor: Tensor) -> None:
        if tensor.dtype not in _CODE_OF:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored (supported: {_SUPPORTED})")
        size = tensor.element_size()
        bits = _bits(tensor)
        n = bits.size
        layout, self.runs = 0, [(bits, size)]
        count = int(np.count_nonzero(bits))
        if -(-n // 8) + count * size < n * size:
            layout, self.runs = 1, list(zip(_pack_select(bits, count), (1, size), strict=True))
        self.record = [name, _CODE_OF[tensor.dtype], list(tensor.shape), layout]
        crc = _record_crc(self.record)
        for run, _ in self.runs:
            crc = zlib.crc32(run, crc)
        self.crc = crc


def _write(path: str | os.PathLike[str], encoded: list[_Encoded], aliases: list[list[Any]] | None = None) -> None:
    """Write a file: the safetensors header, the CRC table, every run of bytes (zero-padded to align); ``aliases``
    (``[name, stored name, position]`` of each name holding a tensor stored under another) go in the table."""
    offset = 4 * len(encoded)
    placed = []
    for item in encoded:
        for run, align in item.runs:
            pad = -offset % align
            placed.append((pad, run))
            offset += pad + run.nbytes
    contents: dict[str, Any] = {"version": FORMAT_VERSION, "tensors": [item.record for item in encoded]}
    if aliases:
        contents["aliases"] = aliases
    table = json.dumps(contents, separators=(",", ":"))
    header = json.dumps(
        {
            "__metadata__": {METADATA_KEY: table},
            DATA_KEY: {"dtype": "U8", "shape": [offset], "data_offsets": [0, offset]},
        },
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, so every run is aligned in memory too
    # into a temporary file beside the target, then renamed over it: a failed or interrupted save leaves any
    # previous file at ``path`` whole
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save {str(path)!r}: its folder {str(path.parent)!r} does not exist")
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb", buffering=0) as handle:
            if path.exists():  # overwritten in place as open() would: the file keeps its permissions
                os.chmod(partial, stat.S_IMODE(path.stat().st_mode))
            _write_all(handle, struct.pack("<Q", len(header)) + header)
            _write_all(handle, np.array([item.crc for item in encoded], dtype="<u4"))
            for pad, run in placed:
                if pad:
                    _write_all(handle, bytes(pad))
                _write_all(handle, run)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _write_all(handle: BinaryIO, data: np.ndarray | bytes) -> None:
    """Write every byte (an unbuffered write may take fewer than it is given)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[handle.write(view) :]


def save_sparse(obj: nn.Module | Mapping[str, Tensor], path: str | os.PathLike[str]) -> None:
    """Write a model's tensors to a safetensors file, each dense or as bitmask plus kept values (the smaller).

    Args:
        obj: A module, plain or pruned (lightprune's or ``torch.nn.utils.prune``'s reparametrization: the file holds
            ``weight``, the pruned tensor ``weight_orig * weight_mask`` with exact zeros where pruned, instead of the
            pair), or a state_dict (``x_orig``/``x_mask`` pairs are folded the same way). A tensor held under
            several names (tied weights: an embedding and the output layer) is stored once.
        path: The file to write (``.safetensors`` by convention); replaced if present, only once the new file is
            complete (it is written beside it first), so a failed save leaves the previous file whole.

    Raises:
        TypeError: A key that is not a ``str``, a value that is not a plain tensor (a DTensor shard, say, or one on
            the meta device), or a dtype safetensors cannot store, naming the key.

    Example:
        >>> import tempfile
        >>> from lightprune import prune
        >>> layer = prune.l1_unstructured(nn.Linear(64, 64), "weight", amount=0.9)
        >>> path = Path(tempfile.mkdtemp()) / "layer.safetensors"
        >>> save_sparse(layer, path)
        >>> state = load_sparse(path)
        >>> sorted(state), torch.equal(state["weight"], layer.weight)
        (['bias', 'weight'], True)
        >>> stored_layouts(path)
        {'weight': 'bitmask', 'bias': 'dense'}
    """
    encoded, aliases = [], []
    stored: dict[tuple[Any, ...], str] = {}  # a tensor held under several names (tied weights) is stored once
    for position, (name, value) in enumerate(effective_state_dict(obj).items()):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"state_dict entry {name!r} is a {type(value).__name__}, not a tensor; only tensors can be saved"
            )
        if value.layout != torch.strided:
            raise TypeError(f"tensor {name!r} has layout {value.layout}; convert it to a dense tensor first")
        value = value.detach()
        if type(value) is not Tensor:
            hint = (
                "gather it first (`.full_tensor()`, or torch.distributed.checkpoint's get_model_state_dict with "
                "StateDictOptions(full_state_dict=True, cpu_offload=True)) and save on one rank"
                if hasattr(value, "full_tensor")
                else "convert it to a plain tensor first"
            )
            raise TypeError(f"tensor {name!r} is a {type(value).__name__}, not a plain tensor: {hint}")
        if value.is_meta:
            raise TypeError(f"tensor {name!r} is on the meta device: it holds no values to save")
        place = tensor_place(value)
        if place is not None and place in stored:
            aliases.append([name, stored[place], position])
            continue
        if place is not None:
            stored[place] = name
        encoded.append(_Encoded(name, value.to("cpu").contiguous()))
    _write(path, encoded, aliases)


# -------------------------------------------------------------------------------------------------------------------
# reading
# -------------------------------------------------------------------------------------------------------------------


def _read_header(path: str | os.PathLike[str]) -> tuple[dict, int, int]:
    """safetensors' JSON header, the offset of its data section and the file size; refuses what is no such file."""
    size = Path(path).stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise SparseFileError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise SparseFileError(
                f"{path}: not a safetensors file, or truncated inside its header (header length {length}, "
                f"file size {size} bytes)"
            )
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise SparseFileError(f"{path}: not a safetensors file (the header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise SparseFileError(f"{path}: not a safetensors file (the header is not a JSON object)")
    return header, 8 + length, size


def _table(path: str | os.PathLike[str], header: dict) -> list[Any]:
    """The tensor table of the header's lightprune metadata, refusing any format version but :data:`FORMAT_VERSION`."""
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or METADATA_KEY not in metadata:
        raise SparseFileError(
            f"{path}: a safetensors file without lightprune's '{METADATA_KEY}' metadata; it was not written by "
            "save_sparse (read a plain one with safetensors.torch.load_file)"
        )
    try:
        table = json.loads(metadata[METADATA_KEY])
        version, tensors = table["version"], table["tensors"]
    except (ValueError, KeyError, TypeError) as err:
        raise SparseFileError(f"{path}: the '{METADATA_KEY}' metadata is not valid ({err!r})") from None
    if version == 1:
        raise SparseFileError(
            f"{path}: sparse format version 1, a layout of lightprune's development versions before 0.1.0 that was "
            f"never released; this lightprune reads version {FORMAT_VERSION} only"
        )
    if version != FORMAT_VERSION:
        raise SparseFileError(
            f"{path}: sparse format version {version!r}; this lightprune reads version {FORMAT_VERSION}"
        )
    if not isinstance(tensors, list):
        raise SparseFileError(f"{path}: the '{METADATA_KEY}' metadata holds no tensor table")
    return tensors


def _aliases(path: str | os.PathLike[str], header: dict) -> list[tuple[str, str, int]]:
    """The ``(name, stored name, position)`` of each name the file holds as another's tensor (tied weights)."""
    found = json.loads(header["__metadata__"][METADATA_KEY]).get("aliases", [])
    ok = isinstance(found, list) and all(
        isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and isinstance(a[1], str) and type(a[2]) is int
        for a in found
    )
    if not ok:
        raise SparseFileError(f"{path}: the '{METADATA_KEY}' metadata's aliases are not [name, stored name, position]")
    return [(name, target, position) for name, target, position in found]


def _with_aliases(path: str | os.PathLike[str], out: dict[str, Tensor], aliases: list[tuple[str, str, int]]) -> dict:
    """``out`` with each alias holding its stored tensor (shared, as the tied weights were), in the saved order."""
    if not aliases:
        return out
    names: list[str | None] = [None] * (len(out) + len(aliases))
    for name, target, position in aliases:
        _check(target in out, path, name, f"it is an alias of {target!r}, which the file does not hold")
        _check(0 <= position < len(names) and names[position] is None, path, name, f"bad alias position {position}")
        names[position] = name
    stored = iter(out)
    names = [name if name is not None else next(stored) for name in names]
    targets = {name: target for name, target, _ in aliases}
    _check(len(set(names)) == len(names), path, names[0] or "?", "a name appears twice")
    return {name: out[targets.get(name, name)] for name in names if name is not None}


def _check(cond: bool, path: str | os.PathLike[str], name: str, what: str) -> None:
    if not cond:
        raise SparseFileError(f"{path}: tensor {name!r}: {what}")


def _check_shape(shape: object, path: str | os.PathLike[str], name: str) -> int:
    """The number of entries of a recorded shape, which must be a list of non-negative ints."""
    _check(
        isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape), path, name, f"bad shape {shape!r}"
    )
    n = 1
    for d in shape:
        n *= d
    return n


class _Reader:
    """Reads runs of a file's data section into fresh memory, naming the tensor when bytes are missing.

    A run that ends past the end of the file is a truncation when the file is shorter than its header says, and an
    altered bitmask (one that asks for more values than were written) when it is not.
    """

    def __init__(self, path: str | os.PathLike[str], handle: BinaryIO, start: int, size: int, declared: int) -> None:
        self.path, self.handle, self.start, self.size, self.declared = path, handle, start, size, declared

    def require(self, offset: int, nbytes: int, name: str) -> None:
        """Refuse a run that would end past the end of the file (before memory is allocated for it)."""
        end = self.start + offset + nbytes
        if end <= self.size:
            return
        if self.size >= self.start + self.declared:
            raise SparseFileError(
                f"{self.path}: tensor {name!r}: checksum mismatch: the file was altered or damaged (its layout asks "
                f"for bytes up to {end}, past the end of the data at {self.size})"
            )
        raise SparseFileError(
            f"{self.path}: truncated: tensor {name!r} needs bytes up to {end}, the file has {self.size}"
        )

    def into(self, target: np.ndarray, offset: int, name: str) -> None:
        self.require(offset, target.nbytes, name)
        view = memoryview(target).cast("B")
        self.handle.seek(self.start + offset)
        while view:
            got = self.handle.readinto(view)
            if not got:  # the file shrank while being read
                raise SparseFileError(f"{self.path}: truncated: tensor {name!r} (the file shrank while being read)")
            view = view[got:]


def _load(path: str | os.PathLike[str], header: dict, start: int, size: int, table: list) -> dict[str, Tensor]:
    entry = header.get(DATA_KEY)
    stray = sorted(key for key in header if key not in ("__metadata__", DATA_KEY))
    if stray:
        raise SparseFileError(f"{path}: entries {stray} are not part of a lightprune sparse file (file altered?)")
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise SparseFileError(f"{path}: the '{DATA_KEY}' entry is missing from the safetensors header (file altered?)")
    out: dict[str, Tensor] = {}
    with open(path, "rb", buffering=0) as handle:
        reader = _Reader(path, handle, start, size, offsets[1])
        crcs = np.empty(len(table), dtype="<u4")
        reader.into(crcs, 0, table[0][0] if table and isinstance(table[0], list) and table[0] else "?")
        offset = crcs.nbytes
        for index, record in enumerate(table):
            ok = isinstance(record, list) and len(record) == 4 and isinstance(record[0], str)
            name = record[0] if ok else f"#{index}"
            _check(ok, path, name, f"its table record {record!r} is not [name, dtype, shape, bitmask]")
            _, code, shape, layout = record
            _check(code in _CODES, path, name, f"unknown dtype {code!r}")
            _check(type(layout) is int and layout in _LAYOUT_NAMES, path, name, f"unknown layout {layout!r}")
            _check(name not in out, path, name, "it appears twice in the table")
            n = _check_shape(shape, path, name)
            dtype = _CODES[code]
            itemsize = _CODE_SIZES[code]
            reader.require(offset, -(-n // 8) if layout else -offset % itemsize + n * itemsize, name)
            result = _empty(n, dtype)
            bits = _bit_view(result).numpy()
            crc = _record_crc(record)
            if not layout:
                offset += -offset % itemsize
                reader.into(bits, offset, name)
                offset += bits.nbytes
                crc = zlib.crc32(bits, crc)
            else:
                packed = np.empty(-(-n // 8), dtype=np.uint8)
                reader.into(packed, offset, name)
                offset += packed.nbytes
                offset += -offset % itemsize
                values = np.empty(popcount(packed), dtype=bits.dtype)
                reader.into(values, offset, name)
                offset += values.nbytes
                crc = zlib.crc32(values, zlib.crc32(packed, crc))
            _check(crc == int(crcs[index]), path, name, "checksum mismatch: the file was altered or damaged")
            if layout:
                _check(not n % 8 or not packed[-1] >> (n % 8), path, name, "the bitmask has bits past the end")
                _scatter(bits, packed, values)
            out[name] = result.view(shape)
        if offsets != [0, offset] or start + offset != size:
            raise SparseFileError(
                f"{path}: the data section holds {size - start} bytes, the tensors take {offset} (file altered?)"
            )
    return out


def load_sparse(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a file written by :func:`save_sparse` back into a plain state_dict of dense tensors.

    Every tensor comes back exactly as saved: dtype, shape and every bit (zeros where pruned), each in its own
    memory, except that the names of one tied tensor share it, as they did when saved. The result loads into an
    unpruned model with ``model.load_state_dict(state)``.

    Args:
        path: The file.

    Returns:
        ``{name: tensor}`` in the order the tensors were saved.

    Raises:
        SparseFileError: The file is not a safetensors file, was not written by :func:`save_sparse`, is truncated,
            or a tensor's bytes or layout were altered (checksum mismatch); the message names the tensor.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "state.safetensors"
        >>> save_sparse({"w": torch.tensor([[0.0, 2.5], [0.0, 0.0]])}, path)
        >>> load_sparse(path)
        {'w': tensor([[0.0000, 2.5000],
                [0.0000, 0.0000]])}
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such file: {path}")
    header, start, size = _read_header(path)
    out = _load(path, header, start, size, _table(path, header))
    return _with_aliases(path, out, _aliases(path, header))


def stored_layouts(path: str | os.PathLike[str]) -> dict[str, str]:
    """How each tensor of a :func:`save_sparse` file is stored: ``{name: "dense" | "bitmask"}``, from the header
    (``"alias of <name>"`` for a tied tensor stored under another name, after the stored ones).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "s.safetensors"
        >>> save_sparse({"zeros": torch.zeros(1000), "ones": torch.ones(1000)}, path)
        >>> stored_layouts(path)
        {'zeros': 'bitmask', 'ones': 'dense'}
    """
    header, _, _ = _read_header(path)
    layouts: dict[str, str] = {
        record[0]: _LAYOUT_NAMES.get(record[3], "unknown")
        for record in _table(path, header)
        if isinstance(record, list) and len(record) == 4 and isinstance(record[0], str)
    }
    for name, target, _ in _aliases(path, header):
        layouts[name] = f"alias of {target}"
    return layouts
