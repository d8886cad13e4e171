"""The local testbed: Fed Server, Main Server and device agents as separate processes on loopback,
or with real links, each device's agent in a network namespace of its own behind a shaped link
(:mod:`testbed.links`)."""
from __future__ import annotations

import math
import secrets
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from shared.config import RunConfig
from shared.imports import is_import_path
from shared.profiles import parse_kind
from shared.ranges import consecutive_runs
from testbed.errors import TestbedError
from testbed.follow import FollowError, ProgressFn, ResumedFn, fetch_status, follow_run
from testbed.links import LinksNetwork, check_host
from testbed.processes import ProcessGroup, SecretFiles, Service, free_port, split_evenly, wait_healthy
from testbed.warm_start import WarmStarter


@dataclass(frozen=True)
class TlsFiles:
    """Certificate and key the servers serve HTTPS with, and the CA everyone verifies against."""

    cert: str
    key: str
    ca: str


#: How the testbed's devices enrol (``--enrolment``): ``secret``, every agent with the run's shared
#: enrolment secret; ``credentials``, each agent with its own enrolment credential covering exactly
#: its shards, issued under a per-run enrolment key (docs/security.md, "Enrolment credentials").
ENROLMENTS = ("secret", "credentials")

#: Seconds an interrupted testbed's processes get after SIGTERM before they are killed.
INTERRUPT_STOP_S = 1.5

#: The device-id prefix the testbed gives its agents' shards (``--prefix``: given, not left to the
#: agent's default or ``SFL_PREFIX``), which their credentials' shard ranges name.
AGENT_PREFIX = "dev"


def main_servers_for(split_mode: str) -> int:
    """Main Server processes a run needs by default: one, none for a split-depth-zero algorithm
    (FedAvg, FedBC, ...), which never calls it and would hold its memory idle (measured:
    benchmarks/results/2026-11-24_eval-batch-and-no-main-server/no_main_server.json)."""
    return 0 if split_mode == "zero" else 1


