"""``python -m fed_server``: run the Fed Server for one run configuration."""
from __future__ import annotations

import argparse
import time

from shared.config import env_default
from http_api.serve import serve
from shared.service import add_server_args, configure_process, parse_service_args


def main_server_urls_of(value: str | list[str] | None) -> list[str]:
    """The Main Server replicas from ``--main-server-url`` (repeated flags, a settings file's string
    or list), each entry possibly comma-separated like ``SFL_MAIN_SERVER_URL``; that variable, else
    one local Main Server, when none is given."""
    if value is None:
        value = str(env_default("main_server_url", "http://127.0.0.1:8081"))
    entries = [value] if isinstance(value, str) else value
    return [url.strip() for entry in entries for url in str(entry).split(",") if url.strip()]


def main(argv: list[str] | None = None) -> None:
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
                        help="where config, metrics, checkpoint and summary are written (default runs/<time>-<algorithm>)")
    parser.add_argument("--run-id", default=env_default("run_id", None), help="run id (default: random)")
    parser.add_argument("--main-server-url", action="append", default=None, metavar="URL",
                        help="a Main Server replica (env SFL_MAIN_SERVER_URL, comma-separated; default "
                             "http://127.0.0.1:8081), as devices and this server reach it; repeat the flag for "
                             "several replicas, over which each round's groups are spread")
    parser.add_argument("--per-device-metrics", action=argparse.BooleanOptionalAction,
                        default=str(env_default("per_device_metrics", "true")).lower() not in ("0", "false", "no", "off"),
                        help="export per-device Prometheus series (device label; env SFL_PER_DEVICE_METRICS; default on). "
                             "Turn off for very large deployments: per-phase and per-split aggregates remain")
    parser.add_argument("--enrolment-secret-file", default=env_default("enrolment_secret_file", None),
                        help="secret devices present to register (or env SFL_ENROLMENT_SECRET); needs the service secret")
    args = parse_service_args(parser, argv)
    configure_process(args.log_level, args.torch_threads, args.torch_device)

    from fed_server.app import create_app
    from fed_server.driver import FedServerSettings
    from shared.auth import auth_from_settings, warn_if_open
    from fed_server.coordinator import Coordinator
    from fed_server.run_dir import RunDirectory
    from shared.run_config import ConfigError, exit_on_config_error, resolve_run_config

    try:
        config = resolve_run_config(args.config, args.overrides)
    except ConfigError as exc:
        exit_on_config_error(exc)
    # Flag mistakes are reported before the Coordinator loads data and evaluates the model.
    try:
        auth = auth_from_settings(args.service_secret_file, args.enrolment_secret_file)
    except ValueError as exc:
        parser.error(str(exc))
    if auth.enabled and auth.enrolment_secret is None:
        parser.error("a service secret without an enrolment secret would refuse every device: "
                     "set --enrolment-secret-file or SFL_ENROLMENT_SECRET too")
    main_server_urls = main_server_urls_of(args.main_server_url)
    run_dir = RunDirectory(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{config.algorithm}")
    try:
        coordinator = Coordinator(config, run_dir, main_server_urls, run_id=args.run_id,
                                  torch_device=args.torch_device)
    except ValueError as exc:   # e.g. a checkpoint of a different configuration in --run-dir
        parser.error(str(exc))
    warn_if_open(auth, "fed_server", "register devices, upload models and server portions")
    settings = FedServerSettings(per_device_metrics=args.per_device_metrics, auth=auth, ca_file=args.ca_file)
    serve(create_app(coordinator, settings), args)


if __name__ == "__main__":
    main()
