"""The run a device joins: its spec, asked for until the Fed Server answers, and checked before
anything of it is built (an unknown algorithm, a model this process may not or cannot build)."""
from __future__ import annotations

import logging
import threading
import time

from device_agent.api import FedApi
from shared.algorithms.registry import ALGORITHMS, build_privacy_defences
from shared.losses import check_loss_origin
from shared.models import SplitModel, build_model, build_model_layout, check_model_origin
from shared.schemas import RunInfo

log = logging.getLogger("device_agent")


def build_run_model(info: RunInfo, layout: bool = False) -> SplitModel:
    """The run's model with real weights, or (``layout``) its structure on the meta device."""
    build = build_model_layout if layout else build_model
    return build(info.model, info.num_classes, tuple(info.input_shape), seed=info.seed, params=info.model_params)


def check_run(info: RunInfo, model_ref: str | None, loss_ref: str | None = None) -> SplitModel:
    """The run's model layout, once the run is known to be one this process can train: its
    algorithm is one it knows, its loss one it may use (an import path only when it is the
    operator's ``--loss``) and its model one it may build (an import path only when it is the
    operator's ``--model``), checked before anything is imported, and can, and its privacy defences
    ones it knows. ValueError naming what is wrong otherwise."""
    if info.algorithm not in ALGORITHMS:
        raise ValueError(f"the run's algorithm {info.algorithm!r} is not one this agent knows "
                         f"({', '.join(ALGORITHMS)}): run an agent of the Fed Server's version")
    check_loss_origin(info.loss, loss_ref)
    check_model_origin(info.model, model_ref)
    # Names of this agent's own table only: a run that names another is refused here.
    build_privacy_defences(info.split_privacy.defences, info.split_privacy.defence_params)
    return build_run_model(info, layout=True)


#: How often an agent that found the run over asks whether the Fed Server's next run has begun
#: (a Fed Server begins it when it is started again, which the agent cannot be told of).
NEXT_RUN_POLL_S = 5.0


def wait_for_run(fed: FedApi, stop: threading.Event, server: str) -> RunInfo:
    """The spec of a run to join, asked for until the Fed Server answers with one that is not over
    (or ``stop`` is set). Every second at most while it does not answer: an agent started beside
    its servers (the testbed starts them together) registers as soon as the Fed Server is up, not
    seconds later; every :data:`NEXT_RUN_POLL_S` while its run is over.

    ``server`` names the Fed Server in the log: one WARNING when it first does not answer, DEBUG
    for every later try, one INFO line once it answers, so an agent waiting for a server that is
    still starting says so once rather than once a try. A run that is over is said once too: the
    agent waits for the next run, which a Fed Server started again begins, rather than joining a
    run with nothing left to train."""
    delay = 0.2
    waiting_since: float | None = None
    over: str | None = None
    while True:
        try:
            info = fed.run_info()
        except Exception as exc:  # the Fed Server may still be starting
            if stop.is_set():
                raise
            reason = " ".join(str(exc).split()) or type(exc).__name__
            if waiting_since is None:
                waiting_since = time.monotonic()
                log.warning("waiting for %s: not reachable yet (%s); retrying", server, reason)
            else:
                log.debug("waiting for %s: still not reachable (%s)", server, reason)
            stop.wait(delay)
            delay = min(delay * 2, 1.0)
            continue
        if waiting_since is not None:
            log.info("%s is reachable (after %.1f s)", server, time.monotonic() - waiting_since)
            waiting_since = None
        if not info.finished:
            return info
        if over != info.run_id:
            over = info.run_id
            log.info("run %s of %s is over: waiting for its next run (a Fed Server started again begins one)",
                     info.run_id, server)
        if stop.wait(NEXT_RUN_POLL_S):
            return info
