"""DistributedOptimizer's Horovod groups (``num_groups=``, ``groups=``): across two worker
processes, the same parameters, bit for bit, as without groups and as one process on the
whole batch, with every gradient of a group issued only once the whole group is ready;
without a job, how the parameters are grouped and every bad argument refused."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from groups_worker import LR, STEPS, VARIANTS, Net, batch, loss_of
from jobs import run_worker_processes

import sumflow.torch as hvd
from sumflow.torch.optimizer import plan_groups

WORKER = str(Path(__file__).with_name("groups_worker.py"))
WORKERS = 2
#: The model's parameters, in the optimizer's order.
PARAMS = ["first.weight", "first.bias", "second.weight", "second.bias"]
PARAMS += ["unused.weight", "unused.bias"]
#: Each variant's groups by name; the parameters in none are sent alone.
GROUPS = {
    "plain": [],
    "num_groups=2": [PARAMS[:3], PARAMS[3:]],
    "groups=3": [PARAMS[:2], PARAMS[2:4], PARAMS[4:]],
    "groups=lists": [["second.weight", "first.bias"], ["first.weight", "unused.weight"]],
}
GROUPS["groups=lists, 2 passes"] = GROUPS["groups=lists"]
GROUPS["groups=lists, cross_barrier"] = GROUPS["groups=lists"]
GROUPS["num_groups=2, SUMFLOW_FUSION_THRESHOLD"] = GROUPS["num_groups=2"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One job of two workers, every variant trained in it: starting one costs seconds."""
    tmp_path = tmp_path_factory.mktemp("groups")
    outcomes = run_worker_processes(tmp_path, WORKERS, [WORKER, str(tmp_path)], 1)
    for o in outcomes:
        assert o.returncode == 0, f"worker {o.rank} exited {o.returncode}:\n{o.stderr[-3000:]}"
    return [torch.load(tmp_path / f"rank{o.rank}.pt", weights_only=False) for o in outcomes]


def one_process() -> dict[str, torch.Tensor]:
    """The same steps in one process, on the concatenated batch."""
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        xs, ys = zip(*(batch(step, r, WORKERS) for r in range(WORKERS)), strict=True)
        # The workers' sums, averaged.
        (loss_of(m, torch.cat(xs), torch.cat(ys)) / WORKERS).backward()
        opt.step()
    return m.state_dict()


def test_groups_give_the_parameters_of_no_groups_and_of_one_process_exactly(
    ranks: list[dict[str, Any]],
) -> None:
    # Integer data and weights and a power-of-two learning rate: every sum is exact, so
    # nothing may differ by a bit, whatever the order of summation.
    assert GROUPS.keys() == VARIANTS.keys()
    want = one_process()
    moved = [k for k, v in Net().state_dict().items() if not torch.equal(want[k], v)]
    assert moved == PARAMS[:4], "training must move every parameter the forward uses"
    for rank, got in enumerate(ranks):
        for variant, run in got.items():
            for k, v in want.items():
                assert torch.equal(run["model"][k], v), (rank, variant, k)


def ready_at(events: list[tuple[str, str]], p: str) -> int:
    """When p's gradient was last ready (its last backward pass); step() if never."""
    last = [i for i, e in enumerate(events) if e == ("ready", p)]
    return last[-1] if last else events.index(("step", ""))


def test_a_group_is_issued_only_once_its_last_gradient_is_ready(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, got in enumerate(ranks):
        for variant, groups in GROUPS.items():
            events = got[variant]["events"]
            where = f"rank {rank}, {variant}: {events}"
            issued = {name: i for i, (kind, name) in enumerate(events) if kind == "issue"}
            assert sorted(issued) == sorted(PARAMS), where
            assert len(issued) == sum(kind == "issue" for kind, _ in events), where
            for g in groups:
                last = max(ready_at(events, p) for p in g)
                # Nothing before the last gradient of the group, then the whole group at
                # once: issued by the last one's hook (or by step() when one is unused).
                at = sorted(issued[p] for p in g)
                assert at == list(range(last + 1, last + 1 + len(g))), (g, where)
            step = events.index(("step", ""))
            for p in set(PARAMS) - {p for g in groups for p in g}:
                # Alone, as without groups: at once if backward produced it, else by step().
                assert issued[p] == ready_at(events, p) + 1 or issued[p] > step, (p, where)
    # The recording does see a gradient issued before the others are ready.
    plain = ranks[0]["plain"]["events"]
    assert plain[0][0] == "ready", plain
    assert plain[1] == ("issue", plain[0][1]), plain


def test_fusion_from_the_environment_gives_way_to_groups_with_a_warning(
    ranks: list[dict[str, Any]],
) -> None:
    for got in ranks:
        assert got["num_groups=2, SUMFLOW_FUSION_THRESHOLD"]["warnings"] == [
            "SUMFLOW_FUSION_THRESHOLD=1048576 is ignored by a DistributedOptimizer with "
            "groups: its groups decide which gradients are sent together"
        ]
        assert got["num_groups=2"]["warnings"] == []


# ---- without a job: the plan, and the refusals (raised before sumflow is needed) -------


def params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(i + 1)) for i in range(n)]


