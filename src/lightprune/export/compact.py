"""Exact physical removal of pruned channels: a smaller model computing the same function as the masked one.

:func:`compact` traces the model with ``torch.fx``, follows every channel of every Linear/Conv output through the
graph and removes the channels nothing needs. A channel is removed when, at every place it is read (a Linear or
Conv input), it is either

* **unused**: the reader's weight slice for it is all zero (input channels pruned along ``dim=1``), or
* **constant**: its producer's weight slice is all zero (output channels pruned along ``dim=0``), so it carries the
  same value everywhere (its bias, through activations and BatchNorm); that value times the reader's weights is
  added to the reader's bias, which is exact where every output position sees the whole kernel (a Linear, a Conv
  without padding, or one whose reflect/replicate/circular padding repeats the constant). Behind a zero-padded Conv
  border positions see less of it: the constants are removed there too, and a correction map for the input's
  spatial size (:func:`constant_input_correction`) is added to the layer's output instead.

Channel sets follow elementwise activations, dropout, BatchNorm (its entries are removed too), pooling, flatten,
residual additions (the channels of the two operands are merged: a channel goes only if it can go from both) and
concatenation along the channel dimension. An in-place operation on a tensor (or on a view of one) that is also read
elsewhere keeps that tensor's channels. Any other operation keeps every channel that reaches it (with a warning
naming the operation where that keeps pruned channels), so the result is always exact; it is checked on the example
inputs before it is returned.

Input channels of a layer fed by something that must keep them (the model input, an unsupported operation) whose
weight slice is all zero are dropped by an ``index_select`` in front of the layer, so such layers shrink as well.
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree

from lightprune._modes import eval_mode
from lightprune.export._pruned import effective_state_dict

__all__ = ["CompactError", "compact", "constant_input_correction"]


class CompactError(RuntimeError):
    """A model :func:`compact` cannot trace, or whose compact form would not match it."""


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_LAYER_STATE = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
"""The state a Linear/Conv/BatchNorm that compact rebuilds may hold (after pruning pairs are folded)."""
_ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Softplus,
    nn.Softsign,
    nn.Tanhshrink,
)
_IDENTITY_MODULES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
_CONSTANT_KEEPING_POOLS = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)
_AVG_POOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_ELEMENTWISE_FUNCTIONS: set[Any] = {
    torch.relu,
    torch.relu_,
    F.relu,
    F.relu6,
    F.leaky_relu,
    F.elu,
    F.selu,
    F.celu,
    F.gelu,
    F.silu,
    F.mish,
    F.hardswish,
    F.hardsigmoid,
    F.hardtanh,
    F.softplus,
    torch.sigmoid,
    F.sigmoid,
    torch.tanh,
    F.tanh,
}
_IDENTITY_FUNCTIONS: set[Any] = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, torch.dropout}
_ELEMENTWISE_METHODS = {"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_"}
_IDENTITY_METHODS = {"contiguous", "clone", "detach"}
_POOL_FUNCTIONS: set[Any] = {
    F.max_pool1d,
    F.max_pool2d,
    F.max_pool3d,
    torch.max_pool1d,
    torch.max_pool2d,
    torch.max_pool3d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d,
    F.adaptive_max_pool2d,
    F.adaptive_max_pool3d,
}
_BINARY = {
    operator.add: torch.add,
    operator.iadd: torch.add,
    operator.sub: torch.sub,
    operator.isub: torch.sub,
    operator.mul: torch.mul,
    operator.imul: torch.mul,
    torch.add: torch.add,
    torch.sub: torch.sub,
    torch.mul: torch.mul,
    "add": torch.add,
    "add_": torch.add,
    "sub": torch.sub,
    "sub_": torch.sub,
    "mul": torch.mul,
    "mul_": torch.mul,
}


# ------------------------------------------------------------------------------------------------------------------
# Tracing and copying
# ------------------------------------------------------------------------------------------------------------------


class _NamingTracer(fx.Tracer):
    """An fx tracer that remembers where it was, so a failure can name the module and the last node traced."""

    def where(self) -> str:
        modules = [path for path, _ in self.module_stack.values() if path]
        last = next(iter(reversed(self.graph.nodes)), None) if hasattr(self, "graph") else None
        parts = []
        if modules:
            parts.append(f"inside module {modules[-1]!r}")
        if last is not None and last.op != "placeholder":
            parts.append(f"after node {last.name!r} ({last.format_node()})")
        return ", ".join(parts) or "at the model's forward"


def _trace(model: nn.Module) -> fx.Graph:
    tracer = _NamingTracer()
    try:
        return tracer.trace(model)
    except Exception as err:
        raise CompactError(
            f"compact cannot trace {type(model).__name__} with torch.fx ({tracer.where()}): "
            f"{type(err).__name__}: {err}. Data-dependent control flow or Python on tensor values cannot be traced; "
            "move it into a leaf module or rewrite it with tensor operations."
        ) from err


def _trace_in_eval_mode(model: nn.Module) -> fx.GraphModule:
    """Trace and copy ``model`` as it computes in eval mode; every module's ``training`` flag is restored after.

    Python branches on ``self.training`` (and ``F.dropout(x, p, self.training)``) are fixed when the model is traced,
    so the trace must see the inference function whatever mode the caller left the model in. Attributes the trace
    left holding a Proxy (the pruned ``weight`` a pruning hook stores) get their values back too.
    """
    attributes = [(module, dict(vars(module))) for module in model.modules()]
    try:
        with eval_mode(model):
            return _copy_graph_module(model, _trace(model))
    finally:
        for module, before in attributes:  # a pruning hook stores its traced weight (a Proxy) on the module
            for key, value in list(vars(module).items()):
                if isinstance(value, fx.Proxy):
                    if key in before:
                        module.__dict__[key] = before[key]
                    else:
                        del module.__dict__[key]


def _plain_copy(module: nn.Module, target: str) -> nn.Module:
    """An independent, unpruned copy: Linear/Conv/BatchNorm rebuilt from their effective tensors, others deep-copied."""
    state = {k: v.detach().clone() for k, v in effective_state_dict(module).items()}
    kind = type(module)
    if kind is nn.Linear or kind in _CONVS or kind in _NORMS:
        unknown = sorted(set(state) - _LAYER_STATE)
        if unknown or (kind not in _NORMS and "weight" not in state):
            raise CompactError(
                f"module {target!r} ({kind.__name__}) holds {unknown} instead of a plain weight: a hook-based "
                "reparametrization such as torch.nn.utils.spectral_norm or weight_norm, which compact cannot copy. "
                "Remove it first (torch.nn.utils.remove_spectral_norm / remove_weight_norm store the weight the layer "
                "computes in eval mode)"
            )
    kwargs = {"device": "meta", "dtype": None}
    if kind is nn.Linear:
        new = nn.Linear(module.in_features, module.out_features, bias="bias" in state, **kwargs)
    elif kind in _CONVS:
        new = kind(
            module.in_channels,
            module.out_channels,
            module.kernel_size,
            stride=module.stride,
            padding=module.padding,
            dilation=module.dilation,
            groups=module.groups,
            bias="bias" in state,
            padding_mode=module.padding_mode,
            **kwargs,
        )
    elif kind in _NORMS:
        new = kind(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=module.track_running_stats,
            **kwargs,
        )
    else:
        try:
            return copy.deepcopy(module)
        except RuntimeError as err:
            raise CompactError(
                f"cannot copy module {target!r} ({kind.__name__}): {err}; call prune.remove on it first"
            ) from err
    new.load_state_dict(state, assign=True)
    return new


def _copy_graph_module(model: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule over independent copies of everything the graph uses: the input model is never touched."""
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target not in root:
            root[node.target] = _plain_copy(model.get_submodule(node.target), node.target)
        elif node.op == "get_attr" and node.target not in root:
            *owner, name = node.target.split(".")
            value = getattr(model.get_submodule(".".join(owner)), name)
            if isinstance(value, nn.Parameter):
                value = nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
            elif isinstance(value, Tensor):
                value = value.detach().clone()
            root[node.target] = value
    gm = fx.GraphModule(root, graph, class_name=f"Compact{type(model).__name__}")
    return gm.eval()


