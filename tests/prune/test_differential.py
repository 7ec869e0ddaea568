"""Differential tests: ``lightprune.prune`` against ``torch.nn.utils.prune`` as the oracle.

Every test builds the same module(s) twice from one spec (same constructor, same seeded data), prunes one copy
with torch and the other with lightprune, and compares masks, counts, the reparametrization, state_dict keys,
forward outputs, gradients, hooks and exceptions.

Comparison rules
----------------
* Deterministic methods (L1, Ln, global L1, custom_from_mask, identity): the masks must be identical whenever the
  ranking is unambiguous at the cut. This is checked explicitly on the oracle's inputs (exact for magnitudes, with
  a relative margin for norms, which torch computes in the parameter's precision). When ties straddle the cut,
  lightprune's choice must still be *a* valid answer: same count, and nothing it pruned ranks above anything it
  kept.
* Random methods: same counts as torch, whole channels for structured methods, never un-pruning, 0/1 values.
* After a step whose masks may legitimately differ (random methods, ties), torch's copy is synced to lightprune's
  mask so that torch remains a valid oracle for the next step of the sequence.
* Errors: lightprune raises an exception that catching torch's type catches (where torch asserts, lightprune's
  error is a ValueError and an AssertionError) and leaves the module exactly as it was, checked against a
  snapshot -- not against torch, which can leave a module half-pruned (or with its parameters reordered) after a
  failed call. A sequence stops at the first error, since torch's copy is then no longer a trustworthy oracle.
* Mask dtype: the parameter's dtype by default; ``torch.bool`` inside ``lp.mask_dtype(torch.bool)``. Every
  stateful test runs in both modes.

Budget
------
The default example counts keep this file around a minute on a 2-core machine. For a nightly run use
``LIGHTPRUNE_HYPOTHESIS_PROFILE=nightly`` (25x the examples)::

    LIGHTPRUNE_HYPOTHESIS_PROFILE=nightly python -m pytest tests/prune/test_differential.py -q
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import prune as tp

from lightprune import prune as lp
from lightprune.prune import base

# --------------------------------------------------------------------------------------------------------------
# Hypothesis budget
# --------------------------------------------------------------------------------------------------------------

settings.register_profile(
    "lightprune-differential",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
settings.register_profile(
    "lightprune-differential-nightly",
    parent=settings.get_profile("lightprune-differential"),
    max_examples=2500,
)
_NIGHTLY = os.environ.get("LIGHTPRUNE_HYPOTHESIS_PROFILE", "").lower() == "nightly"
_PROFILE = settings.get_profile("lightprune-differential-nightly" if _NIGHTLY else "lightprune-differential")
_FACTOR = 25 if _NIGHTLY else 1


def budget(n: int) -> settings:
    """Settings for a test with ``n`` examples by default (``25 * n`` in the nightly profile)."""
    return settings(_PROFILE, max_examples=n * _FACTOR)


# --------------------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LOW_PRECISION = (torch.float16, torch.bfloat16)
STYLES = ("distinct", "channel", "normal", "ties")
ALL_NORMS = (1, 2, 3, 0.5, 0, -1, math.inf, -math.inf, "fro", "nuc")
SAFE_NORMS = (1, 2)
MODES = ("default", "bool")
HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@contextlib.contextmanager
def lp_mode(mode: str) -> Iterator[None]:
    """Run lightprune calls with its default mask dtype or with boolean masks."""
    if mode == "bool":
        with lp.mask_dtype(torch.bool):
            yield
    else:
        yield


def nuclear_norm_refused(n: Any, shape: tuple[int, ...] | torch.Size) -> bool:
    """lightprune's one documented refusal of a call torch may accept: ``LnStructured(n='nuc')`` on a tensor with
    other than two dims besides ``dim``. torch <= 2.13 raises there too; torch 2.14+ ranks the channels by nuclear
    norms of the tensor's last two dims, which are not one per channel (see ``LnStructured._channel_norms``)."""
    return isinstance(n, str) and n == "nuc" and len(shape) != 3


def accept_nuclear_norm_refusal(n: Any, shape: tuple[int, ...] | torch.Size, terr: Any, lerr: Any) -> bool:
    """True where torch accepted and lightprune refused for :func:`nuclear_norm_refused`'s reason (checked)."""
    if terr is not None or lerr is None or not nuclear_norm_refused(n, shape):
        return False
    assert isinstance(lerr, RuntimeError) and "no norm per channel" in str(lerr), f"unexpected error {lerr!r}"
    event("documented difference: n='nuc' without a matrix per channel, torch accepted, lightprune refused")
    return True


def attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as err:
        return None, err


def assert_compatible_error(terr: BaseException, lerr: BaseException | None, what: str, alt: tuple = ()) -> None:
    """lightprune must raise what torch raised: an exception that ``except <torch's type>`` catches."""
    assert lerr is not None, f"torch raised {type(terr).__name__}({terr}) but lightprune did not: {what}"
    allowed: tuple = (type(terr), *alt)
    assert isinstance(lerr, allowed), (
        f"torch raised {type(terr).__name__}({terr}); lightprune raised {type(lerr).__name__}({lerr}): {what}"
    )


# --------------------------------------------------------------------------------------------------------------
# Data and modules
# --------------------------------------------------------------------------------------------------------------


