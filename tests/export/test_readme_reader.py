"""The reader for save_sparse files in docs/export.md, which uses safetensors and torch only, reads them exactly."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from lightprune import prune
from lightprune.export import load_sparse, save_sparse

README = Path(__file__).resolve().parents[2] / "docs" / "export.md"


def _reader():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    (source,) = [b for b in blocks if "def read_sparse_safetensors" in b]
    namespace: dict = {}
    exec(compile(source, str(README), "exec"), namespace)
    return namespace["read_sparse_safetensors"]


def test_readme_reader_reads_every_dtype_save_sparse_writes(tmp_path):
    from lightprune.export.sparse_file import _CODES

    read = _reader()
    tensors = {}
    for code, dtype in _CODES.items():
        values = torch.zeros(64)
        values[::7] = torch.arange(1, 11, dtype=torch.float32)  # mostly zeros: stored sparse
        tensors[code] = values.to(dtype)
    path = tmp_path / "dtypes.safetensors"
    save_sparse(tensors, path)
    want, got = load_sparse(path), read(str(path))
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_readme_reader_matches_load_sparse(tmp_path):
    read = _reader()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 10)).to(torch.bfloat16)
    prune.l1_unstructured(model[0], "weight", amount=0.9)
    path = tmp_path / "m.safetensors"
    extra = {
        "flags": torch.rand(77) < 0.1,
        "scalar": torch.tensor(-0.5, dtype=torch.float64),
        "i8": torch.arange(5).to(torch.int8),
    }
    save_sparse({**model.state_dict(), "step": torch.tensor(7), "zeros": torch.zeros(3, 999), **extra}, path)
    want, got = load_sparse(path), read(str(path))
    assert list(got) == list(want) == ["0.weight", "0.bias", "2.weight", "2.bias", "step", "zeros", *extra]
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
