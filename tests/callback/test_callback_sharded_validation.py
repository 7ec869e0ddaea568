"""``PruningCallback`` under ``ModelParallelStrategy`` with a validation loop and the root ``fully_shard``-ed.

FSDP2 leaves a root module unsharded after a forward without backward: after Lightning's validation loop the root's
own parameters (here ``net.4``; embeddings or an ``lm_head`` in real models) are full copies until the next training
backward. An epoch's event runs right after the previous epoch's validation, and the end-of-fit summary after the
last one: both must see the shards. The script (2 gloo processes) records after every training batch the zeros of the
full weights and the callback's own counts; this process checks that they agree and that the final total is exact.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from processes import run_script

SCRIPT = textwrap.dedent(
    """
    import atexit
    import json
    import sys
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from lightprune.callback import PruningCallback
    from lightprune.prune.distributed import is_sharded
    from lightprune.schedules import Linear

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())


    def full(tensor):
        return tensor.full_tensor() if is_sharded(tensor) else tensor.detach()


    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 10), nn.ReLU(), nn.Linear(10, 4))

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)
            fully_shard(self.net, mesh=mesh)  # the root: net.4's parameters are sharded through it

        def training_step(self, batch, batch_idx):
            generator = torch.Generator().manual_seed(1000 + self.trainer.global_step)
            x, y = torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            return nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(1)
            x, y = torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)
            return DataLoader(TensorDataset(x, y), batch_size=8)

        val_dataloader = train_dataloader


    class Record(Callback):
        def __init__(self, pruning):
            self.pruning, self.rows = pruning, []

        def record(self, trainer, pl_module, where):
            zeros = {
                name: int((full(p) == 0).sum()) for name, p in pl_module.named_parameters() if name.endswith("weight")
            }
            counted = [pruned for _, pruned in self.pruning._masked.counts()]  # collective on shards
            self.rows.append({"where": where, "step": trainer.global_step, "zeros": zeros, "counted": counted})

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.record(trainer, pl_module, "batch")

        def on_train_end(self, trainer, pl_module):
            self.record(trainer, pl_module, "end")


    pruning = PruningCallback(
        Linear(final=0.7, start=0, end=2, frequency=1), unit="epoch", include=r"net\\.[024]\\.weight",
        make_permanent=False,
    )
    record = Record(pruning)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=3, callbacks=[pruning, record], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
    )
    trainer.fit(Net())
    if trainer.global_rank == 0:
        (out / "record.json").write_text(json.dumps(record.rows))
    """
)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_events_after_validation_prune_the_shards_of_a_root_sharded_model(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    run_script(script, str(tmp_path), timeout=400)
    rows = json.loads((tmp_path / "record.json").read_text())
    assert [row["step"] for row in rows if row["where"] == "batch"] == list(range(1, 13))
    for row in rows:  # the weights the model trains hold exactly the zeros the callback counts, layer by layer
        zeros = [row["zeros"][name] for name in ("net.0.weight", "net.2.weight", "net.4.weight")]
        assert zeros == row["counted"], row
    assert sum(rows[-1]["zeros"].values()) == round(0.7 * (8 * 13 + 13 * 10 + 10 * 4))
