"""Criteria beyond magnitude on sharded models: ``PruningCallback`` under ``ModelParallelStrategy`` (FSDP2, gloo).

As in ``test_callback_sharded.py``, the fits run in a script on 2 or 3 CPU processes, every rank sees the same
batches (a function of the optimizer step), and after every batch a callback records on rank 0 the gathered weights
(before and after the pruning callback ran) and the gathered masks. The model records the sums of squares of every
layer's inputs at each forward, and the script records what the callback ranked by at each event (the activation
totals, or the gathered movement scores). The test then checks in this process, for every event, that

* the statistics are those of the data: activation totals equal the world-size sum of the recorded forward sums of
  the window (bit for bit: every rank adds the same float32 vector), movement scores equal ``-sum W * grad``
  (computed here from the recorded weights and gradients, to float32 rounding);
* the masks are those ``lightprune.prune`` computes in one process on the gathered weights from those statistics,
  bit for bit: global and per-row (``scope="row"``) activation, global movement (signed), 2:4 along the inputs,
  and adopted zeros;
* a fit resumed from a distributed checkpoint in the middle of an activation window, or between two movement
  events, ends bit-identical;
* OBS events (global, per row from calibration batches, and sequential block by block): masks and updated weights
  equal the callback's one-process OBS event on the gathered weights with the same summed ``H``; without the update
  (``reconstruct=False``) each rank's saliencies, gathered, are those of the gathered weights and rank as one
  process ranks them.

Layers have 13, 10 and 4 output rows (uneven shards for 2 and 3 ranks); the last layer stays unsharded.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lightprune import prune
from lightprune.prune.obs import layer_saliency
from processes import run_script

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from lightprune.callback import PruningCallback
    from lightprune.prune.distributed import is_sharded
    from lightprune.schedules import Constant, Linear

    out, world, cases = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    import atexit
    atexit.register(lambda: torch.distributed.is_initialized() and torch.distributed.destroy_process_group())


    def full(t):
        return t.full_tensor() if is_sharded(t) else t.detach().clone()


    class Net(L.LightningModule):
        def __init__(self, zeros=False):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 10), nn.ReLU(), nn.Linear(10, 4))
            if zeros:  # a checkpoint pruned elsewhere
                with torch.no_grad():
                    self.net[0].weight.view(-1)[:30] = 0
                    self.net[4].weight.view(-1)[::3] = 0
            self.sums = []  # per forward: (global_step, training, {layer: sum of x**2 over the batch})
            for i in (0, 2, 4):
                self.net[i].register_forward_pre_hook(self._record(f"net.{i}.weight"))

        def _record(self, key):
            def hook(module, args):
                if not self.sums or self.sums[-1][2].get(key) is not None:
                    self.sums.append((self.trainer.global_step, self.training, {}))
                self.sums[-1][2][key] = (args[0].detach().float() ** 2).sum(0)
            return hook

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[2], mesh=mesh)

        def training_step(self, batch, batch_idx):
            generator = torch.Generator().manual_seed(1000 + self.trainer.global_step)
            x, y = torch.randn(8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(1)
            x, y = torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)
            return DataLoader(TensorDataset(x, y), batch_size=8)  # 4 steps per epoch


    class Record(Callback):
        def __init__(self, pruning, before):
            self.pruning, self.before, self.steps, self.grads = pruning, before, {}, {}

        def on_train_start(self, trainer, pl_module):  # around an event when training starts
            entry = self.steps.setdefault(trainer.global_step, {})
            if self.before:
                entry["before"] = {k: full(v) for k, v in pl_module.named_parameters()}
            else:
                entry["after"] = {k: full(v) for k, v in pl_module.named_parameters()}
                entry["masks"] = {k: full(v) for k, v in self.pruning._masked.masks().items()}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if self.before:
                self.grads[trainer.global_step + 1] = {
                    k: full(v.grad) for k, v in pl_module.named_parameters() if v.grad is not None
                }

        def on_train_batch_end(self, trainer, pl_module, *args):
            entry = self.steps.setdefault(trainer.global_step, {})
            if self.before:
                entry["before"] = {k: full(v) for k, v in pl_module.named_parameters()}
            else:
                entry["after"] = {k: full(v) for k, v in pl_module.named_parameters()}
                entry["masks"] = {k: full(v) for k, v in self.pruning._masked.masks().items()}


    def spy_on_scores(pruning, ranked):
        importance = pruning._importance
        scores = importance.scores

        def spied(*args):
            found = scores(*args)
            if found is None:  # magnitude
                ranked.append(None)
            elif importance.activations is not None:
                ranked.append({k: v.clone() for k, v in importance.activations.totals.items()})
            else:  # movement: the local scores of the shards, gathered
                gathered = {}
                for q, module, name in importance._selection:
                    weight = module.get_parameter(name)
                    if is_sharded(weight):
                        from lightprune.prune.distributed import as_dtensor
                        gathered[q] = as_dtensor(found[q], weight).full_tensor()
                    else:
                        gathered[q] = found[q].clone()
                    if importance.hessians is not None:  # OBS saliencies: and the H they came from
                        gathered["H " + q] = importance.hessians.hessian(q).clone()
                ranked.append(gathered)
            return found

        importance.scores = spied


    def fit(name, schedule, kwargs, max_steps, zeros=False, ckpt_dir=None, ckpt_path=None):
        pruning = PruningCallback(schedule, include=kwargs.pop("include", r"net\\.[024]\\.weight"), **kwargs)
        before, after = Record(pruning, True), Record(pruning, False)
        ranked = []
        callbacks = [before, pruning, after]
        if ckpt_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1))
        trainer = L.Trainer(
            accelerator="cpu", devices=world, max_steps=max_steps, callbacks=callbacks, logger=False,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=ckpt_dir is not None,
            use_distributed_sampler=False,
        )
        model = Net(zeros)
        original_setup = pruning.on_fit_start

        def on_fit_start(trainer, pl_module):
            original_setup(trainer, pl_module)
            spy_on_scores(pruning, ranked)

        pruning.on_fit_start = on_fit_start
        if kwargs.get("importance") == "obs":  # what each OBS event was given: its target and the summed H
            from lightprune.callback.masked_selection import MaskedSelection

            original_reconstruct = MaskedSelection.reconstruct_to

            def reconstruct_to(self, target, hessian_of, only=None):
                names = [q for q, _, _ in self.selection if only is None or q in only]
                ranked.append((target, {q: hessian_of(q).clone() for q in names}))
                return original_reconstruct(self, target, hessian_of, only)

            MaskedSelection.reconstruct_to = reconstruct_to
        trainer.fit(model, ckpt_path=ckpt_path)
        final = {"weights": {k: full(v) for k, v in model.named_parameters()},
                 "masks": {k: full(v) for k, v in pruning._masked.masks().items()}}
        if trainer.global_rank == 0:
            steps = {s: {**before.steps.get(s, {}), **after.steps.get(s, {})} for s in after.steps}
            torch.save({"steps": steps, "final": final, "ranked": ranked, "sums": model.sums, "grads": before.grads},
                       out / f"{name}.pt")


    RAMP = Linear(initial=0.3, final=0.7, start=2, end=6, frequency=2)
    if "activation" in cases:
        fit("activation", RAMP, {"importance": "activation", "activation_window": 2}, 6)
    if "row" in cases:  # calibrated, an event when training starts, then two more; per row
        schedule = Linear(initial=0.3, final=0.6, start=0, end=4, frequency=2)
        fit("row", schedule, {"importance": "activation", "calibration_batches": 2, "scope": "row"}, 5)
    if "movement" in cases:
        fit("movement", RAMP, {"importance": "movement"}, 6)
    if "nm" in cases:
        fit("nm", Constant(0.5, at=2), {"method": "semi_structured", "include": r"net\\.0\\.weight",
                                         "importance": "activation"}, 3)
    if "obs" in cases:  # global OBS with the SparseGPT update, statistics over windows of 2 batches
        fit("obs", RAMP, {"importance": "obs", "activation_window": 2, "scope": "global"}, 6)
    if "obs_row" in cases:  # calibrated, an event when training starts, then two more; per row
        schedule = Linear(initial=0.3, final=0.6, start=0, end=4, frequency=2)
        fit("obs_row", schedule, {"importance": "obs", "calibration_batches": 2, "scope": "row"}, 5)
    if "obs_saliency" in cases:  # OBS saliencies ranked as any scores, no update (each rank scores its own rows)
        fit("obs_saliency", RAMP, {"importance": "obs", "activation_window": 2, "scope": "global",
                                   "reconstruct": False}, 6)
    if "obs_sequential" in cases:  # one-shot at the start, block by block (each block's H through the pruned ones)
        kwargs = {"importance": "obs", "calibration_batches": 2, "sequential": True, "scope": "layerwise"}
        fit("obs_sequential", 0.5, kwargs, 2)
    if "adopt" in cases:
        fit("adopt", RAMP, {"adopt_zeros": True}, 6, zeros=True)
    if "resume" in cases:  # events at 3 and 6, a window of 3: the epoch-end checkpoint at step 4 is mid-window
        schedule = Linear(initial=0.3, final=0.6, start=3, end=6, frequency=3)
        kwargs = {"importance": "activation", "activation_window": 3}
        fit("whole", schedule, dict(kwargs), 7, ckpt_dir=out / "ckpt")
        fit("resumed", schedule, dict(kwargs), 7, ckpt_path=out / "ckpt" / "epoch=0-step=4.ckpt")
    if "resume_movement" in cases:  # the same with movement: each rank's running sums travel beside the weights
        schedule = Linear(initial=0.3, final=0.6, start=3, end=6, frequency=3)
        fit("whole_movement", schedule, {"importance": "movement"}, 7, ckpt_dir=out / "ckpt_movement")
        fit("resumed_movement", schedule, {"importance": "movement"}, 7,
            ckpt_path=out / "ckpt_movement" / "epoch=0-step=4.ckpt")
    """
)

