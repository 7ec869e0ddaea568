"""Structured pruning units of a model, found from one traced forward: MLP hidden neurons and attention heads.

A *unit* is a set of weight slices that must go together for the model to stay a smaller model of the same shape:

* **neurons**: one hidden unit of an MLP, the rows (with bias entries) of every projection whose output reaches the
  next projection only through elementwise operations (both ``gate_proj`` and ``up_proj`` in a gated MLP, ``wi_0``
  and ``wi_1`` in T5 v1.1), and the matching input columns of that next projection;
* **heads**: one key/value head with all the query heads that read it: its rows of the query, key and value
  projections (with bias entries) and the matching input columns of the output projection. Without grouped-query
  attention a unit is one head; with grouped-query or multi-query attention it is one whole group (a key/value head
  and its ``num_attention_heads / num_key_value_heads`` query heads), so the ratio of query to key/value heads, and
  with it the model's code, stays valid.

The units are read from the graph of one forward (``torch.export.export(model, (), kwargs, strict=False)``), not
from class names: a projection is a ``linear`` (``nn.Linear``, ``nn.MultiheadAttention``'s packed ``in_proj``) or an
``addmm`` on a parameter (transformers' ``Conv1D``); neurons are what flows from projections to one projection
through elementwise operations; heads are the arguments of ``scaled_dot_product_attention`` (or of the
``matmul``-``softmax``-``matmul`` of eager attention) followed back to the projections that made them, through
reshapes, transposes, splits of a fused projection (GPT-2's ``c_attn``, the packed ``in_proj`` of
``nn.MultiheadAttention``), rotary embeddings and key/value repetition. A projection's feature ``f`` belongs to head
``f // head_dim`` (the graph is checked for a view that splits the features as ``(heads, head_dim)``).
"""

from __future__ import annotations

import copy
import math
import operator
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from lightprune import adapters, prune
from lightprune.selection import parameter_owners

__all__ = ["Slice", "UnitError", "UnitGroup", "find_units", "removal_problem"]


class UnitError(ValueError):
    """A model whose pruning units cannot be found (the message names the module)."""


@dataclass(frozen=True)
class Slice:
    """Where the units of a group sit in one parameter: unit ``u`` owns entries ``offset + u * per_unit`` up to
    ``offset + (u + 1) * per_unit`` (exclusive) along ``dim``.

    Example:
        >>> Slice("fc1", "weight", dim=0, offset=0, per_unit=1).indices(unit=3)
        range(3, 4)
    """

    module: str
    name: str
    dim: int
    offset: int
    per_unit: int

    def indices(self, unit: int) -> range:
        """The entries of ``unit`` along :attr:`dim`."""
        start = self.offset + unit * self.per_unit
        return range(start, start + self.per_unit)


@dataclass(frozen=True)
class UnitGroup:
    """A set of units pruned together: the MLP neurons or the attention heads of one block.

    Attributes:
        kind: ``"neurons"`` or ``"heads"``.
        module: the qualified name of the module holding every projection of the group (the MLP, the attention).
        count: how many units.
        produce: slices of the projections computing the units (rows of a Linear weight and its bias).
        consume: slices of the projection reading the units (input columns).
        heads_per_unit: query heads per unit (heads: the grouped-query ratio; neurons: 1).
        head_dim: features per query head (neurons: 1).
        per_head_bias: heads only: the attention scores get a per-head tensor from outside the projections (T5's
            and MPNet's relative position bias, shared by every layer; Swin's and BEiT's tables, one per layer):
            masks are exact, but the heads cannot be removed.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        >>> group = find_units(mlp, (torch.randn(2, 4),))[0]
        >>> group.kind, group.count, [(s.module, s.name, s.dim) for s in group.produce + group.consume]
        ('neurons', 6, [('0', 'weight', 0), ('0', 'bias', 0), ('2', 'weight', 1)])
    """

    kind: str
    module: str
    count: int
    produce: tuple[Slice, ...]
    consume: tuple[Slice, ...]
    heads_per_unit: int = 1
    head_dim: int = 1
    per_head_bias: bool = False

    @property
    def slices(self) -> tuple[Slice, ...]:
        """Every slice of the group: producers first, then consumers."""
        return self.produce + self.consume


