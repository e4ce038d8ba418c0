"""A model that computes by sleeping: real parameters and gradients, no arithmetic.

:func:`build_model` turns a :class:`~sumflow.profiles.ModelProfile` into an ``nn.Module``
with one :class:`SleepingLayer` per profile layer, each owning ``nn.Parameter``s of the
profile's shapes. A one-element activation flows through the layers, so autograd runs
their backward passes in reverse order, one after another, as in real backpropagation.
A layer's forward sleeps its ``forward_ms``; its backward fills its parameters' gradients
with a constant and sleeps the rest of its ``backward_ms``. ``time.sleep`` releases the
GIL and costs no CPU, so communication threads run while the model "computes", as they
would beside a GPU.

Every parameter gets a gradient every step, so DistributedDataParallel (no unused
parameters) and ``sumflow.torch.DistributedOptimizer`` (post-accumulate-grad hooks) see
what they see with a real model. Gradients are ``gradient_value(step, seed)`` everywhere:
give each worker its own seed (its rank) and the average after a step is known exactly
(:func:`expected_average`).

    model = build_model(profiles.load("resnet50"), seed=rank)
    model().sum().backward()        # sleeps forward_ms + backward_ms of every layer
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from sumflow.profiles import LayerProfile, ModelProfile

#: Longest sleep overshoot carried over to the next layer. Sleeps overshoot by tens of
#: microseconds; paying that back keeps many short layers on time, but a long stall (a GC
#: pause, a page-fault storm) must not be paid back by skipping later layers' compute.
_MAX_CARRY_S = 0.002


def gradient_value(step: int, seed: int) -> float:
    """The value of every gradient element of forward pass `step` (0, 1, ...) of a model
    built with `seed`: ``(seed + 1) * (step % 8 + 1) / 4096``. Small integers over a power
    of two, so sums over workers are exact in float32."""
    return (seed + 1) * (step % 8 + 1) / 4096.0


def expected_average(step: int, seeds: range | list[int]) -> float:
    """The average over workers built with `seeds` of their gradients at `step`."""
    seeds = list(seeds)
    return sum(gradient_value(step, s) for s in seeds) / len(seeds)


class ComputeClock:
    """Paces a model's sleeps and adds up the time its layers spent, in seconds.

    Attributes:
        forward_s: time inside layer forwards since construction.
        backward_s: time inside layer backwards (gradient fill included).
    """

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.backward_s = 0.0
        self._carry = 0.0

    @property
    def total_s(self) -> float:
        """Forward plus backward seconds."""
        return self.forward_s + self.backward_s

    def spend(self, target_s: float, started: float) -> float:
        """Sleeps until `target_s` has passed since `started` (a ``perf_counter()``),
        less earlier overshoot; returns the seconds actually spent since `started`."""
        remaining = target_s - (time.perf_counter() - started) - self._carry
        if remaining > 0:
            time.sleep(remaining)
        elapsed = time.perf_counter() - started
        self._carry = min(max(self._carry + elapsed - target_s, 0.0), _MAX_CARRY_S)
        return elapsed


class _Sleep(torch.autograd.Function):
    """Identity on the activation; forward and backward sleep the layer's times."""

    @staticmethod
    def forward(
        ctx: Any, layer: SleepingLayer, value: float, x: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        started = time.perf_counter()
        ctx.layer = layer
        ctx.value = value
        # A new tensor, not `x` itself: autograd treats a returned input as a view.
        out = x.clone()
        layer.clock.forward_s += layer.clock.spend(layer.forward_s, started)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        started = time.perf_counter()
        layer: SleepingLayer = ctx.layer
        if layer.trace is not None:
            layer.trace.append(layer.name)
        grads = layer.gradients(ctx.value)
        layer.clock.backward_s += layer.clock.spend(layer.backward_s, started)
        return (None, None, grad_out, *grads)


class SleepingLayer(nn.Module):
    """One profile layer: its parameters (flat names: the profile's dots become ``_``) and
    its times. Call it through :class:`SleepingModel`, which passes the step's gradient
    value."""

    def __init__(
        self,
        profile: LayerProfile,
        clock: ComputeClock,
        *,
        init: float,
        trace: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.name = profile.name
        self.forward_s = profile.forward_ms / 1e3
        self.backward_s = profile.backward_ms / 1e3
        self.clock = clock
        self.trace = trace
        self.params: list[nn.Parameter] = []
        self._grad_buffers: list[torch.Tensor | None] = [None] * len(profile.params)
        for spec in profile.params:
            attr = spec.name.replace(".", "_")
            if hasattr(self, attr):
                raise ValueError(
                    f"layer '{profile.name}': parameter '{spec.name}' would be attribute "
                    f"'{attr}', which is taken (another parameter's, or the layer's own); "
                    "rename it in the profile"
                )
            p = nn.Parameter(torch.full(spec.shape, init, dtype=torch.float32))
            self.register_parameter(attr, p)
            self.params.append(p)

    def gradients(self, value: float) -> list[torch.Tensor]:
        """This step's gradients, every element `value`.

        Freshly allocated gradients cost more than the layer's compute time at full size:
        the kernel zeroes every new page, about 0.2 s per 400 MB here. So each parameter
        has a buffer that is refilled in place and handed to autograd as a new alias
        (``detach()``), which autograd adopts as ``.grad`` without a copy. A buffer still
        aliased by ``.grad`` (gradients accumulating over several backward passes) is never
        refilled; a fresh tensor is returned instead."""
        grads = []
        for i, p in enumerate(self.params):
            buf = self._grad_buffers[i]
            if buf is None:
                buf = self._grad_buffers[i] = torch.empty_like(p, requires_grad=False)
            elif p.grad is not None and p.grad.untyped_storage().data_ptr() == (
                buf.untyped_storage().data_ptr()
            ):
                grads.append(torch.full_like(p, value, requires_grad=False))
                continue
            buf.fill_(value)
            grads.append(buf.detach())
        return grads

    def forward(self, x: torch.Tensor, value: float) -> torch.Tensor:
        """`x` unchanged, after sleeping the layer's forward time; backward sleeps the
        layer's backward time and gives every parameter a gradient of `value`."""
        out: torch.Tensor = _Sleep.apply(self, value, x, *self.params)
        return out


class SleepingModel(nn.Module):
    """The layers of a profile, chained (see the module docs).

    Attributes:
        profile: what it was built from.
        seed: selects the gradient values (:func:`gradient_value`).
        steps: forward passes so far; the next one's gradients are
            ``gradient_value(steps, seed)``.
        clock: time spent in the layers.
        trace: layer names in the order their backward ran, if built with
            ``record_order=True``; else None.
    """

    def __init__(self, profile: ModelProfile, *, seed: int = 0, record_order: bool = False):
        super().__init__()
        self.profile = profile
        self.seed = seed
        self.steps = 0
        self.clock = ComputeClock()
        self.trace: list[str] | None = [] if record_order else None
        # Rank-dependent initial values: a broadcast that did not happen shows.
        init = 0.01 * (seed + 1)
        self.layers = nn.ModuleList(
            SleepingLayer(layer, self.clock, init=init, trace=self.trace)
            for layer in profile.layers
        )

    def forward(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Runs every layer; returns the one-element activation (call ``.sum()``
        then ``.backward()``). `x` defaults to a zero that requires grad, so that even a
        first layer without parameters runs its backward."""
        if x is None:
            x = torch.zeros(1, requires_grad=True)
        value = gradient_value(self.steps, self.seed)
        self.steps += 1
        for layer in self.layers:
            x = layer(x, value)
        return x


def build_model(
    profile: ModelProfile, *, seed: int = 0, record_order: bool = False
) -> SleepingModel:
    """A :class:`SleepingModel` of `profile`. Give every worker a different `seed` (its
    rank): gradients then differ across workers and only a working average makes the
    parameters agree. `record_order` keeps the backward order in ``model.trace``."""
    return SleepingModel(profile, seed=seed, record_order=record_order)
