"""What the callback tells the user: sparsities for the loggers, a table at the end of fit, an unfinished schedule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightprune.metrics import SparsityCollection

__all__ = ["sparsities", "summary_table", "warn_batch_past_epoch_end", "warn_unfinished"]


def sparsities(masks: Mapping[str, Tensor], prefix: str, device: torch.device) -> dict[str, float]:
    """Per-tensor and total sparsity of ``masks`` (qualified name -> mask), reduced across DDP ranks by torchmetrics.

    Example:
        >>> sparsities({"fc.weight": torch.tensor([True, False])}, "pruning/sparsity/", torch.device("cpu"))
        {'pruning/sparsity/fc.weight': 0.5, 'pruning/sparsity/total': 0.5}
    """
    metric = SparsityCollection(list(masks), prefix=prefix).to(device)
    metric.update(dict(masks))
    return {key: float(value) for key, value in metric.compute().items()}


def summary_table(title: str, unit: str, rows: Sequence[tuple[str, Sequence[int], int, int]]) -> str:
    """A table of ``(parameter, shape, units, pruned units)`` rows and their total, as ModelSummary prints one.

    A tensor with every unit pruned (layer collapse) is marked ``COLLAPSED``, and a note under the table says what
    that means.

    Example:
        >>> print(summary_table("pruned", "weights", [("fc.weight", (2, 3), 6, 3)]))
        pruned
        parameter  shape  kept / total weights  sparsity
        ------------------------------------------------
        fc.weight  2x3                   3 / 6    50.00%
        ------------------------------------------------
        total                            3 / 6    50.00%
        >>> print(summary_table("pruned", "weights", [("net.0.weight", (4, 2), 8, 4), ("net.2.weight", (1, 4), 4, 4)]))
        pruned
        parameter     shape  kept / total weights  sparsity
        --------------------------------------------------------------
        net.0.weight  4x2                   4 / 8    50.00%
        net.2.weight  1x4                   0 / 4   100.00%  COLLAPSED
        --------------------------------------------------------------
        total                              4 / 12    66.67%
        COLLAPSED: no weights left (layer collapse): the layer computes nothing from its input; see max_layer_sparsity
    """
    table = [("parameter", "shape", f"kept / total {unit}", "sparsity", "")]
    kept_all = total_all = 0
    collapsed = False
    for qualified, shape, units, pruned in rows:
        kept_all, total_all = kept_all + units - pruned, total_all + units
        size = "x".join(str(s) for s in shape)
        mark = "COLLAPSED" if 0 < units == pruned else ""
        collapsed = collapsed or bool(mark)
        table.append((qualified, size, f"{units - pruned:,} / {units:,}", f"{pruned / max(units, 1):.2%}", mark))
    table.append(("total", "", f"{kept_all:,} / {total_all:,}", f"{1 - kept_all / max(total_all, 1):.2%}", ""))
    columns = 5 if collapsed else 4
    widths = [max(len(row[i]) for row in table) for i in range(columns)]
    lines = []
    for row in table:
        padded = zip(row[:columns], widths, strict=True)
        cells = [cell.ljust(width) if i in (0, 1, 4) else cell.rjust(width) for i, (cell, width) in enumerate(padded)]
        lines.append("  ".join(cells).rstrip())
    width = max(len(line) for line in lines)
    lines.insert(1, "-" * width)
    lines.insert(len(lines) - 1, "-" * width)
    if collapsed:
        lines.append(
            f"COLLAPSED: no {unit} left (layer collapse): the layer computes nothing from its input; see "
            "max_layer_sparsity"
        )
    return title + "\n" + "\n".join(lines)


def warn_unfinished(unit: str, now: int, last_event: int, reached: float, final: float) -> None:
    """Fit ended (EarlyStopping, max_steps, interruption) before the schedule's last event: say how far it got."""
    rank_zero_warn(
        f"PruningCallback: fit ended at {unit} {now}, before the schedule's last event at {unit} {last_event}: "
        f"sparsity reached {reached:.4f}, scheduled final sparsity {final:.4f}",
        category=UserWarning,
    )


def warn_batch_past_epoch_end(epoch: int, batch_idx: int, batches: int) -> None:
    """Lightning is about to train a batch past the end of an epoch: say that the resumed run is no longer exact.

    Lightning (2.6 and earlier) treats every run bounded by ``max_steps`` as restarting mid-epoch, so a fit resumed
    from a checkpoint written at the end of an epoch (``ModelCheckpoint`` saving in ``on_train_epoch_end``) can train
    one batch more in that epoch (``batch_idx == batches``, drawn from a new pass over the data; it does when no
    validation runs at that epoch's end) before the whole next epoch: one batch twice, the run's last batch never.
    The callback cannot change Lightning's loop; its own state was restored exactly, but later events see other
    weights.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_batch_past_epoch_end(0, 8, 8)
        >>> str(caught[0].message).split(":")[1].strip()
        "Lightning is training batch 8 of epoch 0, past the epoch's 8 batches"
    """
    rank_zero_warn(
        f"PruningCallback: Lightning is training batch {batch_idx} of epoch {epoch}, past the epoch's {batches} "
        "batches: a fit bounded by max_steps and resumed from a checkpoint written at the end of an epoch trains one "
        "extra batch there and never the run's last one (Lightning's loop, not the callback). Unless the training "
        "data is a function of the step alone, the weights from here on, and the masks of later events, differ from "
        "the uninterrupted run's. To resume exactly, write checkpoints with ModelCheckpoint(every_n_train_steps=...) "
        "or bound the run with max_epochs instead of max_steps",
        category=UserWarning,
    )


def warn_kept_zeros_under_adapters(kept: Mapping[str, int]) -> None:
    """Say which adapted base weights keep entries that are exactly zero (``{qualified name: count}``): the model is
    right, but a mask read from the base weight's zeros would drop their updates.

    Example:
        >>> warn_kept_zeros_under_adapters({})
    """
    if not kept:
        return
    named = ", ".join(f"{name} ({count})" for name, count in list(kept.items())[:3])
    rank_zero_warn(
        f"PruningCallback: the masks keep entries whose base weight is exactly 0 under a LoRA adapter: {named}. "
        "Their effective weight is the update alone, which an adapter saved with save_pretrained (or a checkpoint "
        "loaded without this callback) cannot restore: merge_lora(remask=True) masks by the base weight's zeros and "
        "drops it. Merge before saving (merge_lora(model)), or fit with adopt_zeros=True so those zeros stay pruned",
        category=UserWarning,
    )