NAMES = ("net.0.weight", "net.2.weight", "net.4.weight")


def run(tmp_path: Path, world: int, cases: str) -> None:
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    run_script(script, str(tmp_path), str(world), cases, timeout=500)


def load(tmp_path: Path, name: str) -> dict:
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def events(record: dict) -> list[tuple[int, dict, dict | None]]:
    """``(step, masks after, masks before)`` of every step whose masks changed."""
    found, previous = [], None
    for step in sorted(record["steps"]):
        masks = record["steps"][step]["masks"]
        if masks and (previous is None or any(not torch.equal(masks[k], previous[k]) for k in masks)):
            found.append((step, masks, previous))
        previous = masks or previous
    return found


class Net0Weights:
    """The script's initial weights, rebuilt here (same seed, same layers, the same zeros)."""

    @staticmethod
    def all(zeros: bool = False) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 10), nn.ReLU(), nn.Linear(10, 4))
        if zeros:
            with torch.no_grad():
                net[0].weight.view(-1)[:30] = 0
                net[4].weight.view(-1)[::3] = 0
        return {f"net.{k}": v.detach().clone() for k, v in net.named_parameters()}


def module_with(weight: torch.Tensor, mask: torch.Tensor | None) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(weight.clone())
    if mask is not None:
        with prune.mask_dtype(torch.bool):
            prune.custom_from_mask(module, "weight", mask)
    return module


