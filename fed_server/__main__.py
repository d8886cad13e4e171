"""``python -m fed_server``: run the Fed Server for one run configuration;
``python -m fed_server credentials issue``: write the devices' enrolment credentials;
``python -m fed_server export RUN_DIR``: the run's global model as files plain PyTorch loads."""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from shared.config import env_default, env_switch
from http_api.serve import refuse_to_start, serve
from shared.recording import Recording, add_recording_args, recording_from_args
from shared.service import add_server_args, configure_process, parse_service_args

if TYPE_CHECKING:   # imported at run time only once the process is configured (torch threads)
    from fed_server.coordinator import Coordinator
    from fed_server.settings import FedServerSettings
    from shared.config import RunConfig

log = logging.getLogger("fed_server")


def main_server_urls_of(value: str | list[str] | None, setting: str = "main_server_url",
                        default: str | None = "http://127.0.0.1:8081") -> list[str]:
    """The Main Server replicas from ``--main-server-url`` (repeated flags, a settings file's string
    or list), each entry possibly comma-separated like ``SFL_MAIN_SERVER_URL``; that variable, else
    one local Main Server, when none is given. ``setting`` and ``default``: another flag of URLs
    read the same way (``--main-server-public-url``, no default)."""
    if value is None:
        value = env_default(setting, default)
    if value is None:
        return []
    entries = [value] if isinstance(value, str) else value
    return [url.strip() for entry in entries for url in str(entry).split(",") if url.strip()]


