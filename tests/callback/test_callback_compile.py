"""``PruningCallback`` on models run through ``torch.compile``: what attaches hooks during training is refused at
setup (a compiled forward does not run hooks added after it compiled); the rest trains the eager run's model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightprune.callback import PruningCallback
from lightprune.schedules import Cubic
from tiny_lightning import TinyNet, folded, quiet_trainer, state

pytestmark = pytest.mark.usefixtures("one_thread_for_module")

SCHEDULE = Cubic(final=0.6, start=2, end=10, frequency=2)


class CompiledInside(TinyNet):
    """A submodule compiled in ``configure_model``, as users do to compile part of a model."""

    def configure_model(self) -> None:
        if not isinstance(self.net, torch._dynamo.eval_frame.OptimizedModule):
            self.net = torch.compile(self.net, backend="eager")  # type: ignore[assignment]


class CompiledInPlace(TinyNet):
    """A submodule compiled in place in ``configure_model`` (``nn.Module.compile()``, torch's recommended form)."""

    def configure_model(self) -> None:
        self.net.compile(backend="eager")


class CompiledForward(TinyNet):
    """A submodule whose ``forward`` attribute is a compiled function, another common form."""

    def configure_model(self) -> None:
        if "forward" not in vars(self.net):
            self.net.forward = torch.compile(self.net.forward, backend="eager")


COMPILED = {
    "whole": lambda: torch.compile(TinyNet(), backend="eager"),
    "inside": CompiledInside,
    "in place": CompiledInPlace,
    "forward": CompiledForward,
}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"importance": "activation"}, "importance='activation'"),
        ({"importance": "obs"}, "importance='obs'"),
        ({"regrow": "rigl", "regrow_every": 2}, "regrow='rigl' under masking='reparametrize'"),
    ],
)
@pytest.mark.parametrize("where", list(COMPILED))
def test_hooks_attached_during_training_are_refused_on_a_compiled_model(
    options: dict[str, Any], named: str, where: str
) -> None:
    callback = PruningCallback(0.5 if "regrow" in options else SCHEDULE, **options)
    model = COMPILED[where]()
    trainer = quiet_trainer([callback], max_steps=4)
    with pytest.raises(ValueError, match=r"torch\.compile") as info:
        trainer.fit(model)
    assert named in str(info.value)
    assert trainer.global_step == 0  # refused before any step


def test_the_same_options_train_an_eager_model() -> None:
    quiet_trainer([PruningCallback(SCHEDULE, importance="activation")], max_steps=4).fit(TinyNet())


@pytest.mark.parametrize("options", [{}, {"regrow": "rigl", "regrow_every": 2, "masking": "inplace"}])
def test_what_needs_no_hooks_trains_the_eager_runs_model_compiled(options: dict[str, Any]) -> None:
    def fit(compiled: bool) -> dict[str, torch.Tensor]:
        model = TinyNet()
        callback = PruningCallback(0.5 if options else SCHEDULE, make_permanent=False, summary=False, **options)
        quiet_trainer([callback], max_steps=8).fit(torch.compile(model, backend="eager") if compiled else model)
        return folded(state(model))

    eager, compiled = fit(False), fit(True)
    assert eager.keys() == compiled.keys()
    for key, value in eager.items():
        torch.testing.assert_close(compiled[key], value, rtol=0, atol=0, msg=key)
    assert any(bool((value == 0).any()) for key, value in eager.items() if key.endswith("weight"))
