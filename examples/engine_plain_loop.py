"""Gradual magnitude pruning with ``lightprune.prune`` in a plain PyTorch training loop (no Lightning).

A small MLP learns scikit-learn's bundled handwritten digits (nothing is downloaded). After dense training, the
weights of all three Linear layers are pruned together (``global_unstructured``, L1 magnitude) in a few steps up to
90% sparsity, with a little fine-tuning after each step; ``prune.remove`` then makes the zeros permanent.

``lightprune.prune`` is a drop-in for ``torch.nn.utils.prune``: the same calls work with either import. Amounts given
as integers are exact counts of weights to prune *now*, so the total after every step is exactly the target.

Run::

    python examples/engine_plain_loop.py            # about 10 seconds on a CPU
    python examples/engine_plain_loop.py --quick    # a few seconds, for tests
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn

from lightprune import prune


def load_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as 64-vectors in [0, 1]: 1437 training and 360 test examples."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float = 1e-3) -> None:
    """Plain minibatch training with a fresh Adam. Pruned weights get no gradient (the mask multiplies them), so
    they stay zero."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for batch in torch.randperm(len(x)).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(dim=1) == y).float().mean())


def sparsity(parameters: list[tuple[nn.Module, str]]) -> float:
    """Fraction of zeros over the effective weights (``module.weight`` is ``weight_orig * weight_mask`` when pruned)."""
    zeros = sum(int((getattr(module, name) == 0).sum()) for module, name in parameters)
    return zeros / sum(getattr(module, name).numel() for module, name in parameters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (a few seconds), for tests")
    parser.add_argument("--target", type=float, default=0.9, help="final sparsity of the Linear weights")
    parser.add_argument("--save", type=Path, help="write the pruned model's state_dict (plain tensors) to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny model: one thread is fastest
    dense_epochs, finetune_epochs, final_epochs, steps = (2, 1, 1, 2) if args.quick else (20, 3, 10, 5)

    x_train, y_train, x_test, y_test = load_data()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    train(model, x_train, y_train, dense_epochs)
    print(f"dense: test accuracy {accuracy(model, x_test, y_test):.4f}")

    parameters = [(model[0], "weight"), (model[2], "weight"), (model[4], "weight")]
    total = sum(module.weight.numel() for module, _ in parameters)
    pruned = 0
    for step in range(1, steps + 1):
        target = args.target * step / steps  # a linear ramp of total sparsity
        # an int amount is a count of still-unpruned weights to prune now: masks grow, the total is exact
        amount = round(target * total) - pruned
        prune.global_unstructured(parameters, pruning_method=prune.L1Unstructured, amount=amount)
        pruned += amount
        train(model, x_train, y_train, final_epochs if step == steps else finetune_epochs)
        print(f"step {step}: sparsity {sparsity(parameters):.4f}, test accuracy {accuracy(model, x_test, y_test):.4f}")

    for module, name in parameters:
        prune.remove(module, name)  # plain Parameters holding the zeros; no masks or hooks left
    assert not any(name.endswith(("_orig", "_mask")) for name in model.state_dict())
    names = {module: name for name, module in model.named_modules()}
    for module, name in parameters:
        print(f"{names[module]}.{name}: sparsity {sparsity([(module, name)]):.4f}")
    print(f"final sparsity: {sparsity(parameters):.4f} (target {args.target:.4f})")
    print(f"final test accuracy: {accuracy(model, x_test, y_test):.4f}")
    if args.save is not None:
        torch.save(model.state_dict(), args.save)  # loads into a fresh, unpruned model of the same class


if __name__ == "__main__":
    main()
