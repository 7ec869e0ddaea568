"""Sparse checkpoints: a safetensors file in which each tensor is stored dense or as a bitmask plus its kept values.

Layout on disk (an ordinary safetensors file, no pickle):

* a tensor stored **dense** sits under its own name, as in any safetensors file;
* a tensor stored as a **bitmask** is two entries: ``<name>.__bitmask__``, ``uint8`` holding one bit per entry
  (entry ``i`` is bit ``i % 8`` of byte ``i // 8``, least significant bit first, as
  ``numpy.unpackbits(..., bitorder="little")`` reads it), and ``<name>.__values__``, the entries whose bit is set,
  in row-major order, in the tensor's own dtype;
* the header metadata key ``lightprune.sparse`` holds JSON: ``{"version": 1, "tensors": {name: {"layout":
  "dense" | "bitmask", "dtype": "float32", "shape": [...], "crc32": ...}}}``.

An entry is "set" when its bit pattern is not all zeros, so ``-0.0`` and NaN are kept values and every tensor comes
back bit for bit. Each tensor is stored in whichever layout is smaller. The CRC-32 of each tensor covers its name,
dtype, shape, layout and stored bytes, so a tampered or truncated file fails with an error naming the tensor.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from lightprune.export._pruned import effective_state_dict

__all__ = ["SparseFileError", "load_sparse", "save_sparse", "stored_layouts"]

METADATA_KEY = "lightprune.sparse"
FORMAT_VERSION = 1
BITMASK_SUFFIX = ".__bitmask__"
VALUES_SUFFIX = ".__values__"
HEADER_COST = 160
"""Bytes the two extra header entries of a bitmask tensor cost, roughly: a bitmask must beat dense by this much."""

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")),
    )
}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GATHER_BITS = 0x0102040810204080
"""Byte ``j`` holds ``2 ** (7 - j)``: multiplying eight 0/1 bytes by it collects them in the top byte."""
_UNPACK_TABLE = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(torch.uint8).view(torch.int64).squeeze(1)
"""For each byte value, its 8 bits as 8 bytes (0 or 1) read as one int64: one gather unpacks a byte."""
_POPCOUNT = _UNPACK_TABLE.view(torch.uint8).view(256, 8).sum(1)


class SparseFileError(ValueError):
    """A file that :func:`load_sparse` cannot read back exactly: not a lightprune sparse file, truncated or altered."""


def _name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bit_view(t: Tensor) -> Tensor:
    """``t`` viewed as unsigned/signed integers of the same width, so ``!= 0`` tests the bit pattern."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(_BITS[t.element_size()])


