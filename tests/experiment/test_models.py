"""Tests for lightprune.experiment.models: architectures, the factory, the Lightning classifier and FLOP counts."""

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn.utils import prune as torch_prune

from lightprune.experiment.data import ClassificationDataModule, load_digits_data
from lightprune.experiment.models import (
    MODEL_NAMES,
    Classifier,
    LeNet300100,
    SmallCNN,
    dense_flops,
    flops_by_layer,
    make_model,
    nonzero_flops,
    theoretical_speedup,
)

# --------------------------------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_networks_import_without_lightning():
    """The app checks a config against the networks' parameter names before it imports Lightning."""
    import subprocess
    import sys

    code = "import sys, lightprune.experiment.models, lightprune.experiment.checks; print('lightning' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_lenet300100_parameter_counts_and_names():
    model = LeNet300100()
    weights = sum(p.numel() for name, p in model.named_parameters() if name.endswith("weight"))
    biases = sum(p.numel() for name, p in model.named_parameters() if name.endswith("bias"))
    assert (weights, biases) == (266_200, 410)
    assert [name for name, _ in model.named_parameters() if name.endswith("weight")] == [
        "fc1.weight",
        "fc2.weight",
        "fc3.weight",
    ]


@pytest.mark.parametrize("shape", [(784,), (1, 28, 28)])
def test_lenet300100_flattens_its_input(shape):
    assert LeNet300100()(torch.zeros(3, *shape)).shape == (3, 10)


def test_lenet300100_configurable_sizes():
    model = LeNet300100(in_features=64, hidden=(20, 10, 5), num_classes=4)
    assert [m.out_features for m in model.modules() if isinstance(m, nn.Linear)] == [20, 10, 5, 4]
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    assert LeNet300100(in_features=6, hidden=(), num_classes=2).fc1.in_features == 6  # logistic regression


@pytest.mark.parametrize(
    ("image_size", "channels", "kernel_size", "feature_shape"),
    [
        (8, (16, 32), 3, (32, 2, 2)),
        (28, (16, 32), 3, (32, 7, 7)),
        ((28, 20), (4, 8, 8), 5, (8, 3, 2)),
        (5, (4, 4, 4), 3, (4, 1, 1)),  # 5 -> 2 -> 1, then no more pooling
        (4, (2,), 4, (2, 2, 2)),  # even kernel: padding 2 grows 4 -> 5, pooled to 2
    ],
)
def test_small_cnn_flattened_size_matches_forward(image_size, channels, kernel_size, feature_shape):
    model = SmallCNN(in_channels=2, image_size=image_size, channels=channels, num_classes=7, kernel_size=kernel_size)
    assert model.feature_shape == feature_shape
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    x = torch.zeros(3, 2, h, w)
    features = x
    for name, module in model.named_children():
        if name == "flatten":
            break
        features = module(features)
    assert tuple(features.shape[1:]) == feature_shape
    assert model(x).shape == (3, 7)


def test_small_cnn_layer_names_and_errors():
    model = SmallCNN(image_size=8)
    assert [name for name, _ in model.named_children()] == [
        "conv1",
        "relu1",
        "pool1",
        "conv2",
        "relu2",
        "pool2",
        "flatten",
        "fc",
    ]
    with pytest.raises(ValueError, match="at least one"):
        SmallCNN(channels=())
    with pytest.raises(ValueError, match="too small"):
        SmallCNN(image_size=0)


def test_make_model_sizes_from_data():
    lenet = make_model("lenet300100", (1, 8, 8), 10)
    assert isinstance(lenet, LeNet300100) and lenet.fc1.in_features == 64
    assert make_model("LeNet-300-100", (784,), 3, hidden=(30,)).fc2.out_features == 3
    cnn = make_model("small-cnn", (3, 28, 28), 5, channels=(8,))
    assert isinstance(cnn, SmallCNN) and cnn.conv1.in_channels == 3 and cnn.feature_shape == (8, 14, 14)


def test_make_model_errors():
    with pytest.raises(ValueError) as info:
        make_model("vgg16", (1, 8, 8), 10)
    assert all(name in str(info.value) for name in MODEL_NAMES)
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        make_model("small_cnn", (64,), 10)


# --------------------------------------------------------------------------------------------------------------------
# Classifier
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls"), [("adam", torch.optim.Adam), ("ADAMW", torch.optim.AdamW), ("sgd", torch.optim.SGD)]
)
def test_classifier_optimizers(name, cls):
    module = Classifier(LeNet300100(4, (3,), 2), lr=0.05, optimizer=name, weight_decay=1e-4, momentum=0.5)
    optimizer = module.configure_optimizers()
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.05 and group["weight_decay"] == 1e-4
    assert len(group["params"]) == 4
    if cls is torch.optim.SGD:
        assert group["momentum"] == 0.5


def test_classifier_hparams_and_errors():
    module = Classifier(SmallCNN(image_size=8, num_classes=6))
    assert "model" not in module.hparams
    assert module.hparams.num_classes == 6 and module.hparams.optimizer == "adam"
    with pytest.raises(ValueError, match="unknown optimizer"):
        Classifier(LeNet300100(), optimizer="lbfgs")
    with pytest.raises(ValueError, match="num_classes"):
        Classifier(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()))
    assert Classifier(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()), num_classes=3).hparams.num_classes == 3


