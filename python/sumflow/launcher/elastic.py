"""``sumflow-run`` for an elastic job: workers that fail, leave and join while it trains.

Each membership *epoch* is a job of its own: this launcher starts a fresh coordinator and
fresh summation servers for it, so no round can mix two memberships, while the worker
processes live on from epoch to epoch and take their places from the launcher's
rendezvous (:mod:`sumflow.jobenv.elastic`). An epoch ends when a member fails or leaves it
(``sumflow.torch.elastic.run`` interrupts training at a commit when workers wait to join);
the launcher then stops its services and forms the next from the workers alive. Who
takes part is :mod:`sumflow.launcher.membership`'s bookkeeping; docs/elastic.md tells the
whole story.
"""

from __future__ import annotations

import queue
import signal
import socketserver
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from sumflow import settings
from sumflow._programs import program
from sumflow.jobenv import elastic as wire
from sumflow.launcher.errors import ConfigError
from sumflow.launcher.hosts import Host, join_host_port, parse_host_entry, split_host_port
from sumflow.launcher.membership import Epoch, Membership, Worker
from sumflow.launcher.plan import LOCAL_HOST, ElasticPlan, ProcSpec, build_servers
from sumflow.launcher.supervise import (
    Child,
    Launcher,
    describe_exit,
    exit_status,
    remove_shared_memory,
)

#: How long one connection to the rendezvous may take to send its request.
_REQUEST_READ_TIMEOUT = 5.0
#: How long the discovery script may run.
_DISCOVERY_TIMEOUT = 10.0
#: How long a new epoch waits for the servers started by hand that served the last one
#: to ask for a place in it (they are leaving the old one).
_SETTLE = 5.0
#: Consecutive epochs that may fail to start (their coordinator or a server exiting
#: before any member left) before the job gives up.
_MAX_FAILED_STARTS = 3