def activation_scores(weights: dict, totals: dict) -> dict:
    return {k: weights[k].abs().float() * totals[k].sqrt()[None] for k in totals}


def check_against_one_process(record: dict, how: str, names: tuple[str, ...] = NAMES) -> int:
    """Every event's masks against ``lightprune.prune`` in one process, from the statistics the event ranked by."""
    checked = 0
    found = events(record)
    if how == "adopt":  # the first masks are the adopted zeros of the initial weights, no event
        step, masks, _ = found.pop(0)
        initial = Net0Weights.all(zeros=True)
        for k in names:
            assert torch.equal(masks[k], initial[k] != 0), k
    for index, (step, masks, previous) in enumerate(found):
        before = record["steps"][step]["before"]
        modules = {k: module_with(before[k], None if previous is None else previous[k]) for k in names}
        ranked = record["ranked"][index]
        scores = ranked if how in ("movement", "saliency") else activation_scores(before, ranked) if ranked else None
        pruned = sum(int((~masks[k]).sum()) for k in names)
        already = 0 if previous is None else sum(int((~previous[k]).sum()) for k in names)
        with prune.mask_dtype(torch.bool):
            if how == "row":
                for k in names:
                    target = int((~masks[k][0]).sum()) / masks[k].shape[1]  # the event's per-row target
                    prune.rowwise_l1_unstructured(
                        modules[k],
                        "weight",
                        amount=round(target * masks[k].shape[1])
                        - (0 if previous is None else int((~previous[k][0]).sum())),
                        importance_scores=scores[k],
                    )
            elif how == "nm":
                for k in names:
                    prune.semi_structured(modules[k], "weight", n=2, m=4, importance_scores=scores[k])
            else:
                method = prune.L1Unstructured
                if how == "movement":
                    from lightprune.prune.signed import SignedUnstructured

                    method = SignedUnstructured
                prune.global_unstructured(
                    [(modules[k], "weight") for k in names],
                    method,
                    amount=pruned - already,
                    importance_scores=None if scores is None else {(modules[k], "weight"): scores[k] for k in names},
                )
        for k in names:
            assert torch.equal(masks[k], modules[k].weight_mask.bool()), (how, step, k)
            assert not record["steps"][step]["after"][k][~masks[k]].any(), (how, step, k)
        checked += 1
    return checked


