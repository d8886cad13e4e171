"""``python -m device_agent``: run one or many devices against a Fed Server."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

from shared.config import DeviceMixConfig, env_default
from shared.data.limits import DEFAULT_MAX_IMAGE_PIXELS, FileLimits, default_max_data_bytes
from shared.profiles import AUTO_TRANSFER_RATIO, LINKS, TimeScale, parse_time_scale
from shared.service import add_common_args, configure_process, freeze_startup_objects, interrupt_on_sigterm, parse_service_args

if TYPE_CHECKING:   # imported at run time only once the process is configured (torch threads)
    from device_agent.metrics import AgentMetrics
    from shared.data.local import LocalSource

KEEP_MODELS = {"auto": None, "yes": True, "no": False}
log = logging.getLogger("device_agent")


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, configure the process, run the agent's devices; exit with the agent's code."""
    parser = _parser()
    args = parse_service_args(parser, argv)
    configure_process(args.log_level, args.torch_threads, args.torch_device)
    interrupt_on_sigterm()   # SIGTERM (docker stop, a pod's end) stops the devices like Ctrl-C
    from device_agent.agent import Agent, RunRefused

    sources, data_args, shards, kinds = _devices(parser, args)
    compute_slots = _checked_settings(parser, args)
    metrics = None
    if args.metrics_port:
        from device_agent.metrics import AgentMetrics

        metrics = AgentMetrics()
        metrics.serve(args.metrics_port, args.metrics_host)
    from shared.auth import load_secret

    try:
        enrolment_secret = load_secret(args.enrolment_secret_file, "SFL_ENROLMENT_SECRET")
    except ValueError as exc:   # a secret file that is empty or cannot be read
        parser.error(str(exc))
    agent = Agent(args.fed_server_url, shards, kinds or None, args.time_scale, args.prefix, verify=args.ca_file or True,
                  metrics=metrics, enrolment_secret=enrolment_secret,
                  keep_models=KEEP_MODELS[args.keep_models], keep_data=KEEP_MODELS[args.keep_data], sources=sources, data_args=data_args,
                  device_id=args.device_id, torch_device=args.torch_device, model=args.model,
                  compute_slots=compute_slots, links=args.links, request_delay_s=args.request_delay_ms / 1000,
                  loss=args.loss, state_dir=args.state_dir)
    freeze_startup_objects()   # what the agent keeps for the run is built: out of full collections' way
    try:
        code = agent.run()
    except RunRefused as exc:   # a run this agent cannot train: one line, before any device registers
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if metrics is not None and args.metrics_linger_s > 0:
        _linger(metrics, args.metrics_linger_s)
    sys.exit(code)


def _exit(stop: SystemExit) -> NoReturn:
    """The process's exit, as ``stop`` says. A stopped agent leaves devices waiting on the Fed
    Server (a long poll, a set-up step) to the process's exit, and the interpreter's finalization
    ends such daemon threads wherever they are: one inside torch's C++ code then aborts the whole
    process ("FATAL: exception not rethrown", exit -6, seen when SIGTERM came during the set-up of
    400 devices). So where other threads still run, the exit skips finalization, once the logs and
    output are flushed (the agent has closed what it keeps on disk: ``Agent.run``). Only for
    ``python -m device_agent``: :func:`main` called from other code (a test) raises SystemExit as usual."""
    if threading.active_count() > 1:
        code = stop.code
        if not isinstance(code, int):   # sys.exit("message") prints it and exits 1; None is 0
            if code is not None:
                print(code, file=sys.stderr)
            code = 0 if code is None else 1
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise stop


def _parser() -> argparse.ArgumentParser:
    """The agent's command line: its data, its emulation, and the agent's own settings."""
    parser = argparse.ArgumentParser(
        prog="python -m device_agent",
        description="Device agent: trains its client portion and talks to the Fed Server and Main Server "
                    "(outbound calls only). One process can host many virtual devices.",
        epilog="Exit codes: 0 the run finished; 1 a device stopped with any other error (the Fed Server unreachable for "
               "too long, a fault); 2 a usage "
               "error, a run this agent cannot train, or a device that did not register: its --data refused (missing, "
               "unreadable, a link out of its folder) or its registration refused by the Fed Server (a shard that "
               "does not exist or is held already, a sample count or model the run rules out, a credential that does "
               "not cover it), whether or not the agent's other devices trained on to the end.")
    _add_data_flags(parser)
    _add_emulation_flags(parser)
    _add_agent_flags(parser)
    add_common_args(parser)
    return parser


