"""Sharded selection (gloo, 2 and 3 CPU processes): the masks gathered from every rank are those of one process.

Each rank shards the same full tensors as DTensors (``Shard(0)``, uneven: dim 0 is not divisible by the world size,
and one rank may hold an empty shard), prunes them with :mod:`lightprune.prune.distributed`, and the local masks are
gathered on rank 0, which compares them bit for bit with ``lightprune.prune`` run on the full tensors in one process:
global and layerwise, L1 and random, several sparsities and two successive events, float32 and bfloat16, ties at
the threshold across ranks, a plain (unsharded) tensor among sharded ones, and structured pruning along dim 0 and 1.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from lightprune.prune import distributed
from ranks import LEAVE, run_ranks

SCRIPT = (
    textwrap.dedent(
        """
    import os, sys, copy
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightprune import prune
    from lightprune.prune import distributed as D

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    checked = 0


    def gather(local):
        parts = [None] * world
        dist.all_gather_object(parts, local)
        return torch.cat(parts)


    def shard(full):
        return distribute_tensor(full, mesh, [Shard(0)])


    def full_tensors(dtype, seed, ties=False):
        g = torch.Generator().manual_seed(seed)
        shapes = [(7, 5), (11, 3, 2), (2, 4), (13,)]  # 7, 11, 13 rows: uneven shards; 2 rows: empty shard at 3
        out = []
        for s in shapes:
            t = torch.randn(s, generator=g)
            if ties:
                t = torch.round(t * 2) / 2  # few distinct values: the threshold ties across tensors and ranks
            out.append(t.to(dtype))
        return out


    def reference(fulls, events, method, scope):
        mods = []
        for t in fulls:
            m = nn.Module()
            m.w = nn.Parameter(t.clone())
            mods.append(m)
        results = []
        for i, amount in enumerate(events):
            torch.manual_seed(100 + i)
            with prune.mask_dtype(torch.bool):
                if scope == "global":
                    prune.global_unstructured([(m, "w") for m in mods], method, amount=amount)
                else:
                    for m in mods:
                        method.apply(m, "w", amount=amount)
            results.append([m.w_mask.clone() for m in mods])
        return results


    def check(dtype, seed, ties, events, method, scope, plain_last):
        global checked
        fulls = full_tensors(dtype, seed, ties)
        tensors = [shard(t) for t in fulls]
        if plain_last:
            tensors[-1] = fulls[-1].clone()  # a module left unsharded: the same full tensor on every rank
        expected = reference(fulls, events, method, scope)
        current = [None] * len(tensors)
        name = "random" if method is prune.RandomUnstructured else "l1"
        for i, amount in enumerate(events):
            torch.manual_seed(100 + i)
            if scope == "global":
                current = D.sharded_unstructured_masks(tensors, amount, method=name, current=current)
            else:
                current = [
                    D.sharded_unstructured_masks([t], amount, method=name, current=[c])[0]
                    for t, c in zip(tensors, current)
                ]
            for j, (mask, want) in enumerate(zip(current, expected[i])):
                got = mask if (plain_last and j == len(tensors) - 1) else gather(mask)
                assert got.shape == want.shape, (got.shape, want.shape)
                assert torch.equal(got, want), (dtype, seed, ties, events, name, scope, i, j, got, want)
                checked += 1


    for dtype in (torch.float32, torch.bfloat16):
        for seed, ties in ((0, False), (1, True)):
            for events in ((0.3,), (0.5, 9), (0.9, 0.5)):
                check(dtype, seed, ties, events, prune.L1Unstructured, "global", plain_last=seed == 1)
            check(dtype, seed, ties, (0.4, 0.5), prune.L1Unstructured, "layerwise", plain_last=False)
    D.PER_PIECE_PIECES, per_piece = 0, D.PER_PIECE_PIECES  # ties split by their own counting pass
    check(torch.float32, 1, True, (0.5, 9), prune.L1Unstructured, "global", plain_last=True)
    D.PER_PIECE_PIECES = per_piece
    check(torch.float32, 2, False, (0.3, 0.5), prune.RandomUnstructured, "global", plain_last=True)
    check(torch.float32, 3, False, (0.6,), prune.RandomUnstructured, "layerwise", plain_last=False)

    # structured: channels along the sharded dim 0 and along dim 1 (each rank holds part of every channel)
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (0, 1):
            for n in (2, 1, float("inf"), None):
                g = torch.Generator().manual_seed(7)
                full = torch.randn(11, 9, 3, generator=g).to(dtype)
                ref = nn.Module()
                ref.w = nn.Parameter(full.clone())
                t = shard(full)
                current = None
                for i, amount in enumerate((0.3, 2)):
                    torch.manual_seed(200 + i)
                    with prune.mask_dtype(torch.bool):
                        if n is None:
                            prune.random_structured(ref, "w", amount=amount, dim=dim)
                        else:
                            prune.ln_structured(ref, "w", amount=amount, n=n, dim=dim)
                    torch.manual_seed(200 + i)
                    if current is not None:  # in place masking: the weights are zero where pruned
                        t.to_local().mul_(current)
                    current = D.sharded_structured_mask(t, amount, dim=dim, n=n, current=current)
                    got = gather(current)
                    assert torch.equal(got, ref.w_mask), (dtype, dim, n, i, got, ref.w_mask)
                    checked += 1

    # the traffic of a selection does not grow with the tensors: only histograms and per-tensor tie counts
    sizes = []
    for rows in (1000, 40000):
        t = shard(torch.randn(rows, 64))
        D.traffic.bytes = 0
        D.sharded_unstructured_masks([t], 0.5)
        sizes.append(D.traffic.bytes)
    assert sizes[0] == sizes[1] and 0 < sizes[0] < 4 * 2**20, sizes
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            handle.write(str(checked))
    """
    )
    + LEAVE
)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_masks_equal_one_process(tmp_path: Path, world: int) -> None:
    script = tmp_path / "sharded.py"
    script.write_text(SCRIPT)
    result = tmp_path / "checked.txt"
    run_ranks(script, world, [str(result)])
    # every comparison ran: 2 dtypes x 2 weight sets x (5 global + 2 layerwise events) x 4 tensors, the tie split's
    # counting pass (2 events), random global (2 events) and layerwise (1), structured 2 dtypes x 2 dims x 4 norms x 2
    assert int(result.read_text()) == 2 * 2 * 7 * 4 + 2 * 4 + 2 * 4 + 4 + 2 * 2 * 4 * 2


def test_one_process_without_a_group_is_the_single_process_selection() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(30, 4), torch.randn(50)]
    masks = distributed.sharded_unstructured_masks(tensors, 0.7)
    from lightprune import prune

    mods = []
    for t in tensors:
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(t.clone())
        mods.append(m)
    with prune.mask_dtype(torch.bool):
        prune.global_unstructured([(m, "w") for m in mods], prune.L1Unstructured, amount=0.7)
    for mask, m in zip(masks, mods, strict=True):
        assert torch.equal(mask, m.w_mask)


def test_bad_method_and_placement_are_refused() -> None:
    with pytest.raises(ValueError, match="method must be 'l1' or 'random', got 'l2'"):
        distributed.sharded_unstructured_masks([torch.ones(2)], 0.5, method="l2")
    with pytest.raises(ValueError, match="two or more dims"):
        distributed.sharded_structured_mask(torch.ones(3), 1, dim=0, n=2)