def check_obs_against_one_process(record: dict, scope: str) -> int:
    """Every OBS event's masks and updated weights against the callback's one-process event on the gathered
    weights, from the same target and the same summed ``H``; returns how many events were checked."""
    from lightprune.callback.reconstruction import reconstruct

    checked = 0
    for index, (step, masks, previous) in enumerate(events(record)):
        before, after = record["steps"][step]["before"], record["steps"][step]["after"]
        target, hessians = record["ranked"][index]
        modules = {}
        for k in NAMES:  # Linear layers (OBS checks the layer type) holding the gathered weights and masks
            weight = before[k]
            modules[k] = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            modules[k].weight = nn.Parameter(weight.clone())
            if previous is not None:
                with prune.mask_dtype(torch.bool):
                    prune.custom_from_mask(modules[k], "weight", previous[k])
        triples = [(k, modules[k], "weight") for k in NAMES]
        with prune.mask_dtype(torch.bool):
            reconstruct(triples, lambda m, n: getattr(m, n + "_mask", None), target, scope, hessians.__getitem__)
        for k in NAMES:
            assert torch.equal(masks[k], modules[k].weight_mask.bool()), (scope, step, k)
            difference = float((after[k] - modules[k].weight.detach()).abs().max())
            assert difference == 0.0, (scope, step, k, difference)  # the update itself, bit for bit
        checked += 1
    return checked


def check_sequential_obs_against_one_process(record: dict) -> int:
    """The sequential one-shot event: the callback's one-process OBS event applied block by block on the gathered
    weights, each block from the ``H`` it was given; returns how many blocks were checked."""
    from lightprune.callback.reconstruction import reconstruct

    (step, masks, previous), *_ = events(record)
    assert step == 0 and previous is None
    before, after = record["steps"][0]["before"], record["steps"][0]["after"]
    modules = {}
    for k in NAMES:
        modules[k] = nn.Linear(before[k].shape[1], before[k].shape[0], bias=False)
        modules[k].weight = nn.Parameter(before[k].clone())
    for target, hessians in record["ranked"]:
        triples = [(k, modules[k], "weight") for k in hessians]
        with prune.mask_dtype(torch.bool):
            reconstruct(triples, lambda m, n: getattr(m, n + "_mask", None), target, "layerwise", hessians.__getitem__)
    for k in NAMES:
        assert torch.equal(masks[k], modules[k].weight_mask.bool()), k
        assert torch.equal(after[k], modules[k].weight.detach()), k
    return len(record["ranked"])


def window_totals(record: dict, world: int, steps: set[int], calibration: int = 0) -> dict:
    """The all-reduced activation totals of the training forwards starting at ``steps`` (and the calibration
    forwards), built from the model's recorded sums as the callback adds them: batch by batch, world times each."""
    totals: dict = {}
    calibrations = [s for s in record["sums"] if not s[1]][:calibration]
    trainings = [s for s in record["sums"] if s[1] and s[0] in steps]
    for _, _, sums in calibrations + trainings:
        for key, value in sums.items():
            reduced = value.clone()
            for _ in range(world - 1):
                reduced = reduced + value
            totals[key] = reduced if key not in totals else totals[key] + reduced
    return totals


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_two_ranks_activation_movement_adopted_zeros_and_obs_with_the_sparsegpt_update(tmp_path: Path) -> None:
    """One launch of two processes for every two-rank case (three ranks: the launch below)."""
    run(tmp_path, 2, "activation,movement,adopt,obs,obs_sequential,obs_saliency")
    check_activation_movement_and_adopted_zeros(tmp_path)
    check_obs_with_the_sparsegpt_update(tmp_path)