def removal_problem(model: nn.Module, group: UnitGroup) -> str | None:
    """Why the units of ``group`` can be masked but not physically removed
    (:func:`lightprune.export.remove_units` refuses them), or ``None``.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
        >>> removal_problem(mlp, find_units(mlp, (torch.randn(2, 4),))[0]) is None
        True
    """
    from lightprune.layouts import is_transformers_conv1d

    for piece in group.slices:
        owner = model.get_submodule(piece.module)
        if not (isinstance(owner, nn.Linear) or is_transformers_conv1d(owner)):
            return (
                f"{piece.module or 'the model'!r} ({type(owner).__name__}) holds them in {piece.name!r}, not in a "
                "Linear or Conv1D"
                + (" (its forward derives the head size from embed_dim)" if piece.name == "in_proj_weight" else "")
            )
    if group.per_head_bias:
        return (
            "its attention scores get a per-head bias from outside its projections (a relative position bias, "
            "which removal cannot follow)"
        )
    return None


# ------------------------------------------------------------------------------------------------------------------
# Reading the exported graph
# ------------------------------------------------------------------------------------------------------------------

_aten = torch.ops.aten
_LINEAR = {_aten.linear.default}
_ADDMM = {_aten.addmm.default}
_SDPA = {_aten.scaled_dot_product_attention.default}
_SOFTMAX = {_aten.softmax.int, _aten._softmax.default, _aten._safe_softmax.default}
_TO_PROBABILITIES = {"dropout", "to", "_to_copy", "type_as", "clone", "contiguous"}
"""Operations between an eager attention's softmax and the matmul with the values."""
_MATMUL = {_aten.matmul.default, _aten.bmm.default}
_IGNORED_USERS = {_aten._assert_tensor_metadata.default}
# elementwise: every output feature depends only on the same input feature (with scalars or per-token factors)
_ELEMENTWISE_NAMES = {
    "gelu",
    "relu",
    "relu_",
    "silu",
    "silu_",
    "tanh",
    "sigmoid",
    "mul",
    "add",
    "sub",
    "div",
    "pow",
    "neg",
    "erf",
    "exp",
    "dropout",
    "clone",
    "contiguous",
    "alias",
    "to",
    "_to_copy",
    "type_as",
    "hardtanh",
    "leaky_relu",
    "elu",
    "softplus",
    "mish",
    "hardswish",
    "hardsigmoid",
    "detach",
    "square",
    "rsub",
    "abs",
}
_RESHAPES = {"view", "reshape", "_unsafe_view"}
_PASS_THROUGH = {
    "view",
    "reshape",
    "_unsafe_view",
    "transpose",
    "permute",
    "contiguous",
    "clone",
    "expand",
    "unsqueeze",
    "squeeze",
    "to",
    "_to_copy",
    "type_as",
    "dropout",
    "alias",
    "detach",
}


def _op_name(node: fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in value.shape) if isinstance(value, Tensor) else None


@dataclass(frozen=True)
class _Param:
    module: str
    name: str


@dataclass(frozen=True)
class _Projection:
    """A matrix product with a parameter: where its output features and input features sit in the weight."""

    node: fx.Node
    input: fx.Node
    weight: _Param
    bias: _Param | None
    out_dim: int
    in_dim: int
    width: int
    in_width: int

    def rows(self, offset: int, per_unit: int) -> tuple[Slice, ...]:
        slices = [Slice(self.weight.module, self.weight.name, self.out_dim, offset, per_unit)]
        if self.bias is not None:
            slices.append(Slice(self.bias.module, self.bias.name, 0, offset, per_unit))
        return tuple(slices)

    def columns(self, per_unit: int) -> Slice:
        return Slice(self.weight.module, self.weight.name, self.in_dim, 0, per_unit)