def pack_bits(keep: Tensor) -> Tensor:
    """Pack a flat bool tensor into ``uint8``, 8 entries a byte, least significant bit first.

    Eight bools (bytes 0 or 1) are read as one int64 and gathered into its top byte by one multiplication:
    entry ``i`` of the group, at bit ``8 i``, times ``2 ** (7 - j)`` at byte ``j`` lands at bit ``56 + i`` when
    ``i + j == 7``, and no two partial products overlap, so nothing carries into the top byte.

    Example:
        >>> pack_bits(torch.tensor([True, False, False, False, False, False, False, False, True]))
        tensor([1, 1], dtype=torch.uint8)
    """
    flat = keep.reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n % 8:
        padded = torch.zeros(n + 8 - n % 8, dtype=torch.uint8)
        padded[:n] = flat
        flat = padded
    if not flat.is_contiguous() or flat.storage_offset() % 8:
        flat = flat.clone()  # an int64 view needs contiguous, 8-byte aligned storage
    groups = flat.view(torch.int64)
    return groups.mul(_GATHER_BITS).bitwise_right_shift_(56).to(torch.uint8)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits of ``packed`` as a flat bool tensor.

    Example:
        >>> unpack_bits(torch.tensor([1, 1], dtype=torch.uint8), 9).nonzero().flatten()
        tensor([0, 8])
    """
    return _UNPACK_TABLE[packed.long()].view(torch.uint8)[:n].view(torch.bool)


CHUNK = 1 << 20
"""Entries handled at a time (a multiple of 64): scratch buffers are reused from chunk to chunk, so a large tensor
costs no more fresh memory (and page faults) than its own output."""


def _pack_chunks(bits: Tensor) -> tuple[Tensor, list[int]]:
    """The packed bitmask of ``bits != 0`` (a flat integer view) and the number of set bits of each chunk."""
    n = bits.numel()
    packed = torch.empty(-(-n // 8), dtype=torch.uint8)
    keep = torch.empty(CHUNK, dtype=torch.bool)
    counts_scratch = torch.empty(CHUNK // 8, dtype=torch.int64)
    counts = []
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        chunk_keep = keep[: stop - start]
        torch.ne(bits[start:stop], 0, out=chunk_keep)
        chunk_packed = packed[start // 8 : -(-stop // 8)]
        chunk_packed.copy_(pack_bits(chunk_keep))
        index = counts_scratch[: chunk_packed.numel()]
        index.copy_(chunk_packed)
        counts.append(int(_POPCOUNT.index_select(0, index).sum()))
    return packed, counts


def _select_chunks(bits: Tensor, counts: list[int]) -> Tensor:
    """The entries of the flat integer view ``bits`` that are not zero, in order, chunk by chunk into one tensor."""
    values = torch.empty(sum(counts), dtype=bits.dtype)
    offset = 0
    for chunk, start in enumerate(range(0, bits.numel(), CHUNK)):
        part = bits[start : start + CHUNK]
        torch.index_select(part, 0, part.nonzero().squeeze(1), out=values[offset : offset + counts[chunk]])
        offset += counts[chunk]
    return values


def _unpack_into(packed: Tensor, n: int, index: Tensor, spread: Tensor) -> Tensor:
    m = packed.numel()
    index[:m].copy_(packed)
    torch.index_select(_UNPACK_TABLE, 0, index[:m], out=spread[:m])
    return spread[:m].view(torch.uint8)[:n].view(torch.bool)


def _scatter_chunks(out: Tensor, packed: Tensor, values: Tensor) -> None:
    """Fill the flat integer view ``out``: zeros where the bit is clear, the next value where it is set."""
    n = out.numel()
    index = torch.empty(CHUNK // 8, dtype=torch.int64)
    spread = torch.empty(CHUNK // 8, dtype=torch.int64)
    offset = 0
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        keep = _unpack_into(packed[start // 8 : -(-stop // 8)], stop - start, index, spread)
        count = int(_POPCOUNT.index_select(0, index[: -(-(stop - start) // 8)]).sum())
        chunk = out[start:stop]
        chunk.zero_()
        chunk.masked_scatter_(keep, values[offset : offset + count])
        offset += count


def popcount(packed: Tensor) -> int:
    """Number of set bits in a ``uint8`` tensor (a table lookup per byte: far faster than summing bools).

    Example:
        >>> popcount(torch.tensor([255, 1, 0], dtype=torch.uint8))
        9
    """
    return int(_POPCOUNT[packed.long()].sum())


def _crc(name: str, dtype: str, shape: list[int], layout: str, parts: list[Tensor]) -> int:
    crc = zlib.crc32(json.dumps([name, dtype, shape, layout]).encode())
    for part in parts:
        crc = zlib.crc32(part.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def _encode(name: str, tensor: Tensor) -> tuple[dict[str, Tensor], dict[str, object]]:
    """Stored entries and layout record of one tensor: bitmask plus values when that is smaller, else dense."""
    dtype = _name_of(tensor.dtype)
    if dtype not in _DTYPES:
        raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot be stored (supported: {', '.join(_DTYPES)})")
    shape = list(tensor.shape)
    flat = tensor.reshape(-1)
    layout, stored = "dense", {name: tensor}
    n = flat.numel()
    if n * tensor.element_size() > HEADER_COST:
        packed, counts = _pack_chunks(_bit_view(flat))
        if -(-n // 8) + sum(counts) * tensor.element_size() + HEADER_COST < n * tensor.element_size():
            layout = "bitmask"
            values = _select_chunks(_bit_view(flat), counts).view(tensor.dtype)
            stored = {name + BITMASK_SUFFIX: packed, name + VALUES_SUFFIX: values}
    record = {
        "layout": layout,
        "dtype": dtype,
        "shape": shape,
        "crc32": _crc(name, dtype, shape, layout, [*stored.values()]),
    }
    return stored, record


def save_sparse(obj: nn.Module | Mapping[str, Tensor], path: str | os.PathLike[str]) -> None:
    """Write a model's tensors to a safetensors file, each dense or as bitmask plus kept values (the smaller).

    Args:
        obj: A module, plain or pruned (lightprune's or ``torch.nn.utils.prune``'s reparametrization: the file holds
            ``weight``, the pruned tensor ``weight_orig * weight_mask`` with exact zeros where pruned, instead of the
            pair), or a state_dict (``x_orig``/``x_mask`` pairs are folded the same way).
        path: The file to write (``.safetensors`` by convention); overwritten if present.

    Raises:
        TypeError: A value that is not a tensor, or a dtype safetensors cannot store, naming the key.
        ValueError: Two keys that would collide on disk, naming them.

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
    tensors: dict[str, Tensor] = {}
    records: dict[str, object] = {}
    storages: set[int] = set()
    for name, value in effective_state_dict(obj).items():
        if not isinstance(value, Tensor):
            raise TypeError(
                f"state_dict entry {name!r} is a {type(value).__name__}, not a tensor; only tensors can be saved"
            )
        if value.layout != torch.strided:
            raise TypeError(f"tensor {name!r} has layout {value.layout}; convert it to a dense tensor first")
        tensor = value.detach().to("cpu").contiguous()
        stored, record = _encode(name, tensor)
        for key, part in stored.items():
            if key in tensors:
                raise ValueError(f"tensor {name!r}: its stored key {key!r} collides with another entry of the file")
            if part.numel() and part.untyped_storage().data_ptr() in storages:  # safetensors refuses shared memory
                part = part.clone()
            storages.add(part.untyped_storage().data_ptr())
            tensors[key] = part
        records[name] = record
    metadata = {METADATA_KEY: json.dumps({"version": FORMAT_VERSION, "tensors": records})}
    save_file(tensors, str(path), metadata=metadata)