def main(argv: list[str] | None = None) -> None:
    """``python -m fed_server``: parse the flags, build the Fed Server and serve it (or run the
    ``credentials`` and ``export`` commands). Most of its length is the flags' declarations, kept in
    one place so ``--help`` and docs/configuration.md can be read side by side."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["credentials"]:
        credentials_main(argv[1:])
        return
    if argv[:1] == ["export"]:
        export_main(argv[1:])
        return
    from fed_server.settings import PER_DEVICE_SERIES_LIMIT

    parser = argparse.ArgumentParser(
        prog="python -m fed_server",
        description="S2FL Fed Server: selects devices, picks split points from the client time table, "
                    "aggregates layer-wise (Algorithm 1), evaluates and records the run.")
    add_server_args(parser, default_port=8080)
    parser.add_argument("--config", default=env_default("config", None),
                        help="run configuration file, YAML or JSON (env SFL_CONFIG); see docs/configuration.md")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config value, e.g. --set train.lr=0.1 (repeatable; env SFL_RUN__TRAIN__LR)")
    parser.add_argument("--run-dir", default=env_default("run_dir", None),
                        help="where config, metrics, checkpoint and summary are written (env SFL_RUN_DIR; default "
                             "runs/<time>-<algorithm>); a checkpoint there is resumed. Not with --runs-root")
    parser.add_argument("--runs-root", default=env_default("runs_root", None), metavar="DIR",
                        help="keep every run in its own directory DIR/<run id> (env SFL_RUNS_ROOT): a start resumes the "
                             "current run while it is unfinished and begins a new one once it is over "
                             "(docs/operating.md)")
    parser.add_argument("--resume", default=env_default("resume", None), metavar="RUN_ID",
                        help="with --runs-root: take up this run, finished or not (env SFL_RESUME)")
    parser.add_argument("--new-run", action=argparse.BooleanOptionalAction, default=env_switch("new_run"),
                        help="with --runs-root: begin a new run even though the current one is unfinished, which stays "
                             "as it is (env SFL_NEW_RUN)")
    parser.add_argument("--run-id", default=env_default("run_id", None),
                        help="run id (env SFL_RUN_ID; default: random, with --runs-root <UTC time>-<algorithm>-<4 hex "
                             "digits>); with --runs-root the id of a new run")
    parser.add_argument("--main-server-url", action="append", default=None, metavar="URL",
                        help="a Main Server replica (env SFL_MAIN_SERVER_URL, comma-separated; default "
                             "http://127.0.0.1:8081), as devices and this server reach it; repeat the flag for "
                             "several replicas, over which each round's groups are spread")
    parser.add_argument("--main-server-public-url", action="append", default=None, metavar="URL",
                        help="where the devices reach each Main Server replica, when not at its --main-server-url (env "
                             "SFL_MAIN_SERVER_PUBLIC_URL, comma-separated): one per replica, in the same order. For "
                             "devices outside a cluster whose replicas this server reaches by in-cluster names")
    parser.add_argument("--per-device-metrics", action=argparse.BooleanOptionalAction,
                        default=env_switch("per_device_metrics", None),
                        help="export per-device Prometheus series (device label; env SFL_PER_DEVICE_METRICS; default: "
                             f"on for runs of at most {PER_DEVICE_SERIES_LIMIT:,} devices). Off: per-phase and "
                             "per-split aggregates remain")
    parser.add_argument("--enrolment-secret-file", default=env_default("enrolment_secret_file", None),
                        help="the shared enrolment secret: any device that presents it may register (or env "
                             "SFL_ENROLMENT_SECRET); needs the service secret. See --enrolment-secret-max-devices")
    parser.add_argument("--enrolment-secret-max-devices", type=int,
                        default=env_default("enrolment_secret_max_devices", None), metavar="N",
                        help="at most N devices may register with the shared enrolment secret (env "
                             "SFL_ENROLMENT_SECRET_MAX_DEVICES; default: no cap)")
    parser.add_argument("--enrolment-key-file", default=env_default("enrolment_key_file", None),
                        help="key the devices' enrolment credentials were issued with (python -m fed_server credentials "
                             "issue; or env SFL_ENROLMENT_KEY): a device registers with its own credential, only as the "
                             "devices it was issued for; needs the service secret")
    parser.add_argument("--revoked-credentials-file", default=env_default("revoked_credentials_file", None),
                        help="enrolment credentials refused although their MAC is right, one id per line (python -m "
                             "fed_server credentials revoke; or env SFL_REVOKED_CREDENTIALS_FILE); read at start and again on "
                             "SIGHUP")
    add_recording_args(parser)
    args = parse_service_args(parser, argv)
    configure_process(args.log_level, args.torch_threads, args.torch_device)
    recording = recording_from_args(args, parser, "fed_server")
    if args.run_dir is not None and args.runs_root is not None:
        parser.error("--run-dir is one run's directory, --runs-root a folder of runs: give one of them")
    if args.runs_root is None and (args.resume is not None or args.new_run):
        parser.error("--resume and --new-run choose a run in --runs-root: give --runs-root DIR")

    def refuse(reason: str) -> NoReturn:
        refuse_to_start(parser, args, "fed_server", reason)

    from shared.run_config import ConfigError, exit_on_config_error, resolve_run_config

    try:
        config = resolve_run_config(args.config, args.overrides)
    except ConfigError as exc:
        if not args.wait_on_refusal:
            exit_on_config_error(exc)   # a line per problem
        refuse("config error: " + "; ".join(exc.lines))
    try:
        settings = fed_server_settings(args)
    except ValueError as exc:
        refuse(str(exc))
    coordinator = start_run(config, args, refuse, recording)
    from fed_server.app import create_app
    from shared.auth import warn_if_open

    warn_if_open(settings.auth, "fed_server", "register devices, upload models and server portions")
    serve(create_app(coordinator, settings), args)


def start_run(config: "RunConfig", args: argparse.Namespace, refuse: Callable[[str], NoReturn],
              recording: Recording | None = None) -> "Coordinator":
    """The run this start takes up, built (its checkpoint resumed): ``--run-dir``'s, or the one
    ``--runs-root``'s rule chooses (:mod:`fed_server.runs_root`); ``refuse`` is called with the
    reason when it cannot be; ``recording``: what the run keeps of what it receives. A run taken
    up as the unfinished current one that turns out to have finished (stopped between its last
    checkpoint and its summary, which is written now) is over: a new run is begun instead."""
    from fed_server.coordinator import Coordinator
    from fed_server.run_dir import RunDirectory
    from fed_server.runs_root import RunRefused, RunsRoot

    urls = main_server_urls_of(args.main_server_url)
    device_urls = main_server_urls_of(args.main_server_public_url, "main_server_public_url", None)

    def build(path: str | Path, run_id: str | None) -> Coordinator:
        try:
            return Coordinator(config, RunDirectory(path), urls, run_id=run_id, torch_device=args.torch_device,
                               main_server_device_urls=device_urls, recording=recording)
        except ValueError as exc:   # e.g. a checkpoint of a different configuration in --run-dir
            refuse(str(exc))

    if args.runs_root is None:
        return build(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.algorithm}", args.run_id)
    root = RunsRoot(args.runs_root)
    while True:
        try:
            choice = root.choose(config, args.resume, args.new_run, args.run_id)
        except RunRefused as exc:
            refuse(str(exc))
        log.info("%s (in %s)", choice.why, choice.path)
        root.take(choice)
        coordinator = build(choice.path, choice.run_id)
        if not (choice.resume and args.resume is None and coordinator.core.finished):
            return coordinator
        log.info("run %s had finished before its summary was written; its summary is written now", choice.run_id)


def fed_server_settings(args: argparse.Namespace) -> "FedServerSettings":
    """The server's settings from its flags (the secrets read): ValueError with one line for a
    secret that cannot be read or flags that do not fit together."""
    from fed_server.settings import FedServerSettings
    from shared.auth import auth_from_settings

    auth = auth_from_settings(args.service_secret_file, args.enrolment_secret_file, args.enrolment_key_file,
                              args.enrolment_secret_max_devices, args.revoked_credentials_file)
    if auth.revoked_credentials.path is not None and auth.enrolment_key is None:
        raise ValueError("--revoked-credentials-file revokes enrolment credentials: it needs --enrolment-key-file")
    if auth.enabled and auth.enrolment_secret is None and auth.enrolment_key is None:
        raise ValueError("a service secret without an enrolment secret or key would refuse every device: set "
                         "--enrolment-key-file / SFL_ENROLMENT_KEY or --enrolment-secret-file / SFL_ENROLMENT_SECRET too")
    if args.enrolment_secret_max_devices is not None and args.enrolment_secret_max_devices < 1:
        raise ValueError(f"--enrolment-secret-max-devices must be at least 1, got {args.enrolment_secret_max_devices}")
    return FedServerSettings(per_device_metrics=args.per_device_metrics, auth=auth, ca_file=args.ca_file)


def export_main(argv: list[str]) -> None:
    """``python -m fed_server export RUN_DIR``: write the run's global model (its last completed
    round) as ``model.pt``, ``model.safetensors``, ``model.pt2``, ``model.torchscript.pt`` and, where
    the onnx package is installed, ``model.onnx``, with ``model.json`` saying which model they hold."""
    from shared.models.export import FORMATS

    parser = argparse.ArgumentParser(
        prog="python -m fed_server export",
        description="Export a run's global model (docs/operations.md, 'Using the trained model'): a PyTorch state "
                    "dict with the model's own key names, safetensors, torch.export, TorchScript and ONNX.")
    parser.add_argument("run_dir", help="the run directory (config.yaml and checkpoint.msgpack)")
    parser.add_argument("--out", default=None, help="folder for the files (default: the run directory)")
    parser.add_argument("--format", dest="formats", action="append", choices=list(FORMATS), default=None,
                        help="a format to write (repeatable; default: all)")
    args = parser.parse_args(argv)
    from fed_server.export_run import export_run

    try:
        result = export_run(args.run_dir, args.out, args.formats or list(FORMATS))
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    figures = result.figures_text()
    print(f"global model of round {result.round}{', ' + figures if figures else ''}:")
    exported = result.exported
    for fmt, path in exported.files.items():
        companion = exported.companions.get(fmt)
        print(f"  {fmt:<12} {path}" + (f" (its weights in {companion.name} beside it: copy both)" if companion else ""))
    for fmt, reason in exported.skipped.items():
        print(f"  {fmt:<12} skipped: {reason}")
    for warning in exported.warnings:
        print(f"  warning: {warning}")
    folder = args.out or args.run_dir
    print(f"load it: torch.load('{Path(folder) / FORMATS['pt']}', weights_only=True) into your model, or "
          f"shared.models.export.load_trained('{folder}')")


def credentials_main(argv: list[str]) -> None:
    """``python -m fed_server credentials issue``: enrolment credentials for the devices named, one
    owner-only file per device to copy onto it (or one for an agent hosting them all). They are
    derived from the enrolment key, so the Fed Server needs only that key to verify them.
    ``credentials revoke``: add credentials to the Fed Server's revocation list. Its length is its
    flags' declarations and their one-line errors."""
    from device_agent.agent import parse_shards
    from shared.auth import CredentialScope, issue_credential, load_secret, shard_ranges
    from shared.schemas import _ID_PATTERN

    parser = argparse.ArgumentParser(
        prog="python -m fed_server credentials",
        description="Issue the devices' enrolment credentials (docs/security.md). Each lets its holder register "
                    "only the devices it names, and enrol them again after a restart. Revoke them.")
    commands = parser.add_subparsers(dest="command", required=True)
    revoke = commands.add_parser("revoke", help="add credentials to a revocation list",
                                 description="Add credentials to the revocation list the Fed Server reads at start and "
                                             "on SIGHUP (--revoked-credentials-file).")
    revoke.add_argument("--list", required=True, metavar="FILE", help="the revocation list (created if missing)")
    revoke.add_argument("credentials", nargs="+", metavar="CREDENTIAL",
                        help="a credential file, or a credential id as the list holds it (dev/7, cam-a@2)")
    issue = commands.add_parser("issue", help="write enrolment credential files",
                                description="Write enrolment credential files for the devices named.")
    issue.add_argument("--key-file", default=env_default("enrolment_key_file", None),
                       help="the enrolment key, the Fed Server's --enrolment-key-file (or env SFL_ENROLMENT_KEY)")
    devices = issue.add_mutually_exclusive_group(required=True)
    devices.add_argument("--devices", metavar="ID,ID,...",
                         help="device ids, each allowed on any shard or slot (e.g. the --data devices of a run with "
                              "dataset: local)")
    devices.add_argument("--shards", metavar="SHARDS",
                         help="shards of a built-in data set, e.g. 0-9 or 0,2,4 (an agent's --shards): devices "
                              "<prefix>-<shard as 3 digits>, each allowed only on its own shard")
    issue.add_argument("--prefix", default="dev", help="the agents' --prefix, with --shards (default dev)")
    issue.add_argument("--one-file", metavar="NAME",
                       help="one credential for all these devices, written to OUT/NAME.credential, for one agent "
                            "that hosts them all (default: one file per device, OUT/<device id>.credential)")
    issue.add_argument("--out", required=True, help="folder for the credential files (created owner-only)")
    issue.add_argument("--serial", type=int, default=1, metavar="N",
                       help="serial number (default 1): after a revocation, issue the same devices' credentials again "
                            "with the next serial, which the revoked one does not match")
    args = parser.parse_args(argv)
    if args.command == "revoke":
        revoke_main(revoke, args.list, args.credentials)
        return
    if not 1 <= args.serial <= 999_999_999:
        issue.error(f"--serial must be between 1 and 999999999, got {args.serial}")
    key = load_secret(args.key_file, "SFL_ENROLMENT_KEY")
    if key is None:
        issue.error("no enrolment key: give --key-file FILE or SFL_ENROLMENT_KEY (a new one: "
                    "python -c 'import secrets; print(secrets.token_hex(32))' > enrolment.key)")
    for flag, name in (("--one-file", args.one_file), ("--prefix", args.prefix)):
        if name is not None and not re.fullmatch(_ID_PATTERN, name):
            issue.error(f"{flag} {name!r}: 1 to 64 letters, digits, '_', '.' or '-'")
    if args.devices is not None:
        ids = [part.strip() for part in args.devices.split(",") if part.strip()]
        bad = [d for d in ids if not re.fullmatch(_ID_PATTERN, d)]
        if not ids or bad:
            issue.error(f"--devices: bad device ids {bad or args.devices!r}: 1 to 64 letters, digits, '_', '.' or '-'")
        each = {d: CredentialScope(ids=(d,), serial=args.serial) for d in ids}
        together = CredentialScope(ids=tuple(ids), serial=args.serial)
    else:
        try:
            shards = parse_shards(args.shards)
        except ValueError as exc:
            issue.error(f"--shards: {exc}")
        each = {f"{args.prefix}-{s:03d}": CredentialScope(ranges=shard_ranges(args.prefix, [s]), serial=args.serial)
                for s in shards}
        together = CredentialScope(ranges=shard_ranges(args.prefix, shards), serial=args.serial)
    scopes = each if args.one_file is None else {args.one_file: together}
    out = Path(args.out)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, scope in scopes.items():
        path = out / f"{name}.credential"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)   # a file that existed keeps its mode otherwise
        with os.fdopen(fd, "w") as f:
            f.write(issue_credential(key, scope) + "\n")
        print(f"{path}: {scope.describe()}")
    print("Copy each file onto its device (its agent's --enrolment-secret-file); start the Fed Server with "
          "--enrolment-key-file on the key.")