class _Graph:
    def __init__(self, program: torch.export.ExportedProgram, model_name: str) -> None:
        self.model_name = model_name
        self.graph = program.graph
        signature = program.graph_signature
        self.params = dict(signature.inputs_to_parameters)
        self.buffers = dict(signature.inputs_to_buffers)
        self.projections: dict[fx.Node, _Projection] = {}
        for node in self.graph.nodes:
            projection = self._projection(node)
            if projection is not None:
                self.projections[node] = projection

    def param(self, node: Any) -> _Param | None:
        """The parameter a node reads, if it is a lifted parameter."""
        if isinstance(node, fx.Node) and node.op == "placeholder" and node.name in self.params:
            module, _, name = self.params[node.name].rpartition(".")
            return _Param(module, name)
        return None

    def _projection(self, node: fx.Node) -> _Projection | None:
        if node.op != "call_function":
            return None
        if node.target in _LINEAR:
            weight = self.param(node.args[1])
            bias = self.param(node.args[2]) if len(node.args) > 2 else None
            if weight is None or _shape(node.args[1]) is None or len(_shape(node.args[1])) != 2:
                return None
            out_features, in_features = _shape(node.args[1])
            return _Projection(node, node.args[0], weight, bias, 0, 1, out_features, in_features)
        if node.target in _ADDMM and not node.kwargs:
            weight = self.param(node.args[2])
            if weight is None:
                return None
            in_features, out_features = _shape(node.args[2])
            return _Projection(node, node.args[1], weight, self.param(node.args[0]), 1, 0, out_features, in_features)
        return None

    def where(self, node: fx.Node) -> str:
        stack = node.meta.get("nn_module_stack") or {}
        paths = [path for path, _ in stack.values() if path]
        return repr(paths[-1]) if paths else f"the forward of {self.model_name}"


def _users(node: fx.Node) -> list[fx.Node]:
    return [user for user in node.users if user.target not in _IGNORED_USERS]


def _common_module(names: Sequence[str]) -> str:
    parts = [name.split(".") for name in names]
    common: list[str] = []
    for pieces in zip(*parts, strict=False):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join(common)


# ------------------------------------------------------------------------------------------------------------------
# Neurons
# ------------------------------------------------------------------------------------------------------------------


