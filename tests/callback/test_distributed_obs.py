"""OBS / SparseGPT on weights sharded by rows (gloo, 2 and 3 CPU processes) against one process on the full weights.

Each rank builds the same layers and the same ``H`` (from the same inputs), shards the weights ``Shard(0)`` (uneven:
13, 7 and 2 rows, so one of 3 ranks holds an empty shard of the last), and runs an OBS event with
:func:`lightprune.callback.reconstruction.reconstruct_sharded`: each rank updates its own rows and keeps their
masks. Rank 0 gathers the masks and the updated weights and compares them with
:func:`lightprune.callback.reconstruction.reconstruct` run in one process on the full weights (the callback's own
single-process event): layerwise and global counts (global with a plain, unsharded layer among the sharded ones),
per-row counts, and 2:4; on top of a mask already in force; a Linear with 300 inputs (three blocks of 128
columns, so the unstructured selection ranks across the ranks' rows block after block, with ties) and a Conv2d.
The script writes, per case, whether masks and weights are equal bit for bit and the largest weight difference.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lightprune.prune.distributed_obs import ShardedRows, rows_of, sharded_obs_counts, sharded_obs_problem
from lightprune.prune.obs import LocalRows
from ranks import LEAVE, run_ranks

SCRIPT = (
    textwrap.dedent(
        """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightprune import prune
    from lightprune.callback.reconstruction import reconstruct, reconstruct_sharded
    from lightprune.prune.distributed import local_of, local_part
    from lightprune.prune.obs import input_second_moment

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = {}


    def gather(local):
        parts = [None] * world
        dist.all_gather_object(parts, local)
        return torch.cat(parts)


    def layers(seed):
        torch.manual_seed(seed)
        made = {"a": nn.Linear(300, 13), "b": nn.Conv2d(5, 7, 3), "c": nn.Linear(16, 2), "d": nn.Linear(12, 5)}
        with torch.no_grad():  # ties: a few weights share values, so the selection splits ties across ranks
            made["a"].weight[:, :40] = torch.round(made["a"].weight[:, :40] * 20) / 20
        return made


    def hessians(made, seed):
        g = torch.Generator().manual_seed(seed)
        mix = torch.randn(300, 300, generator=g) / 20 + torch.eye(300)  # correlated inputs
        hs = {"a": input_second_moment(made["a"], torch.randn(400, 300, generator=g) @ mix)}
        hs["b"] = input_second_moment(made["b"], torch.randn(6, 5, 8, 8, generator=g))
        hs["c"] = input_second_moment(made["c"], torch.randn(50, 16, generator=g))
        hs["d"] = input_second_moment(made["d"], torch.randn(50, 12, generator=g))
        return hs


    def prior(made, seed):
        g = torch.Generator().manual_seed(seed + 7)
        return {k: torch.rand(m.weight.shape, generator=g) > 0.2 for k, m in made.items()}


    def case(name, scope, target, n_m=None, names=("a", "b", "c"), plain=()):
        reference, hs = layers(1), hessians(layers(1), 2)
        masks = prior(reference, 1)
        triples = [(k, reference[k], "weight") for k in names]
        with prune.mask_dtype(torch.bool):
            for k in names:
                prune.custom_from_mask(reference[k], "weight", masks[k])
            reconstruct(triples, lambda m, n: getattr(m, n + "_mask", None), target, scope, hs.__getitem__, n_m=n_m)

        sharded, local_masks = layers(1), {}
        for k in names:
            weight = sharded[k].weight
            if k not in plain:
                sharded[k].weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)]))
            local_masks[sharded[k]] = local_part(masks[k], sharded[k].weight)
            with torch.no_grad():
                local_of(sharded[k].weight).mul_(local_masks[sharded[k]])  # masked in place, as the callback keeps it
        put = lambda m, n, keep: local_masks.__setitem__(m, keep)
        reconstruct_sharded([(k, sharded[k], "weight") for k in names], lambda m, n: local_masks[m], target, scope,
                            hs.__getitem__, put, n_m=n_m, group=mesh.get_group())
        for k in names:
            mask = local_masks[sharded[k]]
            weight = local_of(sharded[k].weight).detach()
            if k not in plain:
                mask, weight = gather(mask), gather(weight)
            want_mask, want = reference[k].weight_mask.bool(), reference[k].weight.detach()
            results[f"{name}/{k}"] = {
                "masks_equal": bool(torch.equal(mask.bool(), want_mask)),
                "weights_equal": bool(torch.equal(weight, want)),
                "max_difference": float((weight - want).abs().max()),
                "pruned": int((~want_mask).sum()),
                "entries": want_mask.numel(),
            }


    case("layerwise", "layerwise", 0.6)
    case("global", "global", 0.55, names=("a", "b", "c", "d"), plain=("d",))
    case("row", "row", 0.5)
    case("n_m", "layerwise", 0.5, n_m=(2, 4), names=("a", "c"))
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle, indent=1)
    """
    )
    + LEAVE
)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_obs_equals_one_process_on_the_gathered_weights(tmp_path: Path, world: int) -> None:
    script = tmp_path / "obs.py"
    script.write_text(SCRIPT)
    out = tmp_path / "results.json"
    run_ranks(script, world, [str(out)])
    results = json.loads(out.read_text())
    assert len(results) == 3 + 4 + 3 + 2  # every layer of every case was compared
    for key, found in results.items():
        assert found["masks_equal"], (key, found)
        assert found["pruned"] > 0, key
        # bit for bit, but where SparseGPT's block-to-block update (a matrix product, errors @ U) rounds otherwise
        # for fewer rows (BLAS): measured equal at 2 ranks, at most 2.3e-8 apart (about one float32 ulp) at 3 ranks
        assert found["weights_equal"] or found["max_difference"] < 1e-6, (key, found)


def test_one_process_sharded_rows_select_as_local_rows() -> None:
    torch.manual_seed(0)
    saliency = torch.round(torch.rand(6, 5) * 4)  # ties
    keep = torch.rand(6, 5) > 0.3
    for k in (0, 3, int(keep.sum())):
        assert torch.equal(
            ShardedRows(0).prune_smallest(saliency, keep, k), LocalRows().prune_smallest(saliency, keep, k)
        )
    assert isinstance(rows_of(torch.zeros(3, 2)), LocalRows)


def test_counts_without_sharding_follow_the_scopes() -> None:
    from lightprune.callback.reconstruction import obs_counts

    torch.manual_seed(0)
    layers = [nn.Linear(6, 4), nn.Linear(5, 3)]
    triples = [(f"l{i}.weight", layer, "weight") for i, layer in enumerate(layers)]
    hessian_of = {q: torch.eye(layer.in_features) * (i + 1) for i, (q, layer, _) in enumerate(triples)}.__getitem__
    for scope in ("layerwise", "global"):
        assert sharded_obs_counts(triples, lambda m, n: None, 0.5, scope, hessian_of) == obs_counts(
            triples, lambda m, n: None, 0.5, scope, hessian_of
        )
    assert sharded_obs_problem(nn.Linear(2, 2)) is None