def make_values(shape: tuple[int, ...], style: str, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Seeded data in a few styles.

    * ``distinct``: distinct magnitudes k/32 (exact in every float dtype for up to 256 entries; ints for ints);
    * ``channel``: channel c along dim ``seed % ndim`` is s_c * base with distinct s_c, so every norm along that
      dim is well separated;
    * ``normal``: standard normal (ties only through rounding in low precision);
    * ``ties``: values from {-1, -0.5, 0, 0.5, 1}, so lots of ties.
    """
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64).mul_(2).sub_(1)
    if not dtype.is_floating_point:
        return ((torch.randperm(n, generator=g) + 1) * signs.to(torch.int64)).reshape(shape).to(dtype)
    if style == "distinct" or (style == "channel" and len(shape) < 2):
        mags = (torch.randperm(n, generator=g).to(torch.float64) + 1) / 32
        out = (mags * signs).reshape(shape)
    elif style == "channel":
        d = seed % len(shape)
        c = shape[d]
        scale = (torch.randperm(c, generator=g).to(torch.float64) + 1) / 4
        view = [1] * len(shape)
        view[d] = c
        base_shape = list(shape)
        base_shape[d] = 1
        m = math.prod(base_shape)
        base = 1 + torch.randperm(m, generator=g).to(torch.float64) / (2 * max(m, 1))
        out = base.reshape(base_shape) * scale.reshape(view) * signs.reshape(shape)
    elif style == "normal":
        out = torch.randn(shape, generator=g, dtype=torch.float64)
    else:
        choices = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0], dtype=torch.float64)
        out = choices[torch.randint(0, 5, (n,), generator=g)].reshape(shape)
    return out.to(dtype)


def random_mask(shape: tuple[int, ...], seed: int, density: float, dtype: torch.dtype) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < density).to(dtype)


def wrong_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) if not shape else (*shape[:-1], shape[-1] + 1)


@dataclass(frozen=True)
class ModSpec:
    kind: str  # linear | conv1d | conv2d | conv3d | bare
    dims: tuple[int, ...]  # (in, out) | (in, out, kernel) | parameter shape
    bias: bool
    dtype: torch.dtype
    styles: tuple[tuple[str, int], ...]  # (style, seed) per parameter, in named_parameters() order


def build(spec: ModSpec) -> nn.Module:
    # every parameter is overwritten below, so the layers skip their own initialization (reset_parameters, which
    # also warns "Initializing zero-element tensors is a no-op" for an empty weight)
    if spec.kind == "linear":
        with mock.patch.object(nn.Linear, "reset_parameters", lambda self: None):
            m: nn.Module = nn.Linear(spec.dims[0], spec.dims[1], bias=spec.bias)
    elif spec.kind.startswith("conv"):
        cls = {"conv1d": nn.Conv1d, "conv2d": nn.Conv2d, "conv3d": nn.Conv3d}[spec.kind]
        with mock.patch.object(cls, "reset_parameters", lambda self: None):
            m = cls(spec.dims[0], spec.dims[1], spec.dims[2], bias=spec.bias)
    else:
        m = nn.Module()
        floating = spec.dtype.is_floating_point
        m.w = nn.Parameter(torch.zeros(spec.dims, dtype=spec.dtype), requires_grad=floating)
        m.register_buffer("buf", torch.arange(3, dtype=torch.float32))
    if spec.dtype.is_floating_point:
        m = m.to(spec.dtype)
    assert len(list(m.parameters())) <= len(spec.styles), "every parameter needs a style (none is initialized)"
    with torch.no_grad():
        for (_, p), (style, seed) in zip(m.named_parameters(), spec.styles, strict=False):
            p.copy_(make_values(tuple(p.shape), style, seed, p.dtype))
    return m


def make_input(spec: ModSpec, seed: int = 0) -> Tensor | None:
    g = torch.Generator().manual_seed(seed)
    if spec.kind == "linear":
        shape: tuple[int, ...] = (2, spec.dims[0])
    elif spec.kind.startswith("conv"):
        nd = int(spec.kind[4])
        shape = (1, spec.dims[0], *([spec.dims[2] + 1] * nd))
    else:
        return None
    return torch.randn(shape, generator=g, dtype=torch.float64).to(spec.dtype)


def run_forward(m: nn.Module, spec: ModSpec, x: Tensor | None) -> Tensor | None:
    """Forward pass; a bare module only runs its forward pre-hooks (its forward is unimplemented)."""
    if x is not None:
        return m(x)
    with contextlib.suppress(NotImplementedError):
        m(torch.zeros(1))
    return None


def param_targets(m: nn.Module, mi: int) -> list[tuple[int, str]]:
    return [(mi, name) for name, _ in m.named_parameters()]


seeds = st.integers(0, 2**31 - 1)
styles = st.tuples(st.sampled_from(STYLES), seeds)


@st.composite
def module_specs(draw, kinds=("linear", "conv1d", "conv2d", "conv3d", "bare"), dtypes=FLOAT_DTYPES, bias=None):
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    has_bias = draw(st.booleans()) if bias is None else bias
    if kind == "linear":
        dims: tuple[int, ...] = (draw(st.integers(0, 6)), draw(st.integers(1, 6)))
    elif kind.startswith("conv"):
        kmax = 2 if kind == "conv3d" else 3
        dims = (draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, kmax)))
    else:
        dims = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
        has_bias = False
    return ModSpec(kind, dims, has_bias, dtype, (draw(styles), draw(styles)))


# --------------------------------------------------------------------------------------------------------------
# Mask geometry and the checks shared by every test
# --------------------------------------------------------------------------------------------------------------


def channels(x: Tensor, dim: int) -> Tensor:
    """(channels along ``dim``, entries per channel) view of ``x``."""
    return x.movedim(dim, 0).reshape(x.shape[dim], x.numel() // x.shape[dim] if x.shape[dim] else 0)


def kept_channels(mask: Tensor, dim: int) -> Tensor:
    """Channels that are not entirely zero (torch: ``mask.sum(other dims) != 0``)."""
    return channels(mask, dim).ne(0).any(1)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def channel_norms(t: Tensor, n: Any, dim: int) -> Tensor:
    """Norm of every channel along ``dim``, in float64 (the unrounded version of torch's ``_compute_norm``)."""
    dims = [d for d in range(t.dim()) if d != dim]
    if n == "fro":  # the 2-norm of the entries; torch.norm refuses "fro" over three dims from torch 2.14 on
        return torch.linalg.vector_norm(t.to(torch.float64), 2, dim=dims)
    return torch.norm(t.to(torch.float64), p=n, dim=dims)


def check_binary(mask: Tensor, what: str) -> None:
    values = mask.to(torch.float64)
    assert bool(((values == 0) | (values == 1)).all()), f"{what}: mask has values other than 0/1: {values.unique()}"


def check_unstructured_ranking(scores: Tensor, prev: Tensor, tnew: Tensor, lnew: Tensor, what: str) -> None:
    """Unstructured: torch pruned the k smallest ``scores`` among the units where ``prev`` is 1.

    lightprune must prune as many; if the cut is unambiguous it must prune exactly the same entries, otherwise a
    valid set (nothing it pruned is larger than anything it kept).
    """
    units = prev.reshape(-1) != 0
    s = scores.reshape(-1).to(torch.float64)[units]
    tk = tnew.reshape(-1).to(torch.float64)[units]
    lk = lnew.reshape(-1).to(torch.float64)[units]
    k = int((tk == 0).sum())
    assert int((lk == 0).sum()) == k, f"{what}: lightprune pruned {int((lk == 0).sum())} units, torch {k}"
    srt = s.sort().values
    if k in (0, s.numel()) or bool(srt[k - 1] < srt[k]):
        event("deterministic unstructured: exact comparison")
        assert torch.equal(lk, tk), f"{what}: different entries pruned (no tie at the cut)"
    else:
        event("deterministic unstructured: tie at the cut")
        assert float(s[lk == 0].max()) <= float(s[lk != 0].min()), f"{what}: pruned a larger entry than one kept"


def check_structured(
    prev: Tensor,
    tnew: Tensor,
    lnew: Tensor,
    dim: int,
    what: str,
    scores: Tensor | None = None,
    n: Any = None,
    first: bool = False,
) -> None:
    """Structured: lightprune zeroes whole channels among the kept ones, as many as torch.

    With ``scores`` (Ln pruning), the channel norms decide: identical masks when the cut is clear by a margin,
    otherwise a valid choice. A ``first`` prune ranks every channel, later ones only those not entirely zero.
    """
    d = norm_dim(dim, prev.dim())
    pch, lch = channels(prev, d), channels(lnew, d)
    ok = (lch == pch).all(1) | (lch == 0).all(1)
    assert bool(ok.all()), f"{what}: lightprune's new mask is not the old mask with whole channels zeroed"
    if prev.numel() == 0:
        return  # empty channels: nothing to compare
    keep = torch.ones(prev.shape[d], dtype=torch.bool) if first else kept_channels(prev, d)
    t_after, l_after = kept_channels(tnew, d), kept_channels(lnew, d)
    assert int(l_after.sum()) == int(t_after.sum()), (
        f"{what}: lightprune kept {int(l_after.sum())} channels along dim {dim}, torch {int(t_after.sum())}"
    )
    if scores is None:
        event("random structured: count comparison")
        return
    s = channel_norms(scores.movedim(d, 0)[keep], n, 0)
    t_pruned, l_pruned = ~t_after[keep], ~l_after[keep]
    k = int(t_pruned.sum())
    if not bool(torch.isfinite(s).all()):
        event("Ln structured: non-finite norms, count comparison")
        return
    rel = 3e-2 if scores.dtype in LOW_PRECISION else 1e-4
    srt = s.sort().values
    if k in (0, s.numel()) or float(srt[k] - srt[k - 1]) > rel * abs(float(srt[k])) + 1e-12:
        event("Ln structured: exact comparison")
        assert torch.equal(lnew.to(torch.float64), tnew.to(torch.float64)), (
            f"{what}: different channels pruned (norms clearly separated at the cut)"
        )
    else:
        event("Ln structured: tie at the cut")
        assert float(s[l_pruned].max()) <= float(s[~l_pruned].min()) * (1 + rel) + 1e-12, (
            f"{what}: pruned a channel with a larger norm than one kept"
        )


def check_random_unstructured(prev: Tensor, tnew: Tensor, lnew: Tensor, what: str) -> None:
    t_kept, l_kept = int((tnew != 0).sum()), int((lnew != 0).sum())
    assert l_kept == t_kept, f"{what}: lightprune kept {l_kept} entries, torch {t_kept}"
    event("random unstructured: count comparison")


# --------------------------------------------------------------------------------------------------------------
# Snapshots (rollback after errors)
# --------------------------------------------------------------------------------------------------------------


def _tensor_record(v: Tensor | None) -> Any:
    if v is None:
        return None
    return (v, v.detach().clone(), v.dtype, v.requires_grad, type(v))


def _is_container(h: Any) -> bool:
    return isinstance(h, lp.PruningContainer | tp.PruningContainer)


def _method_attrs(h: Any) -> tuple:
    return tuple((a, getattr(h, a)) for a in ("amount", "n", "dim", "_tensor_name") if hasattr(h, a))


def snapshot(m: nn.Module) -> dict[str, Any]:
    methods = {}
    for k, h in m._forward_pre_hooks.items():
        if isinstance(h, lp.BasePruningMethod | tp.BasePruningMethod):
            members = tuple(h) if _is_container(h) else ()
            methods[k] = (_method_attrs(h), members, tuple(_method_attrs(x) for x in members))
    return {
        "parameters": [(k, _tensor_record(v)) for k, v in m._parameters.items()],
        "buffers": [(k, _tensor_record(v)) for k, v in m._buffers.items()],
        "non_persistent": set(m._non_persistent_buffers_set),
        "hooks": {a: list(getattr(m, a).items()) for a in HOOK_DICTS if hasattr(m, a)},
        "methods": methods,
        "dict_keys": sorted(vars(m)),
        "attrs": {k: _tensor_record(v) for k, v in vars(m).items() if isinstance(v, Tensor)},
        "state_dict": [(k, v.detach().clone()) for k, v in m.state_dict().items()],
    }


def _same_record(a: Any, b: Any, what: str, identity: bool) -> None:
    if a is None or b is None:
        assert a is None and b is None, f"{what}: None-ness changed"
        return
    obj_a, val_a, dtype_a, rg_a, type_a = a
    obj_b, _, dtype_b, rg_b, type_b = b
    if identity:
        assert obj_b is obj_a, f"{what}: object replaced"
    assert type_b is type_a, f"{what}: type changed {type_a.__name__} -> {type_b.__name__}"
    assert dtype_b == dtype_a, f"{what}: dtype changed {dtype_a} -> {dtype_b}"
    assert rg_b == rg_a, f"{what}: requires_grad changed"
    assert obj_b.shape == val_a.shape and torch.equal(obj_b.detach(), val_a), f"{what}: values changed"


def assert_unchanged(m: nn.Module, before: dict[str, Any], what: str) -> None:
    after = snapshot(m)
    pa, pb = before["parameters"], after["parameters"]
    assert [k for k, _ in pb] == [k for k, _ in pa], f"{what}: parameters {[k for k, _ in pa]} -> {[k for k, _ in pb]}"
    for (k, a), (_, b) in zip(pa, pb, strict=True):
        _same_record(a, b, f"{what}: parameter {k}", identity=True)
    ba, bb = before["buffers"], after["buffers"]
    assert [k for k, _ in bb] == [k for k, _ in ba], f"{what}: buffers {[k for k, _ in ba]} -> {[k for k, _ in bb]}"
    for (k, a), (_, b) in zip(ba, bb, strict=True):
        _same_record(a, b, f"{what}: buffer {k}", identity=False)
    assert after["non_persistent"] == before["non_persistent"], f"{what}: non-persistent buffer set changed"
    for name, items in before["hooks"].items():
        got = after["hooks"][name]
        assert [k for k, _ in got] == [k for k, _ in items], f"{what}: {name} keys changed"
        assert all(x is y for (_, x), (_, y) in zip(got, items, strict=True)), f"{what}: {name} objects replaced"
    assert after["methods"].keys() == before["methods"].keys()
    for k, (attrs, members, member_attrs) in before["methods"].items():
        attrs2, members2, member_attrs2 = after["methods"][k]
        assert attrs2 == attrs, f"{what}: pruning method attributes changed"
        assert len(members2) == len(members) and all(x is y for x, y in zip(members, members2, strict=True)), (
            f"{what}: PruningContainer members changed ({len(members)} -> {len(members2)})"
        )
        assert member_attrs2 == member_attrs, f"{what}: container member attributes changed"
    assert after["dict_keys"] == before["dict_keys"], (
        f"{what}: module attributes {before['dict_keys']} -> {after['dict_keys']}"
    )
    for k, a in before["attrs"].items():
        _same_record(a, after["attrs"][k], f"{what}: attribute {k}", identity=False)
    sa, sb = before["state_dict"], after["state_dict"]
    assert [k for k, _ in sb] == [k for k, _ in sa], f"{what}: state_dict keys changed"
    for (k, a), (_, b) in zip(sa, sb, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: state_dict[{k}] changed"


# --------------------------------------------------------------------------------------------------------------
# Operations: drawn as raw plans, resolved against the (synced) oracle state at run time
# --------------------------------------------------------------------------------------------------------------

OP_KINDS = ("l1", "ln", "ru", "rs", "cm", "id", "global", "remove")
STRUCTURED = ("ln", "rs")
WILD: dict[str, tuple[str, ...]] = {
    "l1": ("bad_amount_type", "bad_amount_range", "too_many", "unknown_name", "bad_importance", "buffer_name"),
    "ru": ("bad_amount_type", "bad_amount_range", "too_many", "unknown_name"),
    "ln": ("bad_amount_type", "bad_amount_range", "too_many", "unknown_name", "bad_importance", "bad_dim", "one_dim"),
    "rs": ("bad_amount_type", "bad_amount_range", "too_many", "unknown_name", "bad_dim", "one_dim"),
    "cm": ("bad_mask_shape", "unknown_name"),
    "id": ("unknown_name",),
    "global": (
        "structured_method",
        "too_many",
        "bad_amount_range",
        "bad_amount_type",
        "unknown_name",
        "bad_importance_numel",
        "importance_not_dict",
    ),
    "remove": ("not_pruned",),
}
BAD_AMOUNT_TYPES: tuple[Any, ...] = ("0.5", None, [1], 1j, torch.tensor(0.5))
BAD_AMOUNT_RANGE: tuple[Any, ...] = (-1, 1.5, -0.25, math.inf, -math.inf, math.nan, 2.0, -3)
SPECIAL_AMOUNTS = ("remaining", "one_float", "zero_float", "zero_int", "true", "np_int", "np_float", "fraction")

amount_plans = st.one_of(
    st.tuples(st.just("int"), st.integers(0, 6)),
    st.tuples(st.just("frac"), st.integers(0, 12), st.integers(1, 12)),
    st.tuples(st.just("float"), st.floats(0.0, 1.0)),
    st.tuples(st.just("special"), st.sampled_from(SPECIAL_AMOUNTS)),
)


def resolve_amount(plan: tuple, remaining: int) -> Any:
    kind = plan[0]
    if kind == "int":
        return min(plan[1], remaining)
    if kind == "frac":
        p, q = plan[1], plan[2]
        return (p % (q + 1)) / q
    if kind == "float":
        return plan[1]
    return {
        "remaining": remaining,
        "one_float": 1.0,
        "zero_float": 0.0,
        "zero_int": 0,
        "true": remaining >= 1,
        "np_int": np.int64(min(2, remaining)),
        "np_float": np.float64(0.5),
        "fraction": Fraction(1, 3),
    }[plan[1]]


@dataclass(frozen=True)
class Plan:
    kind: str
    target: int = 0
    subset: tuple[int, ...] = (0,)
    amount: tuple = ("float", 0.5)
    norm: Any = 1
    dim: int = 0
    dim_negative: bool = False
    importance: tuple[int, str] | None = None
    importance_bits: int = 0
    mask: tuple[int, int, str] = (0, 2, "param")
    gmethod: str = "L1Unstructured"
    wild: str | None = None
    wild_choice: int = 0


@st.composite
def plans(draw, kinds=OP_KINDS, wild_rate: int = 10, force_wild: str | None = None, norms=ALL_NORMS):
    kind = draw(st.sampled_from(kinds))
    wild = None
    if force_wild is not None:
        wild = force_wild
    elif wild_rate and draw(st.integers(0, wild_rate - 1)) == 0:
        wild = draw(st.sampled_from(WILD[kind]))
    return Plan(
        kind=kind,
        target=draw(st.integers(0, 63)),
        subset=tuple(draw(st.lists(st.integers(0, 63), min_size=1, max_size=4))),
        amount=draw(amount_plans),
        norm=draw(st.sampled_from(norms)),
        dim=draw(st.integers(0, 7)),
        dim_negative=draw(st.booleans()),
        importance=draw(st.none() | st.tuples(seeds, st.sampled_from(STYLES))),
        importance_bits=draw(st.integers(0, 15)),
        mask=draw(st.tuples(seeds, st.integers(0, 4), st.sampled_from(("bool", "float32", "param", "int64")))),
        gmethod=draw(st.sampled_from(("L1Unstructured", "L1Unstructured", "RandomUnstructured", "Identity"))),
        wild=wild,
        wild_choice=draw(st.integers(0, 7)),
    )


@dataclass
class Call:
    """A fully resolved pruning call, replayed identically on both implementations."""

    kind: str
    targets: list[tuple[int, str]]
    amount: Any = None
    norm: Any = None
    dim: int | None = None
    importance: Any = None  # list (per target) of tensors / None; or a bogus object for global
    mask: Tensor | None = None
    method: str | None = None
    method_kwargs: dict = field(default_factory=dict)
    wild: str | None = None
    alt_errors: tuple = ()
    quirk: str | None = None
    lp_may_succeed: bool = False  # torch raises for a valid call (a torch bug): lightprune may do the right thing

    def fresh(self) -> Call:
        def clone(v: Any) -> Any:
            if isinstance(v, Tensor):
                return v.clone()
            if isinstance(v, list):
                return [clone(x) for x in v]
            return v

        return replace(self, importance=clone(self.importance), mask=clone(self.mask))

    def __str__(self) -> str:
        def short(v: Any) -> str:
            if isinstance(v, Tensor):
                return f"<{v.dtype} {tuple(v.shape)}>"
            if isinstance(v, list):
                return "[" + ", ".join(short(x) for x in v) + "]"
            return repr(v)

        parts = [f"{self.kind} targets={self.targets}"]
        for k in ("amount", "norm", "dim", "method", "wild"):
            if getattr(self, k) is not None:
                parts.append(f"{k}={short(getattr(self, k))}")
        if self.importance is not None:
            parts.append(f"importance={short(self.importance)}")
        if self.mask is not None:
            parts.append(f"mask={short(self.mask)}")
        if self.method_kwargs:
            parts.append(f"kwargs={ {k: short(v) for k, v in self.method_kwargs.items()} }")
        return " ".join(parts)


def is_pruned_param(m: nn.Module, name: str) -> bool:
    return name + "_mask" in m._buffers


def remaining_units(mods: list[nn.Module], targets: list[tuple[int, str]], structured: bool, dim: int | None) -> int:
    total = 0
    for mi, name in targets:
        m = mods[mi]
        t = getattr(m, name)
        mask = m._buffers.get(name + "_mask")
        if mask is None:
            mask = torch.ones_like(t)
        if structured:
            assert dim is not None
            if t.dim() < 2 or not -t.dim() <= dim < t.dim():
                return 0
            if name + "_mask" in m._buffers:  # later prunes: the channels that are not all zero
                total += int(kept_channels(mask, norm_dim(dim, t.dim())).sum())
            else:  # a first prune ranks every channel, even empty ones
                total += t.shape[dim]
        else:
            total += int((mask != 0).sum())
    return total


def resolve(
    plan: Plan, tmods: list[nn.Module], targets: list[tuple[int, str]], importance_dtype: torch.dtype | None = None
) -> Call | None:
    """Turn a raw plan into a concrete call, given the current state of torch's (synced) modules.

    ``targets`` are the (module index, parameter name) pairs of the modules as built, before any pruning.
    """
    kind, wild = plan.kind, plan.wild
    structured = kind in STRUCTURED

    def ndim(t: tuple[int, str]) -> int:
        return getattr(tmods[t[0]], t[1]).dim()

    if kind == "remove":
        pruned = [t for t in targets if is_pruned_param(tmods[t[0]], t[1])]
        pool = [t for t in targets if t not in pruned] if wild == "not_pruned" else pruned
    elif structured:
        pool = [t for t in targets if (ndim(t) < 2) == (wild == "one_dim")]
    else:
        pool = targets
    if not pool:
        return None
    if kind == "global":
        chosen = list(dict.fromkeys(targets[i % len(targets)] for i in plan.subset))
    else:
        chosen = [pool[plan.target % len(pool)]]
    mi, name = chosen[0]
    param = getattr(tmods[mi], name)
    nd = param.dim()

    dim = None
    if structured:
        if wild == "bad_dim":
            dim = (nd, nd + 1, -nd - 1, -nd - 2)[plan.wild_choice % 4]
        elif nd == 0:
            dim = 0
        else:
            dim = plan.dim % nd - (nd if plan.dim_negative else 0)
    remaining = remaining_units(tmods, chosen, structured, dim)
    amount = resolve_amount(plan.amount, remaining)
    if wild == "too_many":
        amount = remaining + 1 + plan.wild_choice
    elif wild == "bad_amount_type":
        amount = BAD_AMOUNT_TYPES[plan.wild_choice % len(BAD_AMOUNT_TYPES)]
    elif wild == "bad_amount_range":
        amount = BAD_AMOUNT_RANGE[plan.wild_choice % len(BAD_AMOUNT_RANGE)]

    def importance_for(t: tuple[int, str]) -> Tensor:
        assert plan.importance is not None
        p = getattr(tmods[t[0]], t[1])
        dtype = importance_dtype or p.dtype
        return make_values(tuple(p.shape), plan.importance[1], plan.importance[0], dtype)

    call = Call(kind=kind, targets=chosen, wild=wild)
    if structured and nd < 2 and is_pruned_param(tmods[mi], name):
        # torch's PruningContainer mis-slices an already pruned 1-D/0-D parameter: a second structured prune of a
        # 1-D one silently succeeds (acting per entry), of a 0-D one raises IndexError. lightprune may instead raise
        # the ValueError that a first structured prune of such a parameter raises.
        call.quirk = "structured prune of an already pruned 1-D/0-D parameter"
        call.alt_errors = (ValueError,)
    if kind in ("l1", "ru", "ln", "rs"):
        call.amount = amount
    if kind == "ln":
        call.norm = plan.norm if wild is None else SAFE_NORMS[plan.wild_choice % 2]
    if structured:
        call.dim = dim
    if kind in ("l1", "ln"):
        if wild == "bad_importance":
            call.importance = [make_values(wrong_shape(tuple(param.shape)), "normal", 0, param.dtype)]
        elif plan.importance is not None:
            call.importance = [importance_for(chosen[0])]
    if kind == "cm":
        seed, density, mdtype = plan.mask
        dtype = {"bool": torch.bool, "float32": torch.float32, "param": param.dtype, "int64": torch.int64}[mdtype]
        shape = wrong_shape(tuple(param.shape)) if wild == "bad_mask_shape" else tuple(param.shape)
        call.mask = random_mask(shape, seed, density / 4, dtype)
    if kind == "global":
        method = plan.gmethod
        if wild == "structured_method":
            method = ("LnStructured", "RandomStructured")[plan.wild_choice % 2]
        elif wild in ("too_many", "bad_amount_range", "bad_amount_type") and method == "Identity":
            method = "L1Unstructured"
        call.method = method
        call.method_kwargs = {} if method == "Identity" else {"amount": amount}
        if method == "LnStructured":
            call.method_kwargs.update(n=1, dim=0)
        if plan.importance is not None or wild == "bad_importance_numel":
            imps: list[Tensor | None] = []
            for j, t in enumerate(chosen):
                use = plan.importance is not None and (plan.importance_bits >> (j % 4)) & 1
                imps.append(importance_for(t) if use else None)
            if wild == "bad_importance_numel":
                imps[0] = make_values((param.numel() + 1,), "normal", 0, param.dtype)
                call.alt_errors = (ValueError,)
            call.importance = imps
        if wild == "importance_not_dict":
            call.importance = "not a dict"
        if any(getattr(tmods[i], n).dim() == 0 for i, n in chosen) and wild is None:
            # torch 2.5 indexes a 0-D parameter's mask and raises IndexError (torch 2.13 prunes it)
            call.quirk = "global_unstructured over a 0-D parameter"
            call.lp_may_succeed = True
    if amount is True and (kind in ("l1", "ru", "rs") or (kind == "global" and call.method != "Identity")):
        call.quirk = "amount=True"
        call.lp_may_succeed = True
    if wild == "unknown_name":
        call.targets = [(mi, "nope"), *chosen[1:]]
    elif wild == "buffer_name":
        with_buffer = [i for i, m in enumerate(tmods) if "buf" in m._buffers]
        call.targets = [(with_buffer[0], "buf")] if with_buffer else [(mi, "nope")]
    return call


def invoke(impl: Any, mods: list[nn.Module], call: Call) -> Any:
    """Run ``call`` with ``impl`` (torch's or lightprune's prune module) on ``mods``."""
    mi, name = call.targets[0]
    m = mods[mi]
    imp = call.importance[0] if isinstance(call.importance, list) else None
    if call.kind == "l1":
        if imp is None:
            return impl.l1_unstructured(m, name, call.amount)
        return impl.l1_unstructured(m, name, amount=call.amount, importance_scores=imp)
    if call.kind == "ln":
        if imp is None:
            return impl.ln_structured(m, name, call.amount, call.norm, call.dim)
        return impl.ln_structured(m, name, amount=call.amount, n=call.norm, dim=call.dim, importance_scores=imp)
    if call.kind == "ru":
        return impl.random_unstructured(m, name, amount=call.amount)
    if call.kind == "rs":
        return impl.random_structured(m, name, call.amount, dim=call.dim)
    if call.kind == "cm":
        return impl.custom_from_mask(m, name, mask=call.mask)
    if call.kind == "id":
        return impl.identity(m, name)
    if call.kind == "remove":
        return impl.remove(m, name)
    assert call.kind == "global"
    params = [(mods[i], n) for i, n in call.targets]
    if isinstance(call.importance, list):
        scores: Any = {
            (mods[i], n): t for (i, n), t in zip(call.targets, call.importance, strict=True) if t is not None
        }
    else:
        scores = call.importance
    method = getattr(impl, call.method)
    return impl.global_unstructured(params, pruning_method=method, importance_scores=scores, **call.method_kwargs)


# --------------------------------------------------------------------------------------------------------------
# Comparison of the two module sets after a successful step
# --------------------------------------------------------------------------------------------------------------


def find_hook(m: nn.Module, name: str, impl: Any) -> Any:
    hooks = [
        h for h in m._forward_pre_hooks.values() if isinstance(h, impl.BasePruningMethod) and h._tensor_name == name
    ]
    assert len(hooks) == 1, f"expected exactly one pruning hook for {name!r}, found {len(hooks)}"
    return hooks[0]


def method_signature(h: Any) -> tuple:
    attrs = []
    for a in ("amount", "n", "dim"):
        if hasattr(h, a):
            v = getattr(h, a)
            attrs.append((a, float(v) if a == "amount" else v))
    return (type(h).__name__, tuple(attrs))


def hook_signature(m: nn.Module, impl: Any) -> list:
    sig = []
    for h in m._forward_pre_hooks.values():
        if isinstance(h, impl.BasePruningMethod):
            if isinstance(h, impl.PruningContainer):
                sig.append((h._tensor_name, "PruningContainer", tuple(method_signature(x) for x in h)))
            else:
                sig.append((h._tensor_name, method_signature(h)))
    return sorted(sig, key=lambda s: s[0])


def sync_torch_to_lp(tm: nn.Module, lm: nn.Module, name: str) -> None:
    """Make torch's copy carry lightprune's mask, so torch stays a valid oracle for the next step."""
    with torch.no_grad():
        tm._buffers[name + "_mask"].copy_(lm._buffers[name + "_mask"])
    setattr(tm, name, find_hook(tm, name, tp).apply_mask(tm))


def compare_step(call: Call, pre: dict, tmods: list[nn.Module], lmods: list[nn.Module], what: str) -> None:
    """Check lightprune's new masks for the targets of ``call`` against torch's."""
    if call.kind == "remove":
        return
    prev, tnew, lnew, scores = [], [], [], []
    first = pre[call.targets[0]][1] is None if call.targets[0] in pre else True
    for j, (mi, name) in enumerate(call.targets):
        before, prev_mask = pre[(mi, name)]
        assert name + "_mask" in lmods[mi]._buffers, f"{what}: no {name}_mask buffer after pruning"
        p = prev_mask.to(torch.float64) if prev_mask is not None else torch.ones_like(before, dtype=torch.float64)
        t = tmods[mi]._buffers[name + "_mask"].to(torch.float64)
        lmask = lmods[mi]._buffers[name + "_mask"]
        assert lmask.shape == t.shape, f"{what}: mask shape {tuple(lmask.shape)} != {tuple(t.shape)}"
        check_binary(lmask, f"{what} ({name})")
        lv = lmask.to(torch.float64)
        assert bool((lv <= p).all()), f"{what}: lightprune un-pruned entries of {name}"
        imp = call.importance[j] if isinstance(call.importance, list) else None
        prev.append(p)
        tnew.append(t)
        lnew.append(lv)
        scores.append(imp if imp is not None else before)
    kind = call.kind
    if kind in ("cm", "id") or (kind == "global" and call.method == "Identity"):
        for (mi, name), t, lv in zip(call.targets, tnew, lnew, strict=True):
            assert torch.equal(lv, t), f"{what}: mask of {mi}.{name} differs from torch's"
    elif kind == "l1":
        check_unstructured_ranking(scores[0].abs(), prev[0], tnew[0], lnew[0], what)
    elif kind == "ru":
        check_random_unstructured(prev[0], tnew[0], lnew[0], what)
    elif kind == "ln" and not call.quirk:
        check_structured(prev[0], tnew[0], lnew[0], call.dim, what, scores=scores[0], n=call.norm, first=first)
    elif kind in ("ln", "rs"):
        check_structured(prev[0], tnew[0], lnew[0], call.dim, what, first=first)
    elif kind == "global":
        cat = [torch.cat([x.reshape(-1).to(torch.float64) for x in xs]) for xs in (scores, prev, tnew, lnew)]
        if call.method == "L1Unstructured":
            check_unstructured_ranking(cat[0].abs(), cat[1], cat[2], cat[3], what)
        else:
            check_random_unstructured(cat[1], cat[2], cat[3], what)
    else:  # pragma: no cover
        raise AssertionError(kind)


def compare_modules(
    tmods: list[nn.Module], lmods: list[nn.Module], mode: str, originals: dict[tuple[int, str], nn.Parameter], what: str
) -> None:
    """Structural comparison of every module pair (after syncing).

    ``originals`` maps (module index, name) to the Parameter objects as built, in named_parameters() order.
    """
    for i, (tm, lm) in enumerate(zip(tmods, lmods, strict=True)):
        w = f"{what} (module {i})"
        assert sorted(lm.state_dict()) == sorted(tm.state_dict()), (
            f"{w}: state_dict keys {list(lm.state_dict())} != torch's {list(tm.state_dict())}"
        )
        # Documented divergence: torch moves name_orig to the end of the parameters, lightprune keeps the order.
        expected = [n + "_orig" if is_pruned_param(tm, n) else n for (j, n) in originals if j == i]
        assert [n for n, _ in lm.named_parameters()] == expected, f"{w}: parameter order (expected {expected})"
        assert [n for n, _ in lm.named_buffers()] == [n for n, _ in tm.named_buffers()], f"{w}: buffers"
        assert lp.is_pruned(lm) == tp.is_pruned(tm), f"{w}: is_pruned"
        assert hook_signature(lm, lp) == hook_signature(tm, tp), f"{w}: pruning hooks differ"
        for k, v in lm.state_dict().items():
            tv = tm.state_dict()[k]
            assert torch.equal(v.to(torch.float64), tv.to(torch.float64)), f"{w}: state_dict[{k}] differs"
    for (mi, name), orig in originals.items():
        tm, lm = tmods[mi], lmods[mi]
        w = f"{what} ({mi}.{name})"
        if is_pruned_param(tm, name):
            assert name not in lm._parameters, f"{w}: {name} is still a Parameter"
            assert lm._parameters.get(name + "_orig") is orig, f"{w}: {name}_orig is not the original Parameter"
            mask = lm._buffers[name + "_mask"]
            expected = torch.bool if mode == "bool" else orig.dtype
            assert mask.dtype == expected, f"{w}: mask dtype {mask.dtype}, expected {expected}"
            value = getattr(lm, name)
            assert not isinstance(value, nn.Parameter), f"{w}: {name} must be a plain tensor"
            assert value.dtype == orig.dtype, f"{w}: {name} dtype {value.dtype} != {orig.dtype}"
            assert torch.equal(value, orig * mask.to(orig.dtype)), f"{w}: {name} != {name}_orig * {name}_mask"
            assert torch.equal(value, getattr(tm, name)), f"{w}: {name} differs from torch's"
        else:
            assert lm._parameters.get(name) is orig, f"{w}: {name} is not the original Parameter"
            assert torch.equal(orig, tm._parameters[name]), f"{w}: values differ from torch's"


def final_checks(specs: list[ModSpec], tmods: list[nn.Module], lmods: list[nn.Module], what: str) -> None:
    """Hooks recompute ``name`` from the current ``name_orig``; outputs and gradients match torch's."""
    for i, spec in enumerate(specs):
        tm, lm = tmods[i], lmods[i]
        with torch.no_grad():
            for p in (*tm.parameters(), *lm.parameters()):
                p.mul_(-1)
        x = make_input(spec, seed=i)
        yt, yl = run_forward(tm, spec, x), run_forward(lm, spec, x)
        for name, _ in tm.named_parameters():
            if name.endswith("_orig"):
                base = name[: -len("_orig")]
                lv = getattr(lm, base)
                assert torch.equal(lv, getattr(tm, base)), f"{what}: {base} not recomputed by the forward pre-hook"
                assert torch.equal(lv, lm._parameters[name] * lm._buffers[base + "_mask"].to(lv.dtype))
        if yt is None:
            continue
        assert yl is not None
        assert yl.dtype == yt.dtype
        torch.testing.assert_close(yl, yt, msg=lambda m: f"{what}: forward outputs differ: {m}")
        if yt.requires_grad and yl.requires_grad:
            yt.sum().backward()
            yl.sum().backward()
            tg = {n: p.grad for n, p in tm.named_parameters()}
            lg = {n: p.grad for n, p in lm.named_parameters()}
            assert tg.keys() == lg.keys()
            for n, g in tg.items():
                if g is None:
                    assert lg[n] is None, f"{what}: unexpected gradient for {n}"
                else:
                    torch.testing.assert_close(lg[n], g, msg=lambda m, n=n: f"{what}: gradient of {n}: {m}")


# --------------------------------------------------------------------------------------------------------------
# The differential sequence runner
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ran: list[str] = field(default_factory=list)  # per step: "ok", "skipped" or the type torch raised
    stopped_on_error: bool = False


def run_sequence(
    specs: list[ModSpec],
    plan_list: list[Plan],
    mode: str,
    importance_dtype: torch.dtype | None = None,
    final: bool = True,
) -> Outcome:
    tmods = [build(s) for s in specs]
    lmods = [build(s) for s in specs]
    originals = {t: lmods[t[0]]._parameters[t[1]] for mi, m in enumerate(lmods) for t in param_targets(m, mi)}
    out = Outcome()
    for step, plan in enumerate(plan_list):
        call = resolve(plan, tmods, list(originals), importance_dtype)
        if call is None:
            event("step skipped: no suitable target")
            out.ran.append("skipped")
            continue
        what = f"step {step}: {call} [mode={mode}]"
        note(what)
        pre = {}
        for mi, name in call.targets:
            if hasattr(tmods[mi], name):
                mask = tmods[mi]._buffers.get(name + "_mask")
                pre[(mi, name)] = (
                    getattr(tmods[mi], name).detach().clone(),
                    None if mask is None else mask.detach().clone(),
                )
        torch.manual_seed(step)
        _, terr = attempt(lambda call=call: invoke(tp, tmods, call.fresh()))
        before = [snapshot(m) for m in lmods]
        torch.manual_seed(step)
        with lp_mode(mode):
            lres, lerr = attempt(lambda call=call: invoke(lp, lmods, call.fresh()))
        if terr is not None and lerr is None and call.lp_may_succeed:
            event(f"torch quirk ({call.quirk}): torch raised, lightprune did not")
            out.ran.append("ok (torch quirk)")
            out.stopped_on_error = True
            return out
        if terr is not None:
            event(f"torch raised {type(terr).__name__}")
            out.ran.append(type(terr).__name__)
            out.stopped_on_error = True
            assert_compatible_error(terr, lerr, what, call.alt_errors)
            for i, (m, snap) in enumerate(zip(lmods, before, strict=True)):
                assert_unchanged(m, snap, f"{what}: after {type(lerr).__name__}, module {i}")
            return out  # torch's copy may be half-pruned now: it is no longer a trustworthy oracle
        if lerr is not None and call.quirk and isinstance(lerr, ValueError):
            event("torch quirk: lightprune raised ValueError")
            out.ran.append("ok (torch quirk)")
            out.stopped_on_error = True
            for i, (m, snap) in enumerate(zip(lmods, before, strict=True)):
                assert_unchanged(m, snap, f"{what}: after {type(lerr).__name__}, module {i}")
            return out
        mi, name = call.targets[0]
        if call.kind == "ln" and accept_nuclear_norm_refusal(
            call.norm, lmods[mi]._parameters.get(name + "_orig", getattr(lmods[mi], name)).shape, terr, lerr
        ):
            out.ran.append("ok (documented difference)")
            out.stopped_on_error = True
            for i, (m, snap) in enumerate(zip(lmods, before, strict=True)):
                assert_unchanged(m, snap, f"{what}: after {type(lerr).__name__}, module {i}")
            return out  # torch's copy holds a mask ranked by a meaningless norm: no longer an oracle
        if lerr is not None:
            raise AssertionError(f"lightprune raised {type(lerr).__name__}({lerr}) but torch did not: {what}") from lerr
        out.ran.append("ok (torch quirk)" if call.quirk else "ok")
        if call.kind == "global":
            assert lres is None, f"{what}: global_unstructured returned {lres!r}"
        else:
            assert lres is lmods[call.targets[0][0]], f"{what}: the module is not returned"
        compare_step(call, pre, tmods, lmods, what)
        if call.kind != "remove":
            for mi, name in call.targets:
                sync_torch_to_lp(tmods[mi], lmods[mi], name)
        compare_modules(tmods, lmods, mode, originals, what)
    if final:
        final_checks(specs, tmods, lmods, f"after {len(plan_list)} steps [mode={mode}]")
    return out


# --------------------------------------------------------------------------------------------------------------
# Tests: random sequences of pruning calls over several modules
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@budget(80)
@given(
    specs=st.lists(module_specs(), min_size=1, max_size=3),
    plan_list=st.lists(plans(), min_size=1, max_size=4),
)
def test_random_call_sequences_match_torch(mode: str, specs: list[ModSpec], plan_list: list[Plan]) -> None:
    run_sequence(specs, plan_list, mode)


@pytest.mark.parametrize("mode", MODES)
@budget(40)
@given(
    specs=st.lists(module_specs(kinds=("linear", "conv2d", "bare")), min_size=1, max_size=3),
    plan_list=st.lists(plans(kinds=("l1", "ln", "global"), wild_rate=0), min_size=1, max_size=4),
)
def test_deterministic_sequences_match_torch(mode: str, specs: list[ModSpec], plan_list: list[Plan]) -> None:
    """Only deterministic methods and no injected errors: most steps compare masks exactly."""
    run_sequence(specs, [replace(p, gmethod="L1Unstructured") for p in plan_list], mode)


ERROR_CASES = [(kind, wild) for kind in OP_KINDS for wild in WILD[kind]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kind", "wild"), ERROR_CASES, ids=[f"{k}-{w}" for k, w in ERROR_CASES])
@budget(6)
@given(data=st.data())
def test_errors_match_torch_and_leave_module_untouched(mode: str, kind: str, wild: str, data: st.DataObject) -> None:
    """Each error torch raises, on a fresh or an already pruned module: same type, and lightprune rolls back."""
    specs = [
        data.draw(module_specs(kinds=("linear", "conv1d", "conv2d"), bias=True), label="layer"),
        data.draw(module_specs(kinds=("bare",)), label="bare"),
    ]
    pre_kinds = ("l1", "ln", "ru", "rs", "cm", "id", "global")
    prefix = data.draw(st.lists(plans(kinds=pre_kinds, wild_rate=0, norms=SAFE_NORMS), max_size=2), label="prefix")
    last = data.draw(plans(kinds=(kind,), force_wild=wild), label="failing call")
    if kind == "remove":
        prefix = []  # make sure something is left unpruned
    out = run_sequence(specs, [*prefix, last], mode, final=False)
    if len(out.ran) == len(prefix) + 1:  # the failing call was reached (the quirk may not fail in torch)
        assert out.ran[-1] != "ok", f"the injected error {wild!r} did not make torch raise"
    event(f"failing call: {out.ran[-1] if len(out.ran) == len(prefix) + 1 else 'not reached'}")


@pytest.mark.parametrize("mode", MODES)
@budget(30)
@given(
    specs=st.lists(module_specs(kinds=("linear", "conv1d", "bare")), min_size=1, max_size=2),
    plan_list=st.lists(plans(kinds=("l1", "ln", "global"), wild_rate=0), min_size=1, max_size=3),
    importance_dtype=st.sampled_from(FLOAT_DTYPES),
)
def test_importance_scores_in_another_dtype(
    mode: str, specs: list[ModSpec], plan_list: list[Plan], importance_dtype: torch.dtype
) -> None:
    """Importance scores in any float dtype: same masks as torch; the mask keeps the parameter's dtype."""
    plan_list = [replace(p, importance=p.importance or (7, "distinct")) for p in plan_list]
    run_sequence(specs, plan_list, mode, importance_dtype=importance_dtype)


@pytest.mark.parametrize("mode", MODES)
@budget(25)
@given(
    specs=st.lists(module_specs(kinds=("bare",), dtypes=(torch.int64, torch.int32)), min_size=1, max_size=2),
    plan_list=st.lists(plans(kinds=("l1", "rs", "cm", "id", "global", "remove"), wild_rate=0), min_size=1, max_size=4),
)
def test_integer_parameters(mode: str, specs: list[ModSpec], plan_list: list[Plan]) -> None:
    """torch prunes integer Parameters (requires_grad=False) with L1, random_structured, custom masks, identity."""
    plan_list = [replace(p, gmethod="L1Unstructured") for p in plan_list]  # RandomUnstructured needs floats
    run_sequence(specs, plan_list, mode)


# --------------------------------------------------------------------------------------------------------------
# Tests: checkpoints
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@budget(30)
@given(
    spec=module_specs(),
    other_styles=st.tuples(styles, styles),
    plan_list=st.lists(
        plans(kinds=("l1", "ln", "ru", "rs", "cm", "id", "global"), wild_rate=0, norms=SAFE_NORMS),
        min_size=1,
        max_size=3,
    ),
)
def test_checkpoints_load_across_implementations(
    mode: str, spec: ModSpec, other_styles: tuple, plan_list: list[Plan]
) -> None:
    """Same calls on differently-initialised copies: strict cross-loading both ways gives equal values."""
    a = build(spec)  # torch
    b = build(replace(spec, styles=other_styles))  # lightprune
    targets = param_targets(a, 0)
    for step, plan in enumerate(plan_list):
        plan = replace(plan, amount=("float", (step + 1) / 7), norm=plan.norm if spec.dims.count(0) == 0 else 1)
        call = resolve(plan, [a], targets)
        if call is None:
            continue
        note(str(call))
        torch.manual_seed(step)
        invoke(tp, [a], call.fresh())
        torch.manual_seed(step)
        with lp_mode(mode):
            invoke(lp, [b], call.fresh())
    assert sorted(b.state_dict()) == sorted(a.state_dict())
    sd_a = {k: v.clone() for k, v in a.state_dict().items()}
    sd_b = {k: v.clone() for k, v in b.state_dict().items()}
    dtypes_b = {k: v.dtype for k, v in sd_b.items()}

    b.load_state_dict(sd_a, strict=True)
    for k, v in b.state_dict().items():
        assert v.dtype == dtypes_b[k], f"loading changed the dtype of {k}"
        assert torch.equal(v.to(torch.float64), sd_a[k].to(torch.float64)), f"torch -> lightprune: {k}"
    a.load_state_dict(sd_b, strict=True)
    for k, v in a.state_dict().items():
        assert torch.equal(v.to(torch.float64), sd_b[k].to(torch.float64)), f"lightprune -> torch: {k}"

    x = make_input(spec)
    run_forward(b, spec, x)
    for name, p in list(b.named_parameters()):
        if name.endswith("_orig"):
            base = name[: -len("_orig")]
            expected = sd_a[name] * sd_a[base + "_mask"].to(p.dtype)
            assert torch.equal(getattr(b, base), expected), f"{base} not recomputed from the loaded checkpoint"


# --------------------------------------------------------------------------------------------------------------
# Tests: pruning-method objects used directly
# --------------------------------------------------------------------------------------------------------------

METHODS = ("L1Unstructured", "RandomUnstructured", "LnStructured", "RandomStructured", "Identity", "CustomFromMask")


@st.composite
def tensors(draw, min_dims=0, max_dims=4, dtypes=FLOAT_DTYPES):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=min_dims, max_size=max_dims)))
    dtype = draw(st.sampled_from(dtypes))
    style, seed = draw(styles)
    return make_values(shape, style, seed, dtype)


@st.composite
def method_args(draw, method: str, t: Tensor, default: Tensor):
    """Constructor args of ``method`` for tensor ``t``, with amounts relative to the units left in ``default``."""
    nd = t.dim()
    if method in ("LnStructured", "RandomStructured"):
        if nd == 0 or draw(st.integers(0, 9)) == 0:
            dim = draw(st.integers(-nd - 2, nd + 1))
        else:
            dim = draw(st.integers(0, nd - 1)) - (nd if draw(st.booleans()) else 0)
        remaining = int(kept_channels(default, norm_dim(dim, nd)).sum()) if -nd <= dim < nd and nd >= 1 else 0
    else:
        dim = None
        remaining = int((default != 0).sum())
    amount = resolve_amount(draw(amount_plans), remaining)
    if method in ("L1Unstructured", "RandomUnstructured"):
        return (amount,)
    if method == "LnStructured":
        return (amount, draw(st.sampled_from(ALL_NORMS)), dim)
    if method == "RandomStructured":
        return (amount, dim)
    if method == "CustomFromMask":
        shape = tuple(t.shape) if draw(st.integers(0, 9)) else wrong_shape(tuple(t.shape))
        return (random_mask(shape, draw(seeds), draw(st.floats(0, 1)), draw(st.sampled_from((torch.bool, t.dtype)))),)
    return ()


def clone_args(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, Tensor) else a for a in args)


