"""A worker process for test_cross_barrier.py: `python cross_barrier_worker.py OUTDIR`.

For each case of CASES it trains one model with the synchronous DistributedOptimizer and
an identical one with ``cross_barrier=True`` on the same data, and saves both; then it runs
the scenarios whose timing or errors the test checks (a delayed push, an update that
hangs, an update that fails, refusals) and saves what it observed, to OUTDIR/rank<r>.pt.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch_worker import batch

import sumflow.torch as hvd

STEPS = 6
#: How long rank 1 holds back a gradient in the behaviour scenarios, in seconds.
DELAY = 1.0
#: How long the hanging update takes; SUMFLOW_TIMEOUT is set below it by the test.
HANG = 4.0


class Net(torch.nn.Module):
    """A small float64 model with a module used every other step and one never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        )
        self.sometimes = torch.nn.Linear(3, 3)
        self.unused = torch.nn.Linear(3, 3)
        self.double()

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.body(x)
        return h + self.sometimes(h) if step % 2 == 0 else h


class SignSGD(torch.optim.Optimizer):
    """A third-party style optimizer: the generic per-parameter path knows nothing of it."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["flips"] = state.get("flips", 0) + 1
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])


def groups(m: Net, lr: float) -> list[dict[str, Any]]:
    """Two parameter groups with different hyper-parameters."""
    first = list(m.body[0].parameters())
    rest = [p for p in m.parameters() if all(p is not q for q in first)]
    return [{"params": first, "lr": lr * 0.5}, {"params": rest}]


@dataclass(frozen=True)
class Case:
    """One comparison: how the optimizer is built and how the loop drives it."""

    optimizer: Callable[[Net], torch.optim.Optimizer]
    backward_passes_per_step: int = 1
    set_to_none: bool = True
    #: Clip the averaged gradients: synchronize(), clip, then a synchronous step.
    clip: bool = False


CASES = {
    "sgd": Case(
        lambda m: torch.optim.SGD(
            groups(m, 0.1), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True
        )
    ),
    "sgd-accumulate": Case(
        lambda m: torch.optim.SGD(groups(m, 0.1), lr=0.1, momentum=0.9, weight_decay=1e-3),
        backward_passes_per_step=2,
        set_to_none=False,
    ),
    "sgd-clip": Case(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), clip=True),
    "adam": Case(lambda m: torch.optim.Adam(groups(m, 0.01), lr=0.01), set_to_none=False),
    "adam-accumulate": Case(
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01), backward_passes_per_step=2
    ),
    "adamw": Case(lambda m: torch.optim.AdamW(groups(m, 0.01), lr=0.01, weight_decay=0.1)),
    "rmsprop": Case(
        lambda m: torch.optim.RMSprop(groups(m, 0.01), lr=0.01, momentum=0.5, centered=True),
        set_to_none=False,
    ),
    "generic-nadam": Case(lambda m: torch.optim.NAdam(groups(m, 0.01), lr=0.01)),
    "generic-adagrad": Case(
        lambda m: torch.optim.Adagrad(groups(m, 0.1), lr=0.1),
        backward_passes_per_step=2,
        set_to_none=False,
    ),
    "generic-third-party": Case(lambda m: SignSGD(groups(m, 0.01), lr=0.01)),
}


#: Net's gradients in backward order are 24, 72, 24, 72, 24 | 384 | 128, 1280 bytes: this
#: theta fuses them into three spans, one of a single gradient, one mixing the module used
#: every other step with the unused one.
FUSION_THRESHOLD = 200


def train(case: str, cross: bool, fused: bool = False) -> dict[str, Any]:
    spec = CASES[case]
    passes = spec.backward_passes_per_step
    m = Net()
    prefix = f"{case}.{'cross' if cross else 'sync'}{'.fused' if fused else ''}"
    opt = hvd.DistributedOptimizer(
        spec.optimizer(m),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in m.named_parameters()],
        backward_passes_per_step=passes,
        fusion_threshold=FUSION_THRESHOLD if fused else 0,
        **({"cross_barrier": True, "model": m} if cross else {}),
    )
    # The learning rate changes every step: an update must use the one in effect when
    # step() was called, not the one when its sum arrived.
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=spec.set_to_none)
        x, y = batch(step, hvd.rank(), hvd.size())
        for chunk in range(passes):
            rows = slice(chunk * len(x) // passes, (chunk + 1) * len(x) // passes)
            loss = torch.nn.functional.cross_entropy(m(x[rows], step), y[rows]) / passes
            loss.backward()
        if spec.clip:
            # Clipping needs every averaged gradient: synchronize() first, then a
            # synchronous step.
            opt.synchronize()  # type: ignore[attr-defined]
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            with opt.skip_synchronize():  # type: ignore[attr-defined]
                opt.step()
        else:
            opt.step()
        scheduler.step()
    return {
        "model": {k: v.clone() for k, v in m.state_dict().items()},
        "optimizer": opt.state_dict(),
    }


def equivalence() -> dict[str, Any]:
    return {
        case: {
            "sync": train(case, False),
            "cross": train(case, True),
            "fused-sync": train(case, False, fused=True),
            "fused-cross": train(case, True, fused=True),
            "initial": Net().state_dict(),
        }
        for case in CASES
    }


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    ).double()


def delayed_push(cross: bool) -> dict[str, Any]:
    """Two steps; in the second, rank 1 holds back the first layer's gradient for DELAY s.
    Rank 0's step() must return at once, and its next forward block until the update."""
    m = model()
    prefix = "delay.cross" if cross else "delay.sync"
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in m.named_parameters()],
        **({"cross_barrier": True, "model": m} if cross else {}),
    )
    seen: dict[str, Any] = {}
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        x, y = batch(step, hvd.rank(), hvd.size())
        if step == 2 and cross:
            # The next forward must wait for the update whose sum rank 1 holds back.
            before = m[0].weight.detach().clone()
            started = time.monotonic()
            out = m(x)
            seen["forward_s"] = time.monotonic() - started
            seen["updated_by_forward"] = not torch.equal(before, m[0].weight)
            # zero_grad() was called while the updates were pending: applied after each.
            seen["grads_zero"] = all(
                p.grad is not None and not p.grad.any() for p in m.parameters()
            )
        else:
            out = m(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        hold = None
        if step == 1 and cross and hvd.rank() == 1:
            hold = m[0].weight.register_hook(lambda g: time.sleep(DELAY))
        loss.backward()
        if hold is not None:
            hold.remove()
        before = m[0].weight.detach().clone()
        started = time.monotonic()
        opt.step()
        if step == 1 and cross:
            seen["step_s"] = time.monotonic() - started
            seen["unchanged_after_step"] = torch.equal(before, m[0].weight)
    opt.synchronize()
    seen["model"] = {k: v.clone() for k, v in m.state_dict().items()}
    return seen


class HangingSGD(torch.optim.SGD):
    """Takes HANG s to update its first parameter on the second step."""

    def step(self, closure: Any = None) -> Any:
        p = self.param_groups[0]["params"][0]
        if self.state[p].get("momentum_buffer") is not None and p.shape == (16, 10):
            time.sleep(HANG)
        return super().step(closure)


class FailingSGD(torch.optim.SGD):
    """Fails to update the last layer's bias on the second step."""

    def step(self, closure: Any = None) -> Any:
        p = self.param_groups[0]["params"][0]
        if self.state[p].get("momentum_buffer") is not None and p.shape == (3,):
            raise ValueError("boom: FailingSGD refuses this update")
        return super().step(closure)


class GroupWriter(torch.optim.SGD):
    """Keeps a step count in its parameter group, shared by all its parameters."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
        return super().step(closure)


def two_steps(cls: type[torch.optim.SGD], name: str) -> tuple[torch.nn.Module, Any, Any]:
    """A model, its cross-barrier optimizer of class `cls` after two steps, and a batch."""
    m = model()
    opt = hvd.DistributedOptimizer(
        cls(m.parameters(), lr=0.1, momentum=0.9),
        named_parameters=[(f"{name}.{n}", p) for n, p in m.named_parameters()],
        cross_barrier=True,
        model=m,
    )
    x, y = batch(0, hvd.rank(), hvd.size())
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return m, opt, x


def hanging_update() -> dict[str, str]:
    """The forward after a hanging update times out; once the update ends, all is well."""
    m, opt, x = two_steps(HangingSGD, "hang")
    return {"forward": _error(lambda: m(x)), "after": _error(opt.synchronize)}


def failing_update() -> dict[str, str]:
    """What the forward, step(), synchronize() and state_dict() raise after an update
    failed."""
    m, opt, x = two_steps(FailingSGD, "fail")
    return {
        "forward": _error(lambda: m(x)),
        "step": _error(opt.step),
        "synchronize": _error(opt.synchronize),
        "state_dict": _error(opt.state_dict),
    }


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as e:
        notes = " ".join(getattr(e, "__notes__", []))
        return f"{type(e).__name__}: {e} [{notes}]"
    return "no error"


class Tied(torch.nn.Module):
    """Reads a child's weight in its own forward, where no pre-hook waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(10, 3, bias=False).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.proj.weight)


def stale_read() -> str:
    """Rank 1 holds back the tied weight's gradient, so rank 0's next forward reads it
    before its update: its backward must say so."""
    m = Tied()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1),
        named_parameters=[(f"tied.{n}", p) for n, p in m.named_parameters()],
        cross_barrier=True,
        model=m,
    )
    x, y = batch(0, hvd.rank(), hvd.size())
    loss = torch.nn.functional.cross_entropy(m(x), y)
    if hvd.rank() == 1:
        m.proj.weight.register_hook(lambda g: time.sleep(DELAY))
    loss.backward()
    opt.step()
    if hvd.rank() == 0:
        opt.zero_grad()
        result = _error(lambda: torch.nn.functional.cross_entropy(m(x), y).backward())
    else:
        result = "not run"
    opt.synchronize()
    return result


