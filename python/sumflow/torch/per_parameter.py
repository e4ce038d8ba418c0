"""The generic per-parameter update: the wrapped optimizer's own ``step`` on one parameter.

Crossing the global barrier (``overlap.py``) updates each parameter as soon as its
average arrives, so it needs the update of one parameter alone. Rather than re-implementing
every optimizer's arithmetic, it runs the optimizer's own ``step`` on a *one-parameter
view*: an instance of the optimizer's class that shares the optimizer's attributes,
``state`` included (so momentum buffers, Adam's moments and step counts live where
``state_dict()``, ``load_state_dict()`` and checkpoints find them), but whose
``param_groups`` is a single group holding this parameter and the group's
hyper-parameters as they were when ``step()`` was called. The result is the optimizer's
own arithmetic, so it is exactly what a whole ``step()`` computes for that parameter
whenever the optimizer is *per-parameter separable*: the update of a parameter reads only
its gradient, its own state and its group's hyper-parameters. Every ``torch.optim``
optimizer but LBFGS is; LBFGS (one line search over the whole flattened model) is refused,
and so is any optimizer caught writing to its parameter group during a step, the sign of
state shared across parameters.

The view is built with public Python only (``__new__``, ``__dict__``); no torch internals.
"""

from __future__ import annotations

from typing import Any

import torch

#: Optimizers whose step couples parameters, so no parameter can be updated alone.
NOT_SEPARABLE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.LBFGS,)


class NotSeparableError(ValueError):
    """The optimizer's update of one parameter depends on the others, so it cannot cross
    the global barrier."""


def check_separable(optimizer: torch.optim.Optimizer) -> None:
    """Refuses optimizers known to couple parameters in their step."""
    if isinstance(optimizer, NOT_SEPARABLE):
        raise NotSeparableError(
            f"{type(optimizer).__name__} updates all parameters together (its step needs a "
            "closure and the whole flattened gradient), so parameters cannot be updated one "
            "at a time: use DistributedOptimizer without cross_barrier"
        )


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of a parameter group's hyper-parameters (everything but its parameters).

    Tensors are copied: LR schedulers change a tensor learning rate in place, and the
    update must use the value in effect when ``step()`` was called.
    """
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in group.items()
        if k != "params"
    }


def step_one(
    base: type[torch.optim.Optimizer],
    attributes: dict[str, Any],
    param: torch.Tensor,
    hyper: dict[str, Any],
    index: int,
    label: str,
) -> None:
    """Runs ``base.step`` for `param` alone, with `hyper` as its group's hyper-parameters
    and the optimizer's `attributes` (its ``__dict__``: ``state``, ``defaults``, ...).
    `index` is the parameter's position in its group, `label` its name in messages.

    Step hooks registered on the optimizer (and torch's global ones) run as for any step:
    once per parameter, on the calling thread, with the view as their optimizer.
    """
    group = dict(hyper)
    group["params"] = [param]
    if "param_names" in group:
        group["param_names"] = [group["param_names"][index]]
    view = base.__new__(base)
    # One C-level copy: the main thread may add attributes meanwhile.
    shared = attributes.copy()
    # The instance attribute "step" is an LR scheduler's wrapper bound to the real
    # optimizer: the view must run the class's step, on itself.
    shared.pop("step", None)
    view.__dict__.update(shared)
    view.param_groups = [group]
    given = dict(group)
    base.step(view)
    written = sorted(
        {k for k in group if k not in given or group[k] is not given[k]}
        | {k for k in given if k not in group}
    )
    if written:
        raise NotSeparableError(
            f"{base.__name__}.step wrote {written} of its parameter group while updating "
            f"'{label}': it keeps state shared across parameters, so parameters "
            "cannot be updated one at a time; use DistributedOptimizer without cross_barrier"
        )