def _add_data_flags(parser: argparse.ArgumentParser) -> None:
    """Where the Fed Server is, and the data the agent's devices hold (shards or their own files)."""
    parser.add_argument("--fed-server-url", default=env_default("fed_server_url", "http://127.0.0.1:8080"),
                        help="the Fed Server (env SFL_FED_SERVER_URL); the Main Server's URL comes with each task")
    parser.add_argument("--shards", default=env_default("shards", None),
                        help="data shards of the run's built-in data set this agent's devices hold, e.g. 0-9 or 3 "
                             "(env SFL_SHARDS; default 0); one device per shard. Not with --data")
    parser.add_argument("--slice", default=env_default("slice", None), metavar="INDEX/COUNT",
                        help="this agent's block of --shards (env SFL_SLICE): block INDEX of COUNT contiguous "
                             "blocks whose sizes differ by at most one (the larger first), so COUNT agents with the "
                             "same --shards host each shard once: --shards 0-9 --slice 1/3 hosts 4-6. INDEX auto: "
                             "JOB_COMPLETION_INDEX (a Kubernetes Indexed Job's pod), else the host name's trailing "
                             "-<ordinal>, as a StatefulSet names its pods (docs/deployment.md)")
    parser.add_argument("--data", action="append", default=[], metavar="PATH",
                        help="the device's own data for a run with data.dataset: local (repeatable; docs/data.md): an "
                             ".npz file with x and y, a .csv file with a header row and the label column data.label_column, "
                             "a folder of images with one sub-folder per class, a function package.module:function, a "
                             "folder of .npz/.csv files or of device folders (one device each)")
    parser.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword passed (as a string) to a --data function (repeatable)")
    parser.add_argument("--max-data-bytes", type=_positive_int, default=env_default("max_data_bytes", default_max_data_bytes()),
                        help="refuse a --data .npz file whose arrays x and y declare or unpack to more bytes than this, "
                             "before reading them (env SFL_MAX_DATA_BYTES; default 1/16 of this machine's memory)")
    parser.add_argument("--max-image-pixels", type=_positive_int,
                        default=env_default("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
                        help="refuse a --data image whose header says it has more pixels (width x height) than this, "
                             f"before decoding it (env SFL_MAX_IMAGE_PIXELS; default {DEFAULT_MAX_IMAGE_PIXELS})")
    parser.add_argument("--device-id", default=None,
                        help="the id of the single --data device (default <prefix>-<file or folder name>)")


def _add_emulation_flags(parser: argparse.ArgumentParser) -> None:
    """The emulated device kinds, their links and transfer scale, and the devices' ids."""
    parser.add_argument("--kinds", default=env_default("kinds", ""),
                        help="emulated device kinds assigned round-robin by shard, e.g. high,mid,low or high-low "
                             "(env SFL_KINDS; empty = real device, no emulation)")
    parser.add_argument("--links", choices=LINKS, default=env_default("links", "emulated"),
                        help="with --kinds: emulated (default) = sleep each transfer at the kind's rate; real = the "
                             "agent's link is really that slow (a shaped link, docs/real-links.md): emulate compute only "
                             "(env SFL_LINKS)")
    parser.add_argument("--request-delay-ms", type=float, default=float(env_default("request_delay_ms", 0)),
                        help="wait this many milliseconds before each request the devices send: an emulated round-trip "
                             "time where the kernel cannot add one (env SFL_REQUEST_DELAY_MS; default 0)")
    parser.add_argument("--time-scale", type=_time_scale, default=str(env_default("time_scale", DeviceMixConfig().time_scale)),
                        help="compress emulated transfer times by this factor, or auto (the default): by "
                             f"{AUTO_TRANSFER_RATIO:g} times the factor by which this host, measured training the run's model, outpaces the "
                             "paper's 5e10 FLOP/s server (env SFL_TIME_SCALE; docs/configuration.md)")
    parser.add_argument("--prefix", default=env_default("prefix", "dev"),
                        help="device id prefix; ids are <prefix>-<shard as 3 digits>, e.g. dev-007, or with --data "
                             "<prefix>-<file or folder name> (env SFL_PREFIX)")


def _add_agent_flags(parser: argparse.ArgumentParser) -> None:
    """TLS, metrics, enrolment, memory and compute settings of the agent process."""
    parser.add_argument("--ca-file", default=env_default("ca_file", None), help="CA bundle to verify HTTPS servers (env SFL_CA_FILE)")
    parser.add_argument("--metrics-port", type=int, default=int(env_default("metrics_port", 0)),
                        help="serve Prometheus metrics of this agent's devices on this port (env SFL_METRICS_PORT; "
                             "default 0 = off). Timings also reach the Fed Server with every upload")
    parser.add_argument("--metrics-host", default=env_default("metrics_host", "127.0.0.1"),
                        help="address the metrics port binds (env SFL_METRICS_HOST; 0.0.0.0 to be scraped from another host)")
    parser.add_argument("--metrics-linger-s", type=float, default=float(env_default("metrics_linger_s", 0)),
                        help="with --metrics-port, once the run is over keep serving until Prometheus scrapes once more "
                             "(so it records the last round's figures), at most this many seconds (env "
                             "SFL_METRICS_LINGER_S; default 0 = exit at once)")
    parser.add_argument("--enrolment-secret-file", default=env_default("enrolment_secret_file", None),
                        help="this agent's enrolment credential (python -m fed_server credentials issue) or the "
                             "deployment's shared enrolment secret, presented to register (or env SFL_ENROLMENT_SECRET)")
    parser.add_argument("--keep-models", choices=sorted(KEEP_MODELS), default=env_default("keep_models", "auto"),
                        help="keep each device's model between rounds (env SFL_KEEP_MODELS): auto (default) = only "
                             "when hosting one device; no = build the trained blocks for each task and free them "
                             "once the upload is encoded (memory follows the devices training at once); yes = always keep")
    parser.add_argument("--keep-data", choices=sorted(KEEP_MODELS), default=env_default("keep_data", "auto"),
                        help="keep each device's data between tasks (env SFL_KEEP_DATA): auto (default) = as it keeps "
                             "its model; no = load it for each task and let it go after (an idle device holds no "
                             "samples); yes = always keep")
    parser.add_argument("--state-dir", default=env_default("state_dir", None), metavar="DIR",
                        help="where the devices keep what their algorithm carries from one round to the next (SCAFFOLD's "
                             "control variates), so it survives a restart of this agent (env SFL_STATE_DIR); default: a "
                             "temporary directory removed when the agent exits")
    parser.add_argument("--compute-slots", default=env_default("compute_slots", "auto"),
                        help="threads that run this agent's devices' whole-model training (env SFL_COMPUTE_SLOTS; split "
                             "training computes on each device's thread): auto "
                             "(default) = one per usable core given --threads when the agent hosts more devices "
                             "than that, else 0; 0 = each device computes on its own thread")
    parser.add_argument("--model", default=env_default("model", None),
                        help="the run's model when it is an import path package.module:function (env SFL_MODEL): a "
                             "device builds an import path only if it equals this, never because the Fed Server "
                             "names it (docs/security.md); built-in names need no flag")
    parser.add_argument("--loss", default=env_default("loss", None),
                        help="the run's loss when it is an import path package.module:function (env SFL_LOSS): "
                             "used only if it equals the run's train.loss, like --model; built-in losses need "
                             "no flag")


def _devices(parser: argparse.ArgumentParser, args: argparse.Namespace
             ) -> tuple[list[LocalSource], dict[str, str], list[int], list[str]]:
    """The devices the flags describe: their ``--data`` sources and ``--data-arg`` keywords, or
    their shards, and their emulated kinds. A usage error (exit 2, one line) for flags that do
    not fit together or do not parse; a ``--data`` value that cannot be read is a device of its
    own that stops alone (:func:`shared.data.local.device_sources`)."""
    from device_agent.agent import local_device_ids, parse_data_args, parse_shards
    from device_agent.slices import agent_shards
    from shared.data.local import device_sources
    from shared.profiles import parse_kind

    if args.data and args.shards is not None:
        parser.error("--data and --shards are exclusive: a device either brings its own data or holds a shard "
                     "of the run's built-in data set")
    if (args.data_arg or args.device_id) and not args.data:
        parser.error("--data-arg and --device-id are for --data devices")
    if args.slice is not None and args.data:
        parser.error("--slice takes a block of --shards; a --data agent hosts the devices of its own files")
    try:
        limits = FileLimits(max_bytes=args.max_data_bytes, max_pixels=args.max_image_pixels)
        sources = [source for path in args.data for source in device_sources(path, limits)]
        data_args = parse_data_args(args.data_arg)
        local_device_ids(sources, args.prefix, args.device_id)
        shards = [] if sources else parse_shards(args.shards or "0")
        if args.slice is not None:
            shards = agent_shards(shards, args.slice)
            log.info("--slice %s: hosting shards %s", args.slice, ",".join(map(str, shards)))
        kinds = [k for k in args.kinds.split(",") if k.strip()]
        for k in kinds:
            parse_kind(k)
    except ValueError as exc:
        parser.error(str(exc))
    return sources, data_args, shards, kinds


def _checked_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    """Refuse (exit 2, one line) agent settings out of range, including those an environment
    default gave (argparse checks choices on the command line only); return ``--compute-slots``
    (None: auto)."""
    for flag in ("keep_models", "keep_data"):  # argparse checks choices on the command line, not env defaults
        if getattr(args, flag) not in KEEP_MODELS:
            parser.error(f"--{flag.replace('_', '-')} must be one of {sorted(KEEP_MODELS)}, got {getattr(args, flag)!r}")
    compute_slots = None if args.compute_slots == "auto" else _whole_number(args.compute_slots)
    if compute_slots is not None and compute_slots < 0:
        parser.error(f"--compute-slots must be auto or a whole number >= 0 (0: each device on its own thread), "
                     f"got {args.compute_slots!r}")
    if args.links not in LINKS:  # argparse checks choices on the command line, not env defaults
        parser.error(f"--links must be one of {', '.join(LINKS)}, got {args.links!r}")
    if not 0 <= args.request_delay_ms < 60_000:
        parser.error(f"--request-delay-ms must be a number of milliseconds from 0 to 60000, got {args.request_delay_ms}")
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be 0 (off) or a port number, got {args.metrics_port}")
    if not 0 <= args.metrics_linger_s < float("inf"):
        parser.error(f"--metrics-linger-s must be a number of seconds >= 0, got {args.metrics_linger_s}")
    return compute_slots


def _linger(metrics: AgentMetrics, linger_s: float) -> None:
    """Once the run is over, serve the metrics until Prometheus scrapes once more (so it records
    the last round's figures), at most ``linger_s`` seconds."""
    log.info("run over: serving metrics until Prometheus scrapes them once more (at most %.0f s)", linger_s)
    try:
        if not metrics.wait_for_scrape(linger_s):
            log.warning("no Prometheus scrape within --metrics-linger-s %.0f s: the last figures were not recorded",
                        linger_s)
    except KeyboardInterrupt:   # Ctrl-C or SIGTERM (docker stop) while lingering: the run is over anyway
        log.info("stopped while waiting for a last scrape")


def _time_scale(text: str) -> TimeScale:
    """``--time-scale``'s value (argparse shows the error with the flag's name)."""
    try:
        return parse_time_scale(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    """A limit flag's value: a whole number above zero (argparse shows the error with the flag's name)."""
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number above zero")
    return value


def _whole_number(text: str) -> int:
    """``text`` as an int, or -1 when it is not one (refused by the caller with the flag's name)."""
    try:
        return int(text)
    except ValueError:
        return -1


if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        _exit(stop)