class Rendezvous(socketserver.ThreadingTCPServer):
    """The launcher's side of :mod:`sumflow.jobenv.elastic`: each request, checked, goes to
    ``answer``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, bind: tuple[str, int], token: str, answer: Any) -> None:
        self.token = token
        self.answer = answer
        #: Nonces of the requests taken within the clock-skew window, by arrival time.
        self._nonces: dict[str, float] = {}
        self._nonces_lock = threading.Lock()
        super().__init__(bind, _RendezvousHandler)

    def fresh(self, nonce: str) -> bool:
        """Whether `nonce` is new (it is remembered for the clock-skew window twice over,
        so a replay of a request signed within the window is refused)."""
        now = time.monotonic()
        with self._nonces_lock:
            if nonce in self._nonces:
                return False
            self._nonces[nonce] = now
            if len(self._nonces) > 4096:
                horizon = now - 2 * wire.MAX_CLOCK_SKEW
                self._nonces = {n: t for n, t in self._nonces.items() if t >= horizon}
            return True

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server_address[:2]
        return str(host), int(port)


class _RendezvousHandler(socketserver.StreamRequestHandler):
    server: Rendezvous

    def handle(self) -> None:
        self.connection.settimeout(_REQUEST_READ_TIMEOUT)
        try:
            line = self.rfile.readline(wire.MAX_LINE + 1)
            reply = self._reply(line)
            self.wfile.write(wire.encode(reply))
        except OSError:
            return  # a client that hung up or stalled: nothing was changed

    def _reply(self, line: bytes) -> dict[str, Any]:
        try:
            message = wire.decode(line)
        except ValueError as e:
            return {"error": f"malformed request: {e}"}
        refused = wire.verify(message, self.server.token)
        if refused is not None:
            return {"error": refused}
        if not self.server.fresh(str(message["nonce"])):
            return {"error": "a request seen before (a replay)"}
        worker, op, after = message.get("worker"), message.get("op"), message.get("after", -1)
        epoch = message.get("epoch", -1)
        if not isinstance(worker, str) or not isinstance(op, str):
            return {"error": "a request names its worker and op"}
        for value in (after, epoch):
            if not isinstance(value, int) or isinstance(value, bool):
                return {"error": "epoch numbers are integers"}
        # A request for a place says after which epoch; "updates" names the one it is in.
        reply: dict[str, Any] = self.server.answer(worker, op, epoch if op == "updates" else after)
        return reply


class ElasticLauncher(Launcher):
    """Runs an elastic job to its end (see the module docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.plan.elastic is not None, "an elastic plan"
        self.elastic: ElasticPlan = self.plan.elastic
        self.membership = Membership(
            self.elastic.min_np, self.elastic.max_np, self.elastic.blacklist_after
        )
        self._lock = threading.Lock()
        self._rendezvous: Rendezvous | None = None
        self._rendezvous_addr = ""
        self._worker_of: dict[int, Worker] = {}
        #: The current epoch's coordinator and servers, and its job id.
        self._services: list[Child] = []
        self._services_job = ""
        self._failed_starts = 0
        #: When the job last had an epoch running, for --elastic-timeout.
        self._short_since: float | None = None
        self._next_discovery = 0.0
        #: Where the CPU servers of the next epoch run (ssh host, None: this machine).
        self._cpu_hosts: list[str | None] = [
            self.plan.cpu_server_hosts[k] if self.plan.cpu_server_hosts else None
            for k in range(self.plan.cpu_servers)
        ]
        self._last_exit = 0
        self._any_success = False

    # -- the rendezvous ----------------------------------------------------------------

    def _answer(self, worker: str, op: str, after: int) -> dict[str, Any]:
        with self._lock:
            reply, ends = self.membership.ask(worker, op, after)
            if ends is not None:
                self.membership.end(ends, time.monotonic())
        if reply.get("wait"):
            reply["patience"] = self.elastic.timeout + 2 * self.plan.start_timeout
        return reply

    def _start_rendezvous(self) -> None:
        bind_host, _ = split_host_port(self.plan.coordinator_bind, "--coordinator-bind")
        bind = (bind_host, self.elastic.rendezvous_port)
        try:
            self._rendezvous = Rendezvous(bind, self._token_text(), self._answer)
        except OSError as e:
            raise ConfigError(
                f"the elastic rendezvous cannot listen on {bind_host}:{bind[1]}: {e}"
            ) from None
        threading.Thread(target=self._rendezvous.serve_forever, daemon=True).start()
        _, port = self._rendezvous.address
        dial = bind_host
        if self.plan.coordinator_addr is not None:
            dial, _ = split_host_port(
                self.plan.coordinator_addr, "--coordinator-addr", port_required=False
            )
        self._rendezvous_addr = join_host_port(dial, port)
        self.out.message(
            f"elastic rendezvous at {self._rendezvous_addr} (a CPU machine lends its cores "
            f"with: sumflow-server --elastic {self._rendezvous_addr} and the job's token)"
        )

    def _token_text(self) -> str:
        if self.plan.token_file is not None:
            return self.plan.token_file.read_text().strip()
        return self._token

    # -- entry -------------------------------------------------------------------------

    def _run(self) -> int:
        self._warn_dropped_settings()
        self._prepare_token()
        try:
            self._start_rendezvous()
        except ConfigError as e:
            self.out.message(f"error: {e}")
            return 1
        try:
            return self._drive()
        finally:
            self._stop_services()
            if self._rendezvous is not None:
                self._rendezvous.shutdown()
                self._rendezvous.server_close()

    def _drive(self) -> int:
        el = self.elastic
        with self._lock:
            hosts = [
                (host_id if ssh is None else ssh, size) for host_id, ssh, size in self.plan.machines
            ]
            if el.discovery_script is not None:
                found = self._discover(el.discovery_script, "--host-discovery-script")
                if found is not None:
                    hosts = found
            if el.server_discovery_script is not None:
                servers = self._discover(el.server_discovery_script, "--server-discovery-script")
                if servers is not None:
                    self._cpu_hosts = _server_hosts(servers)
            self.membership.update_hosts(hosts)
            initial = self.membership.free_slots()[: el.initial]
        if len(initial) < el.min_np:
            self.out.message(
                f"error: only {len(initial)} slot{'s' if len(initial) != 1 else ''} to start "
                f"workers on, fewer than --min-np {el.min_np}"
            )
            return 1
        for host, slot in initial:
            if not self._start_worker(host, slot):
                return 1
        started = time.monotonic()
        while True:
            if self._signals:
                return self._stop_for_signal()
            self._poll_discovery()
            code = self._handle_exits()
            if code is not None:
                return code
            with self._lock:
                epoch = self.membership.epoch
                ended = epoch is not None and epoch.ended is not None
                live = self.membership.live()
            if ended and self._services:
                assert epoch is not None
                self.out.message(f"epoch {epoch.number} ended: {epoch.ended}")
                self._stop_services()
            if not live:
                return 0 if self._any_success else exit_status(self._last_exit) or 1
            if self._any_success:
                pass
            elif epoch is None or ended:
                first = epoch is None
                everyone_asked = all(w.asked_after is not None for w in live)
                if (
                    first
                    and not everyone_asked
                    and time.monotonic() - started < self.plan.start_timeout
                ):
                    time.sleep(0.05)
                    continue
                code = self._next_epoch()
                if code is not None:
                    return code
            else:
                self._fill_slots()
            time.sleep(0.05)

    # -- workers -----------------------------------------------------------------------

    def _start_worker(self, host: str, slot: int) -> bool:
        with self._lock:
            w = self.membership.started(host, slot)
        env = {
            settings.ELASTIC_ADDR.name: self._rendezvous_addr,
            settings.ELASTIC_WORKER.name: w.name,
            **self.plan.worker_env,
        }
        ssh_host = None if host == LOCAL_HOST else host
        spec = ProcSpec(f"worker {w.name}", "worker", list(self.plan.command), env, ssh_host)
        child, _ = self._start(spec)
        if child is None:
            with self._lock:
                self.membership.exited(w.name, failed=True)
            return False
        self._worker_of[child.pid] = w
        if self.plan.verbose or self.membership.epoch is not None:
            self.out.message(f"started {child.describe()} on slot {slot} of {host}")
        return True

    def _fill_slots(self) -> None:
        with self._lock:
            free = self.membership.free_slots()
        for host, slot in free:
            self._start_worker(host, slot)

    def _handle_exits(self) -> int | None:
        """Takes the exits reported so far; an exit status when the job must stop."""
        while True:
            try:
                child = self._events.get_nowait()
            except queue.Empty:
                return None
            code = child.returncode or 0
            w = self._worker_of.get(child.pid)
            if w is None:
                self._service_exited(child, code)
                continue
            failed = code != 0
            with self._lock:
                note, ends = self.membership.exited(w.name, failed)
                if ends:
                    self.membership.end(
                        f"{child.describe()} {describe_exit(code)}", time.monotonic()
                    )
            if failed:
                self._last_exit = code
                self.out.message(f"{child.describe()} {describe_exit(code)}")
            elif w.leave is not None:
                self.out.message(f"{child.describe()} left the job: {w.leave}")
            elif not self._any_success:
                # The training is over: as in Horovod, the job now only waits for the
                # others to finish, and forms no more memberships; workers that were
                # waiting to join are told to leave.
                self._any_success = True
                self.out.message(f"{child.describe()} finished; waiting for the others")
                with self._lock:
                    self.membership.finished = True
                    epoch = self.membership.epoch
                    for other in self.membership.live():
                        if epoch is None or other.name not in epoch.places:
                            other.leave = "the training has finished"
            if note:
                self.out.message(note)

    def _service_exited(self, child: Child, code: int) -> None:
        if child not in self._services or self._any_success or code == 0:
            # An ended epoch's service, stopped on purpose, a finished job's, or one whose
            # workers all left cleanly (they finish, or ask for the next membership).
            return
        with self._lock:
            epoch = self.membership.epoch
            if epoch is None or epoch.ended is not None:
                return
            self.membership.end(f"{child.describe()} {describe_exit(code)}", time.monotonic())
            started = epoch.placed == set(epoch.members)
        # An epoch that never got all its workers in is a failed start; one that trained
        # and then lost a server is a failure like a worker's.
        self._failed_starts = 0 if started else self._failed_starts + 1

    # -- epochs ------------------------------------------------------------------------

    def _next_epoch(self) -> int | None:
        """Forms and starts the next epoch when enough workers are there; an exit status
        when the job cannot go on."""
        el = self.elastic
        with self._lock:
            candidates = self.membership.candidates()
        with self._lock:
            hand = self.membership.hand_servers_ready()
            settling = self.membership.hand_servers_settling()
            ended_at = self.membership.epoch.ended_at if self.membership.epoch else None
        if settling and ended_at is not None and time.monotonic() - ended_at < _SETTLE:
            return None  # servers started by hand are still leaving the last epoch
        if not self.plan.colocated and not self._cpu_hosts and not hand:
            return self._short("no CPU server is listed (--no-colocated needs one)")
        if len(candidates) < el.min_np:
            return self._short(
                f"{len(candidates)} worker{'s' if len(candidates) != 1 else ''} left, fewer "
                f"than --min-np {el.min_np}"
            )
        if self._failed_starts >= _MAX_FAILED_STARTS:
            self.out.message(
                f"error: {self._failed_starts} epochs in a row failed before training "
                "(see the messages above); stopping"
            )
            return 1
        self._short_since = None
        with self._lock:
            epoch = self.membership.form()
        return self._start_services(epoch, list(self._cpu_hosts))

    def _short(self, why: str) -> int | None:
        """Waits, up to --elastic-timeout, for what the next epoch lacks; an exit status
        once that has run out."""
        el = self.elastic
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
            self.out.message(f"{why}; waiting up to {el.timeout:g} s (--elastic-timeout)")
            self._fill_slots()
        elif now - self._short_since > el.timeout:
            self.out.message(f"error: {why} for {el.timeout:g} s (--elastic-timeout); stopping")
            return 1
        return None

    def _start_services(self, epoch: Epoch, cpu_hosts: list[str | None]) -> int | None:
        plan = self.plan
        machines = epoch.machines
        job = f"{self._job_id}-e{epoch.number}"
        addr_file = self._tmp_path(f"coordinator-{epoch.number}")
        argv = [
            *program("sumflow-coordinator"),
            "--bind",
            plan.coordinator_bind,
            "--workers",
            str(len(epoch.members)),
            "--servers",
            str(
                (len(machines) if plan.colocated else 0) + len(cpu_hosts) + len(epoch.hand_servers)
            ),
            "--addr-file",
            str(addr_file),
            "--job-id",
            job,
            *plan.coordinator_args,
        ]
        spec = ProcSpec(f"coordinator e{epoch.number}", "coordinator", argv, dict(plan.service_env))
        coordinator, code = self._start(spec)
        if coordinator is None:
            return code
        self._services = [coordinator]
        self._services_job = job
        bound, code = self._await_address(coordinator, addr_file)
        if bound is None:
            return code
        address = self._dial_address(bound)
        servers = build_servers(
            plan,
            address,
            [(host, None if host == LOCAL_HOST else host) for host, _ in machines],
            cpu_hosts,
        )
        for s in servers:
            s.name = f"{s.name} e{epoch.number}"
            child, code = self._start(s)
            if child is None:
                return code
            self._services.append(child)
        with self._lock:
            epoch.coordinator = address
        shape = ", ".join(f"{host}: {count}" for host, count in machines)
        cpu = ""
        cpus = len(cpu_hosts) + len(epoch.hand_servers)
        if cpus:
            cpu = f", {cpus} CPU server{'s' if cpus != 1 else ''}"
            if epoch.hand_servers:
                cpu += f" ({len(epoch.hand_servers)} started by hand)"
        self.out.message(
            f"epoch {epoch.number}: {len(epoch.members)} worker"
            f"{'s' if len(epoch.members) != 1 else ''} ({shape}){cpu}"
        )
        return None

    def _stop_services(self) -> None:
        """Stops the current epoch's coordinator and servers and waits for them."""
        services, self._services = self._services, []
        for c in services:
            c.close_stdin()
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.plan.kill_timeout
        for c in services:
            if not c.done.wait(max(0.0, deadline - time.monotonic())):
                c.signal(signal.SIGKILL)
                c.done.wait(5)
        if self._services_job:
            remove_shared_memory(self._services_job)

    def _tmp_path(self, name: str) -> Path:
        assert self._tmp is not None
        return self._tmp / name

    # -- discovery ---------------------------------------------------------------------

    def _discover(self, script: list[str], flag: str) -> list[tuple[str, int]] | None:
        """The hosts and counts a discovery script lists now; None (with a message) when it
        fails."""
        try:
            done = subprocess.run(
                script, capture_output=True, text=True, timeout=_DISCOVERY_TIMEOUT, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            self.out.message(f"warning: {flag} failed: {e}; keeping the hosts")
            return None
        if done.returncode != 0:
            self.out.message(
                f"warning: {flag} exited with code {done.returncode}: "
                f"{done.stderr.strip()[-300:]}; keeping the hosts"
            )
            return None
        hosts: list[tuple[str, int]] = []
        try:
            for line in done.stdout.splitlines():
                if line.strip():
                    host, _ = parse_host_entry(line, flag)
                    hosts.append((_name_of(host), host.slots))
        except ConfigError as e:
            self.out.message(f"warning: {e}; keeping the hosts")
            return None
        return hosts

    def _poll_discovery(self) -> None:
        el = self.elastic
        if time.monotonic() < self._next_discovery:
            return
        self._next_discovery = time.monotonic() + el.discovery_interval
        if el.discovery_script is not None:
            found = self._discover(el.discovery_script, "--host-discovery-script")
            if found is not None:
                with self._lock:
                    changes = self.membership.update_hosts(found)
                for change in changes:
                    self.out.message(f"discovery: {change}")
        if el.server_discovery_script is not None:
            servers = self._discover(el.server_discovery_script, "--server-discovery-script")
            if servers is not None and _server_hosts(servers) != self._cpu_hosts:
                self._cpu_hosts = _server_hosts(servers)
                with self._lock:
                    self.membership.servers_changed = True
                where = ", ".join(h or LOCAL_HOST for h in self._cpu_hosts) or "none"
                self.out.message(
                    f"server discovery: {len(self._cpu_hosts)} CPU servers ({where}) from the "
                    "next commit"
                )


def _server_hosts(listed: list[tuple[str, int]]) -> list[str | None]:
    """One entry per CPU server a server discovery script lists: its ssh host, or None
    for this machine."""
    return [None if host == LOCAL_HOST else host for host, count in listed for _ in range(count)]


def _name_of(host: Host) -> str:
    """The name a discovered host is known by: ``localhost`` for this machine."""
    return LOCAL_HOST if host.address in ("localhost", "127.0.0.1", "::1") else host.name
