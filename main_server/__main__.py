"""``python -m main_server``: run the Main Server."""
from __future__ import annotations

import argparse

from shared.config import env_default
from http_api.serve import refuse_to_start, serve
from shared.recording import add_recording_args, recording_from_args
from shared.service import add_server_args, configure_process, parse_service_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m main_server",
        description="S2FL Main Server: trains the server-side model portions of device "
                    "groups and returns each device the gradient of its activations.")
    add_server_args(parser, default_port=8081)
    parser.add_argument("--fed-server-url", default=env_default("fed_server_url", "http://127.0.0.1:8080"),
                        help="where finished groups' server portions are uploaded (env SFL_FED_SERVER_URL)")
    parser.add_argument("--max-step-mb", type=float, default=float(env_default("max_step_mb", 64)),
                        help="largest accepted step body in MiB (env SFL_MAX_STEP_MB)")
    parser.add_argument("--model", default=env_default("model", None),
                        help="the run's model when it is an import path package.module:function (env SFL_MODEL): "
                             "the Main Server builds an import path only if it equals this, never because a plan "
                             "names it (docs/security.md); built-in names need no flag")
    parser.add_argument("--loss", default=env_default("loss", None),
                        help="the run's loss when it is an import path package.module:function (env SFL_LOSS): "
                             "used only if it equals the plan's train.loss, like --model; built-in losses need "
                             "no flag")
    parser.add_argument("--train-workers", type=int, default=env_default("train_workers", None),
                        help="group steps trained at once, each on --threads torch threads (env SFL_TRAIN_WORKERS; "
                             "default: the usable cores divided by --threads, at least 1)")
    add_recording_args(parser)
    args = parse_service_args(parser, argv)
    if args.train_workers is not None and args.train_workers < 1:
        parser.error("--train-workers must be at least 1")
    configure_process(args.log_level, args.torch_threads, args.torch_device)
    recording = recording_from_args(args, parser, "main_server")
    from main_server.app import create_app
    from main_server.server import MainServerSettings
    from main_server.group_trainer import warm_up
    from shared.auth import auth_from_settings, warn_if_open

    try:
        auth = auth_from_settings(args.service_secret_file, None)
    except ValueError as exc:   # a secret file that is empty or cannot be read
        refuse_to_start(parser, args, "main_server", str(exc))
    warn_if_open(auth, "main_server", "open rounds, join them and send activations")
    warm_up(args.torch_device)

    settings = MainServerSettings(fed_server_url=args.fed_server_url, max_step_bytes=int(args.max_step_mb * (1 << 20)),
                                  auth=auth, ca_file=args.ca_file, torch_device=args.torch_device, model=args.model,
                                  loss=args.loss, train_workers=args.train_workers, recording=recording)
    serve(create_app(settings), args)


if __name__ == "__main__":
    main()