def _read_header(path: str | os.PathLike[str]) -> tuple[dict, int]:
    """safetensors' JSON header and the file size, for diagnosing files safetensors itself refuses."""
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
    return header, size


def _diagnose(path: str | os.PathLike[str], err: Exception) -> SparseFileError:
    """A clear error for a file safetensors refuses: name the first tensor whose bytes are missing, if any."""
    try:
        header, size = _read_header(path)
    except SparseFileError as clear:
        return clear
    data_start = 8 + struct.unpack("<Q", open(path, "rb").read(8))[0]  # noqa: SIM115 - 8 bytes, closed by gc
    for key, entry in header.items():
        if key == "__metadata__" or not isinstance(entry, dict):
            continue
        end = data_start + int(entry.get("data_offsets", [0, 0])[1])
        if end > size:
            return SparseFileError(
                f"{path}: truncated: tensor {_owner(key)!r} (stored entry {key!r}) needs bytes up to {end}, the file "
                f"has {size}"
            )
    return SparseFileError(f"{path}: safetensors cannot read it: {err}")


def _owner(key: str) -> str:
    for suffix in (BITMASK_SUFFIX, VALUES_SUFFIX):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def _layout_table(path: str | os.PathLike[str], metadata: dict[str, str] | None) -> dict[str, dict]:
    if not metadata or METADATA_KEY not in metadata:
        raise SparseFileError(
            f"{path}: a safetensors file without lightprune's '{METADATA_KEY}' metadata; it was not written by "
            "save_sparse (read a plain one with safetensors.torch.load_file)"
        )
    try:
        table = json.loads(metadata[METADATA_KEY])
        version, tensors = table["version"], table["tensors"]
    except (ValueError, KeyError, TypeError) as err:
        raise SparseFileError(f"{path}: the '{METADATA_KEY}' metadata is not valid ({err!r})") from None
    if version != FORMAT_VERSION:
        raise SparseFileError(f"{path}: sparse format version {version!r}; this lightprune reads {FORMAT_VERSION}")
    if not isinstance(tensors, dict):
        raise SparseFileError(f"{path}: the '{METADATA_KEY}' metadata holds no tensor table")
    return tensors


