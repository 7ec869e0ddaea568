"""``PruningCallback(scope="erk" | "owl")``: every event's per-layer counts are the allocation's, the total exact;
OWL's ratios come from the activation statistics (checked against input norms computed here); refusals named."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightprune import prune
from lightprune.callback import PruningCallback
from lightprune.prune.allocation import erk_weights, layer_counts, outlier_ratio, owl_offsets
from lightprune.schedules import Linear
from tiny_lightning import WEIGHTS, N, TinyNet, loader, quiet_trainer

pytestmark = pytest.mark.usefixtures("one_thread_for_module")

SHAPES = list(WEIGHTS.values())


class Counts(L.Callback):
    """After every batch (so after every event of the callbacks before it): pruned weights per selected tensor."""

    def __init__(self, callback: PruningCallback) -> None:
        self.callback, self.by_step = callback, {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        masked = self.callback._masked
        assert masked is not None
        self.by_step[trainer.global_step] = [pruned for _, pruned in masked.counts()]


@pytest.mark.parametrize("masking", ["reparametrize", "inplace"])
def test_erk_events_follow_the_allocation_with_exact_totals(masking: str) -> None:
    schedule = Linear(final=0.9, start=0, end=12, frequency=4)
    callback = PruningCallback(schedule, scope="erk", masking=masking, max_layer_sparsity=0.95, make_permanent=False)
    counts = Counts(callback)
    quiet_trainer([callback, counts], max_epochs=2).fit(TinyNet())

    # the expected sequence, event by event: ERK's counts with what each layer holds as lower bounds
    expected, pruned = {}, [0, 0, 0]
    caps = [int(0.95 * rows * cols) for rows, cols in SHAPES]
    for step in range(1, 17):
        if step in schedule.resolve(16).events() or step > 12:
            target = schedule.resolve(16).target(step)
            pruned = layer_counts(SHAPES, target, erk_weights(SHAPES), pruned=pruned, caps=caps)
        expected[step] = pruned
    assert counts.by_step == expected
    assert sum(counts.by_step[16]) == round(0.9 * N)
    # ERK keeps more of the small output layer: (4 + 12) / 48 against (16 + 8) / 128 and (12 + 16) / 192
    sparsities = [p / (rows * cols) for p, (rows, cols) in zip(counts.by_step[16], SHAPES, strict=True)]
    assert sparsities[2] < sparsities[0] < sparsities[1]


def input_norms(model: TinyNet, batches: int) -> dict[str, torch.Tensor]:
    """``||X_j||_2`` of every Linear's input feature over the first ``batches`` batches (no_grad, eval)."""
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def add(module: nn.Module, args: Any, name: str = name) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1])
                sums[name] = sums.get(name, 0) + (x.double() ** 2).sum(0)

            hooks.append(module.register_forward_pre_hook(add))
    with torch.no_grad():
        for i, (x, _) in enumerate(loader()):
            if i == batches:
                break
            model(x)
    for hook in hooks:
        hook.remove()
    return {name: value.sqrt() for name, value in sums.items()}


