"""``PruningCallback`` under ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, gloo, 2 and 3 CPU processes).

The fits run in a script launched with ``subprocess``; Lightning starts the other ranks by re-running it. Every rank
sees the same batches (drawn from the optimizer step), so a layer left unsharded stays the same on every rank
and the model is one model. After every batch a callback gathers the full weights (before the pruning callback runs
and after) and the masks (after), on rank 0 only for the record: the test then checks, in this process, that

* every event's masks are those of ``lightprune.prune`` run in one process on the gathered weights (global L1 through
  ``global_unstructured``, layerwise L1, structured Ln along dim 0 and along dim 1), bit for bit;
* pruned entries stay exactly zero while training goes on, and the final sparsity is exact;
* a fit resumed from a distributed (sharded) checkpoint ends bit-identical to the uninterrupted fit, masks included;
* a consolidated checkpoint holds plain pruned weights that load strictly into an unsharded model.

Layers have 13, 10 and 4 output rows: uneven shards for 2 and 3 ranks. The unsharded layer is pruned too.
"""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lightprune import prune
from processes import run_script

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from lightprune.callback import PruningCallback
    from lightprune.prune.distributed import is_sharded
    from lightprune.schedules import Linear

    out, world, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    # Lightning destroys NCCL groups at exit, not gloo ones, which sometimes abort a rank in finalization
    import atexit
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())


    class Net(L.LightningModule):
        def __init__(self, dtype):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 10), nn.ReLU(), nn.Linear(10, 4)
            ).to(dtype)

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)  # net[4] stays a plain, unsharded layer

        def training_step(self, batch, batch_idx):
            # the data is a function of the optimizer step: a resumed fit sees what the uninterrupted one saw, even
            # where Lightning's loops replay a batch of the loader after restoring an epoch-end checkpoint
            generator = torch.Generator().manual_seed(1000 + self.trainer.global_step)
            x, y = torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            return nn.functional.cross_entropy(self.net(x.to(self.net[0].weight.dtype)).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(1)
            x, y = torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)
            return DataLoader(TensorDataset(x, y), batch_size=8)  # 4 steps per epoch


    def full(t):
        return t.full_tensor() if is_sharded(t) else t.detach().clone()


    def weights(module):
        return {k: full(v) for k, v in module.named_parameters()}


    class Record(Callback):
        def __init__(self, pruning, before):
            self.pruning, self.before, self.steps = pruning, before, {}

        def on_train_batch_end(self, trainer, pl_module, *args):
            entry = self.steps.setdefault(trainer.global_step, {})
            if self.before:
                entry["before"] = weights(pl_module)
            else:
                entry["after"] = weights(pl_module)
                entry["masks"] = {k: full(v) for k, v in self.pruning._masked.masks().items()}


    def fit(name, dtype, callback_kwargs, max_steps, ckpt_dir=None, ckpt_path=None, distributed_ckpt=True, log=False):
        pruning = PruningCallback(
            Linear(final=0.7, start=0, end=6, frequency=2),
            include=r"net\\.[024]\\.weight",
            masking="inplace",
            **callback_kwargs,
        )
        before, after = Record(pruning, True), Record(pruning, False)
        callbacks = [before, pruning, after]
        if ckpt_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ModelParallelStrategy(
                data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=distributed_ckpt
            ),
            max_steps=max_steps,
            callbacks=callbacks,
            logger=CSVLogger(out, name=name, version=0) if log else False,
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=ckpt_dir is not None,
            use_distributed_sampler=False,
        )
        model = Net(dtype)
        trainer.fit(model, ckpt_path=ckpt_path)
        final = {"weights": weights(model), "masks": {k: full(v) for k, v in pruning._masked.masks().items()}}
        if trainer.global_rank == 0:
            steps = {s: {**before.steps.get(s, {}), **after.steps.get(s, {})} for s in after.steps}
            torch.save({"steps": steps, "final": final}, out / f"{name}.pt")
        return trainer, model


    if "global" in cases:
        fit("global", torch.float32, {}, 8, ckpt_dir=out / "ckpt", log=True)
        fit("resumed", torch.float32, {}, 8, ckpt_path=out / "ckpt" / "epoch=0-step=4.ckpt")
    if "capped" in cases:  # layers held at max_layer_sparsity, the total exact; and resumed
        fit("capped", torch.float32, {"max_layer_sparsity": 0.72}, 8, ckpt_dir=out / "ckpt_capped")
        fit("capped_resumed", torch.float32, {"max_layer_sparsity": 0.72}, 8,
            ckpt_path=out / "ckpt_capped" / "epoch=0-step=4.ckpt")
    if "layerwise" in cases:
        fit("layerwise", torch.bfloat16, {"scope": "layerwise"}, 6)
    if "structured" in cases:
        for dim in (0, 1):
            kwargs = {
                "method": "ln_structured",
                "method_kwargs": {"n": 2, "dim": dim},
                "scope": "layerwise",
                "prune_channel_bias": dim == 0,
            }
            fit(f"structured{dim}", torch.float32, kwargs, 6)
    if "random" in cases:
        fit("random", torch.float32, {"method": "random_unstructured", "seed": 5}, 6)
    if "consolidated" in cases:
        trainer, model = fit("consolidated", torch.float32, {}, 6, distributed_ckpt=False)
        trainer.save_checkpoint(out / "consolidated.ckpt")
        fit("from_consolidated", torch.float32, {}, 8, ckpt_path=out / "consolidated.ckpt", distributed_ckpt=False)
    """
)


def run(tmp_path: Path, world: int, cases: str) -> None:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    run_script(script, str(tmp_path), str(world), cases, timeout=400)


NAMES = ("net.0.weight", "net.2.weight", "net.4.weight")
CAP = 0.72  # the "capped" case's max_layer_sparsity


def reference_masks(
    before: dict[str, torch.Tensor],
    previous: dict[str, torch.Tensor] | None,
    increments: dict[str, int],
    how: str,
    step: int = 0,
) -> dict[str, torch.Tensor]:
    """The masks one process computes from the gathered weights and the previous masks."""
    modules = {}
    for key in NAMES:
        m = nn.Module()
        m.weight = nn.Parameter(before[key].clone())
        with prune.mask_dtype(torch.bool):
            if previous is not None:
                prune.custom_from_mask(m, "weight", previous[key])
        modules[key] = m
    with prune.mask_dtype(torch.bool):
        if how in ("global", "random", "capped"):
            total = sum(increments.values())
            method = prune.L1Unstructured
            if how == "random":  # the callback draws from (seed, event): seed 5, the event's step
                method = prune.RandomUnstructured
                torch.manual_seed((5 * 1_000_003 + step) % (2**63))
            cap = CAP if how == "capped" else 1.0
            pairs = [(modules[k], "weight") for k in NAMES]
            prune.global_unstructured(pairs, method, amount=total, max_layer_sparsity=cap)
        else:
            for key in NAMES:
                if increments[key] <= 0:
                    prune.identity(modules[key], "weight") if previous is None else None
                    continue
                if how == "layerwise":
                    prune.l1_unstructured(modules[key], "weight", amount=increments[key])
                else:
                    dim = int(how[-1])
                    prune.ln_structured(modules[key], "weight", amount=increments[key], n=2, dim=dim)
    return {k: modules[k].weight_mask.bool() for k in NAMES}


def pruned_units(mask: torch.Tensor, how: str) -> int:
    if not how.startswith("structured"):
        return int((~mask).sum())
    dim = int(how[-1])
    other = [d for d in range(mask.dim()) if d != dim]
    return int((torch.count_nonzero(mask, dim=other) == 0).sum())


def units(mask: torch.Tensor, how: str) -> int:
    return mask.numel() if not how.startswith("structured") else mask.shape[int(how[-1])]


def check_events(record: dict, how: str) -> int:
    """Every event against one process; masked entries stay zero; returns the number of events checked."""
    steps = record["steps"]
    previous = None
    events = 0
    for step in sorted(steps):
        entry = steps[step]
        # before the first event a tensor has no mask yet: all kept
        masks = {k: entry["masks"].get(k, torch.ones_like(entry["after"][k], dtype=torch.bool)) for k in NAMES}
        if not entry["masks"]:
            previous = None if previous is None else previous
            if previous is None:
                continue
        if previous is not None:  # training since the last step kept pruned entries at exactly zero
            for key in NAMES:
                assert not entry["before"][key][~previous[key]].any(), (how, step, key)
        changed = previous is None or any(not torch.equal(masks[k], previous[k]) for k in NAMES)
        if changed:
            increments = {
                k: pruned_units(masks[k], how) - (0 if previous is None else pruned_units(previous[k], how))
                for k in NAMES
            }
            want = reference_masks(entry["before"], previous, increments, how, step)
            for key in NAMES:
                assert torch.equal(masks[key], want[key]), (how, step, key)
            events += 1
        for key in NAMES:  # after the event the weights are zero where pruned
            assert not entry["after"][key][~masks[key]].any(), (how, step, key)
        previous = masks
    final = {key: record["final"]["masks"][key] for key in NAMES}  # the weights' (biases follow them)
    if how in ("global", "random", "capped"):
        total = sum(m.numel() for m in final.values())
        assert sum(pruned_units(m, how) for m in final.values()) == round(0.7 * total)
        if how == "capped":
            assert all(pruned_units(m, how) / m.numel() <= CAP for m in final.values())
    else:
        for mask in final.values():
            assert pruned_units(mask, how) == round(0.7 * units(mask, how))
    return events


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_global_resume_layerwise_bf16_consolidated_and_capped(tmp_path: Path) -> None:
    """One launch of two processes for every two-rank case (the capped one: below)."""
    run(tmp_path, 2, "global,layerwise,consolidated,capped")
    check_capped_and_resumed(tmp_path)
    record = torch.load(tmp_path / "global.pt", weights_only=False)
    assert check_events(record, "global") == 3  # steps 2, 4 and 6 (step 0 prunes nothing)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    for key, value in record["final"]["weights"].items():
        assert torch.equal(value, resumed["final"]["weights"][key]), key
    for key, value in record["final"]["masks"].items():
        assert torch.equal(value, resumed["final"]["masks"][key]), key
    assert min(resumed["steps"]) == 5  # it did resume after step 4

    # rank 0 logged the sparsities reduced over the shards: the exact counts of the gathered masks
    with open(tmp_path / "global" / "version_0" / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row.get("pruning/sparsity/total")]
    compared = 0
    for row in rows:
        masks = record["steps"][int(row["step"])]["masks"] if int(row["step"]) in record["steps"] else None
        if not masks:
            continue
        compared += 1
        total = sum(m.numel() for m in masks.values())
        assert float(row["pruning/sparsity/total"]) == pytest.approx(
            sum(int((~m).sum()) for m in masks.values()) / total
        )
        for key, mask in masks.items():
            assert float(row[f"pruning/sparsity/{key}"]) == pytest.approx(int((~mask).sum()) / mask.numel())
    assert compared >= 3  # logged at the events of steps 2, 4 and 6

    layerwise = torch.load(tmp_path / "layerwise.pt", weights_only=False)
    assert next(iter(layerwise["final"]["weights"].values())).dtype == torch.bfloat16
    assert check_events(layerwise, "layerwise") == 3

    checkpoint = torch.load(tmp_path / "consolidated.ckpt", weights_only=False)
    plain = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 10), nn.ReLU(), nn.Linear(10, 4))
    plain.load_state_dict({k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()}, strict=True)
    consolidated = torch.load(tmp_path / "consolidated.pt", weights_only=False)["final"]
    for key in NAMES:
        weight = plain.get_submodule(key.removeprefix("net.").removesuffix(".weight")).weight
        assert torch.equal(weight, consolidated["weights"][key]), key
        assert not weight[~consolidated["masks"][key]].any()
    (state,) = [s for k, s in checkpoint["callbacks"].items() if k.startswith("PruningCallback")]
    for key in NAMES:
        assert torch.equal(state["masks"][key], consolidated["masks"][key]), key  # full masks, gathered
    # resuming from it puts each rank's rows of the full masks back: training goes on with the same masks
    resumed = torch.load(tmp_path / "from_consolidated.pt", weights_only=False)
    assert sorted(resumed["steps"]) == [7, 8]
    for step in (7, 8):
        for key in NAMES:
            assert torch.equal(resumed["steps"][step]["masks"][key], consolidated["masks"][key]), (step, key)
            assert not resumed["steps"][step]["before"][key][~consolidated["masks"][key]].any(), (step, key)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_three_ranks_structured_along_dim_0_and_dim_1_and_random(tmp_path: Path) -> None:
    run(tmp_path, 3, "structured,random")
    assert check_events(torch.load(tmp_path / "random.pt", weights_only=False), "random") == 3
    for dim in (0, 1):
        record = torch.load(tmp_path / f"structured{dim}.pt", weights_only=False)
        assert check_events(record, f"structured{dim}") == 3
        if dim == 0:  # the biases of the pruned output channels are zero too
            final = record["final"]
            for key in NAMES:
                dead = torch.count_nonzero(final["masks"][key], dim=1) == 0
                assert dead.any()
                assert not final["weights"][key.replace("weight", "bias")][dead].any(), key


def test_sharded_selections_refuse_what_they_cannot_prune_exactly(tmp_path: Path) -> None:
    dist = pytest.importorskip("torch.distributed")
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightprune.callback.setup_checks import check_sharded, refuse_sharded_units

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = nn.Linear(4, 3)
        mesh = init_device_mesh("cpu", (1,))
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        selection = [("fc.weight", layer, "weight")]
        parallel = ModelParallelStrategy()
        check_sharded(selection, parallel, prune.L1Unstructured, None)  # supported
        check_sharded(selection, type("Mine", (ModelParallelStrategy,), {})(), prune.L1Unstructured, None)  # a subclass
        with pytest.raises(ValueError, match=r"outside ModelParallelStrategy \(got DDPStrategy\).*'fc\.weight'"):
            check_sharded(selection, DDPStrategy(), prune.L1Unstructured, None)
        with pytest.raises(ValueError, match=r"built-in methods.*got Identity for \['fc\.weight'\]"):
            check_sharded(selection, parallel, prune.Identity, None)
        with pytest.raises(
            ValueError, match=r"does not rewind sharded \(DTensor\) parameters yet \(\['fc\.weight'\] are"
        ):
            check_sharded(selection, parallel, prune.L1Unstructured, 0)  # (rewind='init', resolved to step 0)
        head = nn.Linear(3, 4, bias=False)
        head.weight = layer.weight  # tied
        owners = {id(layer.weight): [("fc.weight", layer, "weight"), ("head.weight", head, "weight")]}
        with pytest.raises(ValueError, match=r"tied weights among sharded .*: fc\.weight is also head\.weight"):
            check_sharded(selection, parallel, prune.L1Unstructured, None, owners)
        rows = nn.Linear(4, 3)  # tensor parallelism's row-wise layout: its input dim sharded
        rows.weight = nn.Parameter(distribute_tensor(rows.weight.detach(), mesh, [Shard(1)]))
        with pytest.raises(ValueError, match=r"cannot prune fc2\.weight: .*placed Shard\(0\).*got S\(1\)"):
            check_sharded([*selection, ("fc2.weight", rows, "weight")], parallel, prune.L1Unstructured, None)
        with pytest.raises(ValueError, match=r"method='neurons' does not support models sharded .*such as weight"):
            refuse_sharded_units(layer, "neurons")
        refuse_sharded_units(layer, None)
    finally:
        dist.destroy_process_group()


def check_capped_and_resumed(tmp_path: Path) -> None:
    """FSDP2: every capped event is the one-process capped selection, bit for bit; resuming gives the same end."""
    record = torch.load(tmp_path / "capped.pt", weights_only=False)
    assert check_events(record, "capped") == 3
    final = record["final"]["masks"]
    assert any(int((~m).sum()) == int(CAP * m.numel()) for m in final.values())  # a layer held at its cap
    resumed = torch.load(tmp_path / "capped_resumed.pt", weights_only=False)
    for key, value in final.items():
        assert torch.equal(value, resumed["final"]["masks"][key]), key
    assert min(resumed["steps"]) == 5