# ------------------------------------------------------------------------------------------------------------------
# Channel analysis
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class _Channels:
    """The channels of one tensor along dimension ``dim``: class ids and, where known, the constant each carries."""

    dim: int
    ids: list[int]
    const: Tensor  # float64, one value a channel; meaningful where is_const
    is_const: Tensor  # bool


@dataclass
class _Site:
    """A Linear/Conv call: the module's input and output channel ids and what reached its input."""

    node: fx.Node
    module: nn.Module
    in_ids: list[int]
    out_ids: list[int]
    arriving: _Channels | None
    channel_dim: int  # of the layer's input: 1 for a batched Conv input, 0 for an unbatched one, -1 for a Linear


class _Analysis:
    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.parent: list[int] = []
        self.pinned: list[bool] = []
        self.reason: dict[int, str] = {}  # why a class was kept, where an unsupported operation kept it
        self.info: dict[fx.Node, _Channels | None] = {}
        self.sites: dict[str, _Site] = {}
        self.norms: dict[str, list[int]] = {}
        self.calls: dict[str, int] = {}
        for node in gm.graph.nodes:
            if node.op == "call_module":
                self.calls[node.target] = self.calls.get(node.target, 0) + 1

    # union-find over channel ids -------------------------------------------------------------------------------
    def new_ids(self, n: int, pinned: bool = False) -> list[int]:
        start = len(self.parent)
        self.parent.extend(range(start, start + n))
        self.pinned.extend([pinned] * n)
        return list(range(start, start + n))

    def find(self, i: int) -> int:
        root = i
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[i] != root:
            self.parent[i], i = root, self.parent[i]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.pinned[ra] = self.pinned[ra] or self.pinned[rb]
            if rb in self.reason:
                self.reason.setdefault(ra, self.reason.pop(rb))

    def pin(self, ids: Sequence[int], reason: str | None = None) -> None:
        for i in ids:
            root = self.find(i)
            self.pinned[root] = True
            if reason is not None:
                self.reason.setdefault(root, reason)

    def removed(self, i: int) -> bool:
        return not self.pinned[self.find(i)]

    # helpers ------------------------------------------------------------------------------------------------------
    @staticmethod
    def shape(node: Any) -> tuple[int, ...] | None:
        meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
        return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None

    @staticmethod
    def dtype(node: fx.Node) -> torch.dtype:
        meta = node.meta.get("tensor_meta")
        return meta.dtype if meta is not None and hasattr(meta, "dtype") else torch.float32

    def pin_all_inputs(self, node: fx.Node) -> None:
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        reason = None if node.op == "output" else f"node {node.name!r} ({node.op} {target})"

        def visit(arg: fx.Node) -> fx.Node:
            channels = self.info.get(arg)
            if channels is not None:
                self.pin(channels.ids, reason)
            return arg

        fx.node.map_arg((node.args, node.kwargs), visit)

    def tracked(self, arg: Any) -> _Channels | None:
        return self.info.get(arg) if isinstance(arg, fx.Node) else None

    @staticmethod
    def passthrough(x: _Channels, fn: Callable[[Tensor], Tensor] | None, dtype: torch.dtype) -> _Channels:
        """The channels of ``fn(x)`` for a per-channel ``fn``: same ids, constants mapped through ``fn``."""
        if fn is None:
            return x
        with torch.no_grad():
            const = fn(x.const.to(dtype).clone()).to(torch.float64)
        return _Channels(x.dim, x.ids, const, x.is_const.clone())

    def flatten(self, node: fx.Node, x: _Channels, start: int, end: int) -> _Channels | None:
        shape = self.shape(node.args[0])
        if shape is None:
            return None
        ndim = len(shape)
        start, end = start % ndim if ndim else 0, end % ndim if ndim else 0
        if not start <= x.dim <= end:
            return _Channels(x.dim if x.dim < start else x.dim - (end - start), x.ids, x.const, x.is_const)
        inner = math.prod(shape[x.dim + 1 : end + 1])
        outer = math.prod(shape[start : x.dim])
        index = torch.arange(len(x.ids)).repeat_interleave(inner).repeat(outer)
        return _Channels(start, [x.ids[i] for i in index.tolist()], x.const[index], x.is_const[index])

    # the rules ------------------------------------------------------------------------------------------------------
    def run(self) -> None:
        for node in self.gm.graph.nodes:
            try:
                self.info[node] = self.visit(node)
            except CompactError:
                raise
            except Exception as err:  # a rule met something it does not model: keep everything there
                self.pin_all_inputs(node)
                self.info[node] = None
                node.meta["compact_note"] = f"{type(err).__name__}: {err}"

    def visit(self, node: fx.Node) -> _Channels | None:
        if node.op in ("placeholder", "get_attr"):
            return None
        if _in_place(self.gm, node) and node.args and isinstance(node.args[0], fx.Node):
            chain = _alias_chain(self.gm, node.args[0])
            if any(len(alias.users) > 1 for alias in chain):
                # the tensor (or one it is a view of) is read elsewhere too, before or after it changes: keep it whole
                self.pin_all_inputs(node)
                for alias in chain:
                    if (channels := self.info.get(alias)) is not None:
                        self.pin(channels.ids, f"node {node.name!r} (in place on {alias.name!r})")
                return None
        if node.op == "output":
            self.pin_all_inputs(node)
            return None
        if node.op == "call_module":
            return self.visit_module(node, self.gm.get_submodule(node.target))
        if node.op == "call_function":
            return self.visit_function(node, node.target)
        if node.op == "call_method":
            return self.visit_function(node, node.target)
        self.pin_all_inputs(node)
        return None

    def visit_module(self, node: fx.Node, module: nn.Module) -> _Channels | None:
        kind = type(module)
        x = self.tracked(node.args[0]) if node.args else None
        single = self.calls[node.target] == 1 and len(node.args) == 1 and not node.kwargs
        shape = self.shape(node.args[0]) if node.args else None
        if single and shape is not None and (kind is nn.Linear or (kind in _CONVS and module.groups == 1)):
            return self.visit_layer(node, module, x, len(shape))
        if (
            single
            and kind in _NORMS
            and x is not None
            and x.dim == 1
            and module.track_running_stats
            and module.running_mean is not None
            and len(x.ids) == module.num_features
        ):
            self.norms[node.target] = x.ids
            return self.passthrough(x, lambda c: _norm_eval(module, c), self.dtype(node))
        if x is not None and len(node.args) == 1 and not node.kwargs:
            if kind in _ELEMENTWISE_MODULES:
                return self.passthrough(x, module, self.dtype(node))
            if kind in _IDENTITY_MODULES:
                return x
            if x.dim == 1 and (kind in _CONSTANT_KEEPING_POOLS or kind in _AVG_POOLS):
                if kind in _CONSTANT_KEEPING_POOLS and getattr(module, "return_indices", False):
                    self.pin(x.ids)
                    return None
                out = _Channels(x.dim, x.ids, x.const, x.is_const.clone())
                if kind in _AVG_POOLS and not _avg_pool_keeps_constants(module.padding, module.count_include_pad):
                    out.is_const[:] = False
                if getattr(module, "divisor_override", None) is not None:
                    out.is_const[:] = False
                return out
            if kind is nn.Flatten:
                return self.flatten(node, x, module.start_dim, module.end_dim)
        self.pin_all_inputs(node)
        return None

    def visit_layer(self, node: fx.Node, module: nn.Module, x: _Channels | None, ndim: int) -> _Channels:
        weight = module.weight.detach()
        in_size = weight.shape[1]
        in_ids = self.new_ids(in_size)
        out_ids = self.new_ids(weight.shape[0])
        channel_dim = ndim - 1 if isinstance(module, nn.Linear) else ndim - len(module.kernel_size) - 1
        if x is not None and x.dim == channel_dim and len(x.ids) == in_size:
            for slot, arriving in zip(in_ids, x.ids, strict=True):
                self.union(slot, arriving)
            unused = (weight != 0).transpose(0, 1).reshape(in_size, -1).any(1).logical_not().cpu()
            self.pin([slot for slot, ok in zip(in_ids, (unused | x.is_const).tolist(), strict=True) if not ok])
        else:
            if x is not None:
                self.pin(x.ids)
            self.pin(in_ids)
            x = None
        self.sites[node.target] = _Site(
            node, module, in_ids, out_ids, x, -1 if isinstance(module, nn.Linear) else channel_dim
        )
        zero_rows = (weight != 0).reshape(weight.shape[0], -1).any(1).logical_not().cpu()
        bias = module.bias.detach().cpu() if module.bias is not None else torch.zeros(len(out_ids))
        return _Channels(channel_dim, out_ids, bias.to(torch.float64).clone(), zero_rows)

    def visit_function(self, node: fx.Node, target: Any) -> _Channels | None:
        args, kwargs = node.args, node.kwargs
        x = self.tracked(args[0]) if args else None
        is_method = node.op == "call_method"
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, fx.Node)]
        if target in _BINARY and len(args) == 2:
            return self.visit_binary(node, _BINARY[target])
        if x is not None and not others:
            if (not is_method and target in _ELEMENTWISE_FUNCTIONS) or (is_method and target in _ELEMENTWISE_METHODS):
                fn = (lambda c: getattr(c, target)(*args[1:], **kwargs)) if is_method else None
                fn = fn or (lambda c: target(c, *args[1:], **kwargs))
                return self.passthrough(x, fn, self.dtype(node))
            if (not is_method and target in _IDENTITY_FUNCTIONS) or (is_method and target in _IDENTITY_METHODS):
                return x
            if not is_method and x.dim == 1 and target in _POOL_FUNCTIONS:
                if kwargs.get("return_indices") or (len(args) > 5 and args[5] is True):
                    self.pin(x.ids)
                    return None
                return x
            if not is_method and x.dim == 1 and target in (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d):
                padding = kwargs.get("padding", args[3] if len(args) > 3 else 0)
                include = kwargs.get("count_include_pad", args[5] if len(args) > 5 else True)
                divisor = kwargs.get("divisor_override", args[6] if len(args) > 6 else None)
                out = _Channels(x.dim, x.ids, x.const, x.is_const.clone())
                if divisor is not None or not _avg_pool_keeps_constants(padding, include):
                    out.is_const[:] = False
                return out
            if target in (torch.flatten, "flatten"):
                start = kwargs.get("start_dim", args[1] if len(args) > 1 else 0)
                end = kwargs.get("end_dim", args[2] if len(args) > 2 else -1)
                return self.flatten(node, x, start, end)
        if (
            is_method
            and target == "size"
            and x is not None
            and len(args) == 2
            and not kwargs
            and isinstance(args[1], int)
            and args[1] % max(len(self.shape(args[0]) or ()), 1) != x.dim
        ):
            return None  # the size of another dimension: does not depend on the channels
        if is_method and target in ("view", "reshape") and x is not None and not kwargs:
            out = self.visit_flatten_view(node, x)
            if out is not None:
                return out
        if target in (torch.cat, torch.concat) and not kwargs.keys() - {"dim"}:
            out = self.visit_cat(node)
            if out is not None:
                return out
        self.pin_all_inputs(node)
        return None

    def visit_flatten_view(self, node: fx.Node, x: _Channels) -> _Channels | None:
        """``x.view(batch, -1)`` / ``x.reshape(x.size(0), -1)``: flatten after the batch dimension."""
        sizes = node.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = tuple(sizes[0])
        if len(sizes) != 2 or sizes[1] != -1 or x.dim == 0:
            return None
        batch = sizes[0]
        size0 = (
            isinstance(batch, fx.Node)
            and batch.op == "call_method"
            and batch.target == "size"
            and batch.args[1:] == (0,)
            and not batch.kwargs
        )
        if not (size0 or isinstance(batch, int)):
            return None
        return self.flatten(node, x, 1, -1)

    def visit_binary(self, node: fx.Node, op: Callable[..., Tensor]) -> _Channels | None:
        a, b = node.args
        ca, cb = self.tracked(a), self.tracked(b)
        extra = dict(node.kwargs)
        if any(isinstance(v, fx.Node) for v in extra.values()):
            self.pin_all_inputs(node)
            return None
        shape_a, shape_b, shape_out = self.shape(a), self.shape(b), self.shape(node)
        if ca is not None and cb is not None:
            if shape_a == shape_b == shape_out and ca.dim == cb.dim and len(ca.ids) == len(cb.ids):
                for i, j in zip(ca.ids, cb.ids, strict=True):
                    self.union(i, j)
                with torch.no_grad():
                    const = op(ca.const, cb.const, **extra).to(torch.float64)
                return _Channels(ca.dim, ca.ids, const, ca.is_const & cb.is_const)
        elif ca is not None and isinstance(b, (int, float)) and shape_a == shape_out:
            return self.passthrough(ca, lambda c: op(c, b, **extra), self.dtype(node))
        elif cb is not None and isinstance(a, (int, float)) and shape_b == shape_out:
            return self.passthrough(cb, lambda c: op(a, c, **extra), self.dtype(node))
        self.pin_all_inputs(node)
        return None

    def visit_cat(self, node: fx.Node) -> _Channels | None:
        tensors = node.args[0]
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(dim, int):
            return None
        ndim = len(self.shape(node) or ())
        tracked = [self.tracked(t) for t in tensors]
        if not ndim or all(p is None for p in tracked):
            return None
        parts = [
            self.untracked_part(t, dim % ndim, ndim) if p is None else p for p, t in zip(tracked, tensors, strict=True)
        ]
        if any(p is None or p.dim != dim % ndim for p in parts):
            return None
        return _Channels(
            dim % ndim,
            [i for p in parts for i in p.ids],
            torch.cat([p.const for p in parts]),
            torch.cat([p.is_const for p in parts]),
        )

    def untracked_part(self, arg: Any, dim: int, ndim: int) -> _Channels | None:
        """An operand of a concatenation whose channels no layer made (the model's input): new channels, kept."""
        shape = self.shape(arg) if isinstance(arg, fx.Node) else None
        if shape is None or len(shape) != ndim:
            return None
        count = int(shape[dim])
        return _Channels(
            dim,
            self.new_ids(count, pinned=True),
            torch.zeros(count, dtype=torch.float64),
            torch.zeros(count, dtype=torch.bool),
        )

    def kept_pruned_channels(self) -> dict[tuple[str, str], int]:
        """``{(layer, reason): count}`` of zero-weight output channels kept by an unsupported operation."""
        kept: dict[tuple[str, str], int] = {}
        for target, site in self.sites.items():
            weight = site.module.weight.detach()
            zero_rows = (weight != 0).reshape(weight.shape[0], -1).any(1).logical_not().tolist()
            for channel, zero in zip(site.out_ids, zero_rows, strict=True):
                reason = self.reason.get(self.find(channel))
                if zero and reason is not None:
                    kept[target, reason] = kept.get((target, reason), 0) + 1
        return kept

    def keep_one_channel_per_layer(self) -> None:
        """A layer needs at least one channel: where all would go, keep the first."""
        groups = [ids for site in self.sites.values() for ids in (site.in_ids, site.out_ids)]
        groups += list(self.norms.values())
        for ids in groups:
            if ids and all(self.removed(i) for i in ids):
                self.pin(ids[:1])