def check_direct_mask(method: str, args: tuple, t: Tensor, default: Tensor, tmask: Tensor, lmask: Tensor, what: str):
    """Direct ``compute_mask``: the method ranks *all* of ``t`` and ANDs the result into ``default``."""
    assert lmask.dtype == tmask.dtype, f"{what}: dtype {lmask.dtype} != torch's {tmask.dtype}"
    assert lmask.shape == tmask.shape, f"{what}: shape"
    d, tv, lv = (x.to(torch.float64) for x in (default, tmask, lmask))
    if method in ("Identity", "CustomFromMask"):
        assert torch.equal(lv, tv), f"{what}: mask differs from torch's"
        return
    check_binary(lmask, what)
    assert bool((lv <= d).all()), f"{what}: un-pruned entries of default_mask"
    if method in ("L1Unstructured", "RandomUnstructured"):
        k = int(tp._compute_nparams_toprune(args[0], t.numel()))
        newly = int(((d != 0) & (lv == 0)).sum())
        assert newly <= k <= int((lv == 0).sum()), f"{what}: {k} entries to prune, {newly} newly pruned"
        if method == "L1Unstructured":
            s = t.abs().reshape(-1).to(torch.float64)
            srt = s.sort().values
            if k in (0, s.numel()) or bool(srt[k - 1] < srt[k]):
                event("direct L1: exact comparison")
                assert torch.equal(lv, tv), f"{what}: mask differs from torch's (no tie at the cut)"
            else:
                event("direct L1: tie at the cut")
                boundary = srt[k - 1]
                flat = lv.reshape(-1)
                assert bool((flat[s < boundary] == 0).all()), f"{what}: kept an entry below the cut"
                assert bool((flat[(s > boundary) & (d.reshape(-1) != 0)] == 1).all()), f"{what}: pruned above the cut"
        elif bool((d == 1).all()):
            assert int((lv == 0).sum()) == k
        return
    dim = norm_dim(args[-1], t.dim())
    k = int(tp._compute_nparams_toprune(args[0], t.shape[dim]))
    dch, lch = channels(d, dim), channels(lv, dim)
    assert bool(((lch == dch).all(1) | (lch == 0).all(1)).all()), f"{what}: not whole channels"
    zero = (lch == 0).all(1)
    newly = int((zero & ~(dch == 0).all(1)).sum())
    assert newly <= k <= int(zero.sum()), f"{what}: {k} channels to prune, {newly} newly pruned"
    if method == "LnStructured":
        s = channel_norms(t, args[1], dim)
        if not bool(torch.isfinite(s).all()):
            return
        rel = 3e-2 if t.dtype in LOW_PRECISION else 1e-4
        srt = s.sort().values
        if k in (0, s.numel()) or float(srt[k] - srt[k - 1]) > rel * abs(float(srt[k])) + 1e-12:
            event("direct Ln: exact comparison")
            assert torch.equal(lv, tv), f"{what}: mask differs from torch's (norms clearly separated)"
        else:
            event("direct Ln: tie at the cut")
            boundary = float(srt[k - 1])
            below = s < boundary * (1 - rel) - 1e-12
            above = s > boundary * (1 + rel) + 1e-12
            assert bool(zero[below].all()), f"{what}: kept a channel clearly below the cut"
            assert bool((lch == dch).all(1)[above].all()), f"{what}: pruned a channel clearly above the cut"


