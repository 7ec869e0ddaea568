"""``PruningCallback``: scheduled pruning during ``trainer.fit`` with lightprune's engine.

The callback glues four small pieces together: a :mod:`~lightprune.schedules` schedule (target total sparsity over
time), a :mod:`~lightprune.selection` of parameters, the :mod:`~lightprune.prune` engine and the
:mod:`~lightprune.metrics` sparsity metric. It owns the clock (optimizer steps or epochs) and the little state that
must survive a checkpoint; the masks themselves travel in the model's state_dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase
from typing_extensions import override

from lightprune import prune
from lightprune.metrics import SparsityCollection
from lightprune.prune.base import ModuleSnapshot, find_hook, refresh_pruned
from lightprune.prune.functional import adaptation_plan, apply_adaptation, pair_problems
from lightprune.schedules import Constant, FromCallable, Schedule
from lightprune.selection import DEFAULT_MODULE_TYPES, resolve_pairs, select_parameters

__all__ = ["METHODS", "PruningCallback", "install_checkpoint_adapter"]

METHODS: dict[str, type[prune.BasePruningMethod]] = {
    "l1_unstructured": prune.L1Unstructured,
    "random_unstructured": prune.RandomUnstructured,
    "ln_structured": prune.LnStructured,
    "random_structured": prune.RandomStructured,
}
"""Pruning methods the callback accepts by name; any ``BasePruningMethod`` subclass (or its import path) works too."""

_SCOPES = ("global", "layerwise")
_UNITS = ("step", "epoch")
_LOG_PREFIX = "pruning/"


def _is_int(value: Any) -> bool:
    """An int that is not a bool: ``True`` must not pass for ``1`` as a time, a step count or a seed."""
    return isinstance(value, int) and not isinstance(value, bool)


def _resolve_method(method: str | type[prune.BasePruningMethod]) -> type[prune.BasePruningMethod]:
    """A method class from a registry name, an import path ``"package.module.Class"`` or the class itself."""
    if isinstance(method, type) and issubclass(method, prune.BasePruningMethod):
        return method
    if isinstance(method, str):
        if method in METHODS:
            return METHODS[method]
        module_name, _, class_name = method.rpartition(".")
        if module_name:
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError) as err:
                raise ValueError(f"method={method!r} could not be imported: {err}") from err
            if isinstance(cls, type) and issubclass(cls, prune.BasePruningMethod):
                return cls
            raise ValueError(f"method={method!r} is not a lightprune.prune.BasePruningMethod subclass")
    allowed = ", ".join(repr(name) for name in METHODS)
    raise ValueError(
        f"method={method!r} is not supported: use one of {allowed}, a BasePruningMethod subclass or its import path"
    )


def _resolve_schedule(schedule: Schedule | float | Callable[[int], float]) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, (int, float)) and not isinstance(schedule, bool):
        return Constant(float(schedule))
    if callable(schedule):
        return FromCallable(schedule, start=0, end=1.0, frequency=1)
    raise ValueError(
        f"schedule={schedule!r} must be a lightprune.schedules.Schedule, a sparsity in [0, 1] (one-shot at the "
        "start) or a callable time -> target sparsity"
    )


def _adapt_before_load(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: match the model's pruning reparametrization to the keys being loaded.

    A state_dict that cannot load (a tampered or foreign checkpoint: wrong shapes, tensors missing or replaced,
    unknown keys under ``strict``) is refused here, before anything changes; torch alone would copy every tensor it
    can and raise at the end, leaving the model half-loaded (and the reparametrization adapted to a checkpoint that
    never loaded).
    """
    strict = _loading_strictly()
    plan = adaptation_plan(module, state_dict, prefix)
    unchecked = [entry for entry in plan if not _predictable(entry[1])]  # _load_problems checks the others' pairs
    problems = pair_problems(unchecked, state_dict) + _load_problems(module, state_dict, prefix, strict, plan)
    if problems:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__} (lightprune checked it first; the model is "
            "unchanged):\n\t" + "\n\t".join(problems)
        )
    apply_adaptation(plan, state_dict)
    if plan:
        rank_zero_info(f"lightprune: adapted the pruning reparametrization of {len(plan)} tensors to the state_dict")


