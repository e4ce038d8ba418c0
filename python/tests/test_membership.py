"""The bookkeeping of an elastic job's membership (``sumflow.launcher.membership``):
slots, failures and the blacklist, discovery, epochs and their ranks, and the rendezvous
answers, without any process."""

from __future__ import annotations

import pytest

from sumflow.launcher.membership import Membership


def job(
    hosts: list[tuple[str, int]], min_np: int = 1, max_np: int = 64, after: int = 2
) -> Membership:
    m = Membership(min_np, max_np, after)
    m.update_hosts(hosts)
    return m


def start_all(m: Membership) -> list[str]:
    names = [m.started(h, s).name for h, s in m.free_slots()]
    for n in names:
        m.ask(n, "assignment", -1)
    return names


def test_bad_bounds_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--min-np"):
        Membership(0, 4, 1)
    with pytest.raises(ValueError, match="--max-np 2 is below --min-np 3"):
        Membership(3, 2, 1)
    with pytest.raises(ValueError, match="--blacklist-after"):
        Membership(1, 2, 0)


def test_slots_fill_in_host_order_up_to_max_np() -> None:
    m = job([("a", 2), ("b", 2)], max_np=3)
    assert m.free_slots() == [("a", 0), ("a", 1), ("b", 0)]


def test_epoch_groups_ranks_by_machine_and_keeps_survivors_first() -> None:
    m = job([("a", 2), ("b", 2)])
    names = start_all(m)
    e0 = m.form()
    assert e0.number == 0
    assert e0.members == names
    assert [(p.rank, p.local_rank, p.local_size, p.host) for p in e0.places.values()] == [
        (0, 0, 2, "a"),
        (1, 1, 2, "a"),
        (2, 0, 2, "b"),
        (3, 1, 2, "b"),
    ]
    assert e0.machines == [("a", 2), ("b", 2)]
    # The first worker fails: rank 0 goes to the oldest survivor, machines stay whole.
    note, ends = m.exited(names[0], failed=True)
    assert ends
    assert note is None
    m.end("w0 failed")
    e1 = m.form()
    assert e1.number == 1
    assert e1.members == names[1:]
    assert e1.places[names[1]].rank == 0
    assert e1.machines == [("a", 1), ("b", 2)]


def test_a_failed_slot_is_not_used_again_and_the_host_is_blacklisted_at_the_threshold() -> None:
    m = job([("a", 2), ("b", 2)], after=2)
    names = start_all(m)
    m.form()
    m.exited(names[0], failed=True)
    assert m.free_slots() == []  # a/0 retired
    note, _ = m.exited(names[1], failed=True)
    assert note is not None
    assert "host a blacklisted after 2 failures" in note
    assert "a" in m.blacklisted
    # A host listed again after it disappeared gets fresh slots, unless blacklisted.
    m.update_hosts([("b", 2)])
    m.update_hosts([("a", 2), ("b", 2)])
    assert m.free_slots() == []
    m2 = job([("a", 1)], after=5)
    [w] = start_all(m2)
    m2.form()
    m2.exited(w, failed=True)
    assert m2.free_slots() == []
    m2.update_hosts([])
    m2.update_hosts([("a", 1)])
    assert m2.free_slots() == [("a", 0)]


def test_workers_of_a_blacklisted_or_unlisted_host_must_leave() -> None:
    m = job([("a", 1), ("b", 2)], after=1)
    names = start_all(m)
    e0 = m.form()
    e0.coordinator = "c:1"
    m.exited(names[1], failed=True)  # b blacklisted at once
    assert m.workers[names[2]].leave == "host b is blacklisted"
    m.end("b failed")
    assert [w.name for w in m.candidates()] == [names[0]]
    reply, _ = m.ask(names[2], "assignment", 0)
    assert reply == {"leave": "host b is blacklisted"}
    m3 = job([("a", 2)])
    ns = start_all(m3)
    m3.form().coordinator = "c:1"
    m3.update_hosts([("a", 1)])
    assert m3.workers[ns[1]].leave == "host a slot 1 is no longer listed"
    assert m3.pending()