@budget(120)
@given(data=st.data())
def test_method_compute_mask_and_prune_match_torch(data: st.DataObject) -> None:
    method = data.draw(st.sampled_from(METHODS), label="method")
    t = data.draw(tensors(), label="t")
    default = (
        t.new_ones(t.shape) if data.draw(st.booleans()) else random_mask(tuple(t.shape), data.draw(seeds), 0.7, t.dtype)
    )
    args = data.draw(method_args(method, t, default), label="args")
    shown = tuple(tuple(a.shape) if isinstance(a, Tensor) else a for a in args)
    what = f"{method}{shown} on {t.dtype} {tuple(t.shape)}"
    note(what)
    tm, terr = attempt(lambda: getattr(tp, method)(*clone_args(args)))
    lm, lerr = attempt(lambda: getattr(lp, method)(*clone_args(args)))
    if terr is not None:
        assert_compatible_error(terr, lerr, what)
        return
    assert lerr is None, f"{what}: lightprune's constructor raised {lerr!r}"
    assert isinstance(lm, lp.BasePruningMethod) and lm.PRUNING_TYPE == tm.PRUNING_TYPE

    # torch.topk/kthvalue reject k=True although the amount validator accepts bools (a torch bug)
    bool_quirk = args[0] is True if method in ("L1Unstructured", "RandomUnstructured", "RandomStructured") else False
    torch.manual_seed(0)
    tmask, terr = attempt(lambda: tm.compute_mask(t.clone(), default_mask=default.clone()))
    torch.manual_seed(0)
    lmask, lerr = attempt(lambda: lm.compute_mask(t.clone(), default_mask=default.clone()))
    if terr is not None and lerr is None and bool_quirk:
        event("torch quirk (amount=True): torch raised, lightprune did not")
        return
    if method == "LnStructured" and accept_nuclear_norm_refusal(args[1], t.shape, terr, lerr):
        return
    if terr is not None:
        assert_compatible_error(terr, lerr, what)
    else:
        assert lerr is None, f"{what}: lightprune's compute_mask raised {lerr!r}"
        check_direct_mask(method, args, t, default, tmask, lmask, f"{what}.compute_mask")

    # .prune(t, default_mask=..., importance_scores=...) is t * compute_mask(importance or t, default or ones)
    use_default = data.draw(st.booleans(), label="pass default_mask")
    imp_kind = data.draw(st.sampled_from(("none", "same", "wrong")), label="importance_scores")
    imp = None
    if imp_kind == "same":
        imp = make_values(tuple(t.shape), "distinct", data.draw(seeds), t.dtype)
    elif imp_kind == "wrong":
        imp = make_values(wrong_shape(tuple(t.shape)), "normal", 0, t.dtype)

    def pruned(m: Any) -> Callable[[], Tensor]:
        return lambda: m.prune(t.clone(), default_mask=default.clone() if use_default else None, importance_scores=imp)

    torch.manual_seed(1)
    tout, terr = attempt(pruned(tm))
    torch.manual_seed(1)
    lout, lerr = attempt(pruned(lm))
    what = f"{what}.prune(default_mask={use_default}, importance_scores={imp_kind})"
    if terr is not None and lerr is None and bool_quirk:
        return
    if terr is not None:
        assert_compatible_error(terr, lerr, what)
        return
    assert lerr is None, f"{what}: lightprune raised {lerr!r}"
    assert lout.dtype == tout.dtype and lout.shape == tout.shape, f"{what}: dtype/shape"
    if method in ("Identity", "CustomFromMask", "L1Unstructured", "LnStructured"):
        scores = imp if imp is not None else t
        base = default if use_default else torch.ones_like(t)
        tmask2, lmask2 = tm.compute_mask(scores.clone(), base.clone()), lm.compute_mask(scores.clone(), base.clone())
        check_direct_mask(method, args, scores, base, tmask2, lmask2, f"{what} (mask)")
        assert torch.equal(lout, t * lmask2), f"{what}: output is not t * mask"
        if torch.equal(lmask2.to(torch.float64), tmask2.to(torch.float64)):
            assert torch.equal(lout, tout), f"{what}: output differs from torch's"
    else:
        assert bool(((lout == 0) | (lout == t)).all()), f"{what}: output is not t * (0/1 mask)"
        assert int((lout == 0).sum()) >= int((tout == 0).sum()) - int((t == 0).sum()), f"{what}: too few pruned"


