"""PruningCallback beside Lightning's other moving parts: weight averaging, spawned workers, other pruning tools.

Weight-averaging callbacks (``EMAWeightAveraging``, any ``WeightAveraging``, ``StochasticWeightAveraging``) keep a
copy of the model, average its parameters (and buffers) by position, and copy the average back over the model at
the end of fit. The callback masks their copies with the model's own masks and runs after them, whatever order the
user gave. Lightning's spawning launchers hand rank zero's state_dict back to the main process after teardown. A
float16 fit's gradient scaler skips the optimizer steps whose gradients overflowed: what the callback reads from
gradients leaves those steps out too.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelPruning, StochasticWeightAveraging
from torch import nn

__all__ = [
    "averaged_models",
    "mask_after_optimizer_steps",
    "refuse_averaged_bool_buffers",
    "refuse_other_pruning",
    "run_after_weight_averaging",
    "scaler_skips_step",
    "spawned",
]


# Optimizers outside torch (timm, apex, torch-optimizer) whose update reads a whole tensor's norm: no class of theirs
# can be imported here to test with isinstance, so they are known by class name. torch's own are tested by class.
_THIRD_PARTY_WHOLE = ("LAMB", "Lamb", "LARS", "Lars")


def _weight_averaging() -> tuple[type, ...]:
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # lightning < 2.6
        return ()
    return (WeightAveraging,)


def _is_averaging(callback: Callback) -> bool:
    return isinstance(callback, (StochasticWeightAveraging, *_weight_averaging()))


def averaged_models(trainer: Trainer) -> list[nn.Module]:
    """The copies of the model that weight-averaging callbacks keep (a ``WeightAveraging``'s ``AveragedModel``
    module; ``StochasticWeightAveraging``'s LightningModule copy)."""
    found = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        average: Any = getattr(callback, "_average_model", None)
        if isinstance(callback, StochasticWeightAveraging) and isinstance(average, nn.Module):
            found.append(average)
        elif isinstance(callback, _weight_averaging()) and isinstance(getattr(average, "module", None), nn.Module):
            found.append(average.module)
    return found


def run_after_weight_averaging(trainer: Trainer, callback: Callback) -> None:
    """Move ``callback`` right after the last weight-averaging callback in ``trainer.callbacks`` (checkpoints stay
    last).

    They copy their average back over the model at the end of fit, which must happen before the pruning is made
    permanent; Lightning calls callbacks in list order, and users cannot be expected to know which order is right
    (Lightning moves checkpoint callbacks last for the same reason). The list is replaced, not changed in place, so a
    hook being dispatched over the old list finishes unchanged.
    """
    callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
    averaging = [i for i, c in enumerate(callbacks) if _is_averaging(c)]
    if not averaging or callbacks.index(callback) > averaging[-1]:
        return
    callbacks.remove(callback)
    callbacks.insert(averaging[-1], callback)
    trainer.callbacks = callbacks  # type: ignore[attr-defined]


def refuse_averaged_bool_buffers(trainer: Trainer) -> None:
    """A ``WeightAveraging`` that averages buffers with torch's running mean fails on boolean masks mid-fit."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, _weight_averaging()) or not getattr(callback, "_use_buffers", False):
            continue
        from lightning.pytorch.callbacks import EMAWeightAveraging  # exists where WeightAveraging does (2.6)

        if isinstance(callback, EMAWeightAveraging):  # its update takes boolean buffers
            continue
        raise ValueError(
            f"{type(callback).__name__} averages buffers, and the masks are boolean buffers torch's running mean "
            "cannot average: pass PruningCallback(mask_dtype=None) (masks in the parameters' dtype, which average to "
            f"themselves) or {type(callback).__name__}(use_buffers=False)"
        )


def refuse_other_pruning(trainer: Trainer) -> None:
    """Lightning's ModelPruning on the same Trainer would reparametrize the same weights: refuse, naming it."""
    foreign = [type(c).__name__ for c in trainer.callbacks if isinstance(c, ModelPruning)]  # type: ignore[attr-defined]
    if foreign:
        raise ValueError(
            f"PruningCallback cannot share a Trainer with lightning's {foreign[0]}: both would reparametrize the same "
            "weights. Use one pruning callback (PruningCallback covers ModelPruning's methods and schedules)."
        )


def mask_after_optimizer_steps(trainer: Trainer, pl_module: Any, mask: Any) -> list[Any]:
    """In place masking: call ``mask()`` right after every step of the Trainer's optimizers; returns the handles.

    LBFGS re-evaluates its closure between updates inside one step, on weights the masks cannot reach: refused.
    Optimizers whose update reads a whole tensor (Adafactor's relative step size uses the weights' RMS) and manual
    optimization (several steps or closures per batch are the user's) work, but are not bit for bit the
    reparametrized mode: warned.
    """
    from lightning.pytorch.utilities import rank_zero_warn
    from torch.optim import LBFGS, Adafactor

    optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
    refused = [type(o).__name__ for o in optimizers if isinstance(o, LBFGS)]
    if refused:
        raise ValueError(
            f"PruningCallback(masking='inplace') cannot mask inside {refused[0]}'s step, which re-evaluates its "
            "closure on the updated weights: use masking='reparametrize'"
        )
    whole = [type(o).__name__ for o in optimizers if isinstance(o, Adafactor) or type(o).__name__ in _THIRD_PARTY_WHOLE]
    if whole:
        rank_zero_warn(
            f"PruningCallback(masking='inplace') with {whole[0]}: its update reads whole tensors (norms), which hold "
            "zeros where pruned here and stale values under masking='reparametrize': the two modes differ",
            category=UserWarning,
        )
    if not pl_module.automatic_optimization:
        rank_zero_warn(
            "PruningCallback(masking='inplace') under manual optimization: weights are zeroed after every "
            "optimizer.step() and gradients as they are accumulated; closures evaluated inside a step see the "
            "weights as that step left them",
            category=UserWarning,
        )
    return [optimizer.register_step_post_hook(lambda *args, **kwargs: mask()) for optimizer in optimizers]


def spawned(trainer: Trainer) -> bool:
    """Whether this fit runs in processes spawned or forked by Lightning (``ddp_spawn``, ``ddp_fork``, notebooks)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


def scaler_skips_step(trainer: Trainer, optimizer: Any) -> bool:
    """Whether the gradient scaler of a float16 mixed-precision fit will skip this step of ``optimizer``: one of its
    gradients is not finite. Read in ``on_before_optimizer_step``, where Lightning has unscaled them and the scaler
    decided the same way, before in-place masking zeroes the pruned entries; ``False`` without an enabled scaler
    (float32, bfloat16).

    Example:
        >>> from types import SimpleNamespace
        >>> weight = nn.Parameter(torch.ones(2))
        >>> weight.grad = torch.tensor([1.0, float("inf")])
        >>> optimizer = torch.optim.SGD([weight], lr=0.1)
        >>> scaler = SimpleNamespace(is_enabled=lambda: True)
        >>> scaler_skips_step(SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler)), optimizer)
        True
        >>> scaler_skips_step(SimpleNamespace(precision_plugin=SimpleNamespace()), optimizer)
        False
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return False
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return bool(grads) and not bool(torch.stack([torch.isfinite(grad).all() for grad in grads]).all())


def warn_moves_after_last_average(trainer: Trainer, title: str, regrow: str | None, until: float) -> None:
    """Dynamic sparse training beside ``StochasticWeightAveraging``, which averages when an epoch starts and copies
    its average back at the end: a weight regrown after its last average is zero there, and so in the model
    returned. Warn when the moves (``regrow_until``, a fraction of the run) go on past that average."""
    from lightning.pytorch.utilities import rank_zero_warn

    from lightprune.callback import clock

    epochs = clock.run_length(trainer, "epoch")
    swa = [c for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]  # type: ignore[attr-defined]
    if regrow is None or not swa or epochs is None or not 0 < epochs < float("inf"):
        return
    last_average = swa[0].swa_end  # when that epoch starts
    if until > last_average / epochs:
        rank_zero_warn(
            f"{title}: regrow={regrow!r} moves masks until regrow_until={until} of the run, but "
            f"StochasticWeightAveraging averages for the last time when epoch {last_average} starts and copies its "
            "average back at the end: weights regrown after that are zero in the model returned. Set "
            f"regrow_until <= {last_average / epochs:.4g}",
            category=UserWarning,
        )
