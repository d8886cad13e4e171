"""Devices joining the run: the run's spec they load their data by, their registration (checked
against the run's model fingerprint, shards and label-count rule), their device token, and when
the run has enough of them to start."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping

from fed_server.device_tokens import DeviceTokens
from fed_server.reregistrations import Reregistrations
from fed_server.run_core import RunCore
from fed_server.update_checks import check_registered_samples, held_out_count, max_held_out
from shared.auth import Auth, Enrolment, RevocationList, credential_holder, device_bearer_token
from shared.errors import Conflict, DomainError, Invalid, NotAllowed, NotFound, TooSoon
from shared.losses import label_counts_problem
from shared.models import fingerprint_differences
from shared.models.fingerprint import ModelFingerprint
from shared.schemas import RegisterRequest, RegisterResponse, RunInfo
from shared.short_list import short_list

log = logging.getLogger("fed_server")


class DeviceEnrolment:
    """Registers devices and says when rounds may start.

    ``shard_sizes``: each shard's size, which its device's registered count must match (None:
    ``dataset: local``). ``label_counts_at_registration``: the Fed Server forms the groups (several
    Main Server replicas), so devices send their label counts here."""

    def __init__(self, core: RunCore, fingerprint: ModelFingerprint, input_shape: tuple[int, ...], num_classes: int,
                 shard_sizes: list[int] | None, label_counts_at_registration: bool) -> None:
        self.core = core
        self.fingerprint = fingerprint
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.shard_sizes = shard_sizes
        self.label_counts_at_registration = label_counts_at_registration
        self.created_at = time.monotonic()
        # Places (shards, or device ids with the devices' own data) whose holder's registration was
        # refused for what it claimed: the start does not wait for them (:meth:`ready`).
        self._refused: set[int | str] = set()
        self.tokens = DeviceTokens()
        self.reregistrations = Reregistrations(core.config.deadlines.reregistration_s)

    def run_info(self) -> RunInfo:
        """The run's model and data spec, so a device can load its shard before registering."""
        config = self.core.config
        return RunInfo(run_id=self.core.run_id, algorithm=config.algorithm, model=config.model,
                       model_params=config.model_params, fingerprint=self.fingerprint,
                       num_classes=self.num_classes, input_shape=list(self.input_shape),
                       data=config.data, seed=config.seed, holdout=self.core.holdout(),
                       loss=config.train.loss, task=config.train.resolved_task,
                       label_counts_at_registration=self.label_counts_at_registration, finished=self.core.finished,
                       split_privacy=config.split_privacy)

    def enrol(self, req: RegisterRequest, enrolment: Enrolment | None, auth: Auth) -> RegisterResponse:
        """Register ``req``'s device as ``enrolment``'s holder (:meth:`DeviceRegistry.enrol`) and,
        with authentication on, issue its device token. Enrolment under a known id (an agent
        restarted and lost its token) issues a new token and revokes the old one: the registry
        drew a new nonce (docs/security.md). A device that registered less than
        ``deadlines.reregistration_s`` ago is refused (TooSoon, 429), changing nothing. A refusal is
        logged with the device and its reason, but for a 429: a device re-registering in a loop
        gets a cheap refusal per request, not a log line."""
        devices = self.core.devices
        known = req.device_id in devices.devices
        try:
            answer = devices.enrol(req, enrolment, lambda: self._register_in_time(req))
        except TooSoon:
            raise
        except DomainError as exc:
            log.warning("registration of %s refused: %s", req.device_id, exc)
            raise
        if auth.enabled:
            if known:
                log.warning("device %s enrolled again: its previous token is revoked", req.device_id)
            answer.token = auth.device_token(self.core.run_id, req.device_id,
                                             devices.devices[req.device_id].token_nonce)
            self.tokens.issued(req.device_id, answer.token)
        return answer

    def enrol_each(self, reqs: list[RegisterRequest], enrolment: Enrolment | None,
                   auth: Auth) -> list[RegisterResponse | DomainError]:
        """:meth:`enrol` for each of ``reqs`` in turn (a batch): each device's answer, or the
        domain error its own registration would have raised (it changed nothing)."""
        answers: list[RegisterResponse | DomainError] = []
        for req in reqs:
            try:
                answers.append(self.enrol(req, enrolment, auth))
            except DomainError as exc:
                answers.append(exc)
        return answers

    def revoke(self, credentials: Iterable[str]) -> dict[str, str]:
        """Take the devices enrolled with any of ``credentials`` (credential ids) out of the run:
        out of the open attempt and evaluation phase, their stored contributions with them; their
        tokens unknown, so their next call is answered 404 and their enrolment again 401; their
        registrations gone, so their shards and ids may be enrolled with new credentials. Each
        device taken out -> its credential. Event loop: an attempt being aggregated is closed
        already, and keeps what it has."""
        core = self.core
        by_holder = {credential_holder(c): c for c in credentials}
        taken = {d: by_holder[holder] for d, holder in core.devices.held_by(by_holder).items()}
        by_credential: dict[str, list[str]] = {}
        for device, credential in taken.items():
            by_credential.setdefault(credential, []).append(device)
        for credential, devices in sorted(by_credential.items()):
            reason = f"its enrolment credential {credential} was revoked"
            if core.round is not None:
                core.exclude(core.round, devices, reason, tell_main_server=True)
            for device in devices:
                if core.evaluating is not None:
                    core.evaluating.leave(device, reason)
                core.devices.remove(device)
                self.tokens.forget(device)
                self.reregistrations.forget(device)
            log.warning("enrolment credential %s revoked: %d device(s) taken out of the run: %s", credential,
                        len(devices), short_list(devices, 10))
        if taken:
            core.changed.set()
        return taken

    def reload_revocations(self, revocations: RevocationList) -> None:
        """The operator changed the revocation list (SIGHUP): read it again and :meth:`revoke` the
        credentials it newly names. A list that cannot be read is logged and changes nothing."""
        try:
            new = revocations.reload()
        except ValueError as exc:
            log.error("revocation list not reloaded, the previous one stays: %s", exc)
            return
        taken = self.revoke(new)
        log.warning("revocation list %s reloaded: %d newly revoked credential(s)%s; %d device(s) taken out of the run",
                    revocations.path, len(new), f" ({', '.join(sorted(new))})" if new else "", len(taken))

    def holds_token(self, device_id: str, token: str | None, auth_enabled: bool) -> bool:
        """Whether ``token``, from the body of an agent's request for several devices, is
        ``device_id``'s current token (always, with authentication off)."""
        return not auth_enabled or (token is not None and self.tokens.holder(token) == (device_id, True))

    def check_held_token(self, device_id: str, token: str | None, auth_enabled: bool) -> None:
        """An agent's request speaks for ``device_id`` with ``token`` from its body: NotFound for a
        device this server does not know (it registers again, as after a restart), NotAllowed for
        a token that is not its current one."""
        if self.core.devices.token_nonce(device_id) is None:
            raise NotFound(f"unknown device {device_id!r}: register first")
        if not self.holds_token(device_id, token, auth_enabled):
            raise NotAllowed(f"the token is not the current token of device {device_id!r}: the device enrolled again")

    def check_token(self, headers: Mapping[str, str], device_id: str, auth: Auth) -> None:
        """The caller holds ``device_id``'s current token in this run. A caller with a token for a
        device this server does not know gets 404 (NotFound), not 403: that is how an agent learns
        that a restarted Fed Server forgot it and registers again."""
        nonce = self.core.devices.token_nonce(device_id)
        if nonce is None and auth.enabled and "authorization" in headers:
            raise NotFound(f"unknown device {device_id!r}: register first")
        auth.check_device(headers, self.core.run_id, device_id, nonce)

    def caller(self, headers: Mapping[str, str], auth: Auth) -> str | None:
        """The device whose current token ``headers`` carry, known before the request's body is
        read (:mod:`fed_server.device_tokens`): Unauthenticated without a token, NotFound for a
        token this server did not issue (after a restart: the agent registers again), NotAllowed
        for a revoked one. None with authentication off."""
        if not auth.enabled:
            return None
        token = device_bearer_token(headers)
        holder = self.tokens.holder(token)
        if holder is None:
            raise NotFound("unknown device token: register first")
        device_id, current = holder
        if not current:
            raise NotAllowed(f"the token is not the current token of device {device_id!r} in run "
                             f"{self.core.run_id!r}: the device enrolled again")
        return device_id

    def check_caller(self, caller: str | None, device_id: str) -> None:
        """The body names the device whose token the request carried (:meth:`caller`)."""
        if caller is not None and caller != device_id:
            raise NotAllowed(f"the token is not the current token of device {device_id!r} in run {self.core.run_id!r}")

    def _register_in_time(self, req: RegisterRequest) -> RegisterResponse:
        """:meth:`register`, refused (TooSoon) for a device that registered too recently. Checked
        once the enrolment may register the device: whoever else asks is answered as before."""
        self.reregistrations.check(req.device_id)
        answer = self.register(req)
        self.reregistrations.registered(req.device_id)
        return answer

    def register(self, req: RegisterRequest) -> RegisterResponse:
        """Register a device; Conflict (409), changing nothing, when the fingerprint it sends says
        its model or data pipeline differs from the run's (None: not checked, docs/models.md);
        Invalid (422), changing nothing, for a sample count the run rules out. A refusal is noted:
        the start does not wait for a place whose holder cannot join as it is (:meth:`ready`)."""
        try:
            return self._register(req)
        except (Invalid, Conflict):
            place = self._place_of(req)
            if place is not None and place not in self._refused:
                self._refused.add(place)
                self.core.changed.set()
            raise

    def _register(self, req: RegisterRequest) -> RegisterResponse:
        self._check_label_counts(req)
        core = self.core
        check_registered_samples(req, self.shard_sizes, core.holdout(), core.config.data.max_device_samples)
        if req.fingerprint is not None:
            differences = fingerprint_differences(req.fingerprint, self.fingerprint, "on the device", "in the run")
            if differences:
                raise Conflict(f"{req.device_id}: the device's model or data pipeline differs from the run's "
                               f"(model {core.config.model!r}): " + "; ".join(differences))
        # Its missed deadlines, usual times and measured link rate are kept by device id: registering
        # again clears none of them (docs/security.md, "A silent device").
        record = core.devices.register(req)
        core.changed.set()
        left = core.round.reenrolled(req.device_id) if core.round is not None else None
        if core.round is not None and left is not None:
            core.exclude(core.round, [req.device_id], left, tell_main_server=True)
        log.info("registered %s (%s %d, %d samples, %s)", req.device_id, "slot" if core.devices.local_data else "shard",
                 record.shard, req.num_samples, req.profile.kind)
        return RegisterResponse(run_id=core.run_id, device_id=record.device_id, shard=record.shard)

    def _place_of(self, req: RegisterRequest) -> int | str | None:
        """The place a registration asks for: its device id with the devices' own data, else its
        shard (None: not a shard of this run)."""
        devices = self.core.devices
        if devices.local_data:
            return req.device_id
        return req.shard if req.shard is not None and 0 <= req.shard < devices.num_shards else None

    def _check_label_counts(self, req: RegisterRequest) -> None:
        """Label counts come with a registration exactly when the Fed Server forms the groups."""
        if self.label_counts_at_registration:
            if req.label_counts is None:
                raise Invalid(f"{req.device_id}: this run has several Main Server replicas and groups at the Fed "
                              f"Server: register with label_counts (RunInfo.label_counts_at_registration)")
            problem = label_counts_problem(len(req.label_counts), self.num_classes, self.core.loss.task)
            if problem is not None:
                raise Invalid(problem)
        elif req.label_counts is not None:
            raise Invalid("this run takes label counts at the Main Server only (RunInfo.label_counts_at_registration "
                          "is false): register without label_counts")

    def held_out_limit(self, device_id: str) -> int:
        """The most held-out samples ``device_id`` may report an evaluation over: its shard's held-out
        part, or with its own data (``dataset: local``) the most a device training on its
        registered count can hold out."""
        holdout = self.core.holdout()
        assert holdout is not None, "asked only with federated evaluation"
        record = self.core.devices.devices[device_id]
        if self.shard_sizes is not None:
            return held_out_count(self.shard_sizes[record.shard], holdout)
        return max_held_out(record.num_samples, holdout)

    def ready(self) -> bool:
        """Rounds start once every shard has a registered device or a holder whose registration
        was refused for its claims (with the quorum registered), or, after the registration
        deadline, once the quorum has (a resumed run whose devices did not all come back)."""
        config, devices = self.core.config, self.core.devices
        quorum = len(devices) >= config.deadlines.min_participants
        placed = len(devices) + self.refused_places()
        if len(devices) >= config.data.num_devices or (quorum and placed >= config.data.num_devices):
            return True
        return time.monotonic() >= self.registration_deadline() and quorum

    def refused_places(self) -> int:
        """Places no device holds whose holder's registration was refused for what it claimed."""
        devices = self.core.devices
        return sum(not devices.holds(place) for place in self._refused)

    def registration_deadline(self) -> float:
        """The monotonic time after which the quorum of registered devices suffices."""
        return self.created_at + self.core.config.deadlines.registration_s