def test_container_structured_on_a_1d_tensor_is_refused_for_its_dims_also_with_nuc() -> None:
    """The case Hypothesis found on torch 2.14.1: torch's container slices a 1-D tensor into a 2-D one and (from 2.14)
    ranks it by nuclear norms; lightprune refuses the 1-D tensor itself, before any norm."""
    method = lp.LnStructured(0, "nuc", 0)
    method._tensor_name = "w"
    with pytest.raises(ValueError, match=r"at least 2 dims; got shape \(0,\)"):
        lp.PruningContainer(method).compute_mask(torch.tensor([]), torch.ones(0))


@budget(80)
@given(data=st.data())
def test_pruning_container_used_directly(data: st.DataObject) -> None:
    t = data.draw(tensors(min_dims=1), label="t")
    default = random_mask(tuple(t.shape), data.draw(seeds), data.draw(st.sampled_from((0.5, 0.8, 1.0))), t.dtype)
    names = data.draw(st.lists(st.sampled_from(METHODS), min_size=1, max_size=3), label="methods")
    arg_list = [data.draw(method_args(m, t, default), label=m) for m in names]
    what = f"PruningContainer{tuple(names)} args={arg_list} on {t.dtype} {tuple(t.shape)}"
    note(what)

    def make(impl: Any) -> Any:
        ms = []
        for name, args in zip(names, arg_list, strict=True):
            m = getattr(impl, name)(*clone_args(args))
            m._tensor_name = "w"
            ms.append(m)
        c = impl.PruningContainer(ms[0])
        for m in ms[1:]:
            c.add_pruning_method(m)
        return c, ms

    tres, terr = attempt(lambda: make(tp))
    lres, lerr = attempt(lambda: make(lp))
    if terr is not None:
        assert_compatible_error(terr, lerr, what)
        return
    assert lerr is None, f"{what}: lightprune raised {lerr!r}"
    (tc, _), (lc, lms) = tres, lres
    assert isinstance(lc, lp.PruningContainer) and isinstance(lc, lp.BasePruningMethod)
    assert len(lc) == len(tc) == len(names)
    assert [type(x).__name__ for x in lc] == [type(x).__name__ for x in tc] == list(names)
    assert all(lc[i] is lms[i] for i in range(len(lms)))
    assert lc._tensor_name == "w"

    torch.manual_seed(0)
    tmask, terr = attempt(lambda: tc.compute_mask(t.clone(), default.clone()))
    torch.manual_seed(0)
    lmask, lerr = attempt(lambda: lc.compute_mask(t.clone(), default.clone()))
    # torch's container mis-slices 1-D tensors for structured methods (see resolve()); ValueError is accepted there
    quirk = t.dim() < 2 and names[-1] in ("LnStructured", "RandomStructured")
    bool_quirk = names[-1] in ("L1Unstructured", "RandomUnstructured", "RandomStructured") and arg_list[-1][0] is True
    if terr is not None and lerr is None and bool_quirk:
        event("torch quirk (amount=True): torch raised, lightprune did not")
    elif terr is None and quirk and isinstance(lerr, ValueError):
        # before the nuclear-norm case: a 1-D tensor also has "other than two dims", but the refusal is the 1-D one
        event("torch quirk: lightprune raised ValueError")
    elif names[-1] == "LnStructured" and accept_nuclear_norm_refusal(arg_list[-1][1], t.shape, terr, lerr):
        pass
    elif terr is not None:
        assert_compatible_error(terr, lerr, what, alt=(ValueError,) if quirk else ())
    else:
        assert lerr is None, f"{what}: lightprune's compute_mask raised {lerr!r}"
        assert lmask.dtype == tmask.dtype and lmask.shape == tmask.shape, f"{what}: dtype/shape"
        last, args = names[-1], arg_list[-1]
        call = Call(
            kind={
                "L1Unstructured": "l1",
                "RandomUnstructured": "ru",
                "LnStructured": "ln",
                "RandomStructured": "rs",
                "Identity": "id",
                "CustomFromMask": "cm",
            }[last],
            targets=[(0, "w")],
        )
        call.quirk = "1-D structured" if quirk else None
        if last == "LnStructured":
            call.norm, call.dim = args[1], args[2]
        if last == "RandomStructured":
            call.dim = args[1]
        tm, lm = nn.Module(), nn.Module()
        tm.register_buffer("w_mask", tmask)
        lm.register_buffer("w_mask", lmask)
        compare_step(call, {(0, "w"): (t, default)}, [tm], [lm], what)

    # add_pruning_method validation: not a method -> TypeError, another tensor name -> ValueError
    t_other, l_other = tp.Identity(), lp.Identity()
    t_other._tensor_name = l_other._tensor_name = "other"
    for t_bad, l_bad, expected in ((object(), object(), TypeError), (t_other, l_other, ValueError)):
        _, terr = attempt(lambda b=t_bad: tc.add_pruning_method(b))
        _, lerr = attempt(lambda b=l_bad: lc.add_pruning_method(b))
        assert isinstance(terr, expected)
        assert_compatible_error(terr, lerr, f"{what}: add_pruning_method({type(l_bad).__name__})")
        assert len(lc) == len(names), "a rejected method was added anyway"