@pytest.mark.usefixtures("one_thread")
def test_classifier_trains_and_logs_the_documented_keys(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(96, 1, 4, 4)
    y = (x.flatten(1).sum(1) > 0).long()  # learnable
    dm = ClassificationDataModule.from_tensors(x, y, val_size=16, test_size=16, batch_size=16)
    module = Classifier(make_model("small_cnn", dm.dims, dm.num_classes, channels=(4,)), lr=1e-2)
    logger = CSVLogger(tmp_path, name="run")
    trainer = pl.Trainer(
        max_epochs=2,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, dm)
    results = trainer.test(module, dm, verbose=False)[0]
    assert set(results) == {"test/loss", "test/acc"}
    assert 0.0 <= results["test/acc"] <= 1.0
    with open(f"{logger.log_dir}/metrics.csv", newline="") as handle:
        header = next(csv.reader(handle))
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc", "step", "epoch"):
        assert key in header, header


@pytest.mark.usefixtures("one_thread")
def test_classifier_on_digits_learns():
    pl.seed_everything(0, verbose=False)
    dm = load_digits_data(batch_size=64)
    module = Classifier(make_model("lenet300100", dm.dims, dm.num_classes, hidden=(64,)), lr=3e-3)
    trainer = pl.Trainer(
        max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(module, dm)
    assert trainer.test(module, dm, verbose=False)[0]["test/acc"] > 0.8


# --------------------------------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------------------------------


def test_linear_flops():
    assert dense_flops(nn.Linear(10, 5), (10,)) == 50
    # a Linear over a sequence uses each weight once per position
    assert dense_flops(nn.Linear(10, 5), (7, 10)) == 350
    assert dense_flops(LeNet300100(), (1, 28, 28)) == 784 * 300 + 300 * 100 + 100 * 10


def test_conv_flops_hand_computed():
    # 3x3 conv, 2 -> 3 channels, on 5x5 without padding: 3x3 outputs, 54 weights each used 9 times
    assert dense_flops(nn.Conv2d(2, 3, 3), (2, 5, 5)) == 54 * 9
    # stride 2, padding 1 on 6x6: 3x3 outputs
    assert dense_flops(nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 6, 6)) == 54 * 9
    # groups=2: each filter sees half the channels, 4 filters * 1 channel * 9 = 36 weights, 4x4 outputs (padding 1)
    assert dense_flops(nn.Conv2d(2, 4, 3, padding=1, groups=2), (2, 4, 4)) == 36 * 16
    # 1-D conv: 4 * 1 * 3 weights, 8 outputs
    assert dense_flops(nn.Conv1d(1, 4, 3), (1, 10)) == 12 * 8


def test_small_cnn_flops_per_layer_on_digits():
    model = SmallCNN(image_size=8)  # 8 -> pool 4 -> pool 2
    per_layer = flops_by_layer(model, (1, 8, 8))
    assert per_layer == {
        "conv1": (16 * 9 * 64,) * 2,
        "conv2": (32 * 16 * 9 * 16,) * 2,
        "fc": (32 * 2 * 2 * 10,) * 2,
    }
    assert dense_flops(model, (1, 8, 8)) == 9216 + 73728 + 1280


def test_nonzero_flops_with_zeroed_weights():
    model = SmallCNN(image_size=8, channels=(4, 8), num_classes=3)
    with torch.no_grad():
        model.conv1.weight[:2] = 0  # 2 of 4 filters: 18 weights, each used 8*8 times
        model.conv2.weight[:, :, 0, 0] = 0  # 8*4 weights, each used 4*4 times
        model.fc.weight[0, :5] = 0  # 5 weights, once
    dense = dense_flops(model, (1, 8, 8))
    assert dense == 36 * 64 + 288 * 16 + 96
    assert nonzero_flops(model, (1, 8, 8)) == dense - 18 * 64 - 32 * 16 - 5
    assert theoretical_speedup(model, (1, 8, 8)) == pytest.approx(dense / (dense - 18 * 64 - 32 * 16 - 5))


def test_flops_read_reparametrized_pruned_weights():
    model = LeNet300100(in_features=20, hidden=(10,), num_classes=4)
    torch_prune.l1_unstructured(model.fc1, "weight", amount=0.75)
    assert hasattr(model.fc1, "weight_orig")
    assert dense_flops(model, (20,)) == 240
    assert nonzero_flops(model, (20,)) == 50 + 40
    assert theoretical_speedup(model, (20,)) == pytest.approx(240 / 90)


def test_flops_all_zero_and_no_layers():
    model = nn.Linear(3, 2, bias=False)
    nn.init.zeros_(model.weight)
    assert nonzero_flops(model, (3,)) == 0
    assert theoretical_speedup(model, (3,)) == float("inf")
    assert flops_by_layer(nn.ReLU(), (3,)) == {}


def test_flops_restore_training_mode_and_handle_batchnorm():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    model.train()
    model[2].eval()
    assert dense_flops(model, (4,)) == 18  # BatchNorm1d on one example would fail in training mode
    assert model.training and model[1].training and not model[2].training
    assert not model[0]._forward_hooks and not model[2]._forward_hooks  # hooks removed


def test_flops_of_any_model_match_torchs_counter_and_name_what_they_attribute():
    """Attention's products belong to no weight: counted (dense in both figures) but not attributed to a layer."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightprune.experiment.models import count_flops

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
            self.layers = nn.ModuleList([nn.Linear(8, 8)])  # a container that never runs: counts go past it
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layers[0](self.attention(x, x, x, need_weights=False)[0]).mean(1))

    model = Block()
    with torch.no_grad():
        model.head.weight[:2].zero_()
    x = torch.randn(1, 5, 8)
    with FlopCounterMode(display=False) as counter:
        model(x)
    count = count_flops(model, x)
    assert 2 * count.dense == counter.get_total_flops()
    assert list(count.layers) == ["layers.0", "head"] and count.layers["head"] == (24, 8)
    assert count.layers["layers.0"] == (5 * 64, 5 * 64)
    assert count.unattributed == count.dense - 24 - 5 * 64 > 0
    assert count.nonzero == count.dense - 16
    assert model.training  # restored