def test_owl_one_shot_allocates_by_the_outliers_of_wanda_scores() -> None:
    target, threshold, lam = 0.6, 2.0, 0.1
    reference = TinyNet()
    norms = input_norms(reference, batches=2)
    scores = [
        (reference.net[i].weight.detach().double().abs() * norms[f"net.{i}"]).float() for i in (0, 2, 4)
    ]  # Wanda: |W_ij| * ||X_j||
    ratios = [outlier_ratio(score, threshold=threshold) for score in scores]
    assert len(set(ratios)) > 1, "the example should have layers with different outlier ratios"
    expected = layer_counts(SHAPES, target, owl_offsets(ratios, lam), rule="owl")

    callback = PruningCallback(
        target,
        scope="owl",
        importance="activation",
        calibration_batches=2,
        owl_threshold=threshold,
        owl_lambda=lam,
        make_permanent=False,
    )
    model = TinyNet()
    quiet_trainer([callback], max_steps=1).fit(model)
    assert [pruned for _, pruned in callback._masked.counts()] == expected
    assert sum(expected) == round(target * N)
    # within each layer, Wanda's ranking: the pruned entries are the smallest scores
    for i, score in zip((0, 2, 4), scores, strict=True):
        mask = prune.is_pruned(model.net[i]) and model.net[i].weight_mask.bool()
        assert score[~mask].max() <= score[mask].min()


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"scope": "erk", "method": "ln_structured"}, "erk allocates each layer a share of the weights"),
        ({"scope": "owl", "method": "random_structured"}, "owl allocates each layer a share"),
        ({"scope": "owl"}, "importance='magnitude': scope=owl allocates by the outliers"),
        ({"scope": "owl", "importance": "movement"}, "use importance=activation"),
        (
            {"scope": "owl", "importance": "activation", "owl_lambda": 0.8},
            r"owl_lambda=0.8: must be a float in \[0, 0.5\]",
        ),
        ({"scope": "erk", "owl_lambda": 0.2}, r"owl_lambda=0.2: is used with scope='owl' only \(scope='erk'"),
        (
            {"importance": "activation", "owl_threshold": 7},
            r"owl_threshold=7: is used with scope='owl' only \(scope='global'",
        ),
        ({"token_mask": "mask"}, r"token_mask='mask' is used with importance='activation' or 'obs' .*only"),
        ({"token_mask": None, "method": "neurons"}, r"token_mask=None is used with importance='activation' or 'obs'"),
        ({"example_inputs": (1,)}, r"example_inputs \(a tuple\) is used with method='neurons' or 'heads' only"),
        ({"scope": "owl", "importance": "activation", "owl_threshold": 0}, "owl_threshold=0: must be a float > 0"),
        ({"scope": "erk", "method": "semi_structured"}, "semi_structured ranks its N:M groups within each layer"),
        ({"scope": "erk", "importance": "obs", "calibration_batches": 2}, "not per-layer allocation yet"),
    ],
)
def test_refusals_are_named_at_construction(arguments: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PruningCallback(0.5, **arguments)


def test_owl_ramp_starting_at_level_0_needs_no_scores_at_its_first_event() -> None:
    callback = PruningCallback(
        Linear(final=0.5, start=2, end=6, frequency=4), scope="owl", importance="activation", make_permanent=False
    )
    quiet_trainer([callback], max_steps=8).fit(TinyNet())
    assert sum(pruned for _, pruned in callback._masked.counts()) == round(0.5 * N)


def test_erk_with_a_random_method_is_a_static_random_erk_mask() -> None:
    callback = PruningCallback(0.8, scope="erk", method="random_unstructured", make_permanent=False)
    quiet_trainer([callback], max_steps=1).fit(TinyNet())
    assert [pruned for _, pruned in callback._masked.counts()] == layer_counts(SHAPES, 0.8, erk_weights(SHAPES))


def test_owl_on_bert_takes_one_outlier_ratio_per_transformer_block() -> None:
    """OWL's layer is a transformer block: its tensors' scores pooled into one ratio, and one sparsity for all."""
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import DataLoader, TensorDataset

    class TinyBert(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = transformers.BertConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=12, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )  # fmt: skip
            self.model = transformers.BertForSequenceClassification(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids[:, 0] % 2).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self) -> DataLoader:
            ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(ids), batch_size=8)

    target, threshold, lam = 0.6, 2.0, 0.1
    reference = TinyBert()
    linears = {name: m for name, m in reference.named_modules() if isinstance(m, nn.Linear)}
    sums: dict[str, torch.Tensor] = {}

    def add(module: nn.Module, args: Any, name: str) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
        sums[name] = sums.get(name, 0) + (x**2).sum(0)

    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: add(m, a, n)) for n, m in linears.items()]
    with torch.no_grad():
        for batch in reference.train_dataloader():
            reference.model(input_ids=batch[0])
    for hook in hooks:
        hook.remove()
    # blocks by hand: each encoder layer's six Linears pool their Wanda scores; pooler and classifier stand alone
    block_of = {name: name.split(".layer.")[0] + ".layer." + name.split(".layer.")[1].split(".")[0] if ".layer." in name
                else name for name in linears}  # fmt: skip
    assert len(set(block_of.values())) == 3 + 2
    scores = {name: (m.weight.detach().double().abs() * sums[name].sqrt()) for name, m in linears.items()}
    ratio = {}
    for block in set(block_of.values()):
        pooled = torch.cat([scores[name].flatten() for name in linears if block_of[name] == block])
        ratio[block] = float((pooled > threshold * pooled.mean()).double().mean())
    assert len(set(ratio.values())) > 1, "the example should have blocks with different outlier ratios"
    shapes = [tuple(m.weight.shape) for m in linears.values()]
    expected = layer_counts(shapes, target, owl_offsets([ratio[block_of[n]] for n in linears], lam), rule="owl")

    callback = PruningCallback(
        target, scope="owl", importance="activation", calibration_batches=2, owl_threshold=threshold, owl_lambda=lam,
        make_permanent=False,
    )  # fmt: skip
    model = TinyBert()
    quiet_trainer([callback], max_steps=1).fit(model)
    names = [qualified.removesuffix(".weight") for qualified, _, _ in callback._masked.selection]
    assert names == list(linears)
    counts = [pruned for _, pruned in callback._masked.counts()]
    assert counts == expected and sum(counts) == round(target * sum(r * c for r, c in shapes))
    for block in set(block_of.values()):  # one sparsity per block, up to rounding of each tensor's count
        shares = [
            n / (r * c) for n, (r, c), name in zip(counts, shapes, linears, strict=True) if block_of[name] == block
        ]
        assert max(shares) - min(shares) <= 1 / (32 * 32), (block, shares)
