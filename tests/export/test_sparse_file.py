"""save_sparse / load_sparse: exact round trips, the smaller layout, pruned modules, and files that must be refused."""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightprune import prune
from lightprune.export import SparseFileError, load_sparse, save_sparse, stored_layouts
from lightprune.export.sparse_file import _CODES, effective_state_dict, pack_bits, unpack_bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8]
SPARSITIES = [0.0, 0.5, 0.9, 0.999, 1.0]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(_INT_VIEW[t.element_size()])


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), "bit patterns differ"


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, sparsity: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    else:
        t = torch.randint(-128, 128, shape, generator=g, dtype=torch.int16).to(dtype)
    n = t.numel()
    pruned = torch.randperm(n, generator=g)[: round(sparsity * n)]
    t.view(-1)[pruned] = 0
    return t


shapes = st.lists(st.integers(0, 33), min_size=0, max_size=4).map(tuple)


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    sparsity=st.sampled_from(SPARSITIES),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_bit_exact(tmp_path_factory, dtype, shape, sparsity, seed):
    t = random_tensor(shape, dtype, sparsity, seed)
    path = tmp_path_factory.mktemp("rt") / "t.safetensors"
    save_sparse({"t": t, "scalar": torch.tensor(1.5, dtype=torch.float64)}, path)
    out = load_sparse(path)
    assert list(out) == ["t", "scalar"]
    assert_identical(out["t"], t)
    assert_identical(out["scalar"], torch.tensor(1.5, dtype=torch.float64))
    kept = int((bits(t) != 0).sum())
    # whichever layout is smaller: a bitmask only when it saves bytes
    if stored_layouts(path)["t"] == "bitmask":
        assert math.ceil(t.numel() / 8) + kept * t.element_size() < t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_large_round_trip_and_size_near_the_information_limit(tmp_path, dtype, sparsity):
    t = random_tensor((256, 384), dtype, sparsity, seed=7)
    path = tmp_path / "t.safetensors"
    save_sparse({"w": t}, path)
    assert_identical(load_sparse(path)["w"], t)
    n, size = t.numel(), t.element_size()
    kept = int((bits(t) != 0).sum())
    payload = min(n * size, math.ceil(n / 8) + kept * size)
    header = path.stat().st_size - payload
    assert 0 < header < 400, header  # the file is the smaller layout plus a small header
    assert stored_layouts(path)["w"] == ("bitmask" if payload < n * size else "dense")


def test_special_values_survive(tmp_path):
    t = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 0.0, 0.0] * 64)
    nan_payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    t[3] = nan_payload
    save_sparse({"t": t, "b": t != 0}, tmp_path / "s.safetensors")
    out = load_sparse(tmp_path / "s.safetensors")
    assert_identical(out["t"], t)
    assert torch.equal(out["b"], t != 0) and out["b"].dtype == torch.bool


def test_pack_bits_matches_the_documented_bit_order():
    keep = torch.rand(1001) < 0.3
    packed = pack_bits(keep)
    assert packed.numel() == 126
    expected = [sum(int(keep[8 * j + i]) << i for i in range(8) if 8 * j + i < 1001) for j in range(126)]
    assert packed.tolist() == expected
    assert torch.equal(unpack_bits(packed, 1001), keep)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 10), nn.BatchNorm1d(10))


