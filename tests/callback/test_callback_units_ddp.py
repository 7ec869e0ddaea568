"""``PruningCallback(method="neurons" | "heads")`` under DDP (gloo, 2 CPU processes): identical masks on every rank.

Each rank trains on its own shard; the activation moments (with ``X^T X`` for the refit) and the movement scores
are summed across the ranks, so both rank the same units after every event and refit the same weights.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from processes import run_script

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import atexit
    import sys
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightprune.callback import PruningCallback
    from lightprune.schedules import Linear

    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())


    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                                 num_key_value_heads=4, intermediate_size=24)
            self.model = LlamaForCausalLM(config)

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits

        def training_step(self, batch, batch_idx):
            return self(batch[0]).logsumexp(-1).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            ids = torch.randint(0, 64, (64, 6), generator=torch.Generator().manual_seed(1))
            return DataLoader(TensorDataset(ids), batch_size=4)


    class Dump(Callback):
        def __init__(self):
            self.masks, self.inputs = {}, []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.inputs.append(batch[0].clone())

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.masks[trainer.global_step] = {
                key: value.clone() for key, value in pl_module.named_buffers() if key.endswith("_mask")
            }

        def on_train_end(self, trainer, pl_module):
            torch.save({"masks": self.masks, "inputs": self.inputs, "state": pl_module.state_dict()},
                       out / f"rank{trainer.global_rank}.pt")


    callbacks = [
        PruningCallback(Linear(final=0.5, start=2, end=6, frequency=2), method="heads", importance="activation",
                        reconstruct=True, activation_window=2, make_permanent=False, name="heads"),
        PruningCallback(Linear(final=0.5, start=3, end=7, frequency=2), method="neurons", importance="movement",
                        scope="global", make_permanent=False, name="neurons"),
    ]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=8, callbacks=[*callbacks, Dump()],
                        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Lit())
    """
)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_ddp_ranks_prune_and_refit_the_same_units(tmp_path: Path) -> None:
    script = tmp_path / "ddp_units.py"
    script.write_text(SCRIPT)
    run_script(script, str(tmp_path), timeout=400)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert not torch.equal(torch.stack(ranks[0]["inputs"]), torch.stack(ranks[1]["inputs"]))  # own shards
    assert sorted(ranks[0]["masks"]) == sorted(ranks[1]["masks"]) == list(range(1, 9))
    for step, masks in ranks[0]["masks"].items():
        assert list(masks) == list(ranks[1]["masks"][step])
        for key, mask in masks.items():
            assert torch.equal(mask, ranks[1]["masks"][step][key]), (step, key)
    for key, value in ranks[0]["state"].items():  # the refit wrote the same weights on both ranks
        assert torch.equal(value, ranks[1]["state"][key]), key
    final = ranks[0]["masks"][8]
    k_rows = [final[f"model.model.layers.{i}.self_attn.k_proj.weight_mask"].any(1) for i in (0, 1)]
    assert [int(rows.sum()) for rows in k_rows] == [2 * 4, 2 * 4]  # 2 of 4 key/value heads of head_dim 4 kept
    down = [final[f"model.model.layers.{i}.mlp.down_proj.weight_mask"].any(0) for i in (0, 1)]
    assert sum(int(columns.sum()) for columns in down) == 24  # global: half of the 48 neurons kept