def _loading_strictly() -> bool:
    """The ``strict`` of the ``load_state_dict`` call under way (torch hands its hooks ``strict=True`` always).

    Found in the caller's frame of ``nn.Module.load_state_dict``; where there is none (another loader), the load
    counts as not strict: only what torch rejects either way (shapes, values that are not tensors) is checked.
    """
    code = nn.Module.load_state_dict.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return bool(frame.f_locals.get("strict", True))
        frame = frame.f_back
    return False


def _predictable(module: nn.Module) -> bool:
    """Whether torch loads ``module``'s own tensors with ``nn.Module``'s rules (no override, no key-rewriting hook)."""
    loader = type(module)._load_from_state_dict
    own_hooks = [
        h for h in module._load_state_dict_pre_hooks.values() if getattr(h, "hook", None) is not _adapt_before_load
    ]
    return not own_hooks and (loader is nn.Module._load_from_state_dict or loader is _NormBase._load_from_state_dict)


def _load_problems(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    strict: bool,
    plan: list[tuple[str, nn.Module, str, str]],
) -> list[str]:
    """What ``load_state_dict`` would reject once ``plan`` is applied, by torch's rules, for the modules that follow
    them (:func:`_predictable`): a value that is not a tensor, a shape mismatch and, under ``strict``, missing and
    unexpected keys. Modules with their own loading logic are left to torch."""
    problems: list[str] = []
    planned = {(id(m), n): action for _, m, n, action in plan}
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        if not _predictable(submodule):
            continue
        base = f"{prefix}{module_name}." if module_name else prefix
        local = {n: p for n, p in submodule._parameters.items() if p is not None}
        local.update(
            (n, b)
            for n, b in submodule._buffers.items()
            if b is not None and n not in submodule._non_persistent_buffers_set
        )
        shapes = {n: tuple(t.shape) for n, t in local.items()}
        for name in list(shapes):
            if planned.get((id(submodule), name)) == "identity":
                shapes[name + "_orig"] = shapes[name + "_mask"] = shapes.pop(name)
        for (owner, name), action in planned.items():
            if owner == id(submodule) and action == "remove":
                shapes[name] = shapes.pop(name + "_orig")
                shapes.pop(name + "_mask", None)
        for name, shape in shapes.items():
            key = base + name
            if key not in state_dict:
                # batch norms fill in a num_batches_tracked missing from old checkpoints
                if strict and not (isinstance(submodule, _NormBase) and name == "num_batches_tracked"):
                    problems.append(f"missing key {key!r}")
                continue
            value = state_dict[key]
            if not torch.overrides.is_tensor_like(value):
                problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
            elif name in local and torch.nn.parameter.is_lazy(local[name]):
                continue
            elif tuple(value.shape) != shape and not (shape == () and value.dim() == 1):  # torch takes value[0]
                problems.append(f"size mismatch for {key!r}: {tuple(value.shape)} in the state_dict, {shape} here")
        if not strict:
            continue
        extra_state = base + "_extra_state"
        if type(submodule).set_extra_state is not nn.Module.set_extra_state and extra_state not in state_dict:
            problems.append(f"missing key {extra_state!r}")
        for key in state_dict:
            if key.startswith(base) and key != extra_state:
                first = key[len(base) :].split(".", 1)[0]
                if first not in submodule._modules and first not in shapes:
                    problems.append(f"unexpected key {key!r}")
    return problems


def install_checkpoint_adapter(module: nn.Module) -> None:
    """Let ``module`` load state_dicts saved with or without pruning reparametrization, strictly.

    Lightning restores a checkpoint into the freshly built model before any callback sees it; a pruned
    checkpoint has ``weight_orig`` and ``weight_mask`` where the fresh model has ``weight``. This pre-hook calls
    :func:`lightprune.prune.prepare_for_state_dict` at the start of every ``load_state_dict``. Installing it twice
    is a no-op.

    Example:
        >>> pruned = prune.l1_unstructured(nn.Linear(3, 2), "weight", amount=0.5)
        >>> fresh = nn.Linear(3, 2)
        >>> install_checkpoint_adapter(fresh)
        >>> fresh.load_state_dict(pruned.state_dict())
        <All keys matched successfully>
    """
    if not any(
        getattr(hook, "hook", None) is _adapt_before_load for hook in module._load_state_dict_pre_hooks.values()
    ):
        module.register_load_state_dict_pre_hook(_adapt_before_load)


