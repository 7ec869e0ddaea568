"""``PruningCallback`` under DDP (gloo, 2 CPU processes): every rank holds the same masks after every event.

The fit runs in a script launched with ``subprocess`` and ``strategy="ddp"``, so Lightning starts the second rank the
way it does in real use (it re-runs the script with ``LOCAL_RANK=1``). Each rank gets its own shard of the data and
its own global RNG seed, re-seeded before every batch end; the masks must still agree on every rank after every
event: magnitude masks because DDP keeps the weights identical, random masks because the callback draws them from
its own ``(seed, event)`` and not from the global generator.
"""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

import pytest
import torch

from processes import run_script

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightprune.callback import PruningCallback
    from lightprune.schedules import Geometric, Linear

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    # Lightning destroys NCCL groups at exit, not gloo ones, which sometimes abort a rank in finalization
    import atexit
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(1)
            x, y = torch.randn(128, 8, generator=generator), torch.randint(0, 4, (128,), generator=generator)
            return DataLoader(TensorDataset(x, y), batch_size=8)


    class PerRankSeed(Callback):
        # runs before the pruning callbacks: every rank's global RNG differs at every event
        def setup(self, trainer, pl_module, stage):
            torch.manual_seed(trainer.global_rank)

        def on_train_batch_end(self, trainer, pl_module, *args):
            torch.manual_seed(1000 * trainer.global_rank + trainer.global_step)


    class Dump(Callback):
        # runs after the pruning callbacks: the masks after every batch, the data seen, the final state
        def __init__(self, folder):
            self.folder, self.masks, self.first_inputs = folder, {}, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.first_inputs.append(batch[0][0].clone())

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.masks[trainer.global_step] = {
                key: value.clone() for key, value in pl_module.named_buffers() if key.endswith("_mask")
            }

        def on_train_end(self, trainer, pl_module):
            torch.save(
                {"masks": self.masks, "inputs": self.first_inputs, "state": pl_module.state_dict()},
                self.folder / f"rank{trainer.global_rank}.pt",
            )


    def callbacks_of(variant):
        if variant == "criteria":  # activation (per row) and movement scores, summed across the ranks
            return [
                PruningCallback(
                    Linear(final=0.6, start=2, end=10, frequency=4), importance="activation", activation_window=2,
                    scope="row", include=r"net\\.[02]\\.weight", make_permanent=False, name="wanda",
                ),
                PruningCallback(
                    Linear(final=0.5, start=3, end=11, frequency=4), importance="movement", include=r"net\\.4\\.weight",
                    make_permanent=False, name="movement",
                ),
            ]
        if variant == "obs":  # OBS: H summed across the ranks, reconstruction from it; gradual rows and one-shot N:M
            return [
                PruningCallback(
                    Linear(final=0.6, start=2, end=10, frequency=4), importance="obs", activation_window=2,
                    scope="row", include=r"net\\.[02]\\.weight", make_permanent=False, name="obs",
                ),
                PruningCallback(
                    0.5, method="semi_structured", importance="obs", calibration_batches=2, include=r"net\\.4\\.weight",
                    make_permanent=False, name="obs_nm",
                ),
            ]
        if variant == "dynamic":  # OWL's allocation with SET's random regrowth; RigL's dense gradients
            return [
                PruningCallback(
                    Linear(final=0.6, start=2, end=6, frequency=4), scope="owl", importance="activation",
                    owl_threshold=2.0, include=r"net\\.[02]\\.weight", regrow="set", regrow_every=2, regrow_until=0.9,
                    make_permanent=False,
                ),
                PruningCallback(
                    0.5, include=r"net\\.4\\.weight", regrow="rigl", regrow_every=2, regrow_until=0.9,
                    make_permanent=False, name="rigl",
                ),
            ]
        return [  # magnitude (global) and random draws
            PruningCallback(
                Linear(final=0.6, start=0, end=12, frequency=3), include=r"net\\.[02]\\.weight", make_permanent=False,
                max_layer_sparsity=0.62,
            ),
            PruningCallback(
                Geometric(0.3, start=1, frequency=2, rounds=6),
                method="random_unstructured",
                include=r"net\\.4\\.weight",
                parameter_names=("weight",),
                make_permanent=False,
                log_per_parameter=False,
                name="random",
            ),
        ]
    # every variant in this one launch, fit after fit (the later Trainers join the process group the first set up)
    for variant in sys.argv[2].split(","):
        folder = out / variant
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_epochs=2,
            callbacks=[PerRankSeed(), *callbacks_of(variant), Dump(folder)],
            logger=CSVLogger(folder, name="csv", version=0),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=1,
        )
        trainer.fit(Net())
    """
)


def fit_on_two_ranks(tmp_path: Path, variants: tuple[str, ...]) -> dict[str, list[dict]]:
    """Run the script's ``variants`` in one launch of two DDP ranks, fit after fit; each one's dumps by rank."""
    script = tmp_path / "ddp_fit.py"
    script.write_text(SCRIPT)
    run_script(script, str(tmp_path), ",".join(variants), timeout=420)
    return {variant: identical_masks(tmp_path / variant) for variant in variants}


def identical_masks(folder: Path) -> list[dict]:
    """The dumps of both ranks in ``folder``, checked to hold identical masks after every batch."""
    ranks = [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    # each rank trained on its own shard (else the test would prove nothing about synchronisation) ...
    assert not torch.equal(torch.stack(ranks[0]["inputs"]), torch.stack(ranks[1]["inputs"]))
    # ... yet after every batch, so after every event, the masks are identical
    steps = sorted(ranks[0]["masks"])
    assert steps == sorted(ranks[1]["masks"]) == list(range(1, 17))  # 128 samples, 2 ranks, batch 8: 8 steps/epoch
    for step in steps:
        rank0, rank1 = ranks[0]["masks"][step], ranks[1]["masks"][step]
        assert list(rank0) == list(rank1)
        for key in rank0:
            assert torch.equal(rank0[key], rank1[key]), (step, key)
    return ranks


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ddp_ranks_hold_identical_masks_after_every_event_of_every_criterion(tmp_path: Path) -> None:
    """The four set-ups below in one launch of two ranks, fit after fit (a launch starts two interpreters, each
    importing Lightning: the most part of a fit this small)."""
    ranks = fit_on_two_ranks(tmp_path, ("magnitude", "dynamic", "criteria", "obs"))
    check_magnitude_and_random(ranks["magnitude"], tmp_path / "magnitude")
    check_owl_set_and_rigl(ranks["dynamic"])
    check_activation_and_movement(ranks["criteria"])
    check_obs(ranks["obs"])


def check_magnitude_and_random(ranks: list[dict], folder: Path) -> None:
    """Global magnitude under a cap and random draws: the same masks, weights and logged sparsities on both ranks."""
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), key

    # both callbacks reached their targets to the unit
    final = ranks[0]["masks"][16]
    assert int((~final["net.0.weight_mask"]).sum() + (~final["net.2.weight_mask"]).sum()) == round(0.6 * (128 + 192))
    # ... each layer held under max_layer_sparsity=0.62 (0.62 of 128 is 79.36, of 192 is 119.04), one of them at it
    pruned = [int((~final[key]).sum()) for key in ("net.0.weight_mask", "net.2.weight_mask")]
    assert pruned[0] <= 79 and pruned[1] <= 119 and (pruned[0] == 79 or pruned[1] == 119), pruned
    assert int((~final["net.4.weight_mask"]).sum()) == round((1 - 0.7**6) * 48)
    # the random masks changed at each of their events (steps 1, 3, ..., 11), drawn afresh
    pruned = [int((~ranks[0]["masks"][step]["net.4.weight_mask"]).sum()) for step in (1, 3, 5, 7, 9, 11)]
    assert pruned == [round((1 - 0.7**k) * 48) for k in range(1, 7)]

    # the sparsities reduced across ranks are the true ones (not doubled), logged by rank 0 only
    with open(folder / "csv" / "version_0" / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("pruning/target")]
    assert rows, "nothing logged"
    for row in rows:
        assert 0.0 <= float(row["pruning/sparsity/total"]) <= 1.0
    totals = {
        int(row["step"]): float(row["pruning/sparsity/total"])
        for row in rows
        if row.get("pruning/sparsity/net.0.weight")
    }
    assert totals[12] == pytest.approx(round(0.6 * 320) / 320, abs=1e-7)


def check_owl_set_and_rigl(ranks: list[dict]) -> None:
    """SET draws from (seed, step) and RigL ranks dense gradients averaged across ranks: the moved masks agree."""
    masks = ranks[0]["masks"]
    for key, pruned in (("net.4.weight_mask", 24), ("net.0.weight_mask", None)):
        moved = [step for step in range(7, 17) if not torch.equal(masks[step][key], masks[step - 1][key])]
        assert moved and all(step % 2 == 0 for step in moved), (key, moved)  # at update steps only, and they did
        if pruned is not None:
            assert all(int((~masks[step][key].bool()).sum()) == pruned for step in range(1, 17))
    total = [int((~masks[16][key].bool()).sum()) for key in ("net.0.weight_mask", "net.2.weight_mask")]
    assert sum(total) == round(0.6 * (128 + 192))


def check_activation_and_movement(ranks: list[dict]) -> None:
    """The input statistics and movement scores are summed across ranks: every rank ranks the same scores."""
    final = ranks[0]["masks"][16]
    assert (~final["net.0.weight_mask"].bool()).sum(dim=1).tolist() == [round(0.6 * 8)] * 16
    assert int((~final["net.4.weight_mask"].bool()).sum()) == round(0.5 * 48)


def check_obs(ranks: list[dict]) -> None:
    """Every rank reconstructs from the same summed H: masks and updated weights agree to the bit."""
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), key
    final = ranks[0]["masks"][16]
    assert (~final["net.0.weight_mask"].bool()).sum(dim=1).tolist() == [round(0.6 * 8)] * 16
    assert ((final["net.4.weight_mask"].bool()).view(4, -1, 4).sum(dim=-1) == 2).all()
