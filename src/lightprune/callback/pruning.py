"""``PruningCallback``: Lightning's hooks, the clock and the pruning events; the rest lives beside it.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightprune import choices, prune, rules
from lightprune._checks import is_int
from lightprune.callback import (
    clock,
    neighbours,
    reporting,
    resume,
    rewinding,
    selecting,
    setup_checks,
    sharded,
    sharded_movement,
)
from lightprune.callback.calibration import calibrate, first_batch, inputs_as_trained_on, reshard
from lightprune.callback.importance import Importance, ScoreFunction, check_importance
from lightprune.callback.masked_selection import MaskedSelection
from lightprune.callback.model_hooks import ModelHooks
from lightprune.callback.options import (
    MASKING,
    UNITS,
    check_choice,
    check_n_m_schedule,
    check_owl,
    check_rewind_time,
    check_unused_inputs,
    checked_schedule,
    method_entry,
    method_name,
    raise_problems,
    resolve_method_options,
    resolve_rewind,
    resolve_schedule,
)
from lightprune.callback.reconstruction import blocks
from lightprune.callback.regrowth import DynamicSparsity
from lightprune.callback.timeline import Timeline
from lightprune.callback.tokens import TokenMask, check_token_mask, find_token_mask
from lightprune.callback.units import ExampleInputs, UnitRanking, UnitSelection, example_from_batch, find_groups
from lightprune.choices import ALLOCATION_SCOPES, OWL_LAMBDA, OWL_THRESHOLD
from lightprune.metrics import TOTAL_KEY
from lightprune.prune.collapse import LayerCollapseWarning, check_max_layer_sparsity, collapse_message
from lightprune.prune.stale import StaleRefresher
from lightprune.schedules import Schedule
from lightprune.selection import (
    DEFAULT_MODULE_TYPES,
    check_pairs,
    check_parameter_names,
    compile_patterns,
    parameter_owners,
    resolve_module_types,
)
from lightprune.structure import UnitError

__all__ = ["PruningCallback"]

_LOG_PREFIX = "pruning/"


class PruningCallback(Callback):
    r"""Prune a LightningModule during ``trainer.fit`` on a schedule of target sparsity.

    At every event of ``schedule`` the callback prunes the selected parameters up to the schedule's *target total
    sparsity*: ``round(target * n)`` entries (or channels) of each tensor in ``"layerwise"`` scope, of the whole
    selection in ``"global"`` scope. The difference from what is already pruned goes to the engine as an exact count,
    so masks grow through ``PruningContainer``\ s and the final target is met to the unit.

    Time is counted in optimizer steps (``trainer.global_step``, so gradient accumulation is handled) or in completed
    epochs. An event at step ``t`` runs right after the ``t``-th optimizer step (``t = 0``: when training starts);
    an event at epoch ``e`` runs when epoch ``e`` starts, after ``e`` epochs (one at ``max_epochs`` when fit ends,
    after the last validation and checkpoints: the callback warns, as nothing trains after it).
    Under manual optimization (``automatic_optimization = False``) the step clock counts *training batches* instead
    (an event at ``t`` runs at the end of the ``t``-th batch), because Lightning's ``global_step`` counts every
    ``optimizer.step()`` call there: a fraction of the run stays a fraction of the run whatever number of optimizers a
    batch steps, and also when some batches step none (see :mod:`lightprune.callback.clock`).
    Pruning happens only inside ``fit``: never in the sanity check, ``validate``, ``test`` or ``predict``. Every fit
    starts the schedule afresh on an unpruned model (masks already on the selected tensors are refused unless
    ``adopt_zeros=True``), also with a callback reused from an earlier fit (on Lightning's clock: a fit resumed
    from a checkpoint without the callback's state, a dense one, takes the events before its step at once, and the
    callback warns); a fit resumed from a checkpoint (``ckpt_path=``), with the options and selection of the fit that
    wrote it (others are refused, naming them), continues where the checkpoint left it, masks, clock and rewind
    snapshot included, and ends with
    the masks and weights of the uninterrupted run, as long as Lightning replays the same batches: a mid-epoch
    checkpoint needs a resumable dataloader, and a run bounded by ``max_steps`` resumed from a checkpoint written at
    an epoch's end trains one extra batch (a Lightning issue; the callback warns when it happens). Pruned tensors
    that a parent reads without calling their module's forward (``nn.MultiheadAttention``'s ``out_proj``), or that
    another forward pre-hook registered before the pruning reads (the old-style ``nn.utils.weight_norm``'s
    ``weight_v``), are recomputed by the callback before every step, so they never go stale.

    The selection is made when fit starts (``on_fit_start``), after ``LightningModule.configure_model``, so layers
    built there are pruned too. A selected parameter that is tied to other modules (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) is masked in every module that holds it, counted once, and stays tied.

    Checkpoints: every checkpoint the Trainer writes while the callback is attached holds the pruned tensors under
    their plain names (``features.0.weight``, masked values), so ``LitModel.load_from_checkpoint(path)`` and a strict
    ``load_state_dict`` into the unpruned model work without lightprune; the masks travel in the callback's state.

    Args:
        schedule: a :class:`~lightprune.schedules.Schedule`, a float (one-shot to that sparsity when training
            starts) or a callable ``time -> sparsity`` (evaluated at every time unit of the run).
        method: ``"l1_unstructured"``, ``"random_unstructured"``, ``"ln_structured"``, ``"random_structured"``,
            ``"semi_structured"`` (N:M, ``method_kwargs={"n": 2, "m": 4}`` by default, groups along each layer's
            input dim; its pattern is fixed, so the schedule must be one event to ``1 - n/m``: a float or a
            ``Constant``), a ``BasePruningMethod`` subclass, or its import path (``"my_package.pruning.MyMethod"``).
            ``"neurons"`` and ``"heads"`` prune transformer units (see :mod:`lightprune.callback.units`): an MLP's
            hidden neurons (the rows of its input projection(s), gate and up for gated MLPs, with bias, and the
            columns of its output projection), or an attention's heads (rows of q, k, v with bias, columns of the
            output projection; under grouped-query attention a unit is one key/value head with all the query heads
            that read it). The groups are found when training starts from one traced forward of the
            LightningModule on ``example_inputs``; the schedule's targets are shares of each group's units
            (``round(target * count)``, exact; every group keeps at least one). ``include``/``exclude`` then match
            a group's module name or the name of a tensor it slices (a pattern matching no group is warned about);
            ``masking="inplace"``, ``parameters`` and ``max_layer_sparsity`` are refused.
        method_kwargs: extra arguments of the method besides ``amount``, e.g. ``{"n": 2, "dim": 0}`` for
            ``ln_structured`` (whose defaults are ``n=2, dim=0``: output channels).
        scope: ``"global"`` (one ranking across the selection; unstructured methods only), ``"layerwise"``,
            ``"row"`` (every output unit of every tensor pruned to the target: Wanda's per-output ranking; a row
            is a slice along dim 0, or dim 1 of an ``(in, out)`` weight such as transformers' ``Conv1D``;
            ``l1_unstructured`` only), ``"erk"`` or ``"owl"``: each tensor ranked alone, with its own share of the
            event's exact total (:mod:`lightprune.prune.allocation`). ERK (Erdős–Rényi-Kernel) keeps a density
            proportional to ``sum(shape) / prod(shape)``, tensors that would pass density 1 kept dense; OWL keeps
            more of the blocks with more outliers of ``|W| * ||X||``, every tensor of a block at the block's
            sparsity (a block: the tensors named alike up to their first numeric part, a transformer block such
            as ``encoder.layer.3``; ``importance="activation"`` only; see ``owl_threshold`` and ``owl_lambda``).
            Both take unstructured methods and any importance they accept (magnitude, activation, movement, a
            callable, OBS with ``reconstruct=False``; random methods draw each tensor's share at random: a static
            random ERK mask); every event's total is exact and ``max_layer_sparsity`` caps a tensor's share, the
            others taking the rest. Default: global for unstructured methods, layerwise for the others.
        unit: ``"step"`` (optimizer steps; training batches under manual optimization) or ``"epoch"``; the
            schedule's times, ``rewind`` and ``activation_window`` are in this unit.
        parameters: explicit ``(module, name)`` pairs to prune; replaces the pattern selection below.
        include: regular expressions; a parameter's qualified name must fully match one (``None``: all). The
            filters below apply too: a pattern that matches no parameter, or only parameters the filters leave out
            (an LSTM's ``weight_hh_l0`` under the default types and names), is warned about at setup.
        exclude: regular expressions; parameters whose qualified name fully matches one are skipped (a tied tensor,
            such as an output layer sharing the input embeddings, under every one of its names).
        module_types: module classes, or their import paths (``"transformers.pytorch_utils.Conv1D"``), whose
            parameters may be pruned; default Linear and Conv1d/2d/3d, with a warning at setup when those hold less
            than half of the model's weights.
        parameter_names: attribute names that may be pruned (default ``("weight",)``: no biases).
        prune_channel_bias: with a structured method pruning output channels (``dim=0``), also zero the bias
            entries of the pruned channels (refused at setup for a layer whose weight is stored ``(in, out)``, such
            as transformers' ``Conv1D`` or a ``ConvTranspose``: its dim 0 runs over inputs; and for a tensor with
            a bias of its own other than ``bias``, such as ``in_proj_weight`` and ``in_proj_bias``).
        rewind: lottery-ticket rewinding after every event that prunes (not a ramp's first, at level 0): ``None``
            (off), ``"init"`` (the weights when training starts), an int ``k`` (the weights after ``k`` units of
            time) or a snapshot taken earlier with
            :meth:`snapshot_weights` (e.g. the initial weights, for rounds that are separate fits). The snapshot
            lives on the CPU; taken of the module given to ``fit``, it holds every selected tensor under its name
            there: one that lacks any (a snapshot of a submodule) is refused when training starts.
        make_permanent: at the end of fit, remove the reparametrization of the tensors this callback pruned, so
            the model holds plain Parameters with zeros (always so with ``masking="inplace"``).
        masking: ``"reparametrize"`` (torch's ``name_orig * name_mask`` before every forward, the default) or
            ``"inplace"``: between events the tensors stay plain Parameters; pruned gradient entries are zeroed
            once per optimizer step, before clipping (as they are accumulated under manual optimization). Pruned
            weights stay exactly zero without a pass of their own under ``torch.optim.SGD``, ``Adam``, ``AdamW``,
            ``RMSprop`` and ``Adagrad`` (exact classes; momentum and first moments are zeroed where pruned); under
            any other optimizer they are zeroed after every step (:mod:`lightprune.callback.inplace`). Faster and
            leaner; the effective weights are the same for optimizers whose update of an entry depends on that entry
            alone (SGD, Adam, AdamW, RMSprop...). LBFGS is refused; Adafactor and manual optimization warn.
            Parameters sharded as DTensor (``ModelParallelStrategy``, FSDP2) are always masked in place, each rank
            keeping the mask of its own shard (see :mod:`lightprune.prune.distributed`), whatever ``masking`` says.
        mask_dtype: dtype of new masks; ``torch.bool`` (1 byte per entry) by default, ``None`` for the parameter's.
        log_per_parameter: log ``pruning/sparsity/<qualified name>`` for every pruned tensor (turn off for very
            large selections); the total ``pruning/sparsity/total`` and ``pruning/target`` are always logged.
        log_every_n_steps: also log the sparsities every this many optimizer steps (training batches under manual
            optimization), between events.
        seed: seed of the random methods' draws; every event draws from ``seed`` and the event's time, so DDP ranks
            and resumed runs draw identical masks.
        name: names this callback's checkpoint state (its ``state_key``) and its logged keys
            (``pruning/<name>/...``); needed to tell apart several PruningCallbacks on one Trainer. Without it, the
            state key is built from the method, scope, unit and selection patterns.
        summary: at the end of fit, print (rank zero) a table of what was pruned: parameter, shape, kept / total,
            sparsity, and the total.
        importance: what ranks the weights at an event (see :mod:`lightprune.callback.importance`):
            ``"magnitude"`` (``|W|``, the default); ``"activation"`` (Wanda: ``|W_ij| * ||X_j||_2``, ``X_j`` the
            layer's input feature ``j`` over the training batches of the ``activation_window`` before each event;
            Linear, Conv1d/2d/3d (grouped too: each weight scaled by its own input channel's norm),
            ConvTranspose1d/2d/3d (a channel's norm over samples and positions) and transformers'
            ``Conv1D`` weights only); ``"movement"`` (``-sum W * dL/dW`` over the optimizer steps since the previous
            event, with the final gradients; signed, higher kept; ``l1_unstructured`` or ``semi_structured`` only);
            ``"obs"`` (Optimal Brain Surgeon, as SparseGPT: saliency ``w_ij**2 / d_j**2`` from ``H = X^T X`` of the
            layer's inputs over the ``activation_window``; Linear, transformers' ``Conv1D`` and Conv1d/2d weights;
            ``l1_unstructured`` or ``semi_structured``; see ``reconstruct``); for ``"neurons"``/``"heads"``:
            magnitude is the L2 norm of the unit's weights, activation ``||a_u||_2 * ||W_out[:, u]||_2`` (the unit's
            output over the window times its outgoing weights), movement first-order Taylor ``|sum over the unit's
            weights of -W * dL/dW|``, and a callable takes ``(pl_module, group) -> one score per unit`` (a
            :class:`~lightprune.structure.UnitGroup`); or a callable
            ``(qualified_name, module, parameter_name, weight) -> scores`` of the weight's shape, ranked as
            ``importance_scores`` (by magnitude for the L1 methods). Statistics are summed across DDP ranks (every
            rank gets the same masks), reset after each event and kept in the checkpoint state (resume is exact).
            Random methods ignore scores and are refused with any importance but magnitude. Parameters sharded as
            DTensor (``ModelParallelStrategy``) take magnitude, activation, movement and ``"obs"`` (the activation
            sums and ``H`` all-reduced, movement summed on each rank's shard, each rank updating its own rows:
            :mod:`lightprune.prune.distributed_obs`); a callable is refused for them, and ``"obs"`` where a rank
            does not hold whole rows (transformers' ``Conv1D`` sharded ``Shard(0)``, placements but ``Shard(0)``).
        activation_window: with ``importance="activation"`` or ``"obs"``, collect the input statistics during this
            many units of time (optimizer steps, or epochs) before each event; outside the window no hook is attached.
        calibration_batches: with ``importance="activation"`` or ``"obs"``, before training starts, run this many
            batches of the training dataloader through ``training_step`` under ``torch.no_grad()`` (eval mode,
            ``self.log`` skipped, random generators untouched, each batch prepared as the training loop prepares it;
            refused for manual optimization and a ``dataloader_iter`` step) and add their statistics, so an event
            at time 0 (one-shot Wanda or SparseGPT, then fine-tuning, in one fit) has statistics. Run only for
            such an event (one that prunes when training starts); otherwise skipped with a warning, so their sums
            never join a later event's window. Not run when resuming from a checkpoint holding the callback's state; a
            checkpoint without it (dense training) starts the schedule, calibration included.
        reconstruct: recompute the kept weights at every event so the pruned layer's output on the calibration
            data (the inputs collected in the ``activation_window`` before the event, or the ``calibration_batches``
            for an event at time 0) changes as little as possible. One meaning, two mechanisms:

            * weight methods with ``importance="obs"`` (default on): the OBS update (SparseGPT's, block by block:
              :mod:`lightprune.prune.obs`) moves the kept weights of every pruned row, from the weights training has
              reached, using ``H = X^T X`` of the layer's inputs; the optimizer's state for them is kept.
              ``False``: rank by the saliency only, as any scores. The counts per layer follow ``scope``
              (``"global"``: one ranking of the saliencies before any update across layers; ``"row"``: every output
              row of the weight as OBS sees it; see :mod:`lightprune.callback.reconstruction`). Other importances
              of weight methods have no reconstruction (``reconstruct=True`` is refused with them).
            * ``"neurons"``/``"heads"`` (default off; any ``importance``): the projections reading the units (the
              MLP's output projection, attention's output projection) are refit by least squares on the kept units'
              inputs, the bias absorbing the removed units' mean contribution
              (:func:`lightprune.structure.refit_consumers`), from the sums and ``X^T X`` of those inputs.

            Both read their statistics from the one input-statistics collector
            (:class:`lightprune.statistics.InputStatistics`: padding left out by ``token_mask``, summed across DDP
            ranks, kept in the checkpoint state, so a resumed fit is exact); an event at time 0 needs
            ``calibration_batches``.
        sequential: with ``importance="obs"``, reconstruction and ``calibration_batches``, prune the event at the
            start block by block (transformer blocks: names up to their first number), each block's statistics taken
            from calibration batches run through the blocks already pruned, as SparseGPT does: the calibration
            batches run once per block. It pays for one-shot pruning of deep models at high sparsity (errors of
            early blocks change the inputs of later ones); gradual schedules, whose later events see the training
            batches through the pruned model anyway, do not need it.
        adopt_zeros: when fit starts, mask the entries of the selected weights that are exactly zero (a checkpoint
            pruned by another tool), so they stay zero through training; the schedule's targets count them. Masks
            already on the selected tensors (from :mod:`lightprune.prune`, or an earlier fit left reparametrized by
            ``make_permanent=False``) are kept too; without ``adopt_zeros`` such tensors are refused when fit starts.
            With unit methods only those masks are kept (units are ranked whole; zeros are not masked).
        example_inputs: with ``"neurons"``/``"heads"``, the inputs of the forward traced to find the units: a
            callable ``batch -> inputs`` or fixed inputs (a tensor, a tuple of positional arguments, a dict of
            keyword arguments; built on the CPU, they are moved to the device the model trains on and converted as
            the precision converts batches). Default: the first training batch, a dict passed as keyword arguments
            (Hugging Face style), a tensor as the one argument, a tuple or list by its first element (``(inputs,
            targets)``); a resumed fit reads the first batch it trains on (a resumable loader's position is not used
            up). A model whose units cannot be found is refused when training starts, naming it. Refused with a
            weight method.
        max_layer_sparsity: the largest share of any one tensor's units (weights, or channels) that may be pruned,
            in (0, 1]; 1.0 (the default) is no cap. A global ranking can otherwise take every weight of a layer
            whose weights are small next to the others' (layer collapse: a collapsed output layer outputs its bias
            alone): with a cap, each global event still prunes its exact count, taking what a capped tensor cannot
            give from the tensors under their caps. In ``"layerwise"`` and ``"row"`` scope every tensor is pruned
            to the target, so a cap below the schedule's final sparsity is refused. A cap the selection cannot meet
            (the capped tensors hold fewer units than the final target) is refused before the first step.
        token_mask: with ``importance="activation"`` or ``"obs"``, which positions of a batch count in the input
            statistics (the activation sums and OBS's ``H`` alike; padding does not): ``"attention_mask"`` (the
            default) takes ``batch["attention_mask"]`` of shape ``(B, T)`` when the batch is a mapping holding one,
            another string another key, a callable ``batch -> (B, T) mask`` finds it in any batch, ``None`` counts
            every position. A layer whose input starts with the mask's ``(B, T)`` (``(B, T, d)`` in a transformer)
            counts only the positions where the mask is nonzero; other inputs count whole, and convolutions count
            every position (see :mod:`lightprune.callback.tokens`). Set away from its default where no input
            statistics are taken, it is refused (it would change nothing).
        owl_threshold: with ``scope="owl"``, OWL's ``M``: a score above ``M`` times its block's mean (over the
            unpruned entries of the block's tensors) is an outlier (default 5).
        owl_lambda: with ``scope="owl"``, OWL's ``lambda``: the outlier ratios are mapped linearly onto densities
            spanning ``2 * lambda`` whose mean (weighted by size) is the target's (default 0.08), before the caps.
            Either set away from its default with another scope is refused (a forgotten ``scope="owl"``).
        regrow: dynamic sparse training (:mod:`lightprune.callback.regrowth`): ``None`` (masks only grow, the
            default), ``"rigl"`` or ``"set"``. Every ``regrow_every`` optimizer steps before ``regrow_until``, each
            pruned tensor drops its ``k`` smallest active weights and regrows ``k`` of the entries then inactive,
            where the dense gradient of that step is largest (RigL, Evci et al. 2020) or at random from
            ``(seed, step)`` (SET, Mocanu et al. 2018), so every tensor keeps its count and the total stays at the
            target. Regrown weights start at zero with their optimizer state (momentum, Adam's moments) zeroed; a
            dropped weight regrown by the same update keeps both, as in RigL's reference. The new mask replaces the old
            one (a fresh ``CustomFromMask``, as a resume does): masks are no longer monotone, and the checkpoint
            state holds the current ones. Typically with a one-shot schedule at step 0 and ``scope="erk"`` (sparse
            from the start). Unstructured methods, any scope but ``"row"``; sharded selections are refused. Logs
            ``pruning/regrown/<qualified name>`` (the share of the tensor's active weights moved) at each update.
        regrow_every: optimizer steps between mask updates (RigL and SET use 100); like the schedules' step times,
            training batches under manual optimization (:mod:`lightprune.callback.clock`).
        regrow_fraction: the share of each tensor's active weights moved, at step 0; decayed by a cosine,
            ``fraction / 2 * (1 + cos(pi * t / until_step))``, to 0 at ``regrow_until`` (RigL's 0.3).
        regrow_until: the fraction of the run (on the run clock) after which masks stay put (RigL's 0.75).

    Layer collapse is said whatever the cap: when an event leaves a selected tensor with no unpruned weight (no
    channel, for structured methods), a :class:`~lightprune.prune.LayerCollapseWarning` names every such tensor
    (rank zero), and the end-of-fit table marks them.

    The callback is Lightning's side of pruning: its hooks, the clock, the checkpoint state and the logging. What
    is masked and how an event changes the masks lives in
    :class:`~lightprune.callback.masked_selection.MaskedSelection`, how the masks are held and applied at each step
    in its :class:`~lightprune.callback.mask_strategy.MaskStrategy`. (The class is long because its constructor
    checks every argument eagerly, as Lightning's callbacks do, and this docstring documents them all.)

    Raises:
        ValueError: for a bad value, at construction (or, for the selection, at setup), naming it and what is
            allowed.
        TypeError: for an argument of the wrong type (a string seed or schedule, a flag that is not a bool).

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
        masking: str = "reparametrize",
        importance: str | ScoreFunction = "magnitude",
        activation_window: int = 1,
        calibration_batches: int = 0,
        adopt_zeros: bool = False,
        max_layer_sparsity: float = 1.0,
        reconstruct: bool | None = None,
        sequential: bool = False,
        owl_threshold: float = OWL_THRESHOLD,
        owl_lambda: float = OWL_LAMBDA,
        regrow: str | None = None,
        regrow_every: int = choices.REGROW_EVERY,
        regrow_fraction: float = choices.REGROW_FRACTION,
        regrow_until: float = choices.REGROW_UNTIL,
        token_mask: TokenMask = "attention_mask",
        example_inputs: ExampleInputs = None,
    ) -> None:
        self.schedule = resolve_schedule(schedule)
        self.units = method if isinstance(method, str) and method in choices.UNIT_METHODS else None
        self.example_inputs = example_inputs
        if self.units is not None:
            _check_unit_options(method, reconstruct, masking, max_layer_sparsity, parameters)
        self.method, self.method_kwargs, scope = resolve_method_options(method, method_kwargs, scope)
        self.structured = self.method.PRUNING_TYPE == "structured"
        entry = None if self.units else method_entry(self.method)
        self._n_m = entry if entry is not None and entry.kind == "n:m" else None  # an N:M method's registry entry
        check_importance(
            importance, self.method, activation_window, calibration_batches, scope, self.units, reconstruct
        )
        raise_problems(
            rules.obs_problems(
                "callable" if callable(importance) else importance,
                reconstruct=None if self.units else reconstruct,  # the units' refit is theirs, checked above
                sequential=sequential,
                scope=scope,
                calibration_batches=calibration_batches,
                max_layer_sparsity=max_layer_sparsity,
            )
        )
        self.owl_threshold, self.owl_lambda = check_owl(owl_threshold, owl_lambda, scope)
        raise_problems(
            rules.regrow_problems(
                regrow,
                regrow_every,
                regrow_fraction,
                regrow_until,
                method=self.units or method_name(self.method) or self.method.__name__,
                kind="units" if self.units else (entry.kind if entry is not None else self.method.PRUNING_TYPE),
                scope=scope,
            )
        )
        self.regrow, self.regrow_every, self.regrow_fraction, self.regrow_until = (
            regrow,
            regrow_every,
            regrow_fraction,
            regrow_until,
        )
        self._dst = (  # dynamic sparse training: when masks move, RigL's gradients, the moves
            None if regrow is None else DynamicSparsity(regrow, regrow_every, regrow_fraction, regrow_until)
        )
        if self._n_m is not None:
            check_n_m_schedule(self.schedule, self._n_m.name, self.method_kwargs["n"], self.method_kwargs["m"])
        check_token_mask(token_mask)
        flags = {
            "adopt_zeros": adopt_zeros,
            "prune_channel_bias": prune_channel_bias,
            "make_permanent": make_permanent,
            "log_per_parameter": log_per_parameter,
            "summary": summary,
        }
        for key, value in flags.items():
            if not isinstance(value, bool):  # "false" or 0 would pass a truth test
                raise TypeError(f"{key}={value!r} must be a bool")
        self.max_layer_sparsity = check_max_layer_sparsity(max_layer_sparsity)
        if self.schedule.is_resolved:  # else checked when the run's length resolves it, before the first step
            setup_checks.check_cap(self.max_layer_sparsity, scope, self.schedule.final_sparsity)
        check_choice("unit", unit, UNITS)
        check_choice("masking", masking, MASKING)
        raise_problems(
            rules.method_problems(
                self.units or method_name(self.method) or self.method.__name__,
                self.method.PRUNING_TYPE,
                scope=scope,  # its rules held in resolve_method_options: only the channel-bias rule can fail here
                prune_channel_bias=prune_channel_bias,
                dim=self.method_kwargs.get("dim"),
            )
        )
        rewind_at, snapshot = resolve_rewind(rewind, unit)
        check_rewind_time(self.schedule, unit, rewind_at)
        if mask_dtype is not None and not (
            isinstance(mask_dtype, torch.dtype) and (mask_dtype == torch.bool or mask_dtype.is_floating_point)
        ):
            error = ValueError if isinstance(mask_dtype, torch.dtype) else TypeError
            raise error(f"mask_dtype={mask_dtype!r} must be torch.bool, a floating torch.dtype or None")
        check_parameter_names(parameter_names)
        if log_every_n_steps is not None and not (is_int(log_every_n_steps) and log_every_n_steps >= 1):
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} must be None or an int >= 1")
        if not is_int(seed):
            raise TypeError(f"seed={seed!r} must be an int")
        if parameters is not None and (include is not None or exclude is not None):
            raise ValueError("give either parameters=[(module, name), ...] or include/exclude patterns, not both")
        compile_patterns("include", include)  # an invalid pattern fails here, not when fit starts
        compile_patterns("exclude", exclude)
        module_types = resolve_module_types(module_types)
        self._default_types = (  # the selection by type alone: the default types' weights
            module_types is not None
            and set(module_types) == set(DEFAULT_MODULE_TYPES)
            and parameter_names is not None
            and set([parameter_names] if isinstance(parameter_names, str) else parameter_names) == {"weight"}
        )
        if name is not None and not (isinstance(name, str) and name and "/" not in name):
            raise ValueError(f"name={name!r} must be None or a non-empty str without '/'")

        self.scope = scope
        self.unit = unit
        self.parameters = None if parameters is None else check_pairs(parameters, "parameters")
        self.include = include
        self.exclude = exclude
        self.module_types = module_types
        self.parameter_names = parameter_names
        self.prune_channel_bias = prune_channel_bias
        self.rewind = rewind_at
        self.make_permanent = make_permanent
        self.mask_dtype = mask_dtype
        self.log_per_parameter = log_per_parameter
        self.log_every_n_steps = log_every_n_steps
        self.seed = seed
        self.name = name
        self.summary = summary
        self.masking = masking
        self.importance = importance
        self.activation_window = activation_window
        self.calibration_batches = calibration_batches
        self.adopt_zeros = adopt_zeros
        if self.units is not None:  # the least-squares refit of the units' consuming projections
            self.reconstruct = bool(reconstruct)
        else:  # OBS's update of the kept weights
            self.reconstruct = importance == "obs" if reconstruct is None else reconstruct
        self.sequential = sequential
        self.token_mask = token_mask
        self._importance = Importance(importance, activation_window)
        reads_inputs = self._importance.kind in choices.STATISTICS_IMPORTANCES or bool(self.units and reconstruct)
        check_unused_inputs(token_mask, example_inputs, reads_inputs=reads_inputs, units=self.units is not None)
        self._collecting = False  # this training batch's inputs feed the activation statistics
        self._log_prefix = _LOG_PREFIX if name is None else f"{_LOG_PREFIX}{name}/"
        self._state_key: str | None = None  # see state_key

        self._masked: MaskedSelection | None = None
        self._hooks = ModelHooks()  # on the model (plain checkpoints) and the optimizers (in-place masking)
        self._restored_masks: dict[str, Tensor] | None = None
        self._saved_selection: list[str] | None = None  # a checkpoint's selection, compared once this one is made
        self._units_pending = False  # a resumed fit with unit methods: units are found on its first training batch
        self._skipped_step = False  # the gradient scaler skips the current optimizer step
        self._fitting = False  # between setup("fit") and the fit's end: a checkpoint's masks are put back only then
        self._sharded_masks_in: list[str] = []  # names of masks a sharded checkpoint holds beside the weights
        self._timeline = Timeline(self._title(), unit)  # the schedule resolved for this fit, the last event taken
        self._last_logged = -1
        self._total: float | None = None  # the total sparsity the last event (or logging) counted, for self.log
        self._module_logged: tuple[int, float] | None = None  # the (epoch, total) self.log was last given
        self._given_snapshot = snapshot
        self._rewind_snapshot: dict[str, Tensor] | None = snapshot
        self._collapsed: set[str] | None = None  # the tensors with every unit pruned, after the last event
        self._stale = StaleRefresher()  # pruned tensors a parent reads without calling their module's forward

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks: thin, each delegating to a named step
    # ------------------------------------------------------------------------------------------------------------

    @property
    @override
    def state_key(self) -> str:
        """Names the callback's state in a checkpoint, from constructor arguments only (as Lightning's callbacks do).

        With ``name=`` the key is built from the name alone, so renaming a layer or editing the patterns keeps the
        saved state reachable; without it, from the method, scope, unit and selection patterns. Two PruningCallbacks
        with the same key on one Trainer are refused by Lightning when the Trainer is built: give them names. The key
        is built on first use and kept (Lightning reads it at every hook it calls).
        """
        if self._state_key is None:  # built once: Lightning reads it at every hook it calls
            if self.name is not None:
                self._state_key = self._generate_state_key(name=self.name)
            else:
                self._state_key = self._generate_state_key(
                    method=self.units or self.method.__name__,
                    scope=self.scope,
                    unit=self.unit,
                    include=self.include,
                    exclude=self.exclude,
                    parameter_names=self.parameter_names,
                )
        return self._state_key

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._hooks.accept_plain_checkpoints(pl_module)
        if stage == "fit":
            setup_checks.refuse_strategy(trainer.strategy)
            self._reset()
            self._fitting = True
            neighbours.run_after_weight_averaging(trainer, self)

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after configure_model (layers built there are selected) and after the strategy wrapped the model
        setup_checks.refuse_hooks_under_compile(pl_module, self._hooked_features())
        setup_checks.refuse_sharded_units(pl_module, self.units)
        if self.units is not None:
            neighbours.refuse_other_pruning(trainer)
            return  # units are found on the first training batch, when training starts
        self._masked = self._select(trainer, pl_module)
        self._importance.bind(self._masked.selection, self._masked.weight if self._masked.adapted else None)
        self._hooks.write_plain_state_dict(pl_module, self._masked.plain_state_dict)
        self._masked.share_with_averages(neighbours.averaged_models(trainer))
        if self.adopt_zeros:
            self._masked.adopt_zeros()
        self._apply_restored_masks()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fresh = trainer.global_step == 0 and clock.now(trainer, "step") == 0 and self._timeline.last_event < 0
        if self.units is not None and self._masked is None:
            if not fresh and (self.example_inputs is None or callable(self.example_inputs)):
                # a batch drawn here would use up a resumed loader's position: the first training batch serves
                self._units_pending = True
            else:
                self._select_units(trainer, pl_module)
        windowed = (  # (a resumed unit fit binds its statistics at its first batch: reconstruct says it will have some)
            self._importance.kind in choices.STATISTICS_IMPORTANCES
            or self._importance.activations is not None
            or (self.units is not None and self.reconstruct)
        )
        resolved = self._timeline.start(self.schedule, trainer, self.rewind, windowed)
        if self._masked is not None:  # callbacks such as BackboneFinetuning freeze layers when fit starts
            setup_checks.refuse_frozen_movement(self._masked.selection, self._importance.kind, "when training starts")
        self._start_masks(trainer, pl_module)
        if self._dst is not None and self._masked is not None:  # (the run clock: batches under manual optimization)
            self._dst.start(trainer, self._masked, self._timeline.run_length(trainer, "step"), self._title())
        # the callback's schedule starts with this fit (also from a checkpoint without its state, a dense one, and
        # after a restore with nothing trained: LearningRateFinder and BatchSizeFinder put back their own checkpoint)
        now, starting = self._now(trainer), self._timeline.last_event < 0 and (fresh or not self._resumed)
        if starting and now > 0:
            self._timeline.warn_catching_up(now)
        first_due = starting and resolved.target(now) > 0  # an event that prunes, before any training batch
        self._check_first_event(first_due, now)
        if starting and self.sequential:
            self._sequential_first_event(trainer, pl_module, now)
        elif first_due and self.calibration_batches:
            calibrate(
                trainer,
                pl_module,
                self.calibration_batches,
                lambda batch: self._importance.start_batch(find_token_mask(batch, self.token_mask)),
                lambda: self._importance.finish_batch(self._reducer(trainer, "sum")),
            )
        elif starting and self.calibration_batches:  # (their sums would join the first event's window)
            rank_zero_warn(
                f"PruningCallback: calibration_batches={self.calibration_batches} gives statistics to an event when "
                f"training starts, but the schedule {resolved!r} prunes nothing at {self.unit} {now}: its "
                "first event is ranked on its activation_window alone, and no calibration batch runs",
                category=UserWarning,
            )
        self._step(trainer, pl_module, now)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._after_rewrite()  # StochasticWeightAveraging updates its average when an epoch starts
        if trainer.current_epoch > 0:
            self._timeline.warn_if_length_changed(trainer)  # (reloaded loaders of another length)
        if self.unit == "epoch":
            self._step(trainer, pl_module, trainer.current_epoch)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._units_pending:  # a resumed fit finds its units on the batch it trains on
            self._units_pending = False
            self._select_units(trainer, pl_module, batch)
            self._start_masks(trainer, pl_module)
            self._step(trainer, pl_module, self._now(trainer))
        if batch_idx >= trainer.num_training_batches:  # (inf for a loader without length)
            reporting.warn_batch_past_epoch_end(trainer.current_epoch, batch_idx, int(trainer.num_training_batches))
        self._stale.refresh()
        if self._masked is not None and self._stale.pending:
            self._stale.watch(self._masked.pairs())
        # (no schedule events kept: no statistics window to be in; the clock is read only when there is one)
        timeline = self._timeline
        self._collecting = bool(timeline.events) and self._importance.collects(
            self._now(trainer), timeline.next_event()
        )
        if self._collecting:
            self._importance.start_batch(find_token_mask(batch, self.token_mask))
        if self._dst is not None:  # RigL: the backward of an update step's batch gives its dense gradients
            self._dst.before_batch(trainer, self._stale.refreshed)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stale.classify()
        if self._collecting:
            self._collecting = False
            self._importance.finish_batch(self._reducer(trainer, "sum"))  # every rank, before any event
        if self._masked is not None and self._masked.averages:
            self._after_rewrite()  # weight-averaging callbacks (run before this one) updated their copies
        if self.unit == "step":
            self._step(trainer, pl_module, self._now(trainer))
        self._move(trainer)
        if self.log_every_n_steps:
            step = clock.now(trainer, "step")
            if (
                step % self.log_every_n_steps == 0
                and step != self._last_logged
                and not self._timeline.event_next(trainer, batch_idx)
            ):
                resolved = self._timeline.resolved
                target = 0.0 if resolved is None else resolved.target(self._now(trainer))
                self._log(trainer, pl_module, target)
        self._log_total(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # (epoch clock: an epoch max_steps or a stop ended partway was not completed, though Lightning counts it)
        partial = self.unit == "epoch" and clock.ended_inside_epoch(trainer)
        now = self._now(trainer) - partial
        if not (clock.stopped_early(trainer) or partial):  # the last event; none after a stop
            self._step(trainer, pl_module, now)
        if self._masked is not None:
            self._timeline.warn_if_unfinished(now, self._masked.counts)
        if self.summary and self._masked is not None and (trainer.is_global_zero or self._masked.strategy.collective):
            table = self.summary_table()  # sharded: every rank takes part in reducing the counts
            rank_zero_info(table)
        if self._masked is not None:
            reporting.warn_kept_zeros_under_adapters(self._masked.kept_zeros_under_adapters())
            self._masked.make_permanent(self.make_permanent)
        self._hooks.remove_steps()
        self._importance.close()
        if self._dst is not None:
            self._dst.stop()
        self._stale.refresh()

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # a float16 step the scaler skips has inf or NaN gradients: read (one pass over them) only where they are used,
        # before in-place masking writes zeros over the pruned entries (an overflow there alone skips the step too)
        reads_gradients = self._importance.movement is not None or self._dst is not None
        self._skipped_step = reads_gradients and neighbours.scaler_skips_step(trainer, optimizer)
        if self._masked is not None:
            self._follow_optimizers(trainer, pl_module)
            self._masked.strategy.before_optimizer_step()  # the gradients are final; clipping and the step follow
        # movement: final (accumulated, unscaled) gradients, added while an event is left to read them
        self._importance.optimizer_step(optimizer, self._skipped_step, collect=not self._timeline.finished())

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stale.refresh()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._fitting:
            # FSDP2 leaves a root fully_shard module unsharded after validation's forwards (no backward follows):
            # until the next training backward its tensors are full copies, which an epoch's event would prune and
            # the end-of-fit summary would count, while the shards trained on unpruned
            reshard(pl_module)

    @override
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stale.refresh()

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stale.refresh()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._hooks.remove_plain_load()
        if stage != "fit":
            return
        self._fitting = False  # validate/test(ckpt_path=...) restore this state too: their masks are not put back
        if self._masked is not None:
            self._masked.strategy.follow_parameters()  # Lightning moved the model back to the CPU before teardown
        self._importance.follow_parameters()
        if neighbours.spawned(trainer):
            # Lightning hands rank zero's state_dict to the main process after teardown and loads it there with
            # strict=False: keep it plain, or the main process would silently keep its untrained dense weights
            if not self.make_permanent and self._masked is not None:
                rank_zero_warn(
                    "PruningCallback(make_permanent=False) under a spawning strategy: the model returned to the main "
                    "process holds the pruned weights as plain tensors; the reparametrization stays in the worker",
                    category=UserWarning,
                )
            return
        self._hooks.remove_plain_state_dict()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._fitting = False
        self._hooks.remove_all()  # Lightning skips teardown hooks when fit fails
        self._importance.close()
        if self._dst is not None:
            self._dst.stop()
        if self._masked is not None:  # (interrupted: say how far the schedule got, as a stop does)
            with contextlib.suppress(Exception):  # nothing may hide the exception that ended the fit
                self._timeline.warn_if_unfinished(self._now(trainer), self._masked.counts)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # a checkpoint written after the state_dict hook is gone (OnExceptionCheckpoint) is made plain all the same
        if self._masked is not None:
            self._masked.plain_state_dict(pl_module, checkpoint["state_dict"], "", None)
            self._masked.strategy.save_checkpoint(checkpoint, self.state_key)
            if self._masked.strategy.collective:  # sharded: each rank's movement sums, laid out as the masks
                sharded_movement.save_sums(checkpoint, self.state_key)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {
            **self._timeline.state(),
            "rewind_snapshot": self._rewind_snapshot,
            "masks": dict(self._restored_masks or {}) if self._masked is None else self._masked.masks_or_zeros(),
            "sharded_masks": list(self._sharded_masks_in),
            "last_regrow": -1 if self._dst is None else self._dst.last,
            "configuration": resume.configuration(self._resume_options()),
        }
        if self._masked is not None:
            state["selection"] = self.selection
        statistics = self._importance.state_dict()  # collected since the last event (a refit's too, any importance)
        if statistics:
            state["importance"] = statistics
        return state

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._fitting:  # (validate/test(ckpt_path=...) evaluate the checkpoint's weights, whatever wrote them)
            keys = [c.state_key for c in trainer.callbacks if isinstance(c, PruningCallback)]
            resume.refuse_foreign_states(checkpoint, keys, self._title())

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._fitting and "configuration" in state_dict:
            current = resume.configuration(self._resume_options())
            resume.refuse_changed(state_dict["configuration"], current, self._title())
            self._saved_selection = state_dict.get("selection")
        self._resumed = True
        self._timeline.load_state(state_dict)
        if self._dst is not None:
            self._dst.last = int(state_dict.get("last_regrow", -1))
        self._rewind_snapshot = state_dict.get("rewind_snapshot")
        self._sharded_masks_in = list(state_dict.get("sharded_masks", []))
        masks = state_dict.get("masks", {})
        if not isinstance(masks, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in masks.items()
        ):
            raise ValueError(f"{self.state_key}: the checkpoint's 'masks' must map parameter names to tensors")
        self._restored_masks = dict(masks)
        self._apply_restored_masks()  # when the selection exists already (strategies restoring after on_fit_start)
        if not self._fitting and self._masked is not None:  # validate/test(ckpt_path=...): the checkpoint's model
            self._masked.mask_updates_as_saved(self._restored_masks)
        if "importance" in state_dict:
            self._importance.load_state_dict(state_dict["importance"])

    # ------------------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        """Start a fit from a clean clock: a second ``fit`` (same callback, new Trainer) replays the schedule.

        Runs in ``setup``, before Lightning restores a checkpoint's state into the callback (``load_state_dict``).
        """
        self._timeline.reset()
        self._resumed = False  # a checkpoint's state was restored into the callback (load_state_dict)
        self._last_logged = -1
        self._total = None
        self._module_logged = None
        self._rewind_snapshot = self._given_snapshot
        self._restored_masks = None
        self._saved_selection = None
        self._sharded_masks_in = []
        self._masked = None
        self._units_pending = False
        self._stale.reset()
        self._importance.unbind()
        self._collecting = False
        self._collapsed = None
        if self._dst is not None:
            self._dst.reset()

    def _hooked_features(self) -> list[str]:
        """The options set that read the model's forwards through hooks attached during training."""
        features = []
        if self._importance.kind in choices.STATISTICS_IMPORTANCES:
            features.append(f"importance={self._importance.kind!r}")
        if self.reconstruct and (self.units is not None or self._importance.kind != "obs"):
            features.append("reconstruct=True")
        if self.regrow == "rigl" and self.masking != "inplace":
            features.append("regrow='rigl' under masking='reparametrize' (masking='inplace' takes its gradients "
                            "from the parameters)")  # fmt: skip
        return features

    def _select_units(self, trainer: Trainer, pl_module: LightningModule, batch: Any = None) -> None:
        """Find the unit groups on ``batch``, the first training batch or ``example_inputs`` and attach to them."""
        if batch is None and (self.example_inputs is None or callable(self.example_inputs)):
            batch = first_batch(trainer)
        args, kwargs = example_from_batch(batch, self.example_inputs)
        if batch is None:  # fixed example inputs, built on the CPU: the model may train on a GPU
            args, kwargs = inputs_as_trained_on(trainer, (args, kwargs))
        assert self.units is not None
        try:
            groups = find_groups(pl_module, self.units, args, kwargs, self.include, self.exclude)
        except UnitError as err:
            if self.example_inputs is not None or not kwargs:
                raise
            raise UnitError(  # the batch dict went to forward as keyword arguments: say so, and how to choose
                f"{err}\n(the inputs were the training batch's keys {sorted(kwargs)} passed to "
                f"{type(pl_module).__name__}.forward as keyword arguments; give example_inputs=, a callable batch -> "
                "inputs or the inputs, to trace the forward with others)"
            ) from err
        masked = UnitSelection(pl_module, groups, self.scope, self.mask_dtype, self.seed, self.reconstruct)
        setup_checks.refuse_overlaps(masked.selection, self._other_selections(trainer), self._log_prefix)
        setup_checks.refuse_masked_already(masked.selection, pl_module, self.adopt_zeros)
        moments = self._importance.kind == "activation" or self.reconstruct
        if moments:  # the units are ranked or refit on the inputs of the projections reading them
            reader = "importance='activation'" if self._importance.kind == "activation" else "reconstruct=True"
            way_out = "use importance='magnitude' without reconstruct for these units, or exclude their layers"
            setup_checks.refuse_unrecorded_inputs(masked.consumers(), pl_module, reader, way_out)
        self._masked = masked
        self._importance.bind(masked.selection, inputs_of=masked.consumers(), moments=moments, outer=self.reconstruct)
        self._hooks.write_plain_state_dict(pl_module, masked.plain_state_dict)
        masked.share_with_averages(neighbours.averaged_models(trainer))

    def _unit_ranking(self, trainer: Trainer) -> UnitRanking:
        """The criterion and the statistics of this event, for the unit groups."""
        importance = self._importance
        moments = importance.activations.moments() if importance.activations is not None else None
        movement = importance.movement.scores(self._reducer(trainer, "mean")) if importance.movement else None
        return UnitRanking(self.importance, moments, movement)

    def check_model(self, model: nn.Module, batch: Any = None) -> None:
        """Check, before any training, what can be checked on ``model`` alone: the selection (``include``,
        ``exclude``, ``module_types``, ``parameters``) and whether the method, scope and cap fit the selected tensors
        (an N:M group size their input dims, ``ln_structured``'s ``dim`` their dims, ``max_layer_sparsity`` the
        final target). ``trainer.fit`` runs these checks again at setup, with those that need the Trainer (other
        pruning callbacks, sharding, a checkpoint's masks); an app can call this first to fail before a long dense
        phase. Unit groups (``method="heads"`` and the other units) are looked for on ``batch`` (a training batch as
        the dataloader yields it, read as at setup) or fixed ``example_inputs``, in eval mode without gradients;
        without either they are not checked here.

        Raises:
            ValueError: naming the first problem found.

        Example:
            >>> callback = PruningCallback(0.5, method="semi_structured")
            >>> callback.check_model(nn.Sequential(nn.Linear(8, 2)))  # input dim 8: 2:4 groups fit
            >>> callback.check_model(nn.Sequential(nn.Linear(6, 2)))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: semi_structured with m=4 needs the input dim (dim 1) of every weight to be a multiple of m: ...
        """
        if self.units is not None:
            if batch is not None or (self.example_inputs is not None and not callable(self.example_inputs)):
                args, kwargs = example_from_batch(batch, self.example_inputs)
                find_groups(model, self.units, args, kwargs, self.include, self.exclude)
            return
        masked = self._masked_selection(model, self._selected(model))
        if self.max_layer_sparsity < 1:
            schedule = self.schedule
            if not schedule.is_resolved:  # its last level does not depend on the run's length
                try:
                    schedule = schedule.resolve(1_000_000)
                except ValueError:
                    return  # checked when the run's length resolves it, before the first step
            counts = masked.counts() if self.scope in ("global", *ALLOCATION_SCOPES) else None
            setup_checks.check_cap(self.max_layer_sparsity, self.scope, schedule.final_sparsity, counts)

    def check_run(self, steps: int, epochs: int) -> None:
        """Check the schedule and dynamic sparse training against a fit of ``steps`` optimizer steps over ``epochs``
        epochs before it starts (an app that knows its run's length can refuse a schedule that cannot fit it before
        any training): the checks fit makes when training starts.

        Raises:
            ValueError: the schedule's fractions of the run collapse on this length (``start`` rounding to ``end``),
                ``rewind`` comes after its first event that prunes, or no mask update of ``regrow`` falls before
                ``regrow_until``.

        Example:
            >>> from lightprune.schedules import Cubic
            >>> PruningCallback(Cubic(final=0.8, start=0.0, end=0.5, frequency=0.1)).check_run(steps=100, epochs=5)
            >>> PruningCallback(0.8, regrow="set").check_run(steps=120, epochs=1)
            Traceback (most recent call last):
            ...
            ValueError: regrow='set' moves the masks every 100 optimizer steps until regrow_until=0.75 of the run, ...
        """
        checked_schedule(self.schedule, self.unit, epochs if self.unit == "epoch" else steps, self.rewind)
        if self._dst is not None:
            self._dst.check(steps)

    def _selected(self, model: nn.Module) -> list[tuple[str, nn.Module, str]]:
        """The ``(qualified name, module, name)`` of the tensors to prune in ``model``."""
        return selecting.selected(
            model, self.parameters, self.include, self.exclude, self.module_types, self.parameter_names
        )

    def _select(self, trainer: Trainer, pl_module: LightningModule) -> MaskedSelection:
        """Resolve which tensors to prune; check them against other pruning tools, the method and sharding."""
        selection = self._selected(pl_module)
        neighbours.refuse_other_pruning(trainer)
        if self.mask_dtype == torch.bool:
            neighbours.refuse_averaged_bool_buffers(trainer)
        setup_checks.refuse_overlaps(selection, self._other_selections(trainer), self._log_prefix)
        setup_checks.refuse_masked_already(selection, pl_module, self.adopt_zeros)
        setup_checks.check_sharded(selection, trainer.strategy, self.method, self.rewind, parameter_owners(pl_module))
        setup_checks.refuse_sharded_criteria(selection, self._importance.kind, self.method, self.scope, self.regrow)
        if self._default_types and self.parameters is None and self.include is None and self.exclude is None:
            setup_checks.warn_small_share(selection, parameter_owners(pl_module))  # (the selection by type alone)
        return self._masked_selection(pl_module, selection)

    def _other_selections(self, trainer: Trainer) -> list[PruningCallback]:
        """The fit's other PruningCallbacks whose selection is made (units are found when training starts, so a
        unit callback checks against the others then, and they do not see its selection)."""
        return [c for c in trainer.callbacks if isinstance(c, PruningCallback) and c is not self and c._masked]

    def _masked_selection(self, model: nn.Module, selection: list[tuple[str, nn.Module, str]]) -> MaskedSelection:
        """The selection with its ties, channel biases and adapters, checked against the method and scope."""
        if self.structured:
            setup_checks.check_dims(selection, self.method_kwargs, self.method)
        if self.scope == "row":
            setup_checks.check_rows(selection)
        if self._n_m is not None:
            setup_checks.check_n_m_layout(selection, self._n_m.name, self.method_kwargs["m"])
        biases = []
        if self.prune_channel_bias:
            biases = setup_checks.channel_biases(selection)
        ties = setup_checks.find_ties(selection, parameter_owners(model))
        if self.reconstruct:
            setup_checks.refuse_reconstructing_ties(ties, selection)
        adapted = setup_checks.check_adapters(selection, model, self._importance.kind)
        if self.regrow is not None:
            setup_checks.check_regrowth(selection, model, self.regrow, self.masking, adapted)
        if self._importance.kind in choices.STATISTICS_IMPORTANCES:  # (scope="owl" needs importance="activation")
            setup_checks.refuse_unrecorded_inputs(selection, model, f"importance={self._importance.kind!r}")
        setup_checks.refuse_frozen_movement(selection, self._importance.kind)
        setup_checks.refuse_sparse_gradients(
            selection, self.mask_dtype, self.masking, self._importance.kind, self.regrow
        )
        return MaskedSelection(
            selection,
            ties,
            biases,
            self.method,
            self.method_kwargs,
            self.scope,
            self.mask_dtype,
            self.seed,
            inplace=self.masking == "inplace",
            max_layer_sparsity=self.max_layer_sparsity,
            adapted=adapted,
            owl=(self.owl_threshold, self.owl_lambda),
        )

    def _start_masks(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Once the selection exists: put a checkpoint's masks back, attach the strategy's step hooks, and check the
        cap against the restored counts."""
        if self._masked is None:
            return
        if self._given_snapshot is not None and self._rewind_snapshot is self._given_snapshot:
            tensors = [prune.original(module, name) for _, module, name in self._masked.selection]
            rewinding.check_snapshot(pl_module, self._given_snapshot, tensors)
        self._load_sharded_masks(trainer)
        self._load_sharded_sums(trainer)
        self._apply_restored_masks()  # strategies that restore checkpoints after setup restore them after on_fit_start
        resolved = self._timeline.resolved
        if isinstance(self._masked, UnitSelection) and resolved is not None:
            self._masked.check_final(resolved.final_sparsity)
        self._attach(trainer, pl_module)
        if self.max_layer_sparsity < 1 and resolved is not None:  # resumed: the counts hold the masks
            counts = self._masked.counts() if self.scope in ("global", *ALLOCATION_SCOPES) else None
            setup_checks.check_cap(self.max_layer_sparsity, self.scope, resolved.final_sparsity, counts)

    def _load_sharded_masks(self, trainer: Trainer) -> None:
        """Resuming from a distributed checkpoint: read this rank's shard of every mask saved beside the weights."""
        names, self._sharded_masks_in = self._sharded_masks_in, []
        if names and self._masked is not None:
            masks = sharded.load_masks(trainer.ckpt_path, names, self._masked, self.state_key, self.mask_dtype)
            self._masked.restore(masks, self.state_key)

    def _load_sharded_sums(self, trainer: Trainer) -> None:
        """Resuming from a distributed checkpoint: read this rank's shard of the movement sums saved beside the
        weights (a resume between events is exact)."""
        movement = self._importance.movement
        if movement is None or not movement.pending or self._masked is None:
            return
        weights = {q: prune.original(module, name) for q, module, name in self._masked.selection}
        loaded = sharded_movement.load_sums(trainer.ckpt_path, movement.pending, weights, self.state_key)
        movement.load_state_dict({"totals": {**movement.state_dict()["totals"], **loaded}})

    def _after_rewrite(self) -> None:
        """The weights were rewritten (a rewind, a weight average): the strategy masks them again if it must."""
        if self._masked is not None:
            self._masked.after_rewrite()

    def _attach(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Attach the strategy's step hooks to the Trainer's optimizers (in place: their post-step passes, and the
        state of pruned entries zeroed at every event)."""
        masked = self._masked
        if masked is not None:
            self._hooks.attach_steps(
                trainer.optimizers,
                lambda: [
                    *masked.strategy.attach(trainer, pl_module, masked),
                    *self._importance.watch_steps(trainer.optimizers),
                ],
            )

    def _follow_optimizers(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A callback or the module replaced the optimizers mid-fit (``trainer.strategy.optimizers = [...]``): attach
        to the new ones before their first step, or their steps would move pruned weights off zero in place."""
        if self._hooks.optimizers_replaced(trainer.optimizers):
            self._attach(trainer, pl_module)

    def _resume_options(self) -> dict[str, Any]:
        """The options a resumed fit must share with the fit that wrote its checkpoint (:mod:`.resume`)."""
        return {
            "schedule": self.schedule,
            "unit": self.unit,
            "method": self.units or method_name(self.method) or self.method.__name__,
            "method_kwargs": dict(sorted(self.method_kwargs.items())),
            "scope": self.scope,
            "importance": self.importance,
            "activation_window": self.activation_window,
            "calibration_batches": self.calibration_batches,
            "sequential": self.sequential,
            "owl": (self.owl_threshold, self.owl_lambda) if self.scope == "owl" else None,
            "masking": self.masking,
            "rewind": self.rewind if self._given_snapshot is None else "weights given",
            "max_layer_sparsity": self.max_layer_sparsity,
            "prune_channel_bias": self.prune_channel_bias,
            "reconstruct": self.reconstruct,
            "regrow": None if self.regrow is None else (self.regrow, self.regrow_every, self.regrow_fraction),
            "regrow_until": None if self.regrow is None else self.regrow_until,
        }

    def _check_resumed_selection(self) -> None:
        """A resumed fit selects what the fit that wrote its checkpoint selected (checked once it is known)."""
        if self._saved_selection is not None and self._masked is not None:
            saved, self._saved_selection = self._saved_selection, None
            resume.refuse_changed_selection(saved, self.selection, self._title())

    def _apply_restored_masks(self) -> None:
        """Put the masks of a checkpoint back on the selected tensors (resume), once both are known."""
        self._check_resumed_selection()
        if self._restored_masks is not None and self._masked is not None and self._fitting:
            restored, self._restored_masks = self._restored_masks, None
            self._masked.restore(restored, self.state_key)

    # ------------------------------------------------------------------------------------------------------------
    # The clock
    # ------------------------------------------------------------------------------------------------------------

    def _now(self, trainer: Trainer) -> int:
        """The time on the clock of :mod:`lightprune.callback.clock` (steps, batches under manual optimization)."""
        return clock.now(trainer, self.unit)

    def _step(self, trainer: Trainer, pl_module: LightningModule, t: int) -> None:
        """Take the rewind snapshot when its time comes, then prune if an event is due."""
        resolved = self._timeline.resolved
        if resolved is None or self._masked is None or clock.in_swa_batch_norm_epoch(trainer):
            return
        if self.rewind is not None and self._rewind_snapshot is None and t >= self.rewind:
            self._rewind_snapshot = rewinding.snapshot_weights(pl_module)
        # the latest event at or before t, in O(1): events missed in between are caught up by one prune to target
        event = resolved.latest_event(t)
        if event is None or event <= self._timeline.last_event:
            return
        setup_checks.refuse_replaced(self._masked.selection, pl_module)
        target = resolved.target(t)
        if target > 0 and self._collapsed is None:  # (every rank: counting sharded tensors is collective)
            self._collapsed = set(self._masked.collapsed())  # what a resumed fit brought back is not news
        if target > 0 and self.reconstruct and self._importance.hessians is not None:
            self._masked.reconstruct_to(target, self._importance.hessians.hessian)
        else:
            scores: Any = None  # an event at level 0 (a ramp's first) prunes nothing: no scores, the statistics stay
            if target > 0 and self.units is not None:
                scores = self._unit_ranking(trainer)
            elif target > 0:
                scores = self._importance.scores(self._reducer(trainer, "sum"), self._reducer(trainer, "mean"))
                if self.structured and scores is not None:  # (channel norms: torch.norm refuses integer tensors)
                    scores = {q: s if s.is_floating_point() else s.double() for q, s in scores.items()}
            self._masked.prune_to(target, event, scores, signed=self._importance.signed)
        if target > 0:
            self._importance.after_event()
            self._say_collapsed(event)
        self._timeline.last_event = event
        self._stale.expect_new()  # newly pruned tensors: learn at the next batch whether their forward runs
        if self.rewind is not None and self._rewind_snapshot is not None and target > 0:  # (level 0: nothing pruned)
            rewinding.rewind_into(pl_module, self._rewind_snapshot)
            self._after_rewrite()
        self._log(trainer, pl_module, target)

    def _move(self, trainer: Trainer) -> None:
        """Dynamic sparse training: after an update step's optimizer step, move every tensor's mask (once)."""
        if self._dst is None or self._masked is None:
            return
        moved = self._dst.move(trainer, self._masked, self._skipped_step, self._reducer(trainer, "mean"), self._title())
        if moved is None:
            return
        shares, fraction = moved
        self._stale.expect_new()
        values = {f"{self._log_prefix}regrown/{qualified}": share for qualified, share in shares.items()}
        values[self._log_prefix + "regrown/fraction"] = fraction
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=clock.now(trainer, "step"))

    def _say_collapsed(self, event: int) -> None:
        """Warn (rank zero) naming every tensor this event left with no unpruned unit: layer collapse."""
        assert self._masked is not None
        now = self._masked.collapsed()
        new = [qualified for qualified in now if qualified not in (self._collapsed or set())]
        self._collapsed = set(now)
        if new:
            unit = f"channel (dim {self.method_kwargs['dim']})" if self.structured else "weight"
            where = f"{self._title()}: the event at {self.unit} {event}"
            rank_zero_warn(collapse_message(new, where, unit), category=LayerCollapseWarning)

    def _title(self) -> str:
        return "PruningCallback" if self.name is None else f"PruningCallback {self.name!r}"

    def _check_first_event(self, due: bool, now: int) -> None:
        """An event that prunes when training starts (``due``, at ``now``) has no statistics to rank by, unless
        calibration provides them."""
        resolved = self._timeline.resolved
        if not due or resolved is None:
            return
        kind = self._importance.kind
        if kind == "movement":
            raise ValueError(
                f"importance='movement' needs optimizer steps before an event, but the schedule {resolved!r} "
                f"has one at {self.unit} {now}: start it later"
            )
        if self.units is not None and self.reconstruct and not self.calibration_batches:
            raise ValueError(
                f"reconstruct=True refits from input statistics, but the schedule {resolved!r} has an event at "
                f"{self.unit} {now}, before any training batch: set calibration_batches (e.g. 8) or start it later"
            )
        if kind in choices.STATISTICS_IMPORTANCES and not self.calibration_batches:
            raise ValueError(
                f"importance={kind!r} needs input statistics, but the schedule {resolved!r} has an event "
                f"at {self.unit} {now}, before any training batch: set calibration_batches (e.g. 8) or start it later"
            )

    def _sequential_first_event(self, trainer: Trainer, pl_module: LightningModule, now: int) -> None:
        """The event at the start (``now``), block by block: calibration batches through the blocks already pruned,
        then the block's OBS event, until every block is pruned (``sequential=True``)."""
        resolved = self._timeline.resolved
        assert resolved is not None and self._masked is not None and self._importance.hessians is not None
        target = resolved.target(now)
        if target == 0:
            raise ValueError(
                f"sequential=True calibrates an event at {self.unit} {now}, but the schedule {resolved!r} has "
                "none that prunes: use a one-shot schedule (a float) or a ramp starting above 0, or sequential=False"
            )
        hessians = self._importance.hessians
        for block in blocks([qualified for qualified, _, _ in self._masked.selection]):
            names = set(block)
            calibrate(
                trainer,
                pl_module,
                self.calibration_batches,
                lambda batch, names=names: hessians.start(names, find_token_mask(batch, self.token_mask)),
                lambda: hessians.finish_batch(self._reducer(trainer, "sum")),
            )
            self._masked.reconstruct_to(target, hessians.hessian, only=names)
            hessians.reset()
        self._timeline.last_event = resolved.latest_event(now)
        self._stale.expect_new()
        self._log(trainer, pl_module, target)

    @staticmethod
    def _reducer(trainer: Trainer, op: str) -> Callable[[Tensor], Tensor]:
        """A ``sum`` or ``mean`` all-reduce across the processes of ``trainer``'s strategy (identity on one)."""
        return lambda tensor: trainer.strategy.reduce(tensor, reduce_op=op)

    # ------------------------------------------------------------------------------------------------------------
    # Lottery-ticket rewinding, logging, saying what happened
    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def snapshot_weights(model: nn.Module) -> dict[str, Tensor]:
        """A CPU copy of every parameter of ``model``, keyed by its name (``weight``, also for a pruned tensor).

        Pass it as ``rewind=`` to rewind to these weights, e.g. the initial ones, across separate fits.

        Example:
            >>> snapshot = PruningCallback.snapshot_weights(nn.Linear(2, 1))
            >>> sorted(snapshot), snapshot["weight"].device.type
            (['bias', 'weight'], 'cpu')
        """
        return rewinding.snapshot_weights(model)

    def _log(self, trainer: Trainer, pl_module: LightningModule, target: float) -> None:
        """Send the sparsities to every logger at the current step; keep the total for :meth:`_log_total`."""
        if self._masked is None:
            return
        values = self._sparsities(trainer, pl_module)
        if not self.log_per_parameter:
            values = {self._total_key: values[self._total_key]}
        values[self._log_prefix + "target"] = float(target)
        self._last_logged = clock.now(trainer, "step")
        if trainer.is_global_zero:  # on the run clock, as events and regrowth: batches under manual optimization
            for logger in trainer.loggers:
                logger.log_metrics(values, step=self._last_logged)

    @property
    def _total_key(self) -> str:
        return self._log_prefix + "sparsity/" + TOTAL_KEY

    def _sparsities(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """Every selected tensor's sparsity and the total, by logged key (the total kept for :meth:`_log_total`)."""
        assert self._masked is not None
        current = {}
        for qualified, module, name in self._masked.selection:
            current[qualified] = self._masked.strategy.logged_mask(module, name, trainer.global_rank)
        values = reporting.sparsities(current, self._log_prefix + "sparsity/", pl_module.device)
        self._total = values[self._total_key]
        return values

    def _log_total(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The total sparsity to the module's logged metrics (``callback_metrics``, the progress bar, what
        ``ModelCheckpoint``/``EarlyStopping`` monitor): the highest of the epoch's training batches, from the total
        the last event (or logging) counted, given to ``self.log`` at an epoch's first batch and when it changes."""
        if self._masked is None:
            return
        if self._total is None:  # (none counted yet this fit: adopted or restored masks, a level-0 start)
            self._sparsities(trainer, pl_module)
        if self._module_logged == (trainer.current_epoch, self._total):
            return  # (logged once an epoch and at each change: the epoch's maximum is its last value)
        self._module_logged = (trainer.current_epoch, self._total)
        # every rank holds the same masks: the max across ranks (sync_dist) is that value, and Lightning is quiet
        pl_module.log(
            self._log_prefix + "sparsity",
            self._total,
            on_step=False,
            on_epoch=True,
            reduce_fx="max",
            prog_bar=True,
            sync_dist=True,
            batch_size=1,  # a maximum weighs no batch; a dataloader_iter training_step has none to infer it from
        )

    @property
    def selection(self) -> list[str]:
        """Qualified names of the tensors this callback prunes (after fit started).

        Example:
            >>> PruningCallback(0.5).selection
            []
        """
        return [] if self._masked is None else [qualified for qualified, _, _ in self._masked.selection]

    def summary_table(self) -> str:
        """A table of the pruned tensors (parameter, shape, kept / total, sparsity) and the total, as printed at the
        end of fit; units are entries, or channels along ``dim`` for structured methods. After a fit that made the
        pruning permanent, the pruned units are the plain weights' zeros (all-zero channels).

        Example:
            >>> PruningCallback(0.5).summary_table()
            'PruningCallback: nothing selected yet'
        """
        if self._masked is None:
            return "PruningCallback: nothing selected yet"
        if isinstance(self._masked, UnitSelection):
            title = f"{self._title()}: pruned {self.scope}, {self.units}"
            return reporting.summary_table(title, self.units or "units", self._masked.table_rows())
        unit = f"channels (dim {self.method_kwargs['dim']})" if self.structured else "weights"
        rows = [(q, tuple(prune.original(m, n).shape), *self._masked.units(m, n)) for q, m, n in self._masked.selection]
        kind = self._importance.kind
        by = "" if kind == "magnitude" else f" by {'an importance function' if callable(self.importance) else kind}"
        regrown = f", {self.regrow} regrowth" if self.regrow else ""
        title = f"{self._title()}: pruned {self.scope}, {self.method.__name__}{by}{regrown}"
        return reporting.summary_table(title, unit, rows)


def _check_unit_options(
    method: str,
    reconstruct: Any,
    masking: str,
    max_layer_sparsity: float,
    parameters: Any,
) -> None:
    """Refuse, naming them, the options that unit pruning (``method="neurons"``/``"heads"``) does not take."""
    if reconstruct is not None and not isinstance(reconstruct, bool):
        raise ValueError(f"reconstruct={reconstruct!r} must be None or a bool")
    refused = {
        "masking": (masking, masking != "reparametrize", "units are masked through the reparametrization only"),
        "max_layer_sparsity": (
            max_layer_sparsity, max_layer_sparsity != 1.0, "every group keeps at least one unit already",
        ),
        "parameters": ("[...]", parameters is not None, "units are found from the model: use include/exclude"),
    }  # fmt: skip
    for key, (value, bad, why) in refused.items():
        if bad:
            raise ValueError(f"{key}={value!r} is not supported with method={method!r}: {why}")
