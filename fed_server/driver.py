"""The Fed Server's round driver: opens each round, waits on the coordinator's events until the
round is complete or its deadline passes, aggregates off the event loop, opens the next.

No routes and no request handling here (``app.py`` has those): the driver talks to the
coordinator and, for split rounds, sends the round plan to the Main Server.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import httpx
from pydantic import ValidationError

from fed_server.aggregation import Aggregation
from fed_server.coordinator import Coordinator
from fed_server.evaluation_round import EvaluationRound
from fed_server.progress import Conclusion
from fed_server.metrics import FedMetrics
from fed_server.secure_stages import (
    answers_in, close_key_stage, close_share_stage, keys_in, open_unmasking_stage, shares_in,
)
from fed_server.settings import FedServerSettings
from fed_server.records import RoundRecord
from fed_server.fed_round import FedRound
from shared.algorithms.two_phase import two_phase
from shared.auth import MAIN_SERVER
from shared.http_client import ServiceError, decode_response, post_body, service_client, service_signer
from shared.retry import Backoff, retry_async
from shared.schemas import API, Ack, Departures, RoundPlan, RoundWatch
from shared.wire import pack_body

log = logging.getLogger("fed_server")


#: What a plan POST is retried on: no connection, a dropped one, an error answer (a replica that is
#: restarting). Not a timeout: a replica that took a plan's body and sent no answer within
#: ``replica_timeout_s`` is frozen or overloaded, and each further try would cost that again.
PLAN_RETRY_ON = (httpx.NetworkError, httpx.RemoteProtocolError, ServiceError)
#: A set-aside replica's health probes (:func:`probe_replica`): the wait after the first failed
#: one, doubled after each next one up to the last. A replica that is down costs a request now and
#: then; one that comes back is used again within about the longest wait.
PROBE_FIRST_WAIT_S = 0.5
PROBE_LONGEST_WAIT_S = 5.0
#: A replica whose watch stream says nothing for this many heartbeats has failed for the attempt
#: (``ReplicaPlanning.heard``): one heartbeat missed, not a line merely late on a busy replica.
SILENT_HEARTBEATS = 2


async def send_plans(coordinator: Coordinator, fed_round: FedRound, settings: FedServerSettings) -> None:
    """POST each replica that is not set aside its round plan, all at once. A replica that does not
    accept is set aside (``ReplicaPlanning.set_aside``): its groups are spread again over those that
    did, which get their new plan (the same round id replaces the open one there). No replica
    accepts: the round is marked failed.

    The plan phase is part of the attempt, so its waits are bounded: each try by
    ``replica_timeout_s`` (no answer by then is no answer), and each pass over the replicas by what
    is left of ``deadlines.join_s`` since the attempt began (at least one try's time, so the
    replicas left after a refusal still get their new plans). With every replica set aside, the
    plan phase waits, within the same budget, for one to answer its health check.
    """
    replicas = coordinator.replicas
    if not replicas.urls:
        fed_round.plan_failed = "no Main Server URL is configured (--main-server-url)"
        return
    budget_ends = fed_round.started_at + coordinator.config.deadlines.join_s
    if not await wait_until(coordinator.core.changed, lambda: bool(replicas.available()), budget_ends):
        fed_round.plan_failed = ("every Main Server replica is set aside until it answers its health check: "
                                 + "; ".join(f"{url} ({why})" for url, why in replicas.down.items()))
        return
    live = replicas.available()
    errors: dict[str, str] = {}
    fed_round.plan_bytes = 0
    async with service_client(service_signer(settings.auth, MAIN_SERVER), settings.ca_file,
                              timeout=settings.replica_timeout_s) as client:
        async def post(url: str, plan: RoundPlan, within_s: float) -> str | None:
            body = pack_body(plan.model_dump())
            fed_round.plan_bytes += len(body)

            async def attempt() -> Ack:
                return decode_response(await post_body(client, f"{url.rstrip('/')}{API}/rounds", body), Ack)
            try:
                backoff = Backoff(settings.plan_retries, first_delay_s=0.5)
                await asyncio.wait_for(retry_async(attempt, backoff, PLAN_RETRY_ON,
                                                   f"round {fed_round.index} (attempt {fed_round.round_id}): "
                                                   f"plan to Main Server {url}"), within_s)
                return None
            except asyncio.TimeoutError:
                return f"no answer within the plan phase's {within_s:.1f}s"
            except httpx.TimeoutException as exc:
                return f"no answer within {settings.replica_timeout_s:g}s ({type(exc).__name__})"
            except Exception as exc:
                return str(exc)

        while live:
            plans = replicas.plans(fed_round, live)
            within_s = max(settings.replica_timeout_s, budget_ends - time.monotonic())
            outcomes = await asyncio.gather(*(post(url, plan, within_s) for url, plan in plans.items()))
            refused = {url: error for url, error in zip(plans, outcomes) if error is not None}
            for url, error in refused.items():
                replicas.set_aside(url, f"did not accept the plan of round {fed_round.index} (attempt "
                                        f"{fed_round.round_id}): {error}")
            errors.update(refused)
            if not refused:
                return
            log.warning("round %d (attempt %d): Main Server replica(s) %s did not accept the plan (%s); spreading "
                        "their groups over the others", fed_round.index, fed_round.round_id, sorted(refused),
                        "; ".join(refused.values()))
            live = [url for url in live if url not in refused]
    fed_round.plan_failed = "; ".join(f"Main Server at {url} did not accept the plan: {error}"
                                      for url, error in errors.items())


async def send_departures(fed_round: FedRound, url: str, reasons: dict[str, str], settings: FedServerSettings) -> None:
    """Tell replica ``url`` which of its participants left the attempt at the Fed Server, so its
    join and group barriers stop waiting for them. One try, bounded like a plan try: the attempt
    no longer counts on these devices whatever the answer, and a replica that does not take it
    only waits for them until its own deadlines, as it would have."""
    body = pack_body(Departures(round_id=fed_round.round_id, devices=reasons).model_dump())
    endpoint = f"{url.rstrip('/')}{API}/rounds/{fed_round.round_id}/departures"
    try:
        async with service_client(service_signer(settings.auth, MAIN_SERVER), settings.ca_file,
                                  timeout=settings.replica_timeout_s) as client:
            decode_response(await post_body(client, endpoint, body), Ack)
    except Exception as exc:   # noqa: BLE001 - whatever went wrong, the attempt goes on
        log.warning("round %d (attempt %d): Main Server %s not told that %s left: %s", fed_round.index,
                    fed_round.round_id, url, sorted(reasons), exc)


async def watch_replica(coordinator: Coordinator, fed_round: FedRound, url: str, settings: FedServerSettings) -> None:
    """Hold replica ``url``'s watch stream of the attempt until its ``done`` line; an end without
    it, silence for ``replica_timeout_s`` or a connection error is the replica lost
    (``ReplicaPlanning.lost``). Events, not polling: a killed process closes its connection
    at once; a frozen or cut-off one falls silent and times out.

    Every line says the replica was alive then (``ReplicaPlanning.heard``, which takes a gap of
    :data:`SILENT_HEARTBEATS` heartbeats as a failure) and names the members it has dropped so far,
    which leave the attempt at once (``ReplicaPlanning.dropped``); at ``done``, its devices without
    a stored group portion leave it too (``ReplicaPlanning.done``)."""
    timeout = httpx.Timeout(10.0, read=settings.replica_timeout_s)
    endpoint = f"{url.rstrip('/')}{API}/rounds/{fed_round.round_id}/watch"
    try:
        async with service_client(service_signer(settings.auth, MAIN_SERVER), settings.ca_file, timeout=10.0) as client:
            async with client.stream("GET", endpoint, params={"heartbeat_s": settings.heartbeat_s},
                                     timeout=timeout) as response:
                if response.status_code != 200:
                    reason = f"watch answered HTTP {response.status_code}"
                else:
                    reason = "watch stream ended before its last line"
                    last = time.monotonic()
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        now = time.monotonic()
                        coordinator.replicas.heard(fed_round, url, now - last, SILENT_HEARTBEATS * settings.heartbeat_s)
                        last = now
                        watch = RoundWatch.model_validate_json(line)
                        coordinator.replicas.dropped(fed_round, url, watch.dropped)
                        if watch.state == "done":
                            coordinator.replicas.done(fed_round, url, watch.undelivered)
                            return
                        if watch.state == "replaced":
                            reason = "its round was replaced by another plan"
                            break
    except (httpx.HTTPError, ValidationError) as exc:
        reason = f"watch failed: {exc!r}"
    coordinator.replicas.lost(fed_round, url, reason)


async def probe_replica(coordinator: Coordinator, url: str, settings: FedServerSettings) -> None:
    """Ask set-aside replica ``url``'s ``GET /healthz`` until it answers 200, then put it back
    (``ReplicaPlanning.back``). Each try waits at most ``replica_timeout_s``: a frozen replica's
    kernel takes the request, and the process answers it as soon as it runs again. Between failed
    tries the wait grows from :data:`PROBE_FIRST_WAIT_S` to :data:`PROBE_LONGEST_WAIT_S`."""
    wait_s = PROBE_FIRST_WAIT_S
    async with service_client(service_signer(settings.auth, MAIN_SERVER), settings.ca_file,
                              timeout=settings.replica_timeout_s) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url.rstrip('/')}/healthz")).status_code == 200:
                    coordinator.replicas.back(url)
                    return
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, PROBE_LONGEST_WAIT_S)


async def confirm_replicas(coordinator: Coordinator, fed_round: FedRound, settings: FedServerSettings) -> None:
    """Before the attempt closes, learn whether each replica whose devices missed a deadline was
    alive after they did (``FedRound.unconfirmed_misses``): its next watch line (a heartbeat, within
    ``heartbeat_s``) says it was, and the devices are charged; its failure (a silent gap, or its
    loss after ``replica_timeout_s`` of silence) says the misses were its own. A device frozen out
    by its replica is thus never charged, even when the attempt could end before the replica's
    silence is known; a round without missed deadlines does not wait here. A replica still not
    heard from at the end of the wait (its watch ended some other way) is lost."""
    misses = fed_round.unconfirmed_misses(time.monotonic())
    if not misses:
        return
    def known() -> bool:
        return all(fed_round.replica_known_at(url, at) for url, at in misses.items())
    # Its loss is declared after replica_timeout_s of silence; a heartbeat more for the slack.
    until = time.monotonic() + settings.replica_timeout_s + settings.heartbeat_s
    await wait_until(coordinator.core.changed, known, until)
    for url, at in misses.items():
        if not fed_round.replica_known_at(url, at):
            coordinator.replicas.lost(fed_round, url, "not heard from after its devices missed their deadlines")


async def wait_until(changed: asyncio.Event, done: Callable[[], bool], until: float) -> bool:
    """Wait until ``done()`` holds or the monotonic time ``until`` passes; whether it holds.

    Wakes on ``changed`` (``RunCore.changed``: set by every registration, report, update, portion
    and evaluation report), not on a timer. Clearing the event and checking ``done()`` happen without an ``await`` between
    them, so a change that lands while the driver is busy is never missed.
    """
    while not done():
        remaining = until - time.monotonic()
        if remaining <= 0:
            return False
        changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed.wait(), None if math.isinf(remaining) else remaining)
    return True


def registration_outcome(coordinator: Coordinator) -> str:
    """How the run's registration ended, for the line that starts the rounds: every expected device
    registered, or how many of them did, how many were refused (their reasons are logged) and how
    many never registered by the deadline."""
    registered, expected = len(coordinator.core.devices), coordinator.config.data.num_devices
    if registered >= expected:
        return f"all {registered} devices registered"
    refused = coordinator.enrolment.refused_places()
    return (f"{registered} of {expected} devices registered: {refused} refused for what they claimed, "
            f"{max(0, expected - registered - refused)} not registered by the deadline (each refusal is logged "
            f"as 'registration of ... refused')")


async def drive_rounds(coordinator: Coordinator, settings: FedServerSettings, metrics: FedMetrics | None = None) -> None:
    """Run every round of the configuration, one after another.

    The server's evaluation of a round's model (its test set) runs beside the next round's
    training: nothing the next round decides depends on it, the global model does not change
    until the next aggregation, which waits for it, and on two cores it fills the core the
    round's last, largest device leaves idle. The records and checkpoints are still written in
    round order. The last round records at once; a federated evaluation phase (the devices
    evaluate) ends before the next round begins, and only its record is written beside it.
    """
    # Every shard registered, or the registration deadline passed; then (a resumed run whose
    # devices did not all come back) the quorum's registrations.
    enrolment, progress, core = coordinator.enrolment, coordinator.progress, coordinator.core
    if core.finished:   # taken up after its end (--resume of a finished run): served, not trained
        log.info("run %s is over (%d of %d rounds): nothing to train; its results are in %s", core.run_id,
                 progress.rounds_done, coordinator.config.rounds, coordinator.run_dir.path)
        return
    await wait_until(core.changed, enrolment.ready, enrolment.registration_deadline())
    await wait_until(core.changed, enrolment.ready, math.inf)
    if progress.rounds_done:
        log.info("%s; continuing run %s of %s at round %d of %d", registration_outcome(coordinator), core.run_id,
                 coordinator.config.algorithm, progress.rounds_done + 1, coordinator.config.rounds)
    else:
        log.info("%s; starting %d rounds of %s", registration_outcome(coordinator), coordinator.config.rounds,
                 coordinator.config.algorithm)
    recording: asyncio.Task | None = None   # the previous attempt's evaluation and record
    departing: set[asyncio.Task] = set()     # departures on their way to replicas (held until sent)

    def depart(fed_round: FedRound, url: str, reasons: dict[str, str]) -> None:
        task = asyncio.get_running_loop().create_task(send_departures(fed_round, url, reasons, settings))
        departing.add(task)
        task.add_done_callback(departing.discard)
    core.on_departure = depart
    probes: set[asyncio.Task] = set()        # health probes of the replicas set aside

    def probe(url: str) -> None:
        task = asyncio.get_running_loop().create_task(probe_replica(coordinator, url, settings))
        probes.add(task)
        task.add_done_callback(probes.discard)
    coordinator.replicas.on_set_aside = probe
    try:
        while not core.finished:   # a resumed run may have finished already
            fed_round = await _train_attempt(coordinator, settings)
            if recording is not None:   # the previous record first, and the model it evaluates unchanged till then
                _observe(await recording, metrics)
                recording = None
            aggregation = await asyncio.to_thread(coordinator.aggregate_round, fed_round)
            evaluation = await _evaluate(coordinator, fed_round, aggregation)
            conclusion = progress.conclude(fed_round, aggregation, evaluation)
            if conclusion.finished:
                _observe(await _record(coordinator, conclusion), metrics)
                core.post_work()   # the waiting devices' answer is now "done"
                break
            recording = asyncio.create_task(_record(coordinator, conclusion))
            if not aggregation.ok:
                # Back off before retrying, so a Main Server that is restarting gets time to come back.
                await asyncio.sleep(min(10.0, 0.5 * 2 ** progress.failed_in_a_row))
    finally:
        for task in list(probes):
            task.cancel()
        if recording is not None:   # stopped mid-run: the record being written is finished, not torn
            with contextlib.suppress(Exception):
                await asyncio.shield(recording)
    log.info("run finished: %s", progress.summary())


async def _train_attempt(coordinator: Coordinator, settings: FedServerSettings) -> FedRound:
    """Begin an attempt, send its plans, hand out its tasks and wait for its reports and uploads
    until it is complete or its deadlines pass; the attempt, closed."""
    changed = coordinator.core.changed
    fed_round = coordinator.begin_round()
    watchers: list[asyncio.Task] = []
    if fed_round.uses_main_server:
        await send_plans(coordinator, fed_round, settings)
        if fed_round.plan_failed is None:
            watchers = [asyncio.create_task(watch_replica(coordinator, fed_round, url, settings))
                        for url in fed_round.replicas()]
    coordinator.dispatch.open_tasks(fed_round)
    if fed_round.secure is not None:
        await _share_secrets(coordinator, fed_round)
    if two_phase(coordinator.core.algorithm) is not None and fed_round.plan_failed is None:
        # The report phase has its own deadline: the devices that reported by then get their
        # follow-ups and the round waits for their uploads, so one silent device cannot hold
        # every reporter until the round deadline.
        if not await wait_until(changed, fed_round.all_reported, fed_round.report_deadline()):
            log.warning("round %d (attempt %d): report deadline passed; %d of %d devices reported",
                        fed_round.index, fed_round.round_id, len(fed_round.reports), len(fed_round.assignments))
        coordinator.uploads.plan_follow_ups(fed_round)
    if not await _wait_for_uploads(coordinator, fed_round):
        log.warning("round %d (attempt %d): deadline of %.0fs passed; completing with %d of %d updates",
                    fed_round.index, fed_round.round_id, fed_round.deadline_s, len(fed_round.updates),
                    len(fed_round.assignments))
    if watchers:
        await confirm_replicas(coordinator, fed_round, settings)
    for watcher in watchers:   # cancelled before the round closes: no loss is declared after it
        watcher.cancel()
    if fed_round.secure is not None and fed_round.secure.sharers is not None:
        open_unmasking_stage(coordinator.core, fed_round, coordinator.aggregator.usable(fed_round))
        if not await wait_until(changed, lambda: answers_in(fed_round),
                                time.monotonic() + coordinator.config.secure_aggregation.stage_s):
            log.warning("round %d (attempt %d): unmasking stage closed with %d of %d survivors' shares",
                        fed_round.index, fed_round.round_id, len(fed_round.secure.answers),
                        len(fed_round.secure.plan.survivors) if fed_round.secure.plan else 0)
    return coordinator.close_round()


async def _share_secrets(coordinator: Coordinator, fed_round: FedRound) -> None:
    """Secure aggregation's key and share stages (:mod:`fed_server.secure_stages`), each closed
    once every device still in the attempt answered or ``secure_aggregation.stage_s`` after it opened."""
    core, stage_s = coordinator.core, coordinator.config.secure_aggregation.stage_s
    await wait_until(core.changed, lambda: keys_in(fed_round), time.monotonic() + stage_s)
    close_key_stage(core, fed_round)
    await wait_until(core.changed, lambda: shares_in(fed_round), time.monotonic() + stage_s)
    close_share_stage(core, fed_round)


async def _wait_for_uploads(coordinator: Coordinator, fed_round: FedRound) -> bool:
    """Wait until the attempt is complete (whether it is) or its round deadline passes, taking out
    each awaited device whose own deadline passes first (:mod:`fed_server.device_pace`). Wakes on
    ``changed`` and at the next own deadline; each upload may bring the others' deadlines nearer."""
    changed = coordinator.core.changed
    while True:
        changed.clear()   # before the checks, with no await between: no change is missed
        next_due = coordinator.uploads.cut_overdue(fed_round, time.monotonic())
        if fed_round.complete():
            return True
        remaining = min(fed_round.deadline(), next_due) - time.monotonic()
        if fed_round.deadline() <= time.monotonic():
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed.wait(), max(0.0, remaining))