def check_activation_movement_and_adopted_zeros(tmp_path: Path) -> None:
    record = load(tmp_path, "activation")
    assert check_against_one_process(record, "activation") == 3  # steps 2, 4 and 6
    # the statistics of the event at step 4: batches starting at steps 2 and 3 (the window after the event at 2)
    want = window_totals(record, 2, {2, 3})
    for key in NAMES:
        assert torch.equal(record["ranked"][1][key], want[key]), key

    movement = load(tmp_path, "movement")
    assert check_against_one_process(movement, "movement") == 3
    # the first event's scores: -sum over optimizer steps 1 and 2 of W * grad, W the weights each step was given
    initial = Net0Weights.all()
    for key in NAMES:
        grads = [movement["grads"][s][key] for s in (1, 2)]
        expected = -(initial[key] * grads[0]) - (movement["steps"][1]["after"][key] * grads[1])
        torch.testing.assert_close(movement["ranked"][0][key], expected, rtol=1e-5, atol=1e-7)

    adopt = load(tmp_path, "adopt")
    assert check_against_one_process(adopt, "adopt") == 3
    final = adopt["final"]["masks"]
    assert not final["net.0.weight"].view(-1)[:30].any()  # adopted zeros stay pruned
    assert not final["net.4.weight"].view(-1)[::3].any()


def check_obs_with_the_sparsegpt_update(tmp_path: Path) -> None:
    """(Three ranks: ``obs_row`` in the three-rank launch below.)"""
    obs = load(tmp_path, "obs")
    assert check_obs_against_one_process(obs, "global") == 3  # steps 2, 4 and 6
    # the event at 4 was given H summed over the batches of steps 2 and 3, world times each: its diagonal is the
    # world-size sum of the recorded sums of squares (summed in another order: to float32 rounding)
    want = window_totals(obs, 2, {2, 3})
    for key in NAMES:
        torch.testing.assert_close(obs["ranked"][1][1][key].diagonal(), want[key], rtol=1e-5, atol=1e-6)
    saliency = load(tmp_path, "obs_saliency")  # without the update: masks from the gathered saliencies
    assert check_against_one_process(saliency, "saliency") == 3
    for index, (step, _, _) in enumerate(events(saliency)):  # each rank's saliencies of its rows, gathered
        ranked, before = saliency["ranked"][index], saliency["steps"][step]["before"]
        for key in NAMES:
            layer = nn.Linear(before[key].shape[1], before[key].shape[0], bias=False)
            layer.weight = nn.Parameter(before[key].clone())
            assert torch.equal(ranked[key], layer_saliency(layer, "weight", ranked["H " + key])), (step, key)
    sequential = load(tmp_path, "obs_sequential")
    assert check_sequential_obs_against_one_process(sequential) == 3  # net.0, net.2, net.4: one block each


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_three_ranks_calibrated_rows_n_m_obs_rows_and_resume_mid_window(tmp_path: Path) -> None:
    run(tmp_path, 3, "row,nm,resume,resume_movement,obs_row")  # (one launch of three processes for all of them)
    obs_row = load(tmp_path, "obs_row")
    assert check_obs_against_one_process(obs_row, "row") == 3  # steps 0 (on the calibration batches), 2 and 4
    for key in NAMES:
        mask = obs_row["final"]["masks"][key]
        assert (~mask).sum(dim=1).tolist() == [round(0.6 * mask.shape[1])] * mask.shape[0], key
    row = load(tmp_path, "row")
    assert check_against_one_process(row, "row") == 3  # steps 0 (on the calibration batches), 2 and 4
    want = window_totals(row, 3, set(), calibration=2)
    for key in NAMES:
        assert torch.equal(row["ranked"][0][key], want[key]), key
    for key in NAMES:
        mask = row["final"]["masks"][key]
        assert (~mask).sum(dim=1).tolist() == [round(0.6 * mask.shape[1])] * mask.shape[0], key

    nm = load(tmp_path, "nm")
    assert check_against_one_process(nm, "nm", names=("net.0.weight",)) == 1
    for key in ("net.0.weight",):
        groups = nm["final"]["masks"][key].view(-1, 4)
        assert groups.sum(dim=1).eq(2).all(), key

    whole, resumed = load(tmp_path, "whole"), load(tmp_path, "resumed")
    assert sorted(resumed["steps"])[:2] == [4, 5]  # it resumed after step 4, inside the window of the event at 6
    for part in ("weights", "masks"):
        for key, value in whole["final"][part].items():
            assert torch.equal(value, resumed["final"][part][key]), (part, key)
    assert torch.equal(whole["ranked"][-1]["net.2.weight"], resumed["ranked"][-1]["net.2.weight"])

    whole, resumed = load(tmp_path, "whole_movement"), load(tmp_path, "resumed_movement")
    assert sorted(resumed["steps"])[:2] == [4, 5]  # resumed after step 4, one step after the sums restarted at 3
    for part in ("weights", "masks"):
        for key, value in whole["final"][part].items():
            assert torch.equal(value, resumed["final"][part][key]), (part, key)
    for key in NAMES:  # the event at 6 ranked by the sums of steps 4 to 6, the first of them from the checkpoint
        assert torch.equal(whole["ranked"][-1][key], resumed["ranked"][-1][key]), key


