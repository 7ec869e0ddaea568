"""Input statistics skip padding: on a tiny BERT with right-padded batches the activation sums and OBS's ``H = X^T X``
equal the statistics over the unpadded tokens, computed here by running every sequence alone, cut to its length,
through the same model."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightprune.callback import PruningCallback
from lightprune.callback.activations import ActivationStats
from lightprune.callback.hessians import HessianStats
from lightprune.schedules import Constant
from tiny_lightning import quiet_trainer

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.usefixtures("one_thread_for_module"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

ENCODER = r"model\.bert\.encoder\..*\.weight"
CALIBRATION = 2


def padded_batches(count: int = 4, size: int = 4, longest: int = 10) -> list[dict[str, Tensor]]:
    """Right-padded batches (pad id 0) of random lengths 2..longest, each with its ``attention_mask``."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        lengths = torch.randint(2, longest + 1, (size,), generator=generator)
        ids = torch.randint(1, 64, (size, int(lengths.max())), generator=generator)
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        batches.append({"input_ids": ids * mask, "attention_mask": mask})
    return batches


class PaddedBert(L.LightningModule):
    """A BERT classifier from config (no download) trained on :func:`padded_batches`; ``as_tuples`` feeds them as
    ``(input_ids, attention_mask)`` tuples instead of dicts."""

    def __init__(self, as_tuples: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            num_labels=2,
        )
        self.model = transformers.BertForSequenceClassification(config)
        self.as_tuples = as_tuples

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, mask = (batch["input_ids"], batch["attention_mask"]) if isinstance(batch, dict) else batch
        return self.model(input_ids=ids, attention_mask=mask, labels=ids[:, 0] % 2).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        batches: list[Any] = padded_batches()
        if self.as_tuples:
            batches = [(b["input_ids"], b["attention_mask"]) for b in batches]
        return DataLoader(batches, batch_size=None)  # the batches as they are