async def _evaluate(coordinator: Coordinator, fed_round: FedRound, aggregation: Aggregation) -> EvaluationRound | None:
    """Federated evaluation of an aggregated attempt: wait for the asked devices' reports, woken by
    each one; at the deadline the round is recorded with what arrived (none: no figures, still
    recorded). None when the attempt is not evaluated this way."""
    evaluation = coordinator.evaluation.begin(fed_round, aggregation)
    if evaluation is not None:
        if not await wait_until(coordinator.core.changed, evaluation.complete, evaluation.deadline()):
            log.warning("round %d (attempt %d): evaluation deadline of %.0fs passed; %d of %d devices reported",
                        fed_round.index, fed_round.round_id, evaluation.deadline_s, len(evaluation.reports),
                        len(evaluation.asked))
        coordinator.evaluation.close()
    return evaluation


async def _record(coordinator: Coordinator, conclusion: Conclusion) -> RoundRecord:
    """Evaluate and write a concluded attempt's record off the event loop, then wake the status
    requests waiting for it (``/v1/status?wait_s=``) at once, not when the driver next looks."""
    record = await asyncio.to_thread(coordinator.progress.record, conclusion)
    coordinator.status_posted.post()
    return record


def _observe(record: RoundRecord, metrics: FedMetrics | None) -> None:
    """A round's record is written: count it in the metrics and log it."""
    if metrics is not None:
        metrics.observe_round(record)
        metrics.checkpoint_written()  # Progress.record writes checkpoint.msgpack once per round
    privacy = record.privacy
    spent = (f", epsilon {privacy.epsilon:.4g} at delta {privacy.delta:g}"
             if privacy is not None and privacy.epsilon is not None else "")
    samples = record.sample_privacy
    if samples is not None:
        spent += f", sample-level epsilon {samples.epsilon:.4g} at delta {samples.delta:g} (worst device)"
    log.info("round %d (attempt %d) %s: accuracy %s, %.2fs, %.2f MB%s", record.round, record.round_id, record.status,
             record.test_accuracy, record.round_time_s, record.bytes_total / 1e6, spent)