def _check(cond: bool, path: str | os.PathLike[str], name: str, what: str) -> None:
    if not cond:
        raise SparseFileError(f"{path}: tensor {name!r}: {what}")


def _decode(path: str | os.PathLike[str], handle, keys: set[str], name: str, record: object) -> Tensor:
    _check(isinstance(record, dict), path, name, "its layout record is not a JSON object")
    layout, dtype_name, shape, crc = (record.get(k) for k in ("layout", "dtype", "shape", "crc32"))
    _check(dtype_name in _DTYPES, path, name, f"unknown dtype {dtype_name!r}")
    _check(
        isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape),
        path,
        name,
        f"bad shape {shape!r}",
    )
    dtype = _DTYPES[dtype_name]
    n = 1
    for d in shape:
        n *= d
    if layout == "dense":
        _check(name in keys, path, name, "its data is missing from the file")
        tensor = handle.get_tensor(name)
        _check(tensor.dtype == dtype, path, name, f"stored as {tensor.dtype}, the layout says {dtype_name}")
        _check(
            list(tensor.shape) == shape, path, name, f"stored with shape {list(tensor.shape)}, the layout says {shape}"
        )
        parts = [tensor]
    elif layout == "bitmask":
        mask_key, values_key = name + BITMASK_SUFFIX, name + VALUES_SUFFIX
        _check(mask_key in keys and values_key in keys, path, name, "its bitmask or values are missing from the file")
        packed, values = handle.get_tensor(mask_key), handle.get_tensor(values_key)
        _check(
            packed.dtype == torch.uint8 and packed.shape == (-(-n // 8),), path, name, "the bitmask has the wrong size"
        )
        _check(values.dtype == dtype and values.dim() == 1, path, name, f"the values are not a 1-D {dtype_name} tensor")
        parts = [packed, values]
    else:
        raise SparseFileError(f"{path}: tensor {name!r}: unknown layout {layout!r}")
    _check(
        _crc(name, dtype_name, shape, layout, parts) == crc,
        path,
        name,
        "checksum mismatch: the file was altered or damaged after it was written",
    )
    if layout == "dense":
        return tensor
    _check(popcount(packed) == values.numel(), path, name, "the bitmask and the number of values disagree")
    out = torch.empty(n, dtype=dtype)
    _scatter_chunks(_bit_view(out), packed, _bit_view(values))
    return out.view(shape)


def load_sparse(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a file written by :func:`save_sparse` back into a plain state_dict of dense tensors.

    Every tensor comes back exactly as saved: dtype, shape and every bit (zeros where pruned). The result loads into
    an unpruned model with ``model.load_state_dict(state)``.

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
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
            keys = set(handle.keys())
            table = _layout_table(path, metadata)
            out = {name: _decode(path, handle, keys, name, record) for name, record in table.items()}
            stray = keys - {k for name in table for k in (name, name + BITMASK_SUFFIX, name + VALUES_SUFFIX)}
            if stray:
                raise SparseFileError(f"{path}: entries {sorted(stray)} are not in the layout table (file altered?)")
            return out
    except SafetensorError as err:
        raise _diagnose(path, err) from None


def stored_layouts(path: str | os.PathLike[str]) -> dict[str, str]:
    """How each tensor of a :func:`save_sparse` file is stored: ``{name: "dense" | "bitmask"}``, from the header.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "s.safetensors"
        >>> save_sparse({"zeros": torch.zeros(1000), "ones": torch.ones(1000)}, path)
        >>> stored_layouts(path)
        {'zeros': 'bitmask', 'ones': 'dense'}
    """
    try:
        with safe_open(str(path), framework="pt") as handle:
            table = _layout_table(path, handle.metadata())
    except SafetensorError as err:
        raise _diagnose(path, err) from None
    return {name: record.get("layout") if isinstance(record, dict) else None for name, record in table.items()}