def unpadded_sums(model: PaddedBert, batches: list[dict[str, Tensor]], moments: bool = False) -> dict[str, Tensor]:
    """Sum over the real tokens of ``x_j ** 2`` (``moments``: of ``x^T x``) at every encoder Linear's input: every
    sequence alone, unpadded, in float64."""
    sums: dict[str, Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".encoder." in name:

            def add(layer: nn.Module, args: tuple[Tensor, ...], key: str = f"{name}.weight") -> None:
                rows = args[0].double().reshape(-1, args[0].shape[-1])
                sums[key] = sums.get(key, 0) + (rows.t() @ rows if moments else rows.pow(2).sum(dim=0))

            handles.append(module.register_forward_pre_hook(add))
    model.eval()
    with torch.no_grad():
        for batch in batches:
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
                model.model(input_ids=ids[mask.bool()][None])
    for handle in handles:
        handle.remove()
    return sums


class Totals:
    """The PruningCallback's input statistics as the event when training starts reads them (after calibration,
    before any training step), by layer (OBS: each layer's ``H``, shared or not)."""

    def __init__(self, pruning: PruningCallback) -> None:
        self.pruning = pruning
        self.totals: dict[str, Tensor] = {}
        importance = pruning._importance
        used = importance.after_event  # the statistics are reset once the event used them: read them first

        def read_then_reset() -> None:
            state = self.pruning.state_dict()["importance"]
            if "obs" in state:
                shares = state["obs"]["shares"]
                self.totals = {name: state["obs"]["totals"][owner].clone() for name, owner in shares.items()}
            else:
                self.totals = {name: total.clone() for name, total in state["activation"]["totals"].items()}
            used()

        importance.after_event = read_then_reset


def calibrated_totals(**options: Any) -> dict[str, Tensor]:
    as_tuples = options.pop("as_tuples", False)
    options.setdefault("importance", "activation")
    pruning = PruningCallback(
        Constant(0.5, at=0),
        calibration_batches=CALIBRATION,
        scope="row",
        include=ENCODER,
        summary=False,
        **options,
    )
    totals = Totals(pruning)
    quiet_trainer([pruning], max_steps=1).fit(PaddedBert(as_tuples))
    return totals.totals


@pytest.fixture(scope="module")
def reference() -> dict[str, Tensor]:
    return unpadded_sums(PaddedBert(), padded_batches()[:CALIBRATION])


@pytest.fixture(scope="module")
def reference_moments() -> dict[str, Tensor]:
    return unpadded_sums(PaddedBert(), padded_batches()[:CALIBRATION], moments=True)


def assert_close(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert sorted(got) == sorted(expected) and len(got) == 12  # 2 layers x 6 Linear
    for name, value in expected.items():
        torch.testing.assert_close(got[name].double(), value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_attention_mask_of_a_dict_batch_leaves_padding_out(reference: dict[str, Tensor]) -> None:
    assert_close(calibrated_totals(), reference)


def test_a_callable_finds_the_mask_in_a_tuple_batch(reference: dict[str, Tensor]) -> None:
    assert_close(calibrated_totals(as_tuples=True, token_mask=lambda batch: batch[1]), reference)


def test_without_a_mask_padding_counts(reference: dict[str, Tensor]) -> None:
    counted = calibrated_totals(token_mask=None)
    first = "model.bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(counted[first].double(), reference[first], rtol=1e-3)


def test_obs_second_moments_leave_padding_out_by_the_same_rule(reference_moments: dict[str, Tensor]) -> None:
    assert_close(calibrated_totals(importance="obs"), reference_moments)
    counted = calibrated_totals(importance="obs", token_mask=None)
    first = "model.bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(counted[first].double(), reference_moments[first], rtol=1e-3)


def test_sequential_obs_calibration_passes_each_batch_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sequential=True`` collects block by block: every pass gets its block's layers and its batch's mask."""
    calls: list[tuple[set[str] | None, Tensor | None]] = []
    start = HessianStats.start

    def spy(self: HessianStats, only: set[str] | None = None, mask: Tensor | None = None) -> None:
        calls.append((only, mask))
        start(self, only, mask)

    monkeypatch.setattr(HessianStats, "start", spy)
    pruning = PruningCallback(
        0.5,
        importance="obs",
        calibration_batches=CALIBRATION,
        sequential=True,
        scope="row",
        include=ENCODER,
        summary=False,
    )
    quiet_trainer([pruning], max_steps=1).fit(PaddedBert())
    masks = [batch["attention_mask"].bool() for batch in padded_batches()[:CALIBRATION]]
    blocks = [call[0] for call in calls[::CALIBRATION]]
    assert len(calls) == 2 * CALIBRATION and [sorted(b)[0].split(".")[4] for b in blocks] == ["0", "1"]
    for index, (only, mask) in enumerate(calls):
        assert only == blocks[index // CALIBRATION] and len(only) == 6
        assert mask is not None and torch.equal(mask, masks[index % CALIBRATION])


def test_a_bad_token_mask_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"token_mask=3 must be None, a key of the batch"):
        PruningCallback(0.5, importance="activation", token_mask=3)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    features=st.integers(1, 4),
    data=st.data(),
)
def test_statistics_count_the_real_positions_only(lengths: list[int], features: int, data: Any) -> None:
    """Against a loop over the real positions; a pooled ``(B, d)`` input of the same layer counts whole."""
    longest = max(*lengths, 1) + data.draw(st.integers(0, 2))
    x = torch.randn(len(lengths), longest, features, generator=torch.Generator().manual_seed(len(lengths)))
    mask = torch.arange(longest)[None] < torch.tensor(lengths)[:, None]
    layer = nn.Linear(features, 2)
    stats = ActivationStats([("fc.weight", layer, "weight")])
    stats.start(mask)
    layer(x)
    layer(x[:, 0])  # (B, d): no positions to match the (B, T) mask
    stats.finish_batch(lambda flat: flat)
    expected = torch.zeros(features)
    for b, length in enumerate(lengths):
        for t in range(length):
            expected += x[b, t] ** 2
    expected += (x[:, 0] ** 2).sum(dim=0)
    torch.testing.assert_close(stats.totals["fc.weight"], expected)