@pytest.mark.parametrize("mode", MODES)
@budget(30)
@given(
    spec=module_specs(kinds=("linear", "conv2d"), dtypes=(torch.float32, torch.float64)),
    amounts=st.lists(st.integers(0, 12), min_size=1, max_size=3),
    data=st.data(),
)
def test_custom_subclass_composes_like_torch(mode: str, spec: ModSpec, amounts: list[int], data: st.DataObject) -> None:
    """A user-defined BasePruningMethod subclass (prunes the largest entries) via .apply, global, and mixed."""

    def make_class(impl: Any) -> type:
        class PruneLargest(impl.BasePruningMethod):
            PRUNING_TYPE = "unstructured"

            def __init__(self, amount: Any) -> None:
                impl._validate_pruning_amount_init(amount)
                self.amount = amount

            def compute_mask(self, t: Tensor, default_mask: Tensor) -> Tensor:
                k = impl._compute_nparams_toprune(self.amount, t.nelement())
                impl._validate_pruning_amount(k, t.nelement())
                mask = default_mask.clone(memory_format=torch.contiguous_format)
                if k:
                    mask.view(-1)[torch.topk(t.abs().view(-1), k=k).indices] = 0
                return mask

        return PruneLargest

    tcls, lcls = make_class(tp), make_class(lp)
    a, b = build(spec), build(spec)
    orig = b.weight
    ops = data.draw(st.lists(st.sampled_from(("apply", "l1", "global")), min_size=len(amounts), max_size=len(amounts)))
    for op, k in zip(ops, amounts, strict=True):
        prev = a._buffers.get("weight_mask")
        prev = torch.ones_like(a.weight) if prev is None else prev.clone()
        before = a.weight.detach().clone()
        k = min(k, int((prev != 0).sum()))
        note(f"{op}(amount={k})")
        if op == "apply":
            tres = tcls.apply(a, "weight", amount=k)
            with lp_mode(mode):
                lres = lcls.apply(b, "weight", amount=k)
            assert type(lres).__name__ == type(tres).__name__
            assert isinstance(lres, lp.BasePruningMethod)
        elif op == "l1":
            tp.l1_unstructured(a, "weight", amount=k)
            with lp_mode(mode):
                lp.l1_unstructured(b, "weight", amount=k)
        else:
            tp.global_unstructured([(a, "weight")], pruning_method=tcls, amount=k)
            with lp_mode(mode):
                lp.global_unstructured([(b, "weight")], pruning_method=lcls, amount=k)
        scores = -before.abs() if op in ("apply", "global") else before.abs()
        tnew, lnew = a.weight_mask, b.weight_mask
        check_unstructured_ranking(scores, prev, tnew.to(torch.float64), lnew.to(torch.float64), f"{op}({k})")
        sync_torch_to_lp(a, b, "weight")
        assert hook_signature(b, lp) == hook_signature(a, tp)
        assert b.weight_orig is orig
        assert b.weight_mask.dtype == (torch.bool if mode == "bool" else spec.dtype)
        assert torch.equal(b.weight, a.weight)
    x = make_input(spec)
    torch.testing.assert_close(b(x), a(x))


