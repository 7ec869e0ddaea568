"""In-place masking's optimizer checks: optimizers recognised by class (subclasses included), and the step hook."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightprune.callback.neighbours import mask_after_optimizer_steps


def _hook(optimizer: torch.optim.Optimizer, calls: list[int]) -> list[object]:
    trainer = SimpleNamespace(optimizers=[optimizer])
    return mask_after_optimizer_steps(trainer, SimpleNamespace(automatic_optimization=True), lambda: calls.append(1))


def test_subclasses_of_whole_tensor_optimizers_warn_and_of_lbfgs_are_refused() -> None:
    params = list(nn.Linear(3, 2).parameters())

    class ScaledAdafactor(torch.optim.Adafactor):
        pass

    class Lamb(torch.optim.SGD):  # stands for a third-party LAMB, known by name
        pass

    class MyLBFGS(torch.optim.LBFGS):
        pass

    with pytest.warns(UserWarning, match=r"with ScaledAdafactor: its update reads whole tensors"):
        _hook(ScaledAdafactor(params), [])
    with pytest.warns(UserWarning, match=r"with Lamb: its update reads whole tensors"):
        _hook(Lamb(params, lr=0.1), [])
    with pytest.raises(ValueError, match=r"cannot mask inside MyLBFGS's step"):
        _hook(MyLBFGS(params), [])


def test_elementwise_optimizers_pass_quietly_and_mask_after_every_step() -> None:
    layer = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    calls: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handles = _hook(optimizer, calls)
    for _ in range(3):
        layer(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    assert len(calls) == 3
    for handle in handles:
        handle.remove()
    optimizer.step()
    assert len(calls) == 3
