"""Unstructured-sparse Linear layers on torch's sparse CSR kernels, where that measures faster than dense."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.utils.prune as torch_prune
from torch import Tensor, nn

from lightprune.export._pruned import effective_state_dict
from lightprune.export.latency import check_rounds, compare_latency
from lightprune.layouts import is_transformers_conv1d

__all__ = ["LayerDecision", "SparseLinear", "to_sparse_linear"]

_LAYER_WARMUP = 2  # untimed calls per layer and variant before the timed ones


def _dense_weight_and_bias(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The effective ``(out_features, in_features)`` weight and the bias of an ``nn.Linear`` or a ``Conv1D``."""
    state = effective_state_dict(module)
    weight = state["weight"].t() if is_transformers_conv1d(module) else state["weight"]
    return weight, state.get("bias")


def _to_csr(weight: Tensor) -> Tensor:
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        return weight.detach().to_sparse_csr()


def _take_the_nonzero_count(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """torch loads a buffer by copying into it, which a CSR tensor accepts only from one with as many nonzeros: the
    layer takes a buffer of the checkpoint's count first (the same layer pruned otherwise), then torch copies in."""
    incoming, current = state_dict.get(prefix + "weight"), module._buffers.get("weight")
    if (
        isinstance(incoming, Tensor)
        and isinstance(current, Tensor)
        and incoming.layout == current.layout == torch.sparse_csr
        and incoming.shape == current.shape
        and incoming._nnz() != current._nnz()
    ):
        module._buffers["weight"] = incoming.to(current.device, current.dtype).clone()


class SparseLinear(nn.Module):
    """``nn.Linear`` for inference with its weight in torch's sparse CSR layout: cost follows the nonzeros.

    The weight and bias are buffers (not trained). Inputs of any leading shape work, as with ``nn.Linear``.

    Args:
        weight: Dense ``(out_features, in_features)`` weight; its zeros are dropped.
        bias: Optional ``(out_features,)`` bias (another shape is refused with a ValueError).

    Example:
        >>> layer = nn.Linear(8, 4)
        >>> with torch.no_grad():
        ...     layer.weight[:, 2:] = 0
        >>> sparse = SparseLinear.from_linear(layer)
        >>> sparse, sparse.weight.layout
        (SparseLinear(in_features=8, out_features=4, nnz=8), torch.sparse_csr)
        >>> x = torch.randn(3, 5, 8)
        >>> torch.allclose(sparse(x), layer(x), atol=1e-6)
        True
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(
                f"bias must have shape (out_features,) = ({self.out_features},), got shape {tuple(bias.shape)}"
            )
        self.register_buffer("weight", _to_csr(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_load_state_dict_pre_hook(_take_the_nonzero_count)

    def __deepcopy__(self, memo: dict[int, Any]) -> SparseLinear:
        """An independent copy: torch cannot deep-copy a sparse CSR tensor, so the weight is cloned instead.

        Example:
            >>> layer = SparseLinear(torch.eye(3))
            >>> twin = copy.deepcopy(layer)
            >>> twin.weight.layout, torch.equal(twin.weight.to_dense(), layer.weight.to_dense())
            (torch.sparse_csr, True)
        """
        weight = self._buffers["weight"]
        if weight is not None:
            memo[id(weight)] = weight.clone()
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    @classmethod
    def from_linear(cls, linear: nn.Module) -> SparseLinear:
        """From an ``nn.Linear`` or Hugging Face's ``Conv1D``, pruned (its effective weight is used) or not."""
        return cls(*_dense_weight_and_bias(linear))

    def forward(self, x: Tensor) -> Tensor:
        """``x @ weight.T + bias`` as ``(weight @ x.T).T`` on the CSR kernel."""
        flat = x.reshape(-1, self.in_features)
        try:
            if self.bias is None:
                out = torch.mm(self.weight, flat.t())
            else:
                out = torch.addmm(self.bias.unsqueeze(1), self.weight, flat.t())
        except (RuntimeError, NotImplementedError) as err:
            if "not implemented" not in str(err).lower():
                raise
            raise NotImplementedError(
                f"SparseLinear: torch has no sparse CSR matmul for a {self.weight.dtype} weight on "
                f"{self.weight.device.type} (float32 and float64 work on the CPU); keep this layer dense (as "
                "to_sparse_linear does) or convert the weight's dtype"
            ) from err
        return out.t().reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nnz={self.weight._nnz()}"


@dataclass(frozen=True)
class LayerDecision:
    """What :func:`to_sparse_linear` measured for one Linear layer and whether it converted it.

    Attributes:
        name: Qualified module name.
        sparsity: Fraction of zero weights.
        dense_s: Median seconds of the dense layer on the layer's own example input.
        sparse_s: Median seconds of the CSR layer (None when not timed: sparsity below ``min_sparsity``, or no
            sparse kernel for the layer's dtype and device).
        converted: Whether the layer was replaced by :class:`SparseLinear`.
        note: Why a layer above ``min_sparsity`` was not timed (empty otherwise): no sparse kernel for its dtype,
            or the model did not call it on ``example_inputs`` (an auxiliary head, say).
    """

    name: str
    sparsity: float
    dense_s: float | None
    sparse_s: float | None
    converted: bool
    note: str = ""


def _copy_failure(model: nn.Module, err: Exception, prefix: str = "") -> str:
    """Name the innermost submodule whose ``copy.deepcopy`` fails, with the error and, where it helps, the cause."""
    for name, child in model.named_children():
        try:
            copy.deepcopy(child)
        except RuntimeError as child_err:
            return _copy_failure(child, child_err, f"{prefix}{name}.")
    where = f"module {prefix[:-1]!r} ({type(model).__name__})" if prefix else f"the model ({type(model).__name__})"
    message = f"{where} cannot be deep-copied ({type(err).__name__}: {err})"
    if any(isinstance(hook, torch_prune.BasePruningMethod) for hook in model._forward_pre_hooks.values()):
        message += "; it is pruned with torch.nn.utils.prune, whose modules copy after prune.remove"
    return message


def to_sparse_linear(
    model: nn.Module,
    example_inputs: Tensor | Sequence[Any],
    *,
    min_sparsity: float = 0.5,
    repeats: int = 10,
    margin: float = 1.0,
) -> tuple[nn.Module, list[LayerDecision]]:
    """Copy a model, replacing each unstructured-sparse ``nn.Linear`` by :class:`SparseLinear` where it is faster.

    Hugging Face's ``Conv1D`` (GPT-2's attention and MLP layers: a Linear whose weight is stored transposed) counts as a
    Linear; subclasses of ``nn.Linear`` do not (``nn.MultiheadAttention`` reads its ``out_proj`` weight without calling
    the layer, so replacing it would change nothing or break the model). Each layer whose weight is at least
    ``min_sparsity`` zeros is timed both ways on the input it receives when the model runs ``example_inputs``
    (interleaved repeats, see :func:`~lightprune.export.compare_latency`), and converted only when the CSR median beats
    the dense median by ``margin``. On a 2-core x86 CPU the crossover for a Linear(4096, 4096) at batch 32 lies between
    70% and 80% zeros (see BENCHMARKS.md); measuring per layer keeps small layers, where the sparse kernel's overhead
    dominates, dense. A layer the model does not call on ``example_inputs`` cannot be timed: it stays dense, and its
    decision's ``note`` says so.

    Args:
        model: The model, plain or pruned with the reparametrization (left untouched).
        example_inputs: One tensor or a tuple of positional inputs, shaped like real inference inputs (the batch
            size matters).
        min_sparsity: Layers with fewer zeros are kept dense without timing.
        repeats: Timed calls per layer and variant.
        margin: Required speed-up: convert when ``dense_s / sparse_s >= margin``; ``0`` converts every timed layer.

    Returns:
        ``(model copy in eval mode, one LayerDecision per nn.Linear or Conv1D)``.

    Raises:
        TypeError: ``repeats`` is not an int (a bool, a float or NaN included).
        ValueError: ``repeats`` below 1, ``min_sparsity`` outside [0, 1] or ``margin`` negative (or NaN).

    Example:
        >>> from lightprune import prune
        >>> net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
        >>> _ = prune.l1_unstructured(net[0], "weight", amount=0.99)
        >>> fast, decisions = to_sparse_linear(net, torch.randn(32, 512), repeats=5, margin=0.0)
        >>> [(d.name, round(d.sparsity, 2), d.converted) for d in decisions]
        [('0', 0.99, True), ('2', 0.0, False)]
        >>> x = torch.randn(4, 512)
        >>> torch.allclose(fast(x), net.eval()(x), atol=1e-5)
        True
    """
    # before the copy and the forward: a bad count would otherwise fail only once a layer is timed, or never
    check_rounds(repeats, _LAYER_WARMUP)
    if not 0.0 <= min_sparsity <= 1.0:
        raise ValueError(f"min_sparsity must be in [0, 1], got {min_sparsity}")
    if not margin >= 0.0:
        raise ValueError(f"margin must be at least 0, got {margin}")
    try:
        result = copy.deepcopy(model).eval()
    except RuntimeError as err:  # NotImplementedError included
        raise RuntimeError(f"cannot copy the model: {_copy_failure(model, err)}") from err
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    linears = {name: m for name, m in result.named_modules() if type(m) is nn.Linear or is_transformers_conv1d(m)}
    seen: dict[str, Tensor] = {}

    called: set[str] = set()

    def capture(name: str):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            called.add(name)
            # the input, positional or by keyword (nn.Linear's ``input``, Conv1D's ``x``)
            given = args[0] if args else next(iter(kwargs.values()), None) if len(kwargs) == 1 else None
            if name not in seen and isinstance(given, Tensor):
                seen[name] = given.detach().clone()

        return hook

    handles = [m.register_forward_pre_hook(capture(name), with_kwargs=True) for name, m in linears.items()]
    try:
        with torch.no_grad():
            result(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    decisions = []
    for name, linear in linears.items():
        weight, bias = _dense_weight_and_bias(linear)
        sparsity = float((weight == 0).sum()) / max(weight.numel(), 1)
        if sparsity < min_sparsity or weight.numel() == 0:
            decisions.append(LayerDecision(name, sparsity, None, None, False))
            continue
        if name not in seen:
            reason = "its input was not a tensor" if name in called else "the model did not call it on example_inputs"
            decisions.append(LayerDecision(name, sparsity, None, None, False, f"kept dense, not timed: {reason}"))
            continue
        sparse = SparseLinear(weight, bias)
        try:
            with torch.no_grad():
                sparse(seen[name])
        except (RuntimeError, NotImplementedError) as err:  # e.g. no CSR matmul for bfloat16 on the CPU
            note = f"kept dense: no sparse kernel for {weight.dtype} on {weight.device.type} ({type(err).__name__})"
            decisions.append(LayerDecision(name, sparsity, None, None, False, note))
            continue
        dense = nn.Linear(
            sparse.in_features, sparse.out_features, bias=bias is not None, dtype=weight.dtype, device=weight.device
        )
        dense.load_state_dict({"weight": weight, **({"bias": bias} if bias is not None else {})})
        times = compare_latency(
            {"dense": dense.eval(), "sparse": sparse}, seen[name], repeats=repeats, warmup=_LAYER_WARMUP
        )
        converted = times["dense"].median >= margin * times["sparse"].median
        decisions.append(LayerDecision(name, sparsity, times["dense"].median, times["sparse"].median, converted))
        if converted and not name:
            result = sparse  # the model is itself one Linear
        elif converted:
            *owner, leaf = name.split(".")
            setattr(result.get_submodule(".".join(owner)), leaf, sparse)
    return result, decisions