# --------------------------------------------------------------------------------------------------------------
# Tests: mask dtype switch, remove / is_pruned
# --------------------------------------------------------------------------------------------------------------


def test_mask_dtype_context_manager_and_setter() -> None:
    def pruned_mask_dtype() -> torch.dtype:
        m = nn.Linear(4, 3)
        lp.l1_unstructured(m, "weight", amount=5)
        assert torch.equal(m.weight, m.weight_orig * m.weight_mask.to(m.weight_orig.dtype))
        return m.weight_mask.dtype

    assert pruned_mask_dtype() == torch.float32
    with lp.mask_dtype(torch.bool):
        assert pruned_mask_dtype() == torch.bool
    assert pruned_mask_dtype() == torch.float32
    with pytest.raises(KeyError), lp.mask_dtype(torch.bool):
        raise KeyError("boom")
    assert pruned_mask_dtype() == torch.float32, "mask_dtype did not restore the default after an exception"
    try:
        lp.set_mask_dtype(torch.bool)
        assert pruned_mask_dtype() == torch.bool
        lp.set_mask_dtype(None)
        assert pruned_mask_dtype() == torch.float32
    finally:
        lp.set_mask_dtype(None)


@pytest.mark.parametrize("mode", MODES)
@budget(30)
@given(spec=module_specs(), plan_list=st.lists(plans(kinds=("l1", "ru", "rs", "cm", "id"), wild_rate=0), max_size=3))
def test_remove_and_is_pruned_match_torch(mode: str, spec: ModSpec, plan_list: list[Plan]) -> None:
    """Prune, then remove every parameter (and once more: ValueError); the Parameter object survives."""
    a, b = build(spec), build(spec)
    originals = dict(b.named_parameters())
    targets = param_targets(a, 0)
    for step, plan in enumerate(plan_list):
        call = resolve(plan, [a], targets)
        if call is None:
            continue
        torch.manual_seed(step)
        _, terr = attempt(lambda call=call: invoke(tp, [a], call.fresh()))
        if terr is not None:
            return  # covered elsewhere; torch's copy may be half-pruned
        with lp_mode(mode):
            invoke(lp, [b], call.fresh())
        if call.kind != "remove":
            sync_torch_to_lp(a, b, call.targets[0][1])
    assert lp.is_pruned(b) == tp.is_pruned(a)
    for name, p in originals.items():
        _, terr = attempt(lambda name=name: tp.remove(a, name))
        res, lerr = attempt(lambda name=name: lp.remove(b, name))
        if terr is not None:
            assert_compatible_error(terr, lerr, f"remove({name})")
            continue
        assert lerr is None, f"remove({name}) raised {lerr!r}"
        assert res is b
        assert b._parameters[name] is p, f"remove({name}): not the original Parameter object"
        assert torch.equal(b._parameters[name], a._parameters[name])
        assert name + "_orig" not in b._parameters and name + "_mask" not in b._buffers
    assert sorted(b.state_dict()) == sorted(a.state_dict())
    assert [n for n, _ in b.named_parameters()] == list(originals), "remove() changed the parameter order"
    assert not lp.is_pruned(b) and not tp.is_pruned(a)
    assert len(b._forward_pre_hooks) == len(a._forward_pre_hooks)
    for name in originals:
        _, terr = attempt(lambda name=name: tp.remove(a, name))
        _, lerr = attempt(lambda name=name: lp.remove(b, name))
        assert isinstance(terr, ValueError)
        assert_compatible_error(terr, lerr, f"second remove({name})")


# --------------------------------------------------------------------------------------------------------------
# Tests: private helpers
# --------------------------------------------------------------------------------------------------------------

any_amount = st.one_of(
    st.integers(-5, 60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-0.1, 1.1),
    st.booleans(),
    st.sampled_from(
        ["0.5", None, [1], 1j, np.int64(3), np.float64(0.25), np.float32(0.75), Fraction(1, 3), torch.tensor(0.5)]
    ),
)


def same_outcome(fn_t: Callable[[], Any], fn_l: Callable[[], Any], what: str) -> tuple[Any, Any]:
    tres, terr = attempt(fn_t)
    lres, lerr = attempt(fn_l)
    if terr is not None:
        assert isinstance(lerr, type(terr)), f"{what}: torch raised {terr!r}, lightprune {lerr!r}"
    else:
        assert lerr is None, f"{what}: lightprune raised {lerr!r}, torch returned {tres!r}"
    return tres, lres


@budget(150)
@given(amount=any_amount, size=st.integers(0, 100))
def test_amount_helpers_match_torch(amount: Any, size: int) -> None:
    same_outcome(
        lambda: tp._validate_pruning_amount_init(amount),
        lambda: lp._validate_pruning_amount_init(amount),
        f"_validate_pruning_amount_init({amount!r})",
    )
    same_outcome(
        lambda: tp._validate_pruning_amount(amount, size),
        lambda: lp._validate_pruning_amount(amount, size),
        f"_validate_pruning_amount({amount!r}, {size})",
    )
    if attempt(lambda: tp._validate_pruning_amount_init(amount))[1] is None:
        tres, lres = same_outcome(
            lambda: tp._compute_nparams_toprune(amount, size),
            lambda: lp._compute_nparams_toprune(amount, size),
            f"_compute_nparams_toprune({amount!r}, {size})",
        )
        assert lres == tres, f"_compute_nparams_toprune({amount!r}, {size}): {lres!r} != {tres!r}"