def refusals() -> dict[str, str]:
    m = model()
    return {
        "lbfgs": _error(
            lambda: hvd.DistributedOptimizer(
                torch.optim.LBFGS(m.parameters()), cross_barrier=True, model=m
            )
        ),
        "no_model": _error(
            lambda: hvd.DistributedOptimizer(
                torch.optim.SGD(m.parameters(), lr=0.1), cross_barrier=True
            )
        ),
        "orphan": _error(
            lambda: hvd.DistributedOptimizer(
                torch.optim.SGD([*m.parameters(), torch.nn.Parameter(torch.zeros(2))], lr=0.1),
                cross_barrier=True,
                model=m,
            )
        ),
    }


def closure_and_group_writer() -> dict[str, str]:
    m = model()
    opt = hvd.DistributedOptimizer(
        GroupWriter(m.parameters(), lr=0.1),
        named_parameters=[(f"writer.{n}", p) for n, p in m.named_parameters()],
        cross_barrier=True,
        model=m,
    )
    x, y = batch(0, hvd.rank(), hvd.size())
    torch.nn.functional.cross_entropy(m(x), y).backward()
    closure = _error(lambda: opt.step(lambda: 0.0))
    opt.step()
    return {"closure": closure, "group_writer": _error(lambda: m(x))}