def _find_neurons(graph: _Graph) -> list[UnitGroup]:
    """Projections whose outputs reach other projections' inputs only through elementwise operations."""
    root: dict[fx.Node, fx.Node] = {}  # region node -> producer projection node (union-find on producers)
    parent: dict[fx.Node, fx.Node] = {}

    def find(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    def union(a: fx.Node, b: fx.Node) -> None:
        parent[find(a)] = find(b)

    escaped: set[fx.Node] = set()
    consumers: dict[fx.Node, set[fx.Node]] = {}
    width = {}
    for node in graph.graph.nodes:  # topological order: a region grows forward from its producer
        if node.target in _IGNORED_USERS:
            continue
        if node in graph.projections:
            parent[node] = node
            root[node] = node
            width[node] = graph.projections[node].width
        args = [arg for arg in node.args if isinstance(arg, fx.Node)]
        reached = [arg for arg in args if arg in root]
        if not reached:
            continue
        producers = {find(root[arg]) for arg in reached}
        first = next(iter(producers))
        for other in producers:
            union(other, first)
        projection = graph.projections.get(node)
        if projection is not None and all(arg is projection.input for arg in reached):
            consumers.setdefault(node, set()).update(producers)
            continue
        shape = _shape(node)
        in_shape = _shape(reached[0])
        name = _op_name(node)
        keeps_features = shape is not None and in_shape is not None and len(shape) > 0 and shape[-1] == in_shape[-1]
        others_fine = all(
            arg in root or (_shape(arg) is not None and (len(_shape(arg)) == 0 or _shape(arg)[-1] == 1)) for arg in args
        )
        if keeps_features and ((name in _ELEMENTWISE_NAMES and others_fine) or (name in _RESHAPES)):
            root[node] = first
        else:
            escaped.update(producers)
    for node in graph.graph.nodes:
        if node.op == "output":
            for arg in torch.utils._pytree.tree_leaves(node.args):
                if isinstance(arg, fx.Node) and arg in root:
                    escaped.add(find(root[arg]))
    escaped = {find(node) for node in escaped}
    by_root: dict[fx.Node, tuple[set[fx.Node], set[fx.Node]]] = {}
    for producer in graph.projections:
        by_root.setdefault(find(producer), (set(), set()))[0].add(producer)
    for consumer, producers in consumers.items():
        for producer in producers:
            by_root[find(producer)][1].add(consumer)
    groups = []
    for key, (producers, readers) in by_root.items():
        if key in escaped or not readers:
            continue
        widths = {graph.projections[p].width for p in producers} | {graph.projections[c].in_width for c in readers}
        if len(widths) != 1:
            continue
        count = widths.pop()
        produce = tuple(s for p in _ordered(producers) for s in graph.projections[p].rows(0, 1))
        consume = tuple(graph.projections[c].columns(1) for c in _ordered(readers))
        module = _common_module([s.module for s in produce + consume])
        groups.append(UnitGroup("neurons", module, count, produce, consume))
    return groups


def _ordered(nodes: set[fx.Node]) -> list[fx.Node]:
    order = {node: i for i, node in enumerate(next(iter(nodes)).graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


# ------------------------------------------------------------------------------------------------------------------
# Heads
# ------------------------------------------------------------------------------------------------------------------


def _back_through(node: Any, names: set[str], limit: int = 12) -> fx.Node | None:
    """Follow ``node``'s first argument back through ops named in ``names``."""
    for _ in range(limit):
        if not isinstance(node, fx.Node) or node.op != "call_function" or _op_name(node) not in names:
            return node if isinstance(node, fx.Node) else None
        node = node.args[0]
    return None


def _cores(graph: _Graph) -> list[tuple[fx.Node, fx.Node, fx.Node, fx.Node, list[Any]]]:
    """``(core, q, k, v, extra)`` of every attention: sdpa, or matmul(softmax(matmul(q, k^T) + ...), v); ``extra``:
    every other tensor the scores meet on their way to the softmax (sdpa's mask; eager attention's mask, scale and
    biases, as MPNet adds a per-head position bias and then the mask)."""
    cores = []
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _SDPA:
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            cores.append((node, node.args[0], node.args[1], node.args[2], [mask]))
        elif node.target in _MATMUL:
            probs = _back_through(node.args[0], _TO_PROBABILITIES)
            if probs is None or probs.target not in _SOFTMAX:
                continue
            scores, extra = probs.args[0], []
            for _ in range(8):
                if not isinstance(scores, fx.Node) or scores.target in _MATMUL:
                    break
                # the scores, not a boolean mask beside them (torch.where(causal_mask, scores, -inf) in GPT-Neo)
                tensors = sorted((arg for arg in scores.args if isinstance(arg, fx.Node)), key=_is_boolean)
                if not tensors:
                    scores = None
                    break
                scores, extra = tensors[0], extra + tensors[1:]
            if isinstance(scores, fx.Node) and scores.target in _MATMUL:
                cores.append((node, scores.args[0], scores.args[1], node.args[1], extra))
    return cores


def _unfollowed_softmaxes(graph: _Graph, cores: list[tuple[fx.Node, ...]]) -> list[str]:
    """Where the graph takes a softmax that none of the attentions ``cores`` (of :func:`_cores`) goes through, once
    per module."""
    followed = {_back_through(core.args[0], _TO_PROBABILITIES) for core, *_ in cores if core.target in _MATMUL}
    places = [
        graph.where(node)
        for node in graph.graph.nodes
        if node.op == "call_function" and node.target in _SOFTMAX and node not in followed and _weighs_values(node)
    ]
    return list(dict.fromkeys(places))


def _weighs_values(softmax: fx.Node, limit: int = 12) -> bool:
    """Whether a softmax's probabilities reach a matmul (through reshapes, dtype casts, dropout and the like), as an
    attention's weigh its values; a mixture-of-experts router's go to a top-k and a gather instead."""
    frontier, seen = [softmax], set()
    for _ in range(limit):
        users = [user for node in frontier for user in node.users if user not in seen and user.op == "call_function"]
        if any(user.target in _MATMUL or _op_name(user) in {"einsum", "baddbmm"} for user in users):
            return True
        seen.update(users)
        frontier = [user for user in users if _op_name(user) in _TO_PROBABILITIES | _PASS_THROUGH]
        if not frontier:
            return False
    return False


def _is_boolean(node: fx.Node) -> bool:
    """Whether the traced node is a boolean tensor (a mask)."""
    value = node.meta.get("val")
    return isinstance(value, Tensor) and value.dtype == torch.bool


@dataclass(frozen=True)
class _Source:
    projection: _Projection
    offset: int
    split_width: int  # features of the projection's output that the view into heads split


def _sources(
    graph: _Graph, node: Any, head_dim: int, between: dict[_Param, tuple[int, ...]] | None = None
) -> set[_Source] | None:
    """The projections a query/key/value tensor comes from, with the offset of its features in their outputs.
    ``between`` (if given) gets the parameters (and their shapes) read after the split into heads (a q/k norm)."""
    found: set[_Source] = set()
    seen: set[tuple[fx.Node, int, bool, int | None]] = set()

    def visit(current: Any, offset: int, split: int | None, select: int | None) -> bool:
        if not isinstance(current, fx.Node):
            return True
        key = (current, offset, split is not None, select)
        if key in seen:
            return True
        seen.add(key)
        param = graph.param(current)
        if param is not None and split is None and between is not None:
            between[param] = _shape(current) or ()
        projection = graph.projections.get(current)
        if projection is not None:
            if split is None:
                return False  # features reached a projection without a view splitting them into heads
            found.add(_Source(projection, offset, split))
            return True
        if current.op != "call_function":
            return True  # a model input, a buffer, a constant: no projection on this path
        name = _op_name(current)
        shape, first = _shape(current), current.args[0] if current.args else None
        if split is None and name in _RESHAPES | {"unflatten"}:
            in_shape = _shape(first)
            one_head = shape and in_shape and len(shape) == len(in_shape) + 1 and shape[-2] == 1
            if shape and in_shape and shape[-1] == head_dim and (in_shape[-1] != head_dim or one_head):
                if in_shape[-1] % head_dim:
                    return False
                return visit(first, offset, in_shape[-1], select)
        if split is not None:
            if name == "getitem" and isinstance(first, fx.Node) and _op_name(first) in {"split", "split_with_sizes"}:
                source, sizes, dim = first.args[0], first.args[1], first.args[2] if len(first.args) > 2 else 0
                in_shape = _shape(source)
                if in_shape is None or dim % len(in_shape) != len(in_shape) - 1:
                    return False
                index = current.args[1]
                sizes = [sizes] * (index + 1) if isinstance(sizes, int) else list(sizes)
                return visit(source, offset + sum(sizes[:index]), split, select)
            if name == "select":
                return visit(first, offset, split, current.args[2])
            if name == "unflatten" and select is not None:
                sizes = current.args[2]
                return visit(first, offset + select * int(sizes[-1]), split, None)
            if name == "slice":
                in_shape = _shape(first)
                dim = current.args[1] if len(current.args) > 1 else 0
                step = current.args[4] if len(current.args) > 4 else 1
                if step != 1:
                    return False  # every step-th feature (an interleaved q/k/v): not one contiguous block per head
                if in_shape is not None and dim % len(in_shape) == len(in_shape) - 1:
                    start = current.args[2] if len(current.args) > 2 and current.args[2] is not None else 0
                    return visit(first, offset + int(start), split, select)
            if name not in _PASS_THROUGH | _ELEMENTWISE_NAMES:
                return False  # an op that may mix the projection's features before they are split into heads
        leaves = torch.utils._pytree.tree_leaves(list(current.args))
        return all(visit(arg, offset, split, select) for arg in leaves if isinstance(arg, fx.Node))

    return found if visit(node, 0, None, None) else None


def _per_head(between: Mapping[_Param, tuple[int, ...]]) -> list[_Param]:
    """The parameters read between the split into heads and the attention that are not one set shared by every head:
    one spanning more than the last (feature) dimension (Cohere's q_norm weight, ``(heads, head_dim)``), or one of
    several parameters of the same name in different modules (StableLM's LayerNorm per head, ``norms.0.weight``,
    ``norms.1.weight``, ...). A weight of shape ``(head_dim,)`` shared by every head (Qwen3's q_norm) is fine."""
    by_name: dict[str, list[_Param]] = {}
    for param in between:
        by_name.setdefault(param.name, []).append(param)
    return [
        param
        for param, shape in between.items()
        if math.prod(shape) != (shape[-1] if shape else 1) or len(by_name[param.name]) > 1
    ]


def _readers(graph: _Graph, core: fx.Node, heads: int, head_dim: int) -> list[_Projection] | None:
    """The projections reading the attention output, after it is merged back from ``(heads, head_dim)``: one, or
    several reading the same merged tensor (a LoRA adapter's ``lora_A`` beside its base projection); ``None`` when
    anything else reads it."""
    frontier, merged, readers = [core], False, list[_Projection]()
    while frontier:
        node = frontier.pop()
        for user in _users(node):
            projection = graph.projections.get(user)
            if projection is not None and projection.input is node and merged:
                if readers and readers[0].input is not node:
                    return None  # projections reading the output at two different points
                if projection not in readers:
                    readers.append(projection)
                continue
            name = _op_name(user)
            if user.op != "call_function" or name not in _PASS_THROUGH:
                return None
            in_shape, shape = _shape(node), _shape(user)
            merging = bool(in_shape and shape and shape[-1] == heads * head_dim) and (
                heads * head_dim != in_shape[-1] or (heads == 1 and len(in_shape) > len(shape))
            )
            if name in _RESHAPES and merging and not merged:  # (once merged, later views only flatten tokens)
                if tuple(in_shape[-2:]) != (heads, head_dim):
                    return None
                merged = True
            frontier.append(user)
    return readers or None


def _find_heads(graph: _Graph, cores: list[tuple[fx.Node, fx.Node, fx.Node, fx.Node, list[Any]]]) -> list[UnitGroup]:
    groups = []
    for core, q, k, v, extra in cores:
        where = graph.where(core)
        q_shape, v_shape = _shape(q), _shape(v)
        if q_shape is None or v_shape is None:
            raise UnitError(f"cannot read the attention inputs' shapes in {where}")
        head_dim, value_dim = q_shape[-1], v_shape[-1]
        roles = {}
        for role, node, dim in (("query", q, head_dim), ("key", k, head_dim), ("value", v, value_dim)):
            between: dict[_Param, tuple[int, ...]] = {}
            found = _sources(graph, node, dim, between)
            # one projection, or projections added together feature by feature (a LoRA update beside its base layer)
            if not found or len({(source.offset, source.split_width) for source in found}) != 1:
                raise UnitError(
                    f"cannot follow the attention {role} of {where} back to one projection split into heads "
                    f"of size {dim}; its heads cannot be pruned"
                )
            per_head = _per_head(between)
            if per_head:
                module = _common_module([param.module for param in per_head])
                raise UnitError(
                    f"the attention {role} of {where} goes through parameters of {module!r} that differ from head "
                    f"to head ({', '.join(sorted(f'{p.module}.{p.name}' for p in per_head)[:4])}"
                    f"{', ...' if len(per_head) > 4 else ''}: a norm per head) after its split into heads; its heads "
                    "cannot be pruned (prune its neurons: find_units(..., kinds=['neurons']))"
                )
            roles[role] = sorted(
                found, key=lambda source: (source.projection.weight.module, source.projection.weight.name)
            )
        heads = roles["query"][0].split_width // head_dim
        kv_heads = roles["key"][0].split_width // head_dim
        if kv_heads == 0 or heads % kv_heads or roles["value"][0].split_width // value_dim != kv_heads:
            raise UnitError(f"the attention of {where} has {heads} query and {kv_heads} key/value heads")
        readers = _readers(graph, core, heads, value_dim)
        if readers is None or any(reader.in_width != heads * value_dim for reader in readers):
            raise UnitError(f"cannot find the one output projection of the attention of {where}")
        ratio = heads // kv_heads
        per_unit = {"query": ratio * head_dim, "key": head_dim, "value": value_dim}
        produce = tuple(
            piece
            for role in ("query", "key", "value")
            for source in roles[role]
            for piece in source.projection.rows(source.offset, per_unit[role])
        )
        consume = tuple(reader.columns(ratio * value_dim) for reader in readers)
        shapes = [shape for shape in map(_shape, extra) if shape is not None]
        per_head_bias = any(len(shape) >= 3 and shape[-3] > 1 for shape in shapes)
        module = _common_module([s.module for s in produce + consume])
        groups.append(UnitGroup("heads", module, kv_heads, produce, consume, ratio, head_dim, per_head_bias))
    return groups


# ------------------------------------------------------------------------------------------------------------------
# The public function
# ------------------------------------------------------------------------------------------------------------------

_KINDS = ("neurons", "heads")


def plain_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every pruned tensor made permanent (plain Parameters, same names).

    Example:
        >>> layer = prune.l1_unstructured(nn.Linear(3, 2), "weight", amount=2)
        >>> sorted(name for name, _ in plain_copy(layer).named_parameters()), prune.is_pruned(layer)
        (['bias', 'weight'], True)

    Raises:
        UnitError: a tensor is pruned by ``torch.nn.utils.prune`` (named): its pruned tensor is not a leaf, so the
            model cannot be copied; that pruning must be made permanent first.
    """
    for qualified, module in model.named_modules():
        for name in prune.pruned_names(module):
            try:
                prune.original(module, name)  # refuses torch.nn.utils.prune's reparametrization by name
            except ValueError as err:
                raise UnitError(f"{qualified or 'the model'!r}: {err}") from err
    copied = copy.deepcopy(model)
    for module in copied.modules():
        for name in prune.pruned_names(module):
            prune.remove(module, name)
    return copied


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.export.ExportedProgram:
    try:
        with torch.no_grad():
            return torch.export.export(model, args, kwargs, strict=False)
    except Exception as err:
        raise UnitError(
            f"cannot trace {type(model).__name__} with torch.export to find its pruning units: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}. Pass inputs that run one plain forward (for Hugging "
            "Face models, use_cache=False)"
        ) from err


def find_units(
    model: nn.Module,
    example_inputs: Sequence[Any] | Tensor = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    kinds: Sequence[str] | None = None,
) -> list[UnitGroup]:
    """Find the MLP neurons and attention heads of ``model`` from one traced forward on the example inputs.

    Args:
        model: a torch or Hugging Face model (left unchanged; traced in its current mode).
        example_inputs: positional inputs of one forward (a tensor or a sequence).
        example_kwargs: keyword inputs; for Hugging Face models with a cache, ``use_cache=False`` is added.
        kinds: which units to find, among ``"neurons"`` and ``"heads"``; each one named must be found. By default
            both are looked for and at least one group must be found.

    Returns:
        The groups, each a :class:`UnitGroup`, in the order of their first projection among the model's modules.

    Raises:
        UnitError: the model cannot be traced, an attention's heads cannot be followed to its projections, a
            projection belongs to two groups, a tensor is pruned by ``torch.nn.utils.prune`` (make that permanent
            first), or a kind asked for has no group (the message names the module).
        ValueError: an unknown kind.

    Example:
        >>> from transformers import LlamaConfig, LlamaModel
        >>> config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        ...                      num_key_value_heads=2, intermediate_size=48)
        >>> groups = find_units(LlamaModel(config), example_kwargs={"input_ids": torch.zeros(1, 5, dtype=torch.long)})
        >>> [(g.kind, g.module, g.count, g.heads_per_unit) for g in groups]
        [('heads', 'layers.0.self_attn', 2, 2), ('neurons', 'layers.0.mlp', 48, 1)]
    """
    required = kinds is not None
    kinds = _KINDS if kinds is None else tuple(kinds)
    unknown = [kind for kind in kinds if kind not in _KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown unit kinds {unknown or list(kinds)!r}; allowed: {list(_KINDS)}")
    args = (example_inputs,) if isinstance(example_inputs, Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache") and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    tied = _tied(model)  # read before a plain copy, which unties a Parameter pruned under one owner only
    if any(prune.is_pruned(module) for module in model.modules()):
        model = plain_copy(model)  # trace plain Parameters under their plain names
    graph = _Graph(_export(model, args, kwargs), type(model).__name__)
    groups = []
    if "heads" in kinds:
        cores = _cores(graph)
        groups += _find_heads(graph, cores)
        unfollowed = _unfollowed_softmaxes(graph, cores)
        if unfollowed and not required:
            warnings.warn(
                f"find_units found attention-like softmaxes in {', '.join(unfollowed[:3])}"
                f"{', ...' if len(unfollowed) > 3 else ''} that it cannot follow back to matmul(query, key) (baddbmm, "
                "a disentangled or relative attention): their heads are left out, only other units are returned; "
                "pass kinds=['neurons'] to say that is meant",
                UserWarning,
                stacklevel=2,
            )
    if "neurons" in kinds:
        groups += _find_neurons(graph)
    adapted = {name: adapters.base_of(layer) for name, layer in adapters.adapted_layers(model)}
    groups = [group for group in groups if not _in_adapter(model, adapted, group)]
    for group in [group for group in groups if _cuts_a_tie(group, tied)]:
        warnings.warn(
            f"find_units leaves out the {group.kind} of {group.module or 'the model'!r}: they slice "
            f"{' = '.join(_cuts_a_tie(group, tied))}, one Parameter tied across modules, and cutting it for one "
            "holder would cut it for the others; untie it to prune these units",
            UserWarning,
            stacklevel=2,
        )
        groups.remove(group)
    _refuse_overlaps(groups)
    position = {name: i for i, (name, _) in enumerate(model.named_modules())}
    unique = sorted(dict.fromkeys(groups), key=lambda g: min(position[s.module] for s in g.produce))
    for kind in kinds if required else ():
        if not any(group.kind == kind for group in unique):
            raise UnitError(
                f"found no {kind} in {type(model).__name__}: no projection feeds {_WHAT[kind]}{_own_forwards(model)}"
            )
    if not unique:
        raise UnitError(
            f"found no neurons and no heads in {type(model).__name__}: no projection feeds {_WHAT['neurons']}, "
            f"and none feeds {_WHAT['heads']}{_own_forwards(model)}"
        )
    return unique


def _own_forwards(model: nn.Module) -> str:
    """For a message: the ``nn.Linear`` subclasses of ``model`` with a forward of their own (Falcon's
    ``FalconLinear`` computes ``x @ W.T + b``), whose computation the trace does not read as a projection."""
    names = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if isinstance(m, nn.Linear) and type(m).forward is not nn.Linear.forward
        }
    )
    if not names:
        return ""
    return (
        f" ({', '.join(names[:3])} subclass nn.Linear with a forward of their own, which the trace does not read as a"
        " projection: only torch's linear is)"
    )


def _in_adapter(model: nn.Module, layers: dict[str, nn.Module], group: UnitGroup) -> bool:
    """Whether every tensor ``group`` slices is an adapter's own (a LoRA ``lora_A -> lora_B`` pair looks like an MLP
    whose width is the adapter's rank): those are not the model's units, and they are left alone. ``layers`` maps
    each adapted layer's name to its base layer."""
    for piece in (*group.produce, *group.consume):
        owner = next((n for n in layers if not n or piece.module == n or piece.module.startswith(n + ".")), None)
        if owner is None or model.get_submodule(piece.module) is layers[owner]:
            return False
    return True


def _refuse_overlaps(groups: Sequence[UnitGroup]) -> None:
    """Refuse entries of a tensor that two different groups slice (a projection called in two places, each call
    making it part of another MLP): pruning a unit of one group would cut units of the other. The same group found
    twice (one layer called at every depth, as in ALBERT) is one group, and groups slicing disjoint parts of one
    tensor (the halves of a fused projection) do not overlap.

    Raises:
        UnitError: naming the tensor and both groups.
    """
    claimed: dict[tuple[str, str, int], list[tuple[int, int, UnitGroup]]] = {}
    for group in groups:
        for piece in group.slices:
            start, stop = piece.offset, piece.offset + group.count * piece.per_unit
            spans = claimed.setdefault((piece.module, piece.name, piece.dim), [])
            for other_start, other_stop, other in spans:
                if other != group and start < other_stop and other_start < stop:
                    tensor = f"{piece.module}.{piece.name}" if piece.module else piece.name
                    raise UnitError(
                        f"{tensor} belongs to two unit groups (the {other.kind} of {other.module or 'the model'!r} "
                        f"and the {group.kind} of {group.module or 'the model'!r}, dim {piece.dim}); it cannot be "
                        "pruned as one: is its module called in two places?"
                    )
            spans.append((start, stop, group))


def _tied(model: nn.Module) -> dict[tuple[str, str], list[str]]:
    """``(module, name)`` of every Parameter held by more than one module (an output layer sharing the embedding's
    weight), pruned ones under their plain name, with every holder's qualified name."""
    return {
        (qualified.rpartition(".")[0], name): [place for place, _, _ in owners]
        for owners in parameter_owners(model).values()
        if len(owners) > 1
        for qualified, _, name in owners
    }


def _cuts_a_tie(group: UnitGroup, tied: Mapping[tuple[str, str], list[str]]) -> list[str]:
    """The holders of the tied Parameter ``group`` slices, if any: its units cannot be masked or removed without
    cutting the same entries from the other holders, which use them in another role."""
    for piece in group.slices:
        holders = tied.get((piece.module, piece.name))
        if holders:
            return holders
    return []


_WHAT = {
    "neurons": "another projection through elementwise operations only",
    "heads": "an attention (scaled_dot_product_attention or matmul-softmax-matmul) that could be followed back",
}