@budget(150)
@given(
    t=tensors(max_dims=5, dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16)),
    dim=st.integers(-7, 6),
    n=st.sampled_from(ALL_NORMS),
)
def test_tensor_helpers_match_torch(t: Tensor, dim: int, n: Any) -> None:
    same_outcome(
        lambda: tp._validate_structured_pruning(t),
        lambda: lp._validate_structured_pruning(t),
        f"_validate_structured_pruning({tuple(t.shape)})",
    )
    same_outcome(
        lambda: tp._validate_pruning_dim(t, dim),
        lambda: lp._validate_pruning_dim(t, dim),
        f"_validate_pruning_dim({tuple(t.shape)}, {dim})",
    )
    what = f"_compute_norm({t.dtype} {tuple(t.shape)}, {n!r}, {dim})"
    tres, lres = same_outcome(lambda: tp._compute_norm(t, n, dim), lambda: lp._compute_norm(t, n, dim), what)
    if tres is not None:
        assert lres.dtype == tres.dtype and lres.shape == tres.shape, what
        torch.testing.assert_close(lres, tres, equal_nan=True, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------------------------
# Fixed regression cases for torch quirks that random search might reach rarely
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_failing_second_prune_rolls_back_where_torch_does_not(mode: str) -> None:
    """torch drops the hook (and mutates the container) when a second prune fails; lightprune must not."""
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    tp.l1_unstructured(a, "weight", amount=2)
    tp.ln_structured(a, "weight", amount=1, n=2, dim=0)
    with lp_mode(mode):
        lp.l1_unstructured(b, "weight", amount=2)
        lp.ln_structured(b, "weight", amount=1, n=2, dim=0)
    snap = snapshot(b)
    with pytest.raises(ValueError):
        tp.l1_unstructured(a, "weight", amount=100)
    assert not tp.is_pruned(a)  # torch is left half-pruned: hook gone, reparametrization still there
    with pytest.raises(ValueError), lp_mode(mode):
        lp.l1_unstructured(b, "weight", amount=100)
    assert_unchanged(b, snap, "after a failing third prune")
    with pytest.raises(IndexError), lp_mode(mode):
        lp.random_structured(b, "weight", amount=1, dim=2)
    assert_unchanged(b, snap, "after a failing structured prune")


@pytest.mark.parametrize("mode", MODES)
def test_banker_rounding_and_ties_to_exact_counts(mode: str) -> None:
    """round() is Python's (half to even): 0.5 of 5 prunes 2, 0.5 of 7 prunes 4 (3.5 -> 4), 0.25 of 10 prunes 2."""
    for size, amount in ((5, 0.5), (7, 0.5), (10, 0.25), (6, 0.75), (3, 0.5)):
        m = nn.Module()
        m.w = nn.Parameter(torch.ones(size))  # all tied
        with lp_mode(mode):
            lp.l1_unstructured(m, "w", amount=amount)
        assert int((m.w_mask == 0).sum()) == round(amount * size)
        t = nn.Module()
        t.w = nn.Parameter(torch.ones(size))
        tp.l1_unstructured(t, "w", amount=amount)
        assert int((m.w_mask == 0).sum()) == int((t.w_mask == 0).sum())


# --------------------------------------------------------------------------------------------------------------
# A replaced compute_mask: unittest.mock.patch, a monkey-patched class, a function set on an instance
# --------------------------------------------------------------------------------------------------------------

PATCHABLE = {
    # class name: (functional form, its keyword arguments, deterministic original)
    "L1Unstructured": ("l1_unstructured", {"amount": 0.3}, True),
    "RandomUnstructured": ("random_unstructured", {"amount": 2}, False),
    "LnStructured": ("ln_structured", {"amount": 1, "n": 1, "dim": 0}, True),
    "RandomStructured": ("random_structured", {"amount": 0.5, "dim": -1}, False),
    "Identity": ("identity", {}, True),
}
RULES = ("first_k", "magnitude_at_least", "wrap_original", "raise")


def ranking_is_unambiguous(t: Tensor) -> bool:
    """No tied magnitudes, and no tied L1 norms of the slices along dim 0: torch's topk and lightprune's tie-break
    by flat index then choose the same entries and channels (the originals wrapped below rank by these)."""
    magnitudes = t.detach().abs().reshape(-1).tolist()
    if len(set(magnitudes)) < len(magnitudes):
        return False
    if t.dim() < 2:
        return True
    norms = t.detach().to(torch.float64).abs().reshape(t.shape[0], -1).sum(1).tolist()
    return len(set(norms)) == len(norms)


def replacement_rule(rule: str, k: int, original: Callable[..., Tensor] | None, calls: list) -> Callable[..., Tensor]:
    """A compute_mask(t, default_mask) of the kind tests and users substitute; records what it was shown."""

    def compute_mask(t: Tensor, default_mask: Tensor) -> Tensor:
        calls.append((tuple(t.shape), t.detach().to(torch.float64).clone(), default_mask.to(torch.float64).clone()))
        if rule == "raise":
            raise RuntimeError("replaced compute_mask failed")
        # wrap_original: the method's own rule, then more (where ties could make torch's choice arbitrary, the
        # default mask instead; torch and lightprune are shown the same t, checked by compare_calls)
        wrap = rule == "wrap_original" and ranking_is_unambiguous(t)
        mask = original(t, default_mask).clone() if wrap else default_mask.clone()
        flat = mask.view(-1)
        if rule == "magnitude_at_least":
            flat.mul_((t.detach().reshape(-1).abs() >= 0.5).to(mask.dtype))
        else:
            flat[: min(k, flat.numel())] = 0
        return mask

    return compute_mask


@contextlib.contextmanager
def replaced(impl: Any, cls_name: str, how: str, rule: str, k: int, calls: list) -> Iterator[None]:
    """Replace ``impl.<cls_name>.compute_mask`` for the block: ``how`` is "mock" or "monkeypatch"."""
    cls = getattr(impl, cls_name)
    owner = next(klass for klass in cls.__mro__ if "compute_mask" in klass.__dict__)
    saved = owner.__dict__["compute_mask"]
    original = None
    if rule == "wrap_original":
        original = lambda t, default_mask: saved(cls(**PATCHABLE[cls_name][1]), t, default_mask)  # noqa: E731
    fn = replacement_rule(rule, k, original, calls)
    if how == "mock":
        with mock.patch.object(cls, "compute_mask", side_effect=fn):  # a MagicMock: called without self
            yield
        return
    cls.compute_mask = lambda self, t, default_mask: fn(t, default_mask)
    try:
        yield
    finally:
        if owner is cls:
            cls.compute_mask = saved
        else:
            del cls.compute_mask


def replaced_step(
    impl: Any, m: nn.Module, glob: list[str] | None, cls_name: str, how: str, rule: str, k: int, step: int, calls: list
) -> None:
    """One pruning call with ``cls_name.compute_mask`` replaced (``how``: mock, monkeypatch or none)."""
    function, kwargs, _ = PATCHABLE[cls_name]
    with replaced(impl, cls_name, how, rule, k, calls) if how != "none" else contextlib.nullcontext():
        torch.manual_seed(step)
        if glob:
            impl.global_unstructured([(m, n) for n in glob], getattr(impl, cls_name), **kwargs)
        else:
            getattr(impl, function)(m, "weight", **kwargs)


def compare_calls(tcalls: list, lcalls: list, what: str) -> None:
    assert len(lcalls) == len(tcalls), f"{what}: compute_mask called {len(lcalls)} times, torch {len(tcalls)}"
    for i, ((ts, tt, td), (ls, lt, ld)) in enumerate(zip(tcalls, lcalls, strict=True)):
        assert ls == ts, f"{what}: call {i} shown t of shape {ls}, torch {ts}"
        assert torch.equal(lt, tt), f"{what}: call {i} shown other importance scores than torch"
        assert torch.equal(ld, td), f"{what}: call {i} shown another default_mask than torch"


@pytest.mark.parametrize("mode", MODES)
@budget(40)
@given(
    spec=module_specs(kinds=("linear", "conv1d", "conv2d"), dtypes=(torch.float32, torch.float64)),
    steps=st.lists(
        st.tuples(
            st.sampled_from(tuple(PATCHABLE)),
            st.sampled_from(("mock", "monkeypatch", "none")),
            st.sampled_from(RULES),
            st.integers(0, 6),
            st.booleans(),  # global_unstructured over weight and bias instead of the functional form (unstructured)
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_replaced_compute_mask_is_called_as_torch_calls_it(mode: str, spec: ModSpec, steps: list) -> None:
    """torch always calls compute_mask; lightprune must too once it is replaced, and with the same arguments."""
    tm, lm = build(spec), build(spec)
    names = [name for name, _ in lm.named_parameters()]
    for step, (cls_name, how, rule, k, use_global) in enumerate(steps):
        function, _, deterministic = PATCHABLE[cls_name]
        if rule == "wrap_original" and not deterministic:
            rule = "first_k"  # the random originals draw differently (lightprune's draws are float32 or wider)
        unstructured = cls_name in ("L1Unstructured", "RandomUnstructured")
        glob = use_global and unstructured and len(names) > 1
        what = f"step {step}: {cls_name}.compute_mask {how} ({rule}, k={k}) via {'global' if glob else function}"
        note(what)
        tcalls: list = []
        lcalls: list = []
        args = (names if glob else None, cls_name, how, rule, k, step)
        _, terr = attempt(lambda args=args, calls=tcalls: replaced_step(tp, tm, *args, calls))
        before = snapshot(lm)
        with lp_mode(mode):
            _, lerr = attempt(lambda args=args, calls=lcalls: replaced_step(lp, lm, *args, calls))
        if how != "none":
            compare_calls(tcalls, lcalls, what)
            assert lcalls, f"{what}: the replaced compute_mask was not called"
        if terr is not None:
            assert_compatible_error(terr, lerr, what)
            assert_unchanged(lm, before, f"{what}: after {type(lerr).__name__}")
            return
        assert lerr is None, f"{what}: lightprune raised {lerr!r}"
        for n in names if glob else ["weight"]:
            tmask, lmask = tm._buffers[n + "_mask"], lm._buffers[n + "_mask"]
            assert lmask.dtype == (torch.bool if mode == "bool" else tmask.dtype), f"{what}: {n} mask dtype"
            if how == "none":  # not replaced: checked by the tests above (ties, random draws may differ here)
                sync_torch_to_lp(tm, lm, n)  # torch follows lightprune's mask from here
                continue
            assert torch.equal(lmask.to(tmask.dtype), tmask), f"{what}: {n} mask differs from torch's"
    for cls_name in PATCHABLE:  # nothing is left replaced
        assert base._has_fast_path(getattr(lp, cls_name)(**PATCHABLE[cls_name][1]))
