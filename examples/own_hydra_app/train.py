"""A user's own Hydra training script that composes lightprune's pruning presets instead of copying their YAML.

``conf/config.yaml`` names ``pruning: gmp_cubic`` in its defaults list: Hydra finds lightprune's config groups
through the searchpath plugin installed with lightprune, after this app's own configs. ``instantiate(cfg.pruning)``
returns a ``PruningCallback`` for this script's own Trainer; the rest is the user's code.

Run::

    python train.py                                   # gradual cubic pruning to 90%
    python train.py pruning=one_shot pruning.final_sparsity=0.8
    python train.py epochs=1 hydra.run.dir=/tmp/run   # a few seconds, for tests
"""

import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from torch import nn


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg) -> None:
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(cfg.seed))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :4].argmax(1)), batch_size=64)
    model = Net()
    trainer = pl.Trainer(max_epochs=cfg.epochs, callbacks=[instantiate(cfg.pruning)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    trainer.fit(model, data)
    weights = [layer.weight for layer in model.net if isinstance(layer, nn.Linear)]
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    print(f"final sparsity: {zeros:.4f}")


if __name__ == "__main__":
    main()