def fusion_in_place() -> dict[str, Any]:
    """Where fused gradients live: every gradient a view of one pool in backward order,
    through both zero_grad modes, and the averages written there in place."""
    m = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1),
        named_parameters=[(f"pool.{n}", p) for n, p in m.named_parameters()],
        fusion_threshold=1 << 20,
    )
    params = list(m.parameters())
    seen: dict[str, Any] = {"pool_order": [], "same_memory": [], "averaged": []}
    # This worker's own gradients, as autograd hands them over: the average may land in
    # the pool before backward() returns.
    local: dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: local.__setitem__(i, g.detach().clone()))
    for step, set_to_none in enumerate([True, False, True]):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = batch(step, hvd.rank(), hvd.size())
        torch.nn.functional.cross_entropy(m(x), y).backward()
        addresses = [p.grad.data_ptr() for p in params]
        opt.synchronize()  # type: ignore[attr-defined]
        # Backward order is the reverse of the model's: the last layer's bias comes first.
        item = params[0].element_size()
        ends = [a + p.numel() * item for a, p in zip(addresses, params, strict=True)]
        seen["pool_order"].append(all(ends[i + 1] == addresses[i] for i in range(len(params) - 1)))
        seen["same_memory"].append([p.grad.data_ptr() for p in params] == addresses)
        total = [
            hvd.allreduce(local[i], op=hvd.Sum, name=f"pool.check.{i}") for i in range(len(params))
        ]
        seen["averaged"].append(
            all(torch.equal(p.grad, t / hvd.size()) for p, t in zip(params, total, strict=True))
        )
        with opt.skip_synchronize():  # type: ignore[attr-defined]
            opt.step()
    seen["sent"] = sorted(
        n for n in hvd.wire_bytes() if n.startswith("DistributedOptimizer.grad[pool")
    )
    return seen


def behaviour() -> dict[str, Any]:
    return {
        "delayed_cross": delayed_push(True),
        "delayed_sync": delayed_push(False),
        "hang": hanging_update(),
        "fail": failing_update(),
        "stale": stale_read(),
        "refusals": refusals(),
        "fusion": fusion_in_place(),
        **closure_and_group_writer(),
    }


def main() -> None:
    outdir = Path(sys.argv[1])
    # torch imports its compiler stack (seconds) when the first optimizer is built: done
    # before joining, so the workers start their first sums together (the test gives the
    # job a short timeout).
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    hvd.init()
    result = {"equivalence": equivalence(), "behaviour": behaviour()}
    torch.save(result, outdir / f"rank{hvd.rank()}.pt")
    hvd.shutdown()


if __name__ == "__main__":
    main()