def test_sharded_selections_refuse_a_callable_obs_across_rows_allocation_regrowth_and_groups_across_the_sharded_dim(
    tmp_path: Path,
) -> None:
    dist = pytest.importorskip("torch.distributed")
    transformers = pytest.importorskip("transformers")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightprune.callback.setup_checks import refuse_sharded_criteria

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer = nn.Linear(8, 3)
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        conv1d = transformers.pytorch_utils.Conv1D(3, 8)  # weight (in=8, out=3): inputs along dim 0
        conv1d.weight = nn.Parameter(distribute_tensor(conv1d.weight.detach(), mesh, [Shard(0)]))
        selection = [("fc.weight", layer, "weight"), ("c_attn.weight", conv1d, "weight")]
        for kind in ("magnitude", "activation", "movement"):
            refuse_sharded_criteria(selection, kind, prune.L1Unstructured)  # supported
        refuse_sharded_criteria(selection[:1], "activation", prune.SemiStructured)  # groups inside a row
        with pytest.raises(ValueError, match=r"does not pass parameters sharded as DTensor.*to an importance callable"):
            refuse_sharded_criteria(selection, "callable", prune.L1Unstructured)
        refuse_sharded_criteria(selection[:1], "obs", prune.L1Unstructured)  # rows are whole on every rank
        with pytest.raises(ValueError, match=r"importance='obs' cannot prune \['c_attn\.weight'\] as sharded.*Conv1D"):
            refuse_sharded_criteria(selection, "obs", prune.L1Unstructured)
        conv = nn.Conv1d(3, 2, 1)  # Shard(1): no rank holds a whole row
        conv.weight = nn.Parameter(distribute_tensor(conv.weight.detach(), mesh, [Shard(1)]))
        with pytest.raises(
            ValueError, match=r"importance='obs' cannot prune \['conv\.weight'\].*got S\(1\).*whole rows"
        ):
            refuse_sharded_criteria([("conv.weight", conv, "weight")], "obs", prune.L1Unstructured)
        for scope, regrow in (("erk", None), ("owl", None), ("global", "rigl")):
            with pytest.raises(
                ValueError, match=r"does not support (scope|regrow)=.*sharded as DTensor.*no distributed"
            ):
                refuse_sharded_criteria(selection[:1], "magnitude", prune.L1Unstructured, scope, regrow)
        with pytest.raises(ValueError, match=r"semi_structured.*along dim 0 of \['c_attn\.weight'\].*span two ranks"):
            refuse_sharded_criteria(selection, "magnitude", prune.SemiStructured)
        refuse_sharded_criteria(selection[:1], "magnitude", prune.L1Unstructured, "row")  # rows along dim 0: local
        with pytest.raises(ValueError, match=r"scope='row'.*along dim 1 of \['c_attn\.weight'\].*span every rank"):
            refuse_sharded_criteria(selection, "activation", prune.L1Unstructured, "row")
    finally:
        dist.destroy_process_group()