def _in_place(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` overwrites its first argument (``x.relu_()``, ``x += y``, ``ReLU(inplace=True)``)."""
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        binary_in_place = name.startswith("i") and node.target in _BINARY
        return bool(node.kwargs.get("inplace")) or binary_in_place or name.endswith("_")
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(node.target), "inplace", False))
    return False


_ALIAS_METHODS = {
    "view",
    "view_as",
    "reshape",
    "reshape_as",
    "flatten",
    "unflatten",
    "detach",
    "contiguous",
    "expand",
    "expand_as",
    "transpose",
    "permute",
    "squeeze",
    "unsqueeze",
    "t",
    "narrow",
    "select",
    "unfold",
    "movedim",
    "moveaxis",
    "swapaxes",
    "swapdims",
    "as_strided",
    "split",
    "chunk",
    "unbind",
    "to",
    "type_as",
    "float",
    "double",
    "half",
    "bfloat16",
    "real",
    "imag",
    "__getitem__",
}
_ALIAS_FUNCTIONS: set[Any] = {
    operator.getitem,
    torch.flatten,
    torch.reshape,
    torch.squeeze,
    torch.unsqueeze,
    torch.transpose,
    torch.permute,
    torch.t,
    torch.narrow,
    torch.select,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.movedim,
    torch.swapaxes,
    torch.as_strided,
    torch.detach,
    torch.real,
    torch.imag,
    *_IDENTITY_FUNCTIONS,
}
_ALIAS_MODULES = (nn.Flatten, nn.Unflatten, *_IDENTITY_MODULES)


def _aliases_its_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node``'s result may share memory with its first argument (a view, or the argument itself)."""
    if _in_place(gm, node):
        return True
    if node.op == "call_method":
        return node.target in _ALIAS_METHODS
    if node.op == "call_function":
        return node.target in _ALIAS_FUNCTIONS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(node.target), _ALIAS_MODULES)
    return False


def _alias_chain(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """``node`` and every tensor it may be a view of: what an in-place operation on ``node`` also changes."""
    chain = [node]
    while _aliases_its_input(gm, node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        chain.append(node)
    return chain


def _not(node: fx.Node) -> Callable[[fx.Node], bool]:
    return lambda user: user is not node


def _padding_free(conv: nn.Module) -> bool:
    padding = conv.padding
    if isinstance(padding, str):
        return padding == "valid" or all(k == 1 for k in conv.kernel_size)
    return all(p == 0 for p in padding)


def _avg_pool_keeps_constants(padding: Any, count_include_pad: bool) -> bool:
    pads = padding if isinstance(padding, (tuple, list)) else (padding,)
    return not count_include_pad or all(p == 0 for p in pads)


def _norm_eval(norm: nn.Module, const: Tensor) -> Tensor:
    """BatchNorm in eval mode applied to one value per channel."""
    mean = norm.running_mean.detach().cpu().to(torch.float64)
    var = norm.running_var.detach().cpu().to(torch.float64)
    out = (const.to(torch.float64) - mean) / torch.sqrt(var + norm.eps)
    if norm.affine:
        out = out * norm.weight.detach().cpu().to(torch.float64) + norm.bias.detach().cpu().to(torch.float64)
    return out


# ------------------------------------------------------------------------------------------------------------------
# Rewriting
# ------------------------------------------------------------------------------------------------------------------


def _set_module(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    *owner, name = target.split(".")
    setattr(gm.get_submodule(".".join(owner)), name, module)


def _sliced_layer(site: _Site, keep_in: Tensor, keep_out: Tensor, fold: Tensor | None) -> nn.Module:
    module = site.module
    weight = module.weight.detach()
    new_weight = weight.index_select(0, keep_out).index_select(1, keep_in).clone()
    bias = module.bias.detach().to(torch.float64) if module.bias is not None else None
    if fold is not None and bool(fold.ne(0).any()):
        bias = fold if bias is None else bias + fold
    kind = type(module)
    if kind is nn.Linear:
        new = nn.Linear(len(keep_in), len(keep_out), bias=bias is not None, device="meta")
    else:
        new = kind(
            len(keep_in),
            len(keep_out),
            module.kernel_size,
            stride=module.stride,
            padding=module.padding,
            dilation=module.dilation,
            groups=1,
            bias=bias is not None,
            padding_mode=module.padding_mode,
            device="meta",
        )
    state = {"weight": new_weight}
    if bias is not None:
        state["bias"] = bias.index_select(0, keep_out).to(weight.dtype)
    new.load_state_dict(state, assign=True)
    return new


def _constant_kernel(site: _Site, removed_in: Tensor) -> Tensor | None:
    """``sum_j c_j W[:, j]`` over the removed constant input channels ``j`` (``(out, 1, *kernel)``), or None."""
    x = site.arriving
    if x is None or not bool(removed_in.any()):
        return None
    take = removed_in & x.is_const & (x.const != 0)
    if not bool(take.any()):
        return None
    weight = site.module.weight.detach().to(torch.float64)
    const = torch.where(take, x.const, torch.zeros((), dtype=torch.float64)).to(weight.device)
    return torch.einsum("oi...,i->o...", weight, const).unsqueeze(1)


def _needs_correction_map(module: nn.Module) -> bool:
    """A zero-padded convolution sees less of a constant channel near the border: a bias cannot hold that."""
    return isinstance(module, _CONVS) and module.padding_mode == "zeros" and not _padding_free(module)


def constant_input_correction(x: Tensor, kernel: Tensor, stride: Any, padding: Any, dilation: Any) -> Tensor:
    """What input channels of constant value add to a zero-padded convolution's output, at every position.

    ``kernel`` is ``sum_j c_j W[:, j]`` with a singleton input dimension; the result is that kernel convolved with
    an all-ones image of ``x``'s spatial size, with the convolution's stride, padding and dilation: interior
    positions get the plain sum, border positions only the taps that fall inside the image. The result has no batch
    dimension, so it broadcasts over a batched ``x`` and matches an unbatched one (which a convolution accepts too).
    The function has no Python branch on ``x``: ``torch.fx`` traces through it, so a compacted model holding it can
    be traced again, pickled and loaded (unpickling a ``GraphModule`` traces its code again).

    Example:
        >>> kernel = torch.ones(1, 1, 3)  # one output channel, a constant input channel of value 1, kernel 3
        >>> constant_input_correction(torch.zeros(2, 5, 4), kernel, (1,), (1,), (1,))
        tensor([[2., 3., 3., 2.]])
    """
    dims = len(stride)
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    ones = torch.ones(x.shape[-dims:], dtype=kernel.dtype, device=kernel.device).unsqueeze(0)
    return conv(ones, kernel, None, stride, padding, dilation).to(x.dtype)


def _rewrite(gm: fx.GraphModule, analysis: _Analysis) -> None:
    graph = gm.graph
    for target, site in analysis.sites.items():
        removed_in = torch.tensor([analysis.removed(i) for i in site.in_ids], dtype=torch.bool)
        removed_out = torch.tensor([analysis.removed(i) for i in site.out_ids], dtype=torch.bool)
        weight = site.module.weight.detach()
        unused = (weight != 0).transpose(0, 1).reshape(weight.shape[1], -1).any(1).logical_not().cpu()
        # kept input channels nobody can remove upstream, but this layer ignores: select them away in front of it
        select_away = unused & ~removed_in
        if bool(select_away.any()) and bool(select_away[~removed_in].all()):
            select_away[(~removed_in).nonzero()[0]] = False  # keep one input channel
        kernel = _constant_kernel(site, removed_in)
        correction = kernel is not None and _needs_correction_map(site.module)
        fold = None if kernel is None or correction else kernel.flatten(1).sum(1)
        keep_in_layer = (~removed_in & ~select_away).nonzero().flatten().to(weight.device)
        keep_out = (~removed_out).nonzero().flatten().to(weight.device)
        if bool(select_away.any()):
            # positions among the channels that still reach the layer
            arriving_kept = (~removed_in).nonzero().flatten()
            positions = (~select_away[arriving_kept]).nonzero().flatten().to(weight.device)
            buffer_name = target.replace(".", "_") + "_kept_inputs"
            gm.register_buffer(buffer_name, positions)
            with graph.inserting_before(site.node):
                index = graph.get_attr(buffer_name)
                selected = graph.call_function(torch.index_select, (site.node.args[0], site.channel_dim, index))
            site.node.args = (selected, *site.node.args[1:])
        if bool(removed_in.any() | removed_out.any() | select_away.any()) or fold is not None:
            _set_module(gm, target, _sliced_layer(site, keep_in_layer, keep_out, fold))
        if correction:
            buffer_name = target.replace(".", "_") + "_constant_inputs"
            gm.register_buffer(buffer_name, kernel.index_select(0, keep_out).to(weight.dtype))
            module = site.module
            with graph.inserting_after(site.node):
                kernel_node = graph.get_attr(buffer_name)
            with graph.inserting_after(kernel_node):
                extra = graph.call_function(
                    constant_input_correction,
                    (site.node.args[0], kernel_node, module.stride, module.padding, module.dilation),
                )
            with graph.inserting_after(extra):
                total = graph.call_function(operator.add, (site.node, extra))
            site.node.replace_all_uses_with(total, delete_user_cb=_not(total))
    for target, ids in analysis.norms.items():
        keep = torch.tensor([not analysis.removed(i) for i in ids], dtype=torch.bool)
        if bool(keep.all()):
            continue
        norm = gm.get_submodule(target)
        index = keep.nonzero().flatten().to(norm.running_mean.device)
        new = type(norm)(
            len(index),
            eps=norm.eps,
            momentum=norm.momentum,
            affine=norm.affine,
            track_running_stats=norm.track_running_stats,
            device="meta",
        )
        state = {
            k: (v.detach().index_select(0, index).clone() if v.dim() == 1 else v.detach().clone())
            for k, v in norm.state_dict().items()
        }
        new.load_state_dict(state, assign=True)
        _set_module(gm, target, new.eval())
    graph.lint()
    gm.recompile()


# ------------------------------------------------------------------------------------------------------------------
# The public function
# ------------------------------------------------------------------------------------------------------------------


def _outputs(model: nn.Module, inputs: tuple[Any, ...]) -> list[Tensor]:
    with torch.no_grad():
        out = model(*inputs)
    return [t for t in _pytree.tree_leaves(out) if isinstance(t, Tensor)]


def _check_rtol(rtol: Any) -> None:
    """Refuse a tolerance the final check cannot use, before the rewrite's work rather than after it.

    Example:
        >>> _check_rtol(float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: rtol=nan must be a finite number >= 0 (a tolerance relative to the largest output)
    """
    if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real):
        raise TypeError(f"rtol={rtol!r} must be a real number, not a {type(rtol).__name__}")
    # NaN compares false with everything: ``difference > nan`` would pass any output
    if not (math.isfinite(rtol) and rtol >= 0):
        raise ValueError(f"rtol={rtol!r} must be a finite number >= 0 (a tolerance relative to the largest output)")


def compact(model: nn.Module, example_inputs: Tensor | Sequence[Any], *, rtol: float = 1e-5) -> fx.GraphModule:
    """Return a smaller model computing the same function: pruned channels of Linear/Conv layers physically removed.

    The input model is left untouched (its pruning reparametrization, if any, is read through ``name_orig`` and
    ``name_mask``; the copy holds plain tensors). The result is an inference model: it computes what ``model``
    computes in eval mode, whatever mode ``model`` is in (it is traced in eval mode, and every module's ``training``
    flag is restored afterwards), so BatchNorm uses its running statistics, dropout is off and branches on
    ``self.training`` take their eval-mode side. It is a ``torch.fx.GraphModule`` in eval mode whose submodules keep
    the original names.

    Args:
        model: The pruned model, structured pruning along ``dim=0`` (output channels) and/or ``dim=1`` (input
            channels) of Linear and Conv1d/2d/3d weights; unstructured zeros stay where they are.
        example_inputs: One input tensor or a tuple of positional inputs: used to follow shapes through the graph
            and to check the result.
        rtol: Tolerance of the final check, relative to the largest output magnitude (at least 16 machine epsilons
            of the output dtype: float16 and bfloat16 sums in another order differ by more than 1e-5).

    Returns:
        The compact model (``torch.fx.GraphModule``), in eval mode.

    Raises:
        TypeError: ``rtol`` is not a real number (a bool included).
        ValueError: ``rtol`` is negative, infinite or NaN (NaN would let any output pass the check).
        CompactError: The model cannot be traced by ``torch.fx`` (the message names the module and the last node
            traced), or the compact model does not reproduce the masked model on ``example_inputs``.

    Example:
        >>> from lightprune import prune
        >>> net = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
        >>> _ = prune.ln_structured(net[0], "weight", amount=0.5, n=2, dim=0)
        >>> small = compact(net, torch.randn(4, 8))
        >>> small.get_submodule("0"), small.get_submodule("2")
        (Linear(in_features=8, out_features=3, bias=True), Linear(in_features=3, out_features=3, bias=True))
        >>> x = torch.randn(5, 8)
        >>> torch.allclose(small(x), net.eval()(x), rtol=1e-5, atol=1e-6)
        True
    """
    _check_rtol(rtol)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    gm = _trace_in_eval_mode(model)
    reference = copy.deepcopy(gm)
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*inputs)
    except Exception as err:
        raise CompactError(f"compact could not run the traced model on the example inputs: {err}") from err
    analysis = _Analysis(gm)
    analysis.run()
    analysis.keep_one_channel_per_layer()
    for (layer, reason), count in analysis.kept_pruned_channels().items():
        warnings.warn(
            f"compact kept {count} pruned output channel{'s' if count > 1 else ''} of {layer!r}: they reach {reason}, "
            "which compact does not follow channels through (the result is exact, only larger)",
            stacklevel=2,
        )
    reference_out = _outputs(reference, inputs)
    _rewrite(gm, analysis)
    compact_out = _outputs(gm, inputs)
    for i, (want, got) in enumerate(zip(reference_out, compact_out, strict=True)):
        floating = want.is_floating_point()
        scale = float(want.abs().max()) if want.numel() and floating else 1.0
        tolerance = max(rtol, 16 * torch.finfo(want.dtype).eps) if floating else 0.0
        difference = float((want.double() - got.double()).abs().max()) if want.numel() else 0.0
        if want.shape != got.shape or difference > tolerance * max(scale, 1e-30):
            raise CompactError(
                f"compact model's output {i} differs from the masked model's on the example inputs "
                f"(shapes {tuple(want.shape)} and {tuple(got.shape)}); please report this model"
            )
    return gm.eval()
