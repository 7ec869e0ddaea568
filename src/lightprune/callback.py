"""``PruningCallback``: scheduled pruning during ``trainer.fit`` with lightprune's engine.

The callback glues four small pieces together: a :mod:`~lightprune.schedules` schedule (target total sparsity over
time), a :mod:`~lightprune.selection` of parameters, the :mod:`~lightprune.prune` engine and the
:mod:`~lightprune.metrics` sparsity metric. It owns the clock (optimizer steps or epochs) and the little state that
must survive a checkpoint.

Checkpoints speak plain torch: while the callback is attached, the model's ``state_dict`` holds each pruned tensor
under its own name with its effective values (exact zeros where pruned), so ``load_from_checkpoint`` and a strict
``load_state_dict`` into the unpruned model work without lightprune. The masks, the clock and the rewind snapshot
travel in the callback's own checkpoint state, from which ``trainer.fit(model, ckpt_path=...)`` resumes exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightprune import prune
from lightprune.metrics import SparsityCollection
from lightprune.prune.base import ModuleSnapshot, find_hook, refresh_pruned
from lightprune.prune.state_dict import PlainStateDict
from lightprune.schedules import Constant, FromCallable, Schedule
from lightprune.selection import (
    DEFAULT_MODULE_TYPES,
    compile_patterns,
    parameter_owners,
    resolve_module_types,
    resolve_pairs,
    select_parameters,
)

__all__ = ["METHODS", "PruningCallback"]

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
_SMALL_SHARE = 0.5
"""Below this share of the model's weights (parameters of two or more dimensions), the default selection warns."""


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

    The selection is made when fit starts (``on_fit_start``), after ``LightningModule.configure_model``, so layers
    built there are pruned too. A selected parameter that is tied to other modules (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) is masked in every module that holds it, counted once, and stays tied.

    Checkpoints: every checkpoint the Trainer writes while the callback is attached holds the pruned tensors under
    their plain names (``features.0.weight``, masked values), so ``LitModel.load_from_checkpoint(path)`` and a strict
    ``load_state_dict`` into the unpruned model work without lightprune; the masks travel in the callback's state.

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
        module_types: module classes, or their import paths (``"transformers.pytorch_utils.Conv1D"``), whose
            parameters may be pruned; default Linear and Conv1d/2d/3d, with a warning at setup when those hold less
            than half of the model's weights.
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
        name: names this callback's checkpoint state (its ``state_key``) and its logged keys
            (``pruning/<name>/...``); needed to tell apart several PruningCallbacks on one Trainer. Without it, the
            state key is built from the method, scope, unit and selection patterns.
        summary: at the end of fit, print (rank zero) a table of what was pruned: parameter, shape, kept / total,
            sparsity, and the total.

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
        module_types: Sequence[type[nn.Module] | str] | None = DEFAULT_MODULE_TYPES,
        parameter_names: Sequence[str] | str | None = ("weight",),
        prune_channel_bias: bool = False,
        rewind: str | int | Mapping[str, Tensor] | None = None,
        make_permanent: bool = True,
        mask_dtype: torch.dtype | None = torch.bool,
        log_per_parameter: bool = True,
        log_every_n_steps: int | None = None,
        seed: int = 0,
        name: str | None = None,
        summary: bool = True,
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
        compile_patterns("include", include)  # an invalid pattern fails here, not when fit starts
        compile_patterns("exclude", exclude)
        module_types = resolve_module_types(module_types)
        self._default_types = module_types is not None and set(module_types) == set(DEFAULT_MODULE_TYPES)
        if name is not None and not (isinstance(name, str) and name and "/" not in name):
            raise ValueError(f"name={name!r} must be None or a non-empty str without '/'")

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
        self.name = name
        self.summary = summary
        self._log_prefix = _LOG_PREFIX if name is None else f"{_LOG_PREFIX}{name}/"

        self._selection: list[tuple[str, nn.Module, str]] = []
        # other modules holding a selected parameter (tied weights): (module, name, [(qualified, other, other name)])
        self._ties: list[tuple[nn.Module, str, list[tuple[str, nn.Module, str]]]] = []
        self._plain_state_dict = PlainStateDict([])
        # copies of the model kept by weight-averaging callbacks (EMA, SWA): masked like the model itself
        self._averages: list[nn.Module] = []
        self._plain_state_dict_handle: Any = None
        self._restored_masks: dict[str, Tensor] | None = None
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
        """Names the callback's state in a checkpoint, from constructor arguments only (as Lightning's callbacks do).

        With ``name=`` the key is built from the name alone, so renaming a layer or editing the patterns keeps the
        saved state reachable; without it, from the method, scope, unit and selection patterns. Two PruningCallbacks
        with the same key on one Trainer are refused by Lightning when the Trainer is built: give them names.
        """
        if self.name is not None:
            return self._generate_state_key(name=self.name)
        return self._generate_state_key(
            method=self.method.__name__,
            scope=self.scope,
            unit=self.unit,
            include=self.include,
            exclude=self.exclude,
            parameter_names=self.parameter_names,
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset()
            _run_after_weight_averaging(trainer, self)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after configure_model (layers built there are selected) and after the strategy wrapped the model
        self._select(trainer, pl_module)
        self._install_plain_state_dict(pl_module)
        self._averages = _averaged_models(trainer)
        self._apply_restored_masks()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._apply_restored_masks()  # strategies that restore checkpoints after setup restore them after on_fit_start
        self._resolve_schedule_for_run(trainer)
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
        self._warn_if_schedule_unfinished(trainer)
        if self.summary and trainer.is_global_zero and self._selection:
            rank_zero_info(self.summary_table())
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
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if _spawned(trainer):
            # Lightning hands rank zero's state_dict to the main process after teardown and loads it there with
            # strict=False: keep it plain, or the main process would silently keep its untrained dense weights
            if not self.make_permanent and self._selection:
                rank_zero_warn(
                    "PruningCallback(make_permanent=False) under a spawning strategy: the model returned to the main "
                    "process holds the pruned weights as plain tensors; the reparametrization stays in the worker",
                    category=UserWarning,
                )
            return
        self._remove_plain_state_dict()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove_plain_state_dict()  # Lightning skips teardown hooks when fit fails

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written after the state_dict hook is gone (OnExceptionCheckpoint) is made plain all the same
        self._plain_state_dict(pl_module, checkpoint["state_dict"], "", None)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "last_event": self._last_event,
            "rewind_snapshot": self._rewind_snapshot,
            "masks": self._current_masks(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_event = int(state_dict.get("last_event", -1))
        self._rewind_snapshot = state_dict.get("rewind_snapshot")
        masks = state_dict.get("masks", {})
        if not isinstance(masks, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in masks.items()
        ):
            raise ValueError(f"{self.state_key}: the checkpoint's 'masks' must map parameter names to tensors")
        self._restored_masks = dict(masks)
        if self._selection:  # the selection exists already (strategies restoring after on_fit_start)
            self._apply_restored_masks()

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
        self._restored_masks = None
        self._selection = []
        self._ties = []
        self._averages = []
        self._hooked = set()
        self._unhooked = []
        self._watched = []
        self._watch_pending = True

    def _select(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve which tensors to prune; check them against other pruning callbacks, the method and sharding."""
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
        mine = {id(self._orig(module, name)) for _, module, name in selection}
        _refuse_other_pruning(trainer)
        if self.mask_dtype == torch.bool:
            _refuse_averaged_bool_buffers(trainer)
        others = [c for c in trainer.callbacks if isinstance(c, PruningCallback) and c is not self and c._selection]
        for other in others:
            shared = [q for q, module, name in other._selection if id(other._orig(module, name)) in mine]
            if shared:
                raise ValueError(f"two PruningCallbacks select the same parameters {shared}: make them disjoint")
        for other in others:
            if other._log_prefix == self._log_prefix:
                raise ValueError(
                    f"two PruningCallbacks would log to the same keys {self._log_prefix}...: give each a distinct "
                    "name= (e.g. PruningCallback(..., name='encoder'))"
                )
        _refuse_sharded(selection, self._orig)
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
        owners = parameter_owners(pl_module)
        self._ties = []
        for _, module, name in selection:
            others = [(q, m, n) for q, m, n in owners.get(id(self._orig(module, name)), []) if (m, n) != (module, name)]
            if others:
                self._ties.append((module, name, others))
        self._selection = selection
        self._biases = []
        if self.prune_channel_bias:
            self._biases = [m for _, m, _ in selection if isinstance(getattr(m, "bias", None), Tensor)]
        if self._default_types and self.parameters is None:
            self._warn_small_share(pl_module, owners)

    def _warn_small_share(
        self, pl_module: LightningModule, owners: dict[int, list[tuple[str, nn.Module, str]]]
    ) -> None:
        """Say so once when the default module types leave most of the model's weights unselected (GPT-2's
        ``Conv1D`` layers are not ``nn.Linear``), naming the largest unselected module types."""
        selected = {id(self._orig(module, name)) for _, module, name in self._selection}
        total = chosen = 0
        unselected: dict[str, int] = {}
        for parameter_id, places in owners.items():
            _, module, name = places[0]
            tensor = self._orig(module, name)
            if tensor.dim() < 2:
                continue
            total += tensor.numel()
            if parameter_id in selected:
                chosen += tensor.numel()
            else:
                kind = f"{type(module).__module__}.{type(module).__qualname__}"
                unselected[kind] = unselected.get(kind, 0) + tensor.numel()
        if total == 0 or chosen / total >= _SMALL_SHARE:
            return
        largest = sorted(unselected.items(), key=lambda item: -item[1])[:3]
        named = ", ".join(f"{kind} ({count / total:.0%})" for kind, count in largest)
        rank_zero_warn(
            f"PruningCallback: the default selection (Linear and Conv weights) covers {chosen / total:.0%} of the "
            f"model's weights; the largest unselected module types are {named}. Pass module_types (classes or import "
            "paths) to prune them too.",
            category=UserWarning,
        )

    def _install_plain_state_dict(self, pl_module: LightningModule) -> None:
        """Make the model's state_dict (every checkpoint) hold this callback's pruned tensors under plain names."""
        self._plain_state_dict.pairs = self._pruned_pairs_all()
        if self._plain_state_dict_handle is None:
            self._plain_state_dict_handle = pl_module.register_state_dict_post_hook(self._plain_state_dict)

    def _remove_plain_state_dict(self) -> None:
        """After fit, the model follows torch's state_dict contract again (``name_orig``, ``name_mask``)."""
        if self._plain_state_dict_handle is not None:
            self._plain_state_dict_handle.remove()
            self._plain_state_dict_handle = None

    def _pruned_pairs_all(self) -> list[tuple[nn.Module, str]]:
        """Every ``(module, name)`` this callback may mask: the selection, the tied owners and the channel biases."""
        return [(module, name) for _, module, name in self._named_pairs()]

    def _current_masks(self) -> dict[str, Tensor]:
        """The masks this callback keeps, by qualified name (selection and channel biases): its checkpoint state."""
        masks = {}
        for qualified, module, name in self._selection:
            mask = self._mask(module, name)
            if mask is not None:
                masks[qualified] = mask
        for qualified, module, _ in self._selection:
            if module in self._biases:
                mask = self._mask(module, "bias")
                if mask is not None:
                    masks[_bias_name(qualified)] = mask
        return masks

    def _apply_restored_masks(self) -> None:
        """Put the masks of a checkpoint back on the selected tensors (resume), checked first, all or nothing."""
        if self._restored_masks is None or not self._selection:
            return
        targets = {qualified: (module, name) for qualified, module, name in self._selection}
        for qualified, module, _ in self._selection:
            if module in self._biases:
                targets[_bias_name(qualified)] = (module, "bias")
        problems = []
        for key, mask in self._restored_masks.items():
            if key not in targets:
                problems.append(
                    f"{key!r} is not selected by this callback (a renamed layer or another selection? the selection "
                    f"is {sorted(targets)})"
                )
                continue
            shape = tuple(self._orig(*targets[key]).shape)
            if tuple(mask.shape) != shape:
                problems.append(f"the mask of {key!r} has shape {tuple(mask.shape)}, the parameter {shape}")
            elif mask.dtype != torch.bool and not mask.dtype.is_floating_point:
                problems.append(f"the mask of {key!r} has dtype {mask.dtype}; masks are torch.bool or floating")
        if problems:
            raise ValueError(
                f"{self.state_key}: the checkpoint's masks do not fit the model (nothing was changed):\n  "
                + "\n  ".join(problems)
            )
        restored, self._restored_masks = self._restored_masks, None
        with self._all_or_nothing():
            for key, mask in restored.items():
                module, name = targets[key]
                current = self._mask(module, name)
                if current is not None and torch.equal(current.to(mask.dtype), mask.to(current.device)):
                    continue
                if current is not None:
                    prune.remove(module, name)
                with prune.mask_dtype(mask.dtype):
                    prune.custom_from_mask(module, name, mask=mask)
            self._sync_ties()
        self._plain_state_dict.pairs = self._pruned_pairs_all()
        self._mask_averages()

    def _resolve_schedule_for_run(self, trainer: Trainer) -> None:
        """Fix the schedule's fractional times to this run's length and check it against the run."""
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
        self._mask_averages()
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
        snapshots = [(ModuleSnapshot.take(module, name), name) for module, name in self._pruned_pairs_all()]
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
            self._sync_ties()
        self._plain_state_dict.pairs = self._pruned_pairs_all()

    def _sync_ties(self) -> None:
        """Mask every other module holding a selected (tied) parameter with the very mask of its selected owner.

        The other owner gets the reparametrization too (``name_orig`` is the same Parameter, so the tie holds) and
        shares the mask tensor, so every module computes with the masked values during training.
        """
        for module, name, others in self._ties:
            mask = self._mask(module, name)
            if mask is None:
                continue
            for _, other, other_name in others:
                _share_mask(other, other_name, mask)

    def _mask_averages(self) -> None:
        """Put every mask on the weight-averaging callbacks' copies of the model too (found by qualified name).

        EMA and SWA average the parameters position by position and copy the average back over the model; masked
        the same way (the same reparametrization, the same mask tensors), their copies compute with the masked
        average, their checkpoints hold it plainly, and the average they hand back is masked at fit end.
        """
        pairs = self._named_pairs()
        for average in self._averages:
            mirrored = []
            for qualified, module, name in pairs:
                mask = self._mask(module, name)
                if mask is None:
                    continue
                module_name = qualified.rsplit(".", 1)[0] if "." in qualified else ""
                counterpart = average.get_submodule(module_name)
                _share_mask(counterpart, name, mask)
                mirrored.append((counterpart, name))
            _plain_state_dict_of(average).pairs = mirrored

    def _named_pairs(self) -> list[tuple[str, nn.Module, str]]:
        """:meth:`_pruned_pairs_all` with each tensor's qualified name in the LightningModule."""
        named = list(self._selection)
        named += [other for _, _, others in self._ties for other in others]
        return named + [(_bias_name(q), m, "bias") for q, m, _ in self._selection if m in self._biases]

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
        for module, name in self._pruned_pairs_all():
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
        for module, name in self._pruned_pairs_all():
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
        metric = SparsityCollection(names, prefix=self._log_prefix + "sparsity/").to(pl_module.device)
        tensors = {}
        for qualified, module, name in self._selection:
            mask = self._mask(module, name)
            tensors[qualified] = (
                mask if mask is not None else torch.ones_like(self._orig(module, name), dtype=torch.bool)
            )
        metric.update(tensors)
        values = {key: float(value) for key, value in metric.compute().items()}
        if not self.log_per_parameter:
            values = {self._log_prefix + "sparsity/total": values[self._log_prefix + "sparsity/total"]}
        return values

    def _log(self, trainer: Trainer, pl_module: LightningModule, target: float, log_to_module: bool = True) -> None:
        """Send the sparsities to every logger at the current step and, where Lightning allows ``self.log`` in the
        current hook, the total to the module's logged metrics (progress bar, ``callback_metrics``)."""
        if not self._selection:
            return
        values = self._sparsities(pl_module)
        values[self._log_prefix + "target"] = float(target)
        self._last_logged = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
        if log_to_module:
            total = values[self._log_prefix + "sparsity/total"]
            # every rank holds the same masks: the max across ranks (sync_dist) is that value, and Lightning is quiet
            pl_module.log(
                self._log_prefix + "sparsity",
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

    # ------------------------------------------------------------------------------------------------------------
    # Saying what happened
    # ------------------------------------------------------------------------------------------------------------

    def summary_table(self) -> str:
        """A table of the pruned tensors (parameter, shape, kept / total, sparsity) and the total, as printed at the
        end of fit; units are entries, or channels along ``dim`` for structured methods.

        Example:
            >>> callback = PruningCallback(0.5)
            >>> callback.summary_table()
            'PruningCallback: nothing selected yet'
        """
        if not self._selection:
            return "PruningCallback: nothing selected yet"
        unit = f"channels (dim {self.method_kwargs['dim']})" if self.structured else "weights"
        rows = [("parameter", "shape", f"kept / total {unit}", "sparsity")]
        kept_all = total_all = 0
        for qualified, module, name in self._selection:
            units, pruned = self._units(module, name)
            kept_all, total_all = kept_all + units - pruned, total_all + units
            shape = "x".join(str(size) for size in self._orig(module, name).shape)
            rows.append((qualified, shape, f"{units - pruned:,} / {units:,}", f"{pruned / max(units, 1):.2%}"))
        rows.append(("total", "", f"{kept_all:,} / {total_all:,}", f"{1 - kept_all / max(total_all, 1):.2%}"))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = []
        for row in rows:
            padded = zip(row, widths, strict=True)
            cells = [cell.ljust(width) if i < 2 else cell.rjust(width) for i, (cell, width) in enumerate(padded)]
            lines.append("  ".join(cells))
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        title = "PruningCallback" if self.name is None else f"PruningCallback {self.name!r}"
        return f"{title}: pruned {self.scope}, {self.method.__name__}\n" + "\n".join(lines)

    def _warn_if_schedule_unfinished(self, trainer: Trainer) -> None:
        """Fit ended (EarlyStopping, max_steps, interruption) before the schedule's last event: say how far it got."""
        if self._resolved is None or not self._selection or self._last_event >= self._resolved.last_event:
            return
        counts = [self._units(module, name) for _, module, name in self._selection]
        reached = sum(pruned for _, pruned in counts) / max(sum(units for units, _ in counts), 1)
        rank_zero_warn(
            f"PruningCallback: fit ended at {self.unit} {self._now(trainer)}, before the schedule's last event at "
            f"{self.unit} {self._resolved.last_event}: sparsity reached {reached:.4f}, scheduled final sparsity "
            f"{self._resolved.final_sparsity:.4f}",
            category=UserWarning,
        )


def _refuse_sharded(selection: list[tuple[str, nn.Module, str]], original: Callable[[nn.Module, str], Tensor]) -> None:
    """Parameters sharded as DTensor (ModelParallelStrategy / FSDP2) are not supported yet: refuse them at setup."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return
    sharded = [qualified for qualified, module, name in selection if isinstance(original(module, name), DTensor)]
    if sharded:
        raise ValueError(
            f"PruningCallback does not support parameters sharded as DTensor (ModelParallelStrategy / FSDP2) yet; "
            f"sharded: {sharded[:5]}{' ...' if len(sharded) > 5 else ''}. Train without sharding, or exclude them."
        )


def _spawned(trainer: Trainer) -> bool:
    """Whether this fit runs in processes spawned or forked by Lightning (``ddp_spawn``, ``ddp_fork``, notebooks)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


def _refuse_other_pruning(trainer: Trainer) -> None:
    """Another pruning tool on the same model would fight over the tensors: refuse it at setup, naming it."""
    from lightning.pytorch.callbacks import ModelPruning

    foreign = [type(c).__name__ for c in trainer.callbacks if isinstance(c, ModelPruning)]  # type: ignore[attr-defined]
    if foreign:
        raise ValueError(
            f"PruningCallback cannot share a Trainer with lightning's {foreign[0]}: both would reparametrize the same "
            "weights. Use one pruning callback (PruningCallback covers ModelPruning's methods and schedules)."
        )


def _bias_name(weight_name: str) -> str:
    """The qualified name of the bias beside a qualified weight name."""
    return weight_name.rsplit(".", 1)[0] + ".bias" if "." in weight_name else "bias"


def _share_mask(module: nn.Module, name: str, mask: Tensor) -> None:
    """Mask ``module.<name>`` with ``mask`` itself (the same tensor, or a copy on the parameter's device)."""
    if find_hook(module, name)[1] is None:
        with prune.mask_dtype(mask.dtype):
            prune.custom_from_mask(module, name, mask=mask)
    device = module._parameters[name + "_orig"].device
    module._buffers[name + "_mask"] = mask if mask.device == device else mask.to(device)
    refresh_pruned(module)


def _averaged_models(trainer: Trainer) -> list[nn.Module]:
    """The copies of the model that weight-averaging callbacks keep (``WeightAveraging`` and its subclasses such as
    ``EMAWeightAveraging``: an ``AveragedModel``'s ``module``; ``StochasticWeightAveraging``: a LightningModule)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    found = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        average = getattr(callback, "_average_model", None)
        if isinstance(callback, StochasticWeightAveraging) and isinstance(average, nn.Module):
            found.append(average)
        elif _is_weight_averaging(callback) and isinstance(getattr(average, "module", None), nn.Module):
            found.append(average.module)
    return found


def _is_weight_averaging(callback: Callback) -> bool:
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # lightning < 2.6
        return False
    return isinstance(callback, WeightAveraging)


def _plain_state_dict_of(module: nn.Module) -> PlainStateDict:
    """The :class:`PlainStateDict` hook of an averaged copy, registered on first use."""
    for hook in module._state_dict_hooks.values():
        if isinstance(hook, PlainStateDict):
            return hook
    hook = PlainStateDict([])
    module.register_state_dict_post_hook(hook)
    return hook


def _run_after_weight_averaging(trainer: Trainer, callback: PruningCallback) -> None:
    """Move ``callback`` after the weight-averaging callbacks in ``trainer.callbacks`` (checkpoints stay last).

    They copy their average back over the model at the end of fit, which must happen before the pruning is made
    permanent; Lightning calls callbacks in list order, and users cannot be expected to know which order is right
    (Lightning moves checkpoint callbacks last for the same reason). The list is replaced, not changed in place, so a
    hook being dispatched over the old list finishes unchanged.
    """
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
    averaging = [
        i for i, c in enumerate(callbacks) if isinstance(c, StochasticWeightAveraging) or _is_weight_averaging(c)
    ]
    position = callbacks.index(callback)
    if not averaging or position > averaging[-1]:
        return
    callbacks.remove(callback)
    callbacks.insert(averaging[-1], callback)  # right after the last averaging callback
    trainer.callbacks = callbacks  # type: ignore[attr-defined]


def _refuse_averaged_bool_buffers(trainer: Trainer) -> None:
    """A ``WeightAveraging`` that averages buffers with torch's running mean fails on boolean masks mid-fit."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not _is_weight_averaging(callback) or not getattr(callback, "_use_buffers", False):
            continue
        from lightning.pytorch.callbacks import EMAWeightAveraging

        if isinstance(callback, EMAWeightAveraging):  # its update takes boolean buffers
            continue
        raise ValueError(
            f"{type(callback).__name__} averages buffers, and the masks are boolean buffers torch's running mean "
            "cannot average: pass PruningCallback(mask_dtype=None) (masks in the parameters' dtype, which average to "
            f"themselves) or {type(callback).__name__}(use_buffers=False)"
        )