@pytest.mark.parametrize("engine", ["lightprune", "torch", "lightprune-bool"])
def test_pruned_module_saves_the_pruned_weights(tmp_path, engine):
    model = _mlp()
    p = torch_prune if engine == "torch" else prune
    if engine == "lightprune-bool":
        with prune.mask_dtype(torch.bool):
            prune.l1_unstructured(model[0], "weight", amount=0.9)
            prune.ln_structured(model[2], "weight", amount=0.5, n=2, dim=0)
    else:
        p.l1_unstructured(model[0], "weight", amount=0.9)
        p.ln_structured(model[2], "weight", amount=0.5, n=2, dim=0)
    model(torch.randn(4, 40))
    save_sparse(model, tmp_path / "m.safetensors")
    state = load_sparse(tmp_path / "m.safetensors")
    plain = _mlp()
    plain.load_state_dict(state)  # strict: exactly the keys of an unpruned model
    assert set(state) == set(plain.state_dict())
    for mod in (0, 2):
        assert torch.equal(state[f"{mod}.weight"], model[mod].weight.detach())
    assert int((state["0.weight"] == 0).sum()) == 1080
    model.eval(), plain.eval()
    x = torch.randn(5, 40)
    assert torch.equal(plain(x), model(x))
    # the same from the state_dict
    save_sparse(model.state_dict(), tmp_path / "sd.safetensors")
    assert load_sparse(tmp_path / "sd.safetensors").keys() == state.keys()


def test_buffer_named_mask_in_an_unpruned_module_is_kept(tmp_path):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_orig = nn.Parameter(torch.ones(3))
            self.register_buffer("attn_mask", torch.zeros(3))

    save_sparse(Attn(), tmp_path / "a.safetensors")
    assert sorted(load_sparse(tmp_path / "a.safetensors")) == ["attn_mask", "attn_orig"]


def test_float_mask_zeros_are_positive_zeros(tmp_path):
    layer = nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        layer.weight[:, :32] = -1.0
        layer.weight[0, 0] = float("nan")
    prune.custom_from_mask(layer, "weight", (torch.arange(64) >= 32).float().expand(8, 64))
    save_sparse(layer, tmp_path / "l.safetensors")
    w = load_sparse(tmp_path / "l.safetensors")["weight"]
    assert torch.equal(bits(w[:, :32]), torch.zeros(8, 32, dtype=torch.int32))
    assert stored_layouts(tmp_path / "l.safetensors")["weight"] == "bitmask"


def test_bad_inputs_name_the_key(tmp_path):
    with pytest.raises(TypeError, match=r"'step'"):
        save_sparse({"w": torch.ones(3), "step": 3}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match=r"'c'.*complex"):
        save_sparse({"c": torch.ones(3, dtype=torch.complex64)}, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match=r"nn.Module or a state_dict"):
        save_sparse([torch.ones(3)], tmp_path / "x.safetensors")


@pytest.mark.parametrize("key", [1, ("w",), None])
def test_a_key_that_is_not_a_str_is_named(tmp_path, key):
    path = tmp_path / "x.safetensors"
    message = f"state_dict key {key!r} is not a str ({type(key).__name__}); keys are tensor names"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        save_sparse({"w": torch.ones(3), key: torch.ones(2)}, path)
    assert not path.exists()