def revoke_main(parser: argparse.ArgumentParser, list_file: str, given: list[str]) -> None:
    """``python -m fed_server credentials revoke``: append the ids of the ``given`` credentials (files
    or ids) that ``list_file`` does not hold yet, one per line."""
    from shared.auth import CredentialScope, credential_id, load_revoked_credentials

    ids: list[str] = []
    for item in given:
        path = Path(item)
        try:
            ids.append(credential_id(path.read_text() if path.is_file() else item))
        except (OSError, ValueError) as exc:
            parser.error(f"{item!r}: neither a credential file nor a credential id ({exc})")
    try:
        held = load_revoked_credentials(list_file) if Path(list_file).exists() else frozenset()
    except ValueError as exc:
        parser.error(str(exc))
    new = [i for i in dict.fromkeys(ids) if i not in held]
    with open(list_file, "a") as f:
        f.writelines(f"{i}\n" for i in new)
    for i in ids:
        scope = CredentialScope.parse(i)
        print(f"{'revoked' if i in new else 'already revoked'}: {i} ({scope.describe()})")
    print(f"The Fed Server reads {list_file} at start and on SIGHUP (--revoked-credentials-file): send it SIGHUP "
          f"(kill -HUP <pid>, docker compose kill -s HUP fed-server) to apply the list; devices enrolled with a "
          f"revoked credential are taken out of the run and refused. Issue their devices new credentials with the "
          f"next --serial.")


if __name__ == "__main__":
    main()