class Testbed:
    """Starts every process of one run, follows its progress, stops everything at the end."""

    __test__ = False  # not a pytest test class

    def __init__(self, config: RunConfig, run_dir: str | Path, agents: int = 1, host: str = "127.0.0.1",
                 log_level: str = "INFO", auth: bool = True, tls: TlsFiles | None = None,
                 device_data: list[str] | None = None, data_args: Sequence[str] = (),
                 torch_device: str | None = None,
                 main_servers: int | None = None, warm: WarmStarter | None = None,
                 enrolment: str = "secret", real_links: bool = False, agent_per_device: bool = False,
                 rtt_ms: float = 0.0, server_args: Sequence[str] = ()) -> None:
        """``main_servers``: Main Server processes (replicas); the Fed Server gets every URL
        (docs/deployment.md, "Main Server replicas"). None: :func:`main_servers_for` the
        algorithm's split mode (``python -m testbed`` passes the number: its launcher never
        imports the algorithms, which import torch). ``warm``: fork the processes from this warm
        starter (:mod:`testbed.warm_start`; the integration tests do) instead of ``python -m``.
        ``device_data``: for a ``dataset="local"`` run, one agent process per path, started with
        ``--data PATH`` (``agents`` is then unused); otherwise ``agents`` processes share the shards.
        ``data_args``: ``KEY=VALUE`` strings each of those agents gets as ``--data-arg`` (the
        keywords of a data function; the agent checks them).
        ``torch_device``: ``--torch-device`` of all three services; None: theirs (env or cpu).
        ``enrolment``: one of :data:`ENROLMENTS` (with ``auth``); ``credentials`` needs a built-in
        data set, whose shards the credentials name.
        ``agent_per_device``: one agent process per device (``agents`` is then unused), each
        emulating its device's kind, transfers included, on loopback. ``real_links``: the same
        layout with each agent in a network namespace of its own behind a link shaped to its kind's
        rate times ``devices.time_scale`` (:mod:`testbed.links`; Linux, root, iproute2); the
        servers listen on the network's service address, known once started. ``rtt_ms``: a
        round-trip delay every agent adds to each request (``--request-delay-ms``). ``server_args``:
        flags both servers get besides the testbed's (``--record-received DIR``: recording what they receive)."""
        if enrolment not in ENROLMENTS:
            raise TestbedError(f"enrolment {enrolment!r}: one of {', '.join(ENROLMENTS)}")
        if enrolment == "credentials" and device_data:
            raise TestbedError("--enrolment credentials covers the shards of a built-in data set; a run with "
                               "--device-data enrols with the shared secret (or issue its devices' credentials with "
                               "python -m fed_server credentials issue --devices)")
        self.config = config
        self.torch_device = torch_device
        self.device_data = list(device_data or [])
        self.data_args = list(data_args)
        if self.data_args and not self.device_data:
            raise TestbedError("--data-arg is for the functions of --device-data")
        if (config.data.dataset == "local") != bool(self.device_data):
            raise TestbedError("a run with data.dataset: local needs --device-data PATH (each device's own data)"
                               if self.device_data == [] else
                               "--device-data is for runs with data.dataset: local; this run partitions "
                               f"the built-in data set {config.data.dataset!r}")
        if not (math.isfinite(rtt_ms) and rtt_ms >= 0):
            raise TestbedError(f"rtt {rtt_ms} ms: a number of milliseconds >= 0")
        self.run_dir = Path(run_dir)
        self.agents = max(1, agents)
        self.agent_per_device = agent_per_device or real_links
        self.rtt_ms = rtt_ms
        self.server_args = list(server_args)
        self.log_level = log_level
        self.tls = tls
        self.network = self._links_network(config) if real_links else None
        if main_servers is None:
            from shared.algorithms.registry import build_algorithm   # torch: only for callers that have it

            main_servers = main_servers_for(build_algorithm(config).split_mode())
        self.main_servers = main_servers
        if self.network is None:
            self._listen_on(host)
        # Fresh secrets per run, handed to the children as owner-only files (never on a command
        # line or in their environment, where `ps eww` would show them; see SecretFiles), each
        # named by its flag: --<name>-file PATH.
        self.enrolment = enrolment
        enrolling = {"enrolment-secret": secrets.token_hex(16)} if enrolment == "secret" else {
            "enrolment-key": secrets.token_hex(32)}
        self.secrets = {"service-secret": secrets.token_hex(32), **enrolling} if auth else {}
        self.secret_files: SecretFiles | None = None
        self.verify: bool | str = tls.ca if tls else True
        self.processes = ProcessGroup(self.run_dir / "logs", warm)
        self.fed: Service | None = None
        self.main: Service | None = None   # the first Main Server replica
        self.mains: list[Service] = []
        self.agent_services: list[Service] = []
        self.status_patience_s = 120.0   # how long status requests may fail before follow() gives up

    def _links_network(self, config: RunConfig) -> LinksNetwork:
        """The real-links network of this run's devices (made by :meth:`start`): each device's link
        shaped to its kind's rate times ``devices.time_scale``; TestbedError where it cannot be."""
        devices = config.devices
        if self.device_data:
            raise TestbedError("real links run a built-in data set's shards, one agent per device; not --device-data")
        if self.tls:
            raise TestbedError("real links: the testbed's TLS certificates name loopback, not the service address")
        if not devices.profiles:
            raise TestbedError("real links shape each device's link to its kind's rate: devices.profiles must name kinds")
        if devices.time_scale == "auto":
            raise TestbedError("real links shape each device's link to its kind's rate times devices.time_scale, which "
                               "must be a number here, not auto (e.g. --set devices.time_scale=20)")
        check_host()
        return LinksNetwork([parse_kind(self._kind(i)).rate * devices.time_scale
                             for i in range(config.data.num_devices)])

    def _kind(self, device: int) -> str:
        """The emulated kind of device (shard) ``device``: the run's kinds go round-robin."""
        kinds = self.config.devices.profiles
        return kinds[device % len(kinds)]

    def _listen_on(self, host: str) -> None:
        """Pick the servers' ports on ``host`` and their URLs."""
        scheme = "https" if self.tls else "http"
        self.host = host
        self.fed_port = free_port(host)
        ports = [self.fed_port, *(free_port(host) for _ in range(self.main_servers))]
        self.fed_url = f"{scheme}://{host}:{self.fed_port}"
        self.main_urls = [f"{scheme}://{host}:{port}" for port in ports[1:]]
        # The first replica (the only one by default); None without a Main Server.
        self.main_port: int | None = ports[1] if self.main_servers else None
        self.main_url: str | None = self.main_urls[0] if self.main_servers else None

    def start(self, healthy_s: float = 120.0) -> None:
        """Make the real-links network (with real links), write the config, start the servers and
        the agents, wait until the servers are healthy (at most ``healthy_s`` each: a Fed Server
        generating a large data set listens only once it is written)."""
        if self.network is not None:
            self.network.create()
            self._listen_on(self.network.service_address)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.run_dir / "testbed-config.yaml"
        config_path.write_text(yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False))
        common = ["--log-level", self.log_level, *self._torch_device_args(), *self.server_args]
        if self.tls:
            common += ["--tls-cert", self.tls.cert, "--tls-key", self.tls.key, "--ca-file", self.tls.ca]
        if self.secrets:
            self.secret_files = SecretFiles(self.secrets)
        self.fed = self.processes.start("fed_server", "fed_server", [
            "--host", self.host, "--port", str(self.fed_port), "--config", str(config_path),
            "--run-dir", str(self.run_dir), *(a for url in self.main_urls for a in ("--main-server-url", url)),
            *common, *self._secret_args("service-secret", "enrolment-secret", "enrolment-key")])
        # One log per replica: main_server.log for the first (as with one), main_server-<i>.log after.
        self.mains = [self.processes.start("main_server" if i == 0 else f"main_server-{i}", "main_server", [
            "--host", self.host, "--port", url.rsplit(":", 1)[1], "--fed-server-url", self.fed_url, *common,
            *self._model_args(), *self._secret_args("service-secret")]) for i, url in enumerate(self.main_urls)]
        self.main = self.mains[0] if self.mains else None
        # The agents start beside the servers (each waits for the Fed Server's run spec): their
        # imports and data loading overlap the servers' instead of following them.
        if self.device_data:
            for i, path in enumerate(self.device_data):
                self.agent_services.append(self.start_agent(f"agent-{i}", data=path, index=i))
        elif self.agent_per_device:
            for i in range(self.config.data.num_devices):
                self.agent_services.append(self.start_agent(f"agent-{i}", [i]))
        else:
            for i, chunk in enumerate(self.agent_chunks(list(range(self.config.data.num_devices)))):
                self.agent_services.append(self.start_agent(f"agent-{i}", chunk))
        wait_healthy(self.fed_url, self.fed, healthy_s, verify=self.verify)
        for url, main in zip(self.main_urls, self.mains):
            wait_healthy(url, main, healthy_s, verify=self.verify)

    def agent_chunks(self, shards: list[int]) -> list[list[int]]:
        """The shards of each agent process the testbed starts: ``shards`` over its ``agents``."""
        return split_evenly(shards, self.agents)

    def start_agent(self, name: str, shards: list[int] | None = None, data: str | None = None, index: int = 0,
                    module: str = "device_agent", extra: Sequence[str] = ()) -> Service:
        """Start one agent process hosting the devices of ``shards``, or those of the local data at
        ``data`` (the ``index``-th such agent: its devices' ids start ``dev<index>-`` so two files
        with the same name in different folders stay two devices, and the emulated kinds go on
        round-robin from ``index``). ``module``: the agent's program, ``python -m device_agent`` or
        one that takes its arguments (the attack benchmark's ``benchmarks.adversary``), given
        ``extra`` arguments of its own. With one agent per device, ``shards`` is that device's
        alone and the agent is given its kind alone; with real links it starts in the device's
        namespace."""
        kinds = list(self.config.devices.profiles)
        prefix: list[str] = []
        if data is not None:
            if kinds:  # none (devices.profiles: []): real devices, nothing to rotate
                kinds = kinds[index % len(kinds):] + kinds[:index % len(kinds)]
            devices = ["--data", data, "--prefix", f"dev{index}",
                       *(a for pair in self.data_args for a in ("--data-arg", pair))]
        else:
            devices = ["--shards", _shard_list(shards or []), "--prefix", AGENT_PREFIX]
            if self.agent_per_device and shards:
                kinds = [self._kind(shards[0])] if kinds else []
                prefix = self.network.exec_prefix(shards[0]) if self.network is not None else []
        args = ["--fed-server-url", self.fed_url, *devices, "--kinds", ",".join(kinds),
                "--time-scale", str(self.config.devices.time_scale), "--log-level", self.log_level,
                *self._torch_device_args(), *self._link_args()]
        if self.tls:
            args += ["--ca-file", self.tls.ca]
        args += self._model_args()
        # Devices know only the enrolment secret (or their own credential), never the service secret.
        args += [*self._enrolment_args(name, shards or []), *extra]
        # One agent per device starts afresh (never forked from a warm starter) with or without real
        # links, as an agent entering its namespace must: the emulated layout then differs from the
        # real one in its links alone, not in its agents' cold start.
        if self.agent_per_device and shards:
            return self.processes.start_under(prefix, name, module, args)
        return self.processes.start(name, module, args)

    def _link_args(self) -> list[str]:
        """An agent's ``--links real`` (its link is shaped: only compute is emulated) and
        ``--request-delay-ms`` (the run's round-trip delay), where they differ from the defaults."""
        return [*(["--links", "real"] if self.network is not None else []),
                *(["--request-delay-ms", f"{self.rtt_ms:g}"] if self.rtt_ms else [])]

    def _torch_device_args(self) -> list[str]:
        return ["--torch-device", self.torch_device] if self.torch_device else []

    def _model_args(self) -> list[str]:
        """``--model REF`` (``--loss REF``) when the run's model (loss) is an import path: the Main
        Server and the agents import one only when their operator (here the testbed) names it. The
        children inherit the testbed's working directory and PYTHONPATH (``service_env``), so the
        user's package imports there too."""
        return [arg for flag, ref in (("--model", self.config.model), ("--loss", self.config.train.loss))
                if is_import_path(ref) for arg in (flag, ref)]

    def _secret_args(self, *names: str) -> list[str]:
        """``--<name>-file PATH`` for each named secret this run has (nothing when auth is off)."""
        if self.secret_files is None:
            return []
        paths = self.secret_files.paths
        return [arg for name in names if name in paths for arg in (f"--{name}-file", paths[name])]

    def _enrolment_args(self, agent: str, shards: list[int]) -> list[str]:
        """What agent ``agent`` enrols with: ``--enrolment-secret-file`` on the shared secret, or on
        its own credential for ``shards`` (nothing when auth is off)."""
        if self.secret_files is None or self.enrolment == "secret":
            return self._secret_args("enrolment-secret")
        return ["--enrolment-secret-file", self._issue_credential(agent, shards)]

    def _issue_credential(self, agent: str, shards: list[int], timeout: float = 120.0) -> str:
        """Issue ``agent``'s enrolment credential for exactly ``shards`` with the operator's own
        command (``python -m fed_server credentials issue``, as a child: it imports torch, which
        this process never does), into the owner-only secrets folder; its path."""
        assert self.secret_files is not None
        issuer = self.processes.start(f"credential-{agent}", "fed_server", [
            "credentials", "issue", "--key-file", self.secret_files.paths["enrolment-key"],
            "--shards", _shard_list(shards), "--prefix", AGENT_PREFIX, "--one-file", agent,
            "--out", str(self.secret_files.folder)])
        try:
            code = issuer.process.wait(timeout)
        except subprocess.TimeoutExpired:
            issuer.process.kill()
            code = issuer.process.wait()
        if code != 0:
            raise TestbedError(f"issuing {agent}'s enrolment credential failed (exit code {code}):\n"
                               f"{issuer.log_tail()}")
        return str(self.secret_files.folder / f"{agent}.credential")

    def status(self, since: int = 0, seen: int = 0, wait_s: float = 0.0) -> dict:
        """The Fed Server's ``/v1/status`` (:func:`testbed.follow.fetch_status`)."""
        return fetch_status(self.fed_url, self.verify)(since, seen, wait_s)

    def follow(self, on_round: ProgressFn | None = None, timeout: float | None = None, wait_s: float = 1.0,
               retry_s: float = 0.5, on_resumed: ResumedFn | None = None) -> dict:
        """Wait for the run to finish, calling ``on_round(record, status)`` for each new round; return
        the final status, with every round's record (:func:`testbed.follow.follow_run`: each status
        request waits for a new record; the services' processes are checked at least every
        ``wait_s``). A failure carries the Fed Server's log tail. With ``on_resumed``, a run
        resumed from its run directory's checkpoint calls it once with the rounds it had
        completed, and the records it restored are not passed to ``on_round``."""
        try:
            return follow_run(self.status, on_round, timeout, wait_s, retry_s, self.status_patience_s, self._check_services,
                              on_resumed=on_resumed, replay_restored=on_resumed is None)
        except FollowError as exc:
            raise TestbedError(f"{exc}\n{self.fed.log_tail() if self.fed else ''}") from exc

    def _check_services(self) -> None:
        """Raise if a service the run needs has died."""
        # The run goes on while one Main Server replica lives: the Fed Server spreads the groups
        # over the others (docs/deployment.md, "Main Server replicas").
        dead_mains = [m for m in self.mains if not m.alive()]
        for service in (self.fed, *(dead_mains[:1] if len(dead_mains) == len(self.mains) else [])):
            if service is not None and not service.alive():
                raise TestbedError(f"{service.name} exited with code {service.process.returncode}:\n{service.why_it_stopped()}")
        # A device with its own data that stopped (bad data), or the one device of an agent that
        # failed (say, in its namespace), never registers: the run would wait for it until the
        # timeout, so its one-line reason ends the run at once.
        for service in self.agent_services if self.device_data or self.agent_per_device else ():
            if not service.alive() and service.process.returncode != 0:
                raise TestbedError(f"{service.name} exited with code {service.process.returncode}:\n{service.why_it_stopped()}")

    def stop(self, agent_grace_s: float = 15.0, interrupted: bool = False) -> None:
        """Give the agents a moment to collect the final model and exit on their own, then stop all
        and remove the secrets and the real-links network, even when interrupted (Ctrl-C, SIGTERM)
        while stopping the processes. The agents only exit on their own once the run has finished,
        so a testbed stopped before that (a test that saw what it came for, an error) does not wait
        for them.

        ``interrupted`` (the user pressed Ctrl-C): no grace, and whoever has not exited
        :data:`INTERRUPT_STOP_S` after SIGTERM is killed, so the testbed is gone within about 2 s
        and no further round runs meanwhile. Killing the Fed Server loses nothing a resumed run
        needs: its checkpoint is written whole or not at all (docs/operations.md, "Crashes")."""
        try:
            deadline = time.monotonic() + (0.0 if interrupted or not self._run_finished() else agent_grace_s)
            for agent in self.agent_services:
                while agent.alive() and time.monotonic() < deadline and self.fed is not None and self.fed.alive():
                    time.sleep(0.1)
            if interrupted:
                self.processes.stop(INTERRUPT_STOP_S)
            else:
                self.processes.stop()
        finally:
            if self.secret_files is not None:
                self.secret_files.remove()
            if self.network is not None:
                self.network.remove()

    def _run_finished(self) -> bool:
        """Whether the Fed Server says its run has finished; False when it is gone or cannot say."""
        if self.fed is None or not self.fed.alive():
            return False
        try:
            return bool(self.status()["state"] == "finished")
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def __enter__(self) -> "Testbed":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.stop(interrupted=exc_type is not None and issubclass(exc_type, KeyboardInterrupt))


def _shard_list(shards: Sequence[int]) -> str:
    """``--shards`` as the agent and ``credentials issue`` read it, consecutive shards as ranges
    (``0-2,5``): an agent hosting 100,000 devices gets a short command line."""
    # In the order given: the agent's devices keep it.
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in consecutive_runs(shards))