def test_tensor_subclasses_are_refused_naming_the_key(tmp_path):
    class Tagged(torch.Tensor):
        pass

    with pytest.raises(TypeError, match=r"'w' is a Tagged, not a plain tensor"):
        save_sparse({"b": torch.ones(2), "w": torch.ones(3).as_subclass(Tagged)}, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_dtensor_is_refused_with_the_way_to_gather_it(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of its own")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        weight = distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        with pytest.raises(TypeError, match=r"'0.weight' is a DTensor.*full_tensor"):
            save_sparse({"0.weight": weight}, tmp_path / "x.safetensors")
    finally:
        dist.destroy_process_group()


def test_a_failed_save_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    from lightprune.export import sparse_file

    path = tmp_path / "m.safetensors"
    before = {"w": torch.tensor([0.0, 1.0, 0.0, 2.0])}
    save_sparse(before, path)
    written = sparse_file._write_all
    calls = []

    def disk_full(handle, data):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        written(handle, data)

    monkeypatch.setattr(sparse_file, "_write_all", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_sparse({"w": torch.ones(1000)}, path)
    assert torch.equal(load_sparse(path)["w"], before["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_an_overwritten_file_keeps_its_permissions_and_a_missing_folder_is_named(tmp_path):
    """As ``torch.save`` and ``safetensors.torch.save_file`` (before: 0o600 became 0o644, and a missing folder was
    reported under the hidden temporary file's name)."""
    path = tmp_path / "m.safetensors"
    save_sparse({"w": torch.zeros(4)}, path)
    path.chmod(0o600)
    save_sparse({"w": torch.ones(4)}, path)
    assert path.stat().st_mode & 0o777 == 0o600 and torch.equal(load_sparse(path)["w"], torch.ones(4))
    missing = tmp_path / "no_such_folder" / "m.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"cannot save '{missing}': its folder '{missing.parent}' does not"):
        save_sparse({"w": torch.ones(4)}, missing)


def test_names_of_version_1_entries_are_ordinary_names(tmp_path):
    state = {"w": torch.zeros(1000), "w.__values__": torch.ones(2), "w.__bitmask__": torch.zeros(9)}
    save_sparse(state, tmp_path / "x.safetensors")
    out = load_sparse(tmp_path / "x.safetensors")
    assert list(out) == list(state) and all(torch.equal(out[k], state[k]) for k in state)


def test_shared_tensors_are_saved(tmp_path):
    w = torch.randn(10, 10)
    save_sparse({"a": w, "b": w, "c": w[0]}, tmp_path / "x.safetensors")
    out = load_sparse(tmp_path / "x.safetensors")
    assert torch.equal(out["a"], w) and torch.equal(out["b"], w) and torch.equal(out["c"], w[0])


@pytest.mark.parametrize("pruned", [False, True], ids=["dense tie", "tie pruned through every owner"])
def test_a_tensor_under_several_names_is_stored_once(tmp_path, pruned):
    """An embedding tied to the output layer: one copy in the file (as safetensors' save_model keeps one), both
    names back, in the saved order, sharing one tensor."""
    model = _tiny_gpt2()
    if pruned:
        prune.global_unstructured(
            [(model.transformer.wte, "weight"), (model.lm_head, "weight")], prune.L1Unstructured, amount=0.5
        )
    path = tmp_path / "g.safetensors"
    save_sparse(model, path)
    tied = tmp_path / "untied.safetensors"
    state = {k: v.clone() for k, v in effective_state_dict(model).items()}  # the same tensors, each its own copy
    save_sparse(state, tied)
    embedding = model.transformer.wte.weight.numel() * 4
    assert tied.stat().st_size - path.stat().st_size >= (0.5 if pruned else 0.9) * embedding
    layouts = stored_layouts(path)
    assert layouts["lm_head.weight"] == "alias of transformer.wte.weight"
    out = load_sparse(path)
    assert list(out) == list(state)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    assert out["lm_head.weight"] is out["transformer.wte.weight"]


def test_a_meta_tensor_is_refused_naming_the_key(tmp_path):
    with pytest.raises(TypeError, match=r"tensor 'w' is on the meta device"):
        save_sparse({"v": torch.ones(2), "w": torch.empty(3, device="meta")}, tmp_path / "m.safetensors")


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    config.bos_token_id = config.eos_token_id = None
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_a_tie_pruned_through_every_owner_round_trips_into_a_tied_model(tmp_path):
    model = _tiny_gpt2()
    prune.global_unstructured(
        [(model.transformer.wte, "weight"), (model.lm_head, "weight")], prune.L1Unstructured, amount=0.5
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_sparse(model, tmp_path / "g.safetensors")
    state = load_sparse(tmp_path / "g.safetensors")
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    fresh = _tiny_gpt2()
    fresh.load_state_dict(state)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    ids = torch.randint(0, 50, (2, 8))
    assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_a_tie_split_by_pruning_one_owner_is_named(tmp_path):
    model = _tiny_gpt2()
    prune.l1_unstructured(model.transformer.wte, "weight", amount=0.5)  # lm_head keeps the unpruned Parameter
    with pytest.warns(UserWarning, match=r"'lm_head.weight' is also 'transformer.wte.weight_orig'.*ties"):
        save_sparse(model, tmp_path / "g.safetensors")
    state = load_sparse(tmp_path / "g.safetensors")
    assert not torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


# -------------------------------------------------------------------------------------------------------------------
# the file itself: safetensors, one entry, a small header
# -------------------------------------------------------------------------------------------------------------------


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8 : _data_start(path)])


def test_the_file_is_one_safetensors_entry_with_the_table_in_its_metadata(tmp_path):
    state = {"w": random_tensor((40, 50), torch.bfloat16, 0.9, seed=3), "b": torch.randn(40), "n": torch.tensor(3)}
    path = tmp_path / "m.safetensors"
    save_sparse(state, path)
    with safe_open(str(path), framework="pt") as handle:
        assert list(handle.keys()) == ["data"]
        data = handle.get_tensor("data")
        table = json.loads(handle.metadata()["lightprune.sparse"])
    assert data.dtype == torch.uint8 and data.numel() == path.stat().st_size - _data_start(path)
    assert table == {
        "version": 2,
        "tensors": [["w", "BF16", [40, 50], 1], ["b", "F32", [40], 0], ["n", "I64", [], 0]],
    }
    assert _data_start(path) % 8 == 0


def test_header_costs_about_forty_bytes_a_tensor(tmp_path):
    """What keeps a small checkpoint within 2% of the information limit: no per-tensor safetensors entries (format
    version 1 spent 1,400 bytes on these six tensors)."""
    torch.manual_seed(0)
    layers = [(300, 64), (100, 300), (10, 100)]
    state = {}
    for i, (rows, cols) in enumerate(layers):
        state[f"fc{i + 1}.weight"] = random_tensor((rows, cols), torch.float32, 0.9, seed=i)
        state[f"fc{i + 1}.bias"] = torch.randn(rows)
    path = tmp_path / "m.safetensors"
    save_sparse(state, path)
    payload = sum(min(t.numel() * 4, math.ceil(t.numel() / 8) + int((t != 0).sum()) * 4) for t in state.values())
    overhead = path.stat().st_size - payload
    assert overhead < 130 + 45 * len(state), overhead


# -------------------------------------------------------------------------------------------------------------------
# files that must be refused
# -------------------------------------------------------------------------------------------------------------------

V1_FILE = Path(__file__).parent / "data" / "format_v1.safetensors"
"""A file of format version 1 (one safetensors entry per tensor), written by a development version before 0.1.0."""


def test_version_1_files_are_refused_naming_the_format():
    with safe_open(str(V1_FILE), framework="pt") as handle:  # the fixture is what version 1 wrote
        assert json.loads(handle.metadata()["lightprune.sparse"])["version"] == 1
        assert "layer.weight.__bitmask__" in set(handle.keys())
    for read in (load_sparse, stored_layouts):
        with pytest.raises(
            SparseFileError, match=r"format_v1\.safetensors: sparse format version 1, .*never released; "
        ):
            read(V1_FILE)


@pytest.fixture
def saved(tmp_path) -> Path:
    """A file holding a dense ``layer.bias`` and a bitmask ``layer.weight``."""
    path = tmp_path / "m.safetensors"
    t = random_tensor((64, 64), torch.float32, 0.9, seed=1)
    save_sparse({"layer.bias": torch.randn(64), "layer.weight": t}, path)
    assert {k: v for k, v in stored_layouts(path).items() if k.startswith("layer.")} == {
        "layer.bias": "dense",
        "layer.weight": "bitmask",
    }
    return path


def _data_start(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _runs(path: Path) -> dict[str, tuple[int, int]]:
    """File offsets ``(start, end)`` of each stored run: ``<name>`` (dense), ``<name>.mask`` and ``<name>.values``
    (bitmask) and ``<name>.crc``, walked the way the format documents it."""
    header, start, raw = _header(path), _data_start(path), path.read_bytes()
    table = json.loads(header["__metadata__"]["lightprune.sparse"])["tensors"]
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I8": 1, "BOOL": 1}
    runs, offset = {}, 4 * len(table)
    for index, (name, code, shape, layout) in enumerate(table):
        runs[name + ".crc"] = (start + 4 * index, start + 4 * index + 4)
        n, size = math.prod(shape), sizes[code]
        count = n
        if layout:
            runs[name + ".mask"] = (start + offset, start + offset + math.ceil(n / 8))
            count = sum(bin(b).count("1") for b in raw[start + offset : start + offset + math.ceil(n / 8)])
            offset += math.ceil(n / 8)
        offset += -offset % size
        runs[name + (".values" if layout else "")] = (start + offset, start + offset + count * size)
        offset += count * size
    assert start + offset == len(raw)
    return runs


@pytest.mark.parametrize(
    ("run", "tensor"),
    [
        ("layer.weight.values", "layer.weight"),
        ("layer.weight.mask", "layer.weight"),
        ("layer.bias", "layer.bias"),
        ("layer.bias.crc", "layer.bias"),
    ],
)
def test_one_flipped_bit_is_caught_and_named(saved, run, tensor):
    start, end = _runs(saved)[run]
    raw = bytearray(saved.read_bytes())
    raw[(start + end) // 2] ^= 0x10
    saved.write_bytes(bytes(raw))
    with pytest.raises(SparseFileError, match=f"'{tensor}'.*checksum"):
        load_sparse(saved)


def _rewrite_table(path: Path, change) -> None:
    raw = path.read_bytes()
    header = _header(path)
    table = json.loads(header["__metadata__"]["lightprune.sparse"])
    change(table)
    header["__metadata__"]["lightprune.sparse"] = json.dumps(table)
    new_header = json.dumps(header).encode()
    new_header += b" " * (-len(new_header) % 8)
    path.write_bytes(struct.pack("<Q", len(new_header)) + new_header + raw[_data_start(path) :])


def test_tampered_layout_metadata_is_caught(saved):
    def reshape(table):  # same count, other shape: only the checksum sees it
        [record] = [r for r in table["tensors"] if r[0] == "layer.weight"]
        record[2] = [32, 128]

    _rewrite_table(saved, reshape)
    with pytest.raises(SparseFileError, match=r"'layer.weight'.*checksum"):
        load_sparse(saved)


def test_swapped_names_are_caught(tmp_path):
    path = tmp_path / "m.safetensors"
    save_sparse({"a": torch.randn(30), "b": torch.randn(30)}, path)

    def swap(table):
        table["tensors"][0][0], table["tensors"][1][0] = "b", "a"

    _rewrite_table(path, swap)
    with pytest.raises(SparseFileError, match=r"'b'.*checksum"):
        load_sparse(path)


@pytest.mark.parametrize("keep_fraction", [0.999, 0.6, 0.3])
def test_truncated_file_names_the_tensor(saved, keep_fraction):
    raw = saved.read_bytes()
    cut = max(_data_start(saved) + 1, int(len(raw) * keep_fraction))
    saved.write_bytes(raw[:cut])
    with pytest.raises(SparseFileError, match=r"truncated: tensor '[a-z.]+'"):
        load_sparse(saved)


def test_truncated_v2_file_names_the_tensor_cut(tmp_path):
    path = tmp_path / "m.safetensors"
    save_sparse({"first": torch.randn(100), "second": random_tensor((50, 50), torch.float32, 0.9, 0)}, path)
    runs = _runs(path)
    raw = path.read_bytes()
    for cut, name in [
        (runs["first"][1] - 1, "first"),
        (runs["second.mask"][0] + 3, "second"),
        (len(raw) - 1, "second"),
    ]:
        path.write_bytes(raw[:cut])
        with pytest.raises(SparseFileError, match=f"truncated: tensor '{name}'"):
            load_sparse(path)
    path.write_bytes(raw + b"\0" * 8)
    with pytest.raises(SparseFileError, match=r"altered"):
        load_sparse(path)


def test_a_shape_larger_than_the_file_is_refused_before_allocating(tmp_path):
    path = tmp_path / "m.safetensors"
    save_sparse({"w": torch.randn(10), "m": random_tensor((100,), torch.float32, 0.9, 0)}, path)

    def inflate(table):
        table["tensors"][0][2] = [10**12]  # four terabytes, stored dense
        table["tensors"][1][2] = [10**13]  # a bitmask of more than a terabyte

    _rewrite_table(path, inflate)
    with pytest.raises(SparseFileError, match=r"tensor 'w'.*altered"):
        load_sparse(path)

    def second(table):
        table["tensors"][0][2] = [10]

    _rewrite_table(path, second)
    with pytest.raises(SparseFileError, match=r"tensor 'm'.*altered"):
        load_sparse(path)


def test_truncated_inside_the_header(saved):
    saved.write_bytes(saved.read_bytes()[:40])
    with pytest.raises(SparseFileError, match=r"truncated"):
        load_sparse(saved)


def test_foreign_files_are_refused(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(3)}, str(plain))
    with pytest.raises(SparseFileError, match=r"without lightprune's 'lightprune.sparse' metadata"):
        load_sparse(plain)
    pickled = tmp_path / "model.pt"
    torch.save({"w": torch.ones(3)}, pickled)
    with pytest.raises(SparseFileError, match=r"not a safetensors file"):
        load_sparse(pickled)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(SparseFileError, match=r"too short"):
        load_sparse(empty)
    other_version = tmp_path / "v3.safetensors"
    save_file({"w": torch.ones(3)}, str(other_version), metadata={"lightprune.sparse": '{"version": 3, "tensors": []}'})
    with pytest.raises(SparseFileError, match=r"version 3; this lightprune reads version 2"):
        load_sparse(other_version)
    with pytest.raises(FileNotFoundError):
        load_sparse(tmp_path / "missing.safetensors")


def test_stray_entries_are_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file(
        {"data": torch.zeros(4, dtype=torch.uint8), "extra": torch.ones(1)},
        str(path),
        metadata={"lightprune.sparse": '{"version":2,"tensors":[]}'},
    )
    with pytest.raises(SparseFileError, match=r"\['extra'\] are not part of"):
        load_sparse(path)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 700), sparsity=st.sampled_from(SPARSITIES), seed=st.integers(0, 2**16))
def test_round_trip_across_chunk_boundaries(tmp_path_factory, n, sparsity, seed):
    import lightprune.export.sparse_file as sparse_file

    t = random_tensor((n,), torch.float16, sparsity, seed)
    path = tmp_path_factory.mktemp("chunks") / "t.safetensors"
    previous = sparse_file.CHUNK
    sparse_file.CHUNK = 128  # many chunks, a short last one
    try:
        save_sparse({"t": t}, path)
        out = load_sparse(path)["t"]
    finally:
        sparse_file.CHUNK = previous
    assert_identical(out, t)
    assert_identical(load_sparse(path)["t"], t)  # and read back with the default chunk size


@pytest.mark.parametrize("code", sorted(_CODES))
def test_every_supported_dtype_round_trips_in_both_layouts(tmp_path, code):
    dtype = _CODES[code]
    g = torch.Generator().manual_seed(5)
    if dtype == torch.bool:
        dense = torch.rand(3000, generator=g) < 0.99
    else:
        size = torch.empty((), dtype=dtype).element_size()
        dense = torch.randint(1, 256, (3000 * size,), generator=g, dtype=torch.uint8).view(dtype)
    sparse = dense.clone()
    bits(sparse)[torch.rand(3000, generator=g) < 0.95] = 0
    save_sparse({"dense": dense.view(60, 50), "sparse": sparse.view(3, 1000)}, tmp_path / "t.safetensors")
    out = load_sparse(tmp_path / "t.safetensors")
    assert_identical(out["dense"], dense.view(60, 50))
    assert_identical(out["sparse"], sparse.view(3, 1000))
    assert stored_layouts(tmp_path / "t.safetensors") == {"dense": "dense", "sparse": "bitmask"}