def test_rendezvous_answers_in_order() -> None:
    m = job([("a", 2)])
    w0 = m.started("a", 0).name
    reply, ends = m.ask(w0, "assignment", -1)
    assert reply == {"wait": True}
    assert ends is None
    assert m.ask("w9", "assignment", -1)[0] == {"error": "'w9' is not a running worker of this job"}
    assert "error" in m.ask(w0, "bogus", -1)[0]
    w1 = m.started("a", 1).name
    m.ask(w1, "assignment", -1)
    e0 = m.form()
    # Formed but its coordinator not listening yet: wait.
    assert m.ask(w0, "assignment", -1)[0] == {"wait": True}
    e0.coordinator = "127.0.0.1:5"
    reply, _ = m.ask(w1, "assignment", -1)
    assert e0.placed == {w1}
    assert reply == {
        "epoch": 0,
        "coordinator": "127.0.0.1:5",
        "rank": 1,
        "size": 2,
        "local_rank": 1,
        "local_size": 2,
        "host_id": "a",
    }
    # A member asking for a later epoch has left this one: it ends.
    reply, ends = m.ask(w1, "assignment", 0)
    assert reply == {"wait": True}
    assert ends == "worker 1 (w1) left epoch 0"


def test_a_new_worker_is_pending_until_the_next_epoch_takes_it() -> None:
    m = job([("a", 3)], max_np=3)
    w0, w1 = (m.started("a", s).name for s in (0, 1))
    for w in (w0, w1):
        m.ask(w, "assignment", -1)
    m.form().coordinator = "c:1"
    assert not m.pending()
    late = m.started("a", 2).name
    assert not m.pending()  # still starting: no epoch waits for it
    assert m.ask(late, "updates", 0)[0] == {"pending": False}
    m.ask(late, "assignment", -1)
    assert m.pending()
    m.end("interrupted")
    e1 = m.form()
    assert e1.members == [w0, w1, late]
    assert e1.places[late].rank == 2
    assert not m.pending()


def test_workers_that_exit_cleanly_do_not_end_the_epoch_or_count_as_failures() -> None:
    m = job([("a", 2)])
    names = start_all(m)
    m.form()
    note, ends = m.exited(names[0], failed=False)
    assert note is None
    assert not ends
    assert not m.failures


def test_a_change_of_servers_is_pending_until_the_next_epoch() -> None:
    m = job([("a", 2)])
    start_all(m)
    m.servers_changed = True
    assert not m.pending()  # no epoch yet: the first one takes the servers as they are
    m.form()
    assert not m.servers_changed
    m.servers_changed = True
    assert m.pending()
    m.end("interrupted")
    m.form()
    assert not m.pending()


def test_servers_started_by_hand_join_at_the_next_epoch_and_retire() -> None:
    m = job([("a", 2)])
    start_all(m)
    e0 = m.form()
    e0.coordinator = "c:1"
    # A server asks: the running epoch goes on without it, and must change for it.
    assert m.ask("lender", "serve", -1) == ({"wait": True}, None)
    assert m.pending()
    assert m.ask("w9", "retire", -1)[0] == {"error": "'w9' is not a summation server of this job"}
    m.end("interrupted")
    e1 = m.form()
    assert e1.hand_servers == ["lender"]
    e1.coordinator = "c:2"
    assert m.ask("lender", "serve", -1)[0] == {
        "epoch": 1,
        "coordinator": "c:2",
        "host_id": "cpu-lender",
    }
    assert not m.pending()
    # Its epoch ended without the workers leaving it: the server left it (died, stopped).
    assert m.ask("lender", "serve", 1) == ({"wait": True}, "summation server lender left epoch 1")
    m.end("lender left")
    assert m.hand_servers_settling() == []  # it has asked for the next one already
    e2 = m.form()
    assert e2.hand_servers == ["lender"]
    e2.coordinator = "c:3"
    # Retiring: it serves the running epoch to its end, then is told to leave.
    assert m.ask("lender", "retire", -1)[0] == {"ok": True}
    assert m.pending()
    assert m.ask("lender", "serve", 1)[0]["epoch"] == 2
    m.end("interrupted")
    assert m.ask("lender", "serve", 2)[0] == {"leave": "it retired"}
    assert m.form().hand_servers == []


def test_a_server_that_has_not_asked_again_is_waited_for_then_left_out() -> None:
    m = job([("a", 1)])
    start_all(m)
    m.ask("lender", "serve", -1)
    assert m.form().hand_servers == ["lender"]  # there before the first epoch: in it
    m.end("a worker failed")
    assert m.hand_servers_settling() == ["lender"]  # still leaving epoch 0, or dead
    assert m.form().hand_servers == []
    m.finished = True
    assert m.ask("lender", "serve", 1)[0] == {"leave": "the training has finished"}