class PruningCallback(Callback):
    r"""Prune a LightningModule during ``trainer.fit`` on a schedule of target sparsity.

    At every event of ``schedule`` the callback prunes the selected parameters up to the schedule's *target total
    sparsity*: ``round(target * n)`` entries (or channels) of each tensor in ``"layerwise"`` scope, of the whole
    selection in ``"global"`` scope. The difference from what is already pruned goes to the engine as an exact count,
    so masks grow through ``PruningContainer``\ s and the final target is met to the unit.

    Time is counted in optimizer steps (``trainer.global_step``, so gradient accumulation is handled) or in completed
    epochs. An event at step ``t`` runs right after the ``t``-th optimizer step (``t = 0``: when training starts);
    an event at epoch ``e`` runs when epoch ``e`` starts, after ``e`` epochs (and at the end of fit for the last one).
    Pruning happens only inside ``fit``: never in the sanity check, ``validate``, ``test`` or ``predict``. Every fit
    starts the schedule afresh, also with a callback reused from an earlier fit; a fit resumed from a checkpoint
    (``ckpt_path=``) continues where the checkpoint left it, masks, clock and rewind snapshot included. Pruned tensors
    that a parent reads without calling their module's forward (``nn.MultiheadAttention``'s ``out_proj``) are
    recomputed by the callback, so they never go stale.

    Args:
        schedule: a :class:`~lightprune.schedules.Schedule`, a float (one-shot to that sparsity when training
            starts) or a callable ``time -> sparsity`` (evaluated at every time unit of the run).
        method: ``"l1_unstructured"``, ``"random_unstructured"``, ``"ln_structured"``, ``"random_structured"``, a
            ``BasePruningMethod`` subclass, or its import path (``"my_package.pruning.MyMethod"``).
        method_kwargs: extra arguments of the method besides ``amount``, e.g. ``{"n": 2, "dim": 0}`` for
            ``ln_structured`` (whose defaults are ``n=2, dim=0``: output channels).
        scope: ``"global"`` (one ranking across the selection; unstructured methods only) or ``"layerwise"``.
            Default: global for unstructured methods, layerwise for structured ones.
        unit: ``"step"`` (optimizer steps) or ``"epoch"``; the schedule's times are in this unit.
        parameters: explicit ``(module, name)`` pairs to prune; replaces the pattern selection below.
        include: regular expressions; a parameter's qualified name must fully match one (``None``: all).
        exclude: regular expressions; parameters whose qualified name fully matches one are skipped.
        module_types: module classes whose parameters may be pruned (default Linear and Conv1d/2d/3d).
        parameter_names: attribute names that may be pruned (default ``("weight",)``: no biases).
        prune_channel_bias: with a structured method pruning output channels (``dim=0``), also zero the bias
            entries of the pruned channels.
        rewind: lottery-ticket rewinding after every event: ``None`` (off), ``"init"`` (the weights when training
            starts), an int ``k`` (the weights after ``k`` units of time) or a snapshot taken earlier with
            :meth:`snapshot_weights` (e.g. the initial weights, for rounds that are separate fits). The snapshot
            lives on the CPU.
        make_permanent: at the end of fit, remove the reparametrization of the tensors this callback pruned, so
            the model holds plain Parameters with zeros.
        mask_dtype: dtype of new masks; ``torch.bool`` (1 byte per entry) by default, ``None`` for the parameter's.
        log_per_parameter: log ``pruning/sparsity/<qualified name>`` for every pruned tensor (turn off for very
            large selections); the total ``pruning/sparsity/total`` and ``pruning/target`` are always logged.
        log_every_n_steps: also log the sparsities every this many optimizer steps, between events.
        seed: seed of the random methods' draws; every event draws from ``seed`` and the event's time, so DDP ranks
            and resumed runs draw identical masks.

    Raises:
        ValueError: for any configuration mistake, at construction (or, for the selection, at setup), naming the
            bad value and what is allowed.

    Example:
        >>> from lightprune.schedules import Cubic
        >>> callback = PruningCallback(Cubic(final=0.9, start=0, end=100, frequency=10))
        >>> callback.scope, callback.unit, callback.method.__name__
        ('global', 'step', 'L1Unstructured')
    """

    def __init__(
        self,
        schedule: Schedule | float | Callable[[int], float],
        *,
        method: str | type[prune.BasePruningMethod] = "l1_unstructured",
        method_kwargs: Mapping[str, Any] | None = None,
        scope: str | None = None,
        unit: str = "step",
        parameters: Sequence[tuple[nn.Module, str]] | None = None,
        include: Sequence[str] | str | None = None,
        exclude: Sequence[str] | str | None = None,
        module_types: Sequence[type[nn.Module]] | None = DEFAULT_MODULE_TYPES,
        parameter_names: Sequence[str] | str | None = ("weight",),
        prune_channel_bias: bool = False,
        rewind: str | int | Mapping[str, Tensor] | None = None,
        make_permanent: bool = True,
        mask_dtype: torch.dtype | None = torch.bool,
        log_per_parameter: bool = True,
        log_every_n_steps: int | None = None,
        seed: int = 0,
    ) -> None:
        self.schedule = _resolve_schedule(schedule)
        self.method = _resolve_method(method)
        self.method_kwargs = dict(method_kwargs or {})
        if "amount" in self.method_kwargs:
            raise ValueError("method_kwargs must not contain 'amount': the callback computes it from the schedule")
        self.structured = getattr(self.method, "PRUNING_TYPE", None) == "structured"
        if self.structured:
            self.method_kwargs.setdefault("dim", 0)
            if self.method is prune.LnStructured:
                self.method_kwargs.setdefault("n", 2)
        try:  # build one instance now, so that bad method arguments fail at construction
            self.method(amount=0, **self.method_kwargs)
        except TypeError as err:
            raise ValueError(f"method_kwargs={self.method_kwargs!r} do not fit {self.method.__name__}: {err}") from err

        if scope is None:
            scope = "layerwise" if self.structured else "global"
        if scope not in _SCOPES:
            raise ValueError(f"scope={scope!r} is not supported: allowed are {_SCOPES}")
        if scope == "global" and getattr(self.method, "PRUNING_TYPE", None) != "unstructured":
            raise ValueError(
                f"scope='global' needs an unstructured method, but {self.method.__name__} is "
                f"{getattr(self.method, 'PRUNING_TYPE', None)!r}: use scope='layerwise'"
            )
        if unit not in _UNITS:
            raise ValueError(f"unit={unit!r} is not supported: allowed are {_UNITS}")
        if prune_channel_bias and not (self.structured and self.method_kwargs.get("dim") == 0):
            raise ValueError(
                "prune_channel_bias=True needs a structured method pruning output channels (dim=0); got "
                f"method={self.method.__name__} with method_kwargs={self.method_kwargs!r}"
            )
        snapshot: dict[str, Tensor] | None = None
        if isinstance(rewind, Mapping):
            bad = next(((k, v) for k, v in rewind.items() if not (isinstance(k, str) and isinstance(v, Tensor))), None)
            if bad is not None:
                raise ValueError(
                    f"a rewind snapshot must map parameter names to tensors (see snapshot_weights); got "
                    f"{bad[0]!r}: {type(bad[1]).__name__}"
                )
            snapshot = {k: v.detach().to("cpu", copy=True) for k, v in rewind.items()}
            rewind = 0
        elif rewind is not None and rewind != "init" and not (_is_int(rewind) and rewind >= 0):
            raise ValueError(
                f"rewind={rewind!r} must be None, 'init', an int >= 0 (a time in {unit}s) or a snapshot_weights() dict"
            )
        if mask_dtype is not None and not isinstance(mask_dtype, torch.dtype):
            raise ValueError(f"mask_dtype={mask_dtype!r} must be a torch.dtype (e.g. torch.bool) or None")
        if log_every_n_steps is not None and not (_is_int(log_every_n_steps) and log_every_n_steps >= 1):
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be None or an int >= 1")
        if not _is_int(seed):
            raise ValueError(f"seed={seed!r} must be an int")
        if parameters is not None and (include is not None or exclude is not None):
            raise ValueError("give either parameters=[(module, name), ...] or include/exclude patterns, not both")

        self.scope = scope
        self.unit = unit
        self.parameters = None if parameters is None else list(parameters)
        self.include = include
        self.exclude = exclude
        self.module_types = module_types
        self.parameter_names = parameter_names
        self.prune_channel_bias = prune_channel_bias
        self.rewind = 0 if rewind == "init" else rewind
        self.make_permanent = make_permanent
        self.mask_dtype = mask_dtype
        self.log_per_parameter = log_per_parameter
        self.log_every_n_steps = log_every_n_steps
        self.seed = seed

        self._selection: list[tuple[str, nn.Module, str]] = []
        self._state_key: str | None = None
        self._biases: list[nn.Module] = []
        self._resolved: Schedule | None = None
        self._last_event = -1
        self._last_logged = -1
        self._given_snapshot = snapshot
        self._rewind_snapshot: dict[str, Tensor] | None = snapshot
        # pruned tensors that their module's forward recomputes (seen), and those it does not (refreshed by us)
        self._hooked: set[tuple[int, str]] = set()
        self._unhooked: list[tuple[nn.Module, str]] = []
        self._watched: list[tuple[nn.Module, str, weakref.ReferenceType[Tensor]]] = []
        self._watch_pending = True

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks: thin, each delegating to a named step
    # ------------------------------------------------------------------------------------------------------------

    @property
    @override
    def state_key(self) -> str:
        """Names the callback's state in a checkpoint: its method, scope, unit and the tensors it selected.

        Two callbacks of a Trainer must prune disjoint tensors (checked at setup), so after setup the selection
        tells them apart, also when both were given ``parameters=`` pairs, and it is the same when a run resumes
        with a freshly built model. Before setup (Lightning only checks the keys are distinct when the Trainer is
        built) the key is this instance's own, so that overlapping callbacks reach setup, which says what overlaps.
        Lightning reads the key at every hook call (profiler labels), so it is computed once per selection.
        """
        if self._state_key is None:
            return self._generate_state_key(
                method=self.method.__name__, scope=self.scope, unit=self.unit, selection=f"unresolved-{id(self):x}"
            )
        return self._state_key

    def _selection_state_key(self) -> str:
        selection = repr(self.selection)
        if len(selection) > 200:
            digest = hashlib.sha1("\n".join(self.selection).encode()).hexdigest()[:16]
            selection = f"{len(self._selection)} tensors, sha1 {digest}"
        return self._generate_state_key(
            method=self.method.__name__, scope=self.scope, unit=self.unit, selection=selection
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        install_checkpoint_adapter(pl_module)
        if stage == "fit":
            self._reset()
            self._select(trainer, pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resolve_schedule(trainer)
        self._step(trainer, pl_module, self._now(trainer), log_to_module=False)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.unit == "epoch":
            self._step(trainer, pl_module, trainer.current_epoch)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._refresh_unhooked()
        self._watch_forward()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._classify_watched()
        if self.unit == "step":
            self._step(trainer, pl_module, trainer.global_step)
        step = trainer.global_step
        if self.log_every_n_steps and step % self.log_every_n_steps == 0 and step != self._last_logged:
            self._log(trainer, pl_module, self._target_now(trainer))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step(trainer, pl_module, self._now(trainer), log_to_module=False)
        if self.make_permanent:
            self._make_permanent()
        self._refresh_unhooked()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refresh_unhooked()

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refresh_unhooked()

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._refresh_unhooked()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "last_event": self._last_event,
            "rewind_snapshot": self._rewind_snapshot,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_event = int(state_dict.get("last_event", -1))
        self._rewind_snapshot = state_dict.get("rewind_snapshot")

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        """Start a fit from a clean clock: a second ``fit`` (same callback, new Trainer) replays the schedule.

        Runs in ``setup``, before Lightning restores a checkpoint's state into the callback (``load_state_dict``).
        """
        self._resolved = None
        self._last_event = -1
        self._last_logged = -1
        self._rewind_snapshot = self._given_snapshot
        self._hooked = set()
        self._unhooked = []
        self._watched = []
        self._watch_pending = True

    def _select(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve which tensors to prune; check them against other pruning callbacks and the method."""
        if self.parameters is not None:
            selection = resolve_pairs(pl_module, self.parameters)
        else:
            selection = select_parameters(
                pl_module,
                include=self.include,
                exclude=self.exclude,
                module_types=self.module_types,
                parameter_names=self.parameter_names,
            )
        mine = {(id(module), name) for _, module, name in selection}
        for other in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(other, PruningCallback) and other is not self:
                shared = [q for q, module, name in other._selection if (id(module), name) in mine]
                if shared:
                    raise ValueError(f"two PruningCallbacks select the same parameters {shared}: make them disjoint")
        for qualified, module, name in selection:
            tensor = self._orig(module, name)
            if self.structured and tensor.dim() < 2:
                raise ValueError(f"{qualified} has shape {tuple(tensor.shape)}: structured pruning needs >= 2 dims")
            dim = self.method_kwargs.get("dim")
            if self.structured and _is_int(dim) and not -tensor.dim() <= dim < tensor.dim():
                # else the first event fails, mid-training
                raise ValueError(
                    f"method_kwargs dim={dim} is out of range for {qualified} of shape {tuple(tensor.shape)}: "
                    f"allowed dims are {-tensor.dim()} ... {tensor.dim() - 1}"
                )
        self._selection = selection
        self._state_key = self._selection_state_key()
        self._biases = []
        if self.prune_channel_bias:
            self._biases = [m for _, m, _ in selection if isinstance(getattr(m, "bias", None), Tensor)]

    def _resolve_schedule(self, trainer: Trainer) -> None:
        schedule = self.schedule
        if not schedule.is_resolved:
            total = trainer.estimated_stepping_batches if self.unit == "step" else trainer.max_epochs
            if total is None or total < 1 or total == float("inf"):
                raise ValueError(
                    f"the schedule {schedule!r} gives times as fractions of the run, but the run length in "
                    f"{self.unit}s is unknown ({total!r}): set max_steps/max_epochs or give integer times"
                )
            schedule = schedule.resolve(int(total))
        validate = getattr(schedule, "validate", None)
        if callable(validate):
            validate()
        self._resolved = schedule
        if self.rewind is not None and schedule.first_event < self.rewind:
            raise ValueError(
                f"rewind={self.rewind} is after the first pruning event at {self.unit} {schedule.first_event}: the "
                "weights to rewind to would not exist yet"
            )
        # the run's last time: steps as Lightning counts them (max_steps, max_epochs and accumulation), or epochs
        end = trainer.estimated_stepping_batches if self.unit == "step" else trainer.max_epochs
        if end is not None and 0 <= end < float("inf") and schedule.last_event > end:
            warnings.warn(
                f"the schedule's last event is at {self.unit} {schedule.last_event}, after the end of training at "
                f"{self.unit} {int(end)}: the final sparsity {schedule.final_sparsity} will not be reached",
                stacklevel=2,
            )

    # ------------------------------------------------------------------------------------------------------------
    # The clock
    # ------------------------------------------------------------------------------------------------------------

    def _now(self, trainer: Trainer) -> int:
        return trainer.global_step if self.unit == "step" else trainer.current_epoch

    def _target_now(self, trainer: Trainer) -> float:
        return 0.0 if self._resolved is None else self._resolved.target(self._now(trainer))

    def _step(self, trainer: Trainer, pl_module: LightningModule, t: int, log_to_module: bool = True) -> None:
        """Take the rewind snapshot when its time comes, then prune if an event is due."""
        if self._resolved is None:
            return
        if self.rewind is not None and self._rewind_snapshot is None and t >= self.rewind:
            self._rewind_snapshot = self._snapshot(pl_module)
        # the latest event at or before t, in O(1): events missed in between are caught up by one prune to target
        event = self._resolved.latest_event(t)
        if event is None or event <= self._last_event:
            return
        target = self._resolved.target(t)
        self._prune_to(target, event)
        self._last_event = event
        self._watch_pending = True  # newly pruned tensors: learn at the next batch whether their forward runs
        if self.rewind is not None and self._rewind_snapshot is not None:
            self._rewind(pl_module)
        self._log(trainer, pl_module, target, log_to_module=log_to_module)

    # ------------------------------------------------------------------------------------------------------------
    # Pruning
    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def _orig(module: nn.Module, name: str) -> Tensor:
        _, hook = find_hook(module, name)
        return module._parameters[name + "_orig"] if hook is not None else getattr(module, name)

    @staticmethod
    def _mask(module: nn.Module, name: str) -> Tensor | None:
        _, hook = find_hook(module, name)
        return module._buffers[name + "_mask"] if hook is not None else None

    def _units(self, module: nn.Module, name: str) -> tuple[int, int]:
        """``(units, pruned units)`` of a tensor: entries, or channels along ``dim`` for structured methods."""
        tensor = self._orig(module, name)
        mask = self._mask(module, name)
        if not self.structured:
            pruned = 0 if mask is None else tensor.numel() - int(torch.count_nonzero(mask))
            return tensor.numel(), pruned
        dim = self.method_kwargs["dim"] % tensor.dim()
        if mask is None:
            return tensor.shape[dim], 0
        other = [d for d in range(mask.dim()) if d != dim]
        return tensor.shape[dim], int((torch.count_nonzero(mask, dim=other) == 0).sum())

    @contextlib.contextmanager
    def _seeded(self, event: int) -> Iterator[None]:
        """Draw random masks from ``(seed, event)`` alone, leaving the global generators as they were."""
        tensors = [self._orig(module, name) for _, module, name in self._selection]
        devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((self.seed * 1_000_003 + event) % (2**63))
            yield

    @contextlib.contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """Undo every mask change of the block if it raises (also ``KeyboardInterrupt``): an event is applied whole.

        A layerwise event prunes its tensors one call at a time; the engine rolls back only the failing call, so a
        failure at the second tensor would leave the first one at the new target (a half-applied event, in the model
        and in any checkpoint written on the exception).
        """
        pairs = [(module, name) for _, module, name in self._selection] + [(module, "bias") for module in self._biases]
        snapshots = [(ModuleSnapshot.take(module, name), name) for module, name in pairs]
        try:
            yield
        except BaseException:
            for snapshot, name in reversed(snapshots):
                snapshot.restore(name)
            raise

    def _prune_to(self, target: float, event: int) -> None:
        """Prune the selection up to ``target`` total sparsity (exact counts), as one event: all of it or nothing."""
        with prune.mask_dtype(self.mask_dtype), self._seeded(event), self._all_or_nothing():
            if self.scope == "global":
                counts = [self._units(module, name) for _, module, name in self._selection]
                total = sum(units for units, _ in counts)
                increment = round(target * total) - sum(pruned for _, pruned in counts)
                if increment > 0:
                    pairs = [(module, name) for _, module, name in self._selection]
                    prune.global_unstructured(pairs, self.method, amount=increment, **self.method_kwargs)
            else:
                for _, module, name in self._selection:
                    units, pruned = self._units(module, name)
                    increment = round(target * units) - pruned
                    if increment > 0:
                        self.method.apply(module, name, amount=increment, **self.method_kwargs)
            for module in self._biases:
                self._prune_bias(module)

    @staticmethod
    def _prune_bias(module: nn.Module) -> None:
        """Zero the bias entries of the output channels the weight's mask has removed entirely."""
        weight_mask = module._buffers.get("weight_mask")
        if weight_mask is None:
            return
        keep = torch.count_nonzero(weight_mask, dim=list(range(1, weight_mask.dim()))) > 0
        bias_mask = PruningCallback._mask(module, "bias")
        if bias_mask is not None and torch.equal(bias_mask != 0, keep):
            return
        prune.custom_from_mask(module, "bias", mask=keep)

    def _make_permanent(self) -> None:
        """Remove the reparametrization of the tensors this callback pruned (others' are left alone)."""
        pairs = [(module, name) for _, module, name in self._selection] + [(module, "bias") for module in self._biases]
        for module, name in pairs:
            if find_hook(module, name)[1] is not None:
                prune.remove(module, name)

    # ------------------------------------------------------------------------------------------------------------
    # Pruned tensors read without their module's forward
    # ------------------------------------------------------------------------------------------------------------
    # A pruned tensor ``name`` is recomputed from ``name_orig * name_mask`` by its module's forward pre-hook. A parent
    # may read it without calling that forward: nn.MultiheadAttention reads ``out_proj.weight`` directly (pytorch
    # #69353), and would see values from before the last optimizer step, with an autograd graph already freed by
    # the last backward ("Trying to backward through the graph a second time"). During the first training batch
    # after an event, the callback watches which pruned tensors the forward recomputes; the others it recomputes
    # itself before every training batch and before validation, test and predict. Normal layers cost nothing.

    def _pruned_pairs(self) -> Iterator[tuple[nn.Module, str]]:
        pairs = [(module, name) for _, module, name in self._selection] + [(module, "bias") for module in self._biases]
        for module, name in pairs:
            if find_hook(module, name)[1] is not None and isinstance(module.__dict__.get(name), Tensor):
                yield module, name

    def _watch_forward(self) -> None:
        """Remember the pruned tensors not yet classified, to see at batch end whether the forward replaced them."""
        if not self._watch_pending:
            return
        self._watch_pending = False
        unhooked = {(id(module), name) for module, name in self._unhooked}
        self._watched = [
            (module, name, weakref.ref(module.__dict__[name]))
            for module, name in self._pruned_pairs()
            if (id(module), name) not in self._hooked and (id(module), name) not in unhooked
        ]

    def _classify_watched(self) -> None:
        """A watched tensor still in place after the batch was not recomputed by its module's forward pre-hook."""
        for module, name, ref in self._watched:
            if module.__dict__.get(name) is ref():
                self._unhooked.append((module, name))
            else:
                self._hooked.add((id(module), name))
        self._watched = []

    def _refresh_unhooked(self) -> None:
        """Recompute the pruned tensors that no forward pre-hook recomputes, from the current ``orig`` and mask."""
        for module, name in self._unhooked:
            _, hook = find_hook(module, name)
            if hook is not None:
                hook(module, ())

    # ------------------------------------------------------------------------------------------------------------
    # Lottery-ticket rewinding
    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def _named_weights(pl_module: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """Every parameter under its user-facing name (``weight`` for a pruned ``weight_orig``)."""
        for module_name, module in pl_module.named_modules():
            pruned = {hook._tensor_name for _, hook in prune.base.pruning_hooks(module)}
            for name, parameter in module._parameters.items():
                if parameter is None:
                    continue
                if name.endswith("_orig") and name[: -len("_orig")] in pruned:
                    name = name[: -len("_orig")]
                yield (f"{module_name}.{name}" if module_name else name), parameter

    @classmethod
    def snapshot_weights(cls, model: nn.Module) -> dict[str, Tensor]:
        """A CPU copy of every parameter of ``model``, keyed by its name (``weight``, also for a pruned tensor).

        Pass it as ``rewind=`` to rewind to these weights, e.g. the initial ones, across separate fits.

        Example:
            >>> snapshot = PruningCallback.snapshot_weights(nn.Linear(2, 1))
            >>> sorted(snapshot), snapshot["weight"].device.type
            (['bias', 'weight'], 'cpu')
        """
        return {name: p.detach().to("cpu", copy=True) for name, p in cls._named_weights(model)}

    def _snapshot(self, pl_module: LightningModule) -> dict[str, Tensor]:
        return self.snapshot_weights(pl_module)

    def _rewind(self, pl_module: LightningModule) -> None:
        """Copy the snapshot's values into the live parameters (a copy: they never share storage)."""
        assert self._rewind_snapshot is not None
        with torch.no_grad():
            for name, parameter in self._named_weights(pl_module):
                saved = self._rewind_snapshot.get(name)
                if saved is not None and saved.shape == parameter.shape:
                    parameter.copy_(saved)
        for module in pl_module.modules():
            refresh_pruned(module)

    # ------------------------------------------------------------------------------------------------------------
    # Logging
    # ------------------------------------------------------------------------------------------------------------

    def _sparsities(self, pl_module: LightningModule) -> dict[str, float]:
        """Per-tensor and total sparsity of the selection's masks, reduced across DDP ranks by torchmetrics."""
        names = [qualified for qualified, _, _ in self._selection]
        metric = SparsityCollection(names, prefix=_LOG_PREFIX + "sparsity/").to(pl_module.device)
        tensors = {}
        for qualified, module, name in self._selection:
            mask = self._mask(module, name)
            tensors[qualified] = (
                mask if mask is not None else torch.ones_like(self._orig(module, name), dtype=torch.bool)
            )
        metric.update(tensors)
        values = {key: float(value) for key, value in metric.compute().items()}
        if not self.log_per_parameter:
            values = {_LOG_PREFIX + "sparsity/total": values[_LOG_PREFIX + "sparsity/total"]}
        return values

    def _log(self, trainer: Trainer, pl_module: LightningModule, target: float, log_to_module: bool = True) -> None:
        """Send the sparsities to every logger at the current step and, where Lightning allows ``self.log`` in the
        current hook, the total to the module's logged metrics (progress bar, ``callback_metrics``)."""
        if not self._selection:
            return
        values = self._sparsities(pl_module)
        values[_LOG_PREFIX + "target"] = float(target)
        self._last_logged = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
        if log_to_module:
            total = values[_LOG_PREFIX + "sparsity/total"]
            # every rank holds the same masks: the max across ranks (sync_dist) is that value, and Lightning is quiet
            pl_module.log(
                _LOG_PREFIX + "sparsity",
                total,
                on_step=False,
                on_epoch=True,
                reduce_fx="max",
                prog_bar=True,
                sync_dist=True,
            )

    @property
    def selection(self) -> list[str]:
        """Qualified names of the tensors this callback prunes (after setup)."""
        return [qualified for qualified, _, _ in self._selection]
