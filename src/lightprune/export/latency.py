"""Inference latency, measured: models timed side by side in interleaved rounds, medians reported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightprune._checks import is_int

__all__ = ["Latency", "compare_latency", "measure_latency"]


@dataclass(frozen=True)
class Latency:
    """Wall-clock seconds of one forward pass: median and quartiles over the timed repeats.

    Attributes:
        median: Median seconds per call.
        q1: First quartile.
        q3: Third quartile.
        repeats: Number of timed calls.
    """

    median: float
    q1: float
    q3: float
    repeats: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Latency:
        """Summarize timed samples (seconds).

        Example:
            >>> Latency.of([3.0, 1.0, 2.0, 4.0, 5.0])
            Latency(median=3.0, q1=2.0, q3=4.0, repeats=5)
        """
        if not samples:
            raise ValueError("no samples to summarize: repeats must be at least 1")
        ordered = sorted(samples)
        if len(ordered) == 1:
            return cls(ordered[0], ordered[0], ordered[0], 1)
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        return cls(statistics.median(ordered), q1, q3, len(ordered))


def _synchronize() -> None:
    """Wait for the GPU's queued kernels: a CUDA call returns when its kernels are launched, not finished."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def check_rounds(repeats: Any, warmup: Any) -> None:
    """Check the timed and untimed round counts before any model runs.

    Raises:
        TypeError: ``repeats`` or ``warmup`` is not an int (a bool, a float or NaN included).
        ValueError: ``repeats`` below 1 or ``warmup`` below 0.

    Example:
        >>> check_rounds(2.5, 3)
        Traceback (most recent call last):
        ...
        TypeError: repeats=2.5 must be an int (a number of timed calls), not a float
    """
    for name, value, what in (("repeats", repeats, "timed calls"), ("warmup", warmup, "untimed calls")):
        if not is_int(value):  # True would pass for 1 and 2.0 fail later in range()
            raise TypeError(f"{name}={value!r} must be an int (a number of {what}), not a {type(value).__name__}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}")


def _as_call(model: nn.Module | Callable[..., Any], example_inputs: Tensor | Sequence[Any]) -> Callable[[], Any]:
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return lambda: model(*inputs)


def compare_latency(
    models: Mapping[str, nn.Module | Callable[..., Any]],
    example_inputs: Tensor | Sequence[Any],
    *,
    repeats: int = 20,
    warmup: int = 3,
) -> dict[str, Latency]:
    """Time several models on the same inputs, interleaved, so a busy machine slows them all alike.

    Each round calls every model once, in an order rotated from round to round; calls run under
    ``torch.inference_mode()`` with the current ``torch.get_num_threads()``. Modules are timed as given (put them in
    eval mode first for inference figures). Where CUDA is in use, each call is timed from a synchronized GPU to the
    end of its kernels.

    Args:
        models: ``{name: model}``; any callable taking the inputs works.
        example_inputs: One tensor or a tuple of positional inputs.
        repeats: Timed rounds.
        warmup: Untimed rounds first.

    Returns:
        ``{name: Latency}`` in the order of ``models``.

    Raises:
        TypeError: ``repeats`` or ``warmup`` is not an int (a bool, a float or NaN included), naming the value.
        ValueError: ``repeats`` below 1 or ``warmup`` below 0.

    Example:
        >>> dense = nn.Linear(64, 64).eval()
        >>> result = compare_latency({"dense": dense, "half": nn.Linear(64, 32).eval()}, torch.randn(8, 64), repeats=3)
        >>> sorted(result), result["dense"].repeats
        (['dense', 'half'], 3)
    """
    check_rounds(repeats, warmup)
    calls = {name: _as_call(model, example_inputs) for name, model in models.items()}
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        for round_index in range(warmup + repeats):
            shift = round_index % max(len(names), 1)
            for name in names[shift:] + names[:shift]:
                _synchronize()
                start = time.perf_counter()
                calls[name]()
                _synchronize()
                elapsed = time.perf_counter() - start
                if round_index >= warmup:
                    samples[name].append(elapsed)
    return {name: Latency.of(samples[name]) for name in names}


def measure_latency(
    model: nn.Module | Callable[..., Any], example_inputs: Tensor | Sequence[Any], *, repeats: int = 20, warmup: int = 3
) -> Latency:
    """Time one model's forward pass (see :func:`compare_latency` for the protocol).

    Raises:
        TypeError: ``repeats`` or ``warmup`` is not an int (a bool, a float or NaN included), naming the value.
        ValueError: ``repeats`` below 1 or ``warmup`` below 0.

    Example:
        >>> latency = measure_latency(nn.Linear(16, 4).eval(), torch.randn(2, 16), repeats=5)
        >>> latency.repeats, 0 < latency.q1 <= latency.median <= latency.q3
        (5, True)
    """
    return compare_latency({"model": model}, example_inputs, repeats=repeats, warmup=warmup)["model"]