def plan(num_groups: Any, groups: Any, ps: list[torch.nn.Parameter]) -> list[list[int]]:
    """The groups as indices into `ps`."""
    names = {p: f"p{i}" for i, p in enumerate(ps)}
    index = {p: i for i, p in enumerate(ps)}
    return [[index[p] for p in g] for g in plan_groups(num_groups, groups, ps, names)]


def test_a_number_of_groups_cuts_the_parameters_in_order_into_nearly_equal_runs() -> None:
    ps = params(7)
    assert plan(3, None, ps) == [[0, 1, 2], [3, 4], [5, 6]]
    assert plan(0, 3, ps) == plan(3, None, ps)
    assert plan(1, None, ps) == [list(range(7))]
    # More groups than parameters: one each, no empty groups.
    assert plan(0, 5, ps[:2]) == [[0], [1]]
    assert plan(0, None, ps) == plan(0, 0, ps) == plan(0, [], ps) == []
    # A parameter that requires no gradient is never sent, so it is in no group.
    ps[1].requires_grad_(False)
    assert plan(3, None, ps) == [[0, 2], [3, 4], [5, 6]]


def test_explicit_groups_keep_their_order_and_leave_out_frozen_parameters() -> None:
    ps = params(5)
    ps[4].requires_grad_(False)
    # Inner lists may be any iterable of parameters (here a tuple and a generator).
    assert plan(0, [(ps[3], ps[0]), (p for p in ps[1:2])], ps) == [[3, 0], [1]]
    assert plan(0, [[ps[4]], [ps[2]]], ps) == [[2]]


NOT_A_NUMBER = "num_groups must be a whole number >= 0 (0 = no groups), not "
NOT_GROUPS = "groups must be a number of groups or a list of lists of parameters, not a "


def wrap(ps: list[torch.nn.Parameter], **kw: Any) -> None:
    hvd.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), **kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_groups": -1}, NOT_A_NUMBER + "-1"),
        ({"num_groups": 1.5}, NOT_A_NUMBER + "1.5"),
        ({"num_groups": True}, NOT_A_NUMBER + "True"),
        ({"num_groups": "2"}, NOT_A_NUMBER + "'2'"),
        ({"groups": -2}, "groups must be a number of groups >= 0 (0 = none), not -2"),
        ({"groups": 1.5}, NOT_GROUPS + "float"),
        ({"groups": "p0"}, NOT_GROUPS + "str"),
        ({"groups": True}, NOT_GROUPS + "bool"),
        ({"num_groups": 2, "groups": 2}, "num_groups=2 and groups=... both given: pass one"),
    ],
)
def test_bad_numbers_of_groups_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        wrap(params(3), **kw)


def test_bad_lists_of_groups_are_refused_naming_the_parameter() -> None:
    ps = params(3)
    named = [("a", ps[0]), ("b", ps[1]), ("c", ps[2])]
    cases = {
        "groups[0] is a Parameter, not a list of parameters": [ps[0], ps[1]],
        "groups[1] is a int, not a list of parameters": [[ps[0]], 3],
        "groups[0] holds a str, not a parameter": [[ps[0], "b"]],
        "groups[1] holds a tensor of shape (4,) that the optimizer does not update": [
            [ps[0]],
            [torch.nn.Parameter(torch.zeros(4))],
        ],
        "parameter b is in groups[0] and groups[1]: a parameter belongs to one group at most": [
            [ps[0], ps[1]],
            [ps[2], ps[1]],
        ],
    }
    for message, groups in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            wrap(ps, named_parameters=named, groups=groups)
    # Without named_parameters a parameter is named by its place in the optimizer.
    with pytest.raises(ValueError, match=r"parameter param\.2 is in groups"):
        wrap(ps, groups=[[ps[2]], [ps[2]]])


def test_groups_with_an_explicit_fusion_threshold_are_refused() -> None:
    ps = params(2)
    with pytest.raises(ValueError, match="fusion_threshold=1024 with groups: both decide"):
        wrap(ps, groups=[ps], fusion_threshold=1024)
    with pytest.raises(ValueError, match="fusion_threshold=64 with groups"):
        wrap(ps, num_groups=1, fusion_threshold=64)
