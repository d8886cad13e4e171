"""The runs a Fed Server keeps in one folder (``--runs-root``): a directory per run, named by its
run id, and which run a start takes up.

The rule is made for a supervisor that starts the Fed Server again and again with the same flags
(``docker compose up``, a Kubernetes pod that is rescheduled): a start takes up the run the folder
names as current (the file ``current``) while that run is unfinished (a crash or a restart
mid-run resumes it), and begins a new run when it is over (its ``summary.json`` is written) or
when there is none. Anything else is the operator's explicit choice: a given run
(``--resume ID``, finished or not: a finished run is served, or continued when ``rounds`` was
raised), or a new run while the current one is unfinished (``--new-run``, which leaves that run's
directory as it is, to be resumed later by its id).

A configuration that differs from an unfinished run's checkpoint in more than a resume may change
(:data:`fed_server.checkpoint.RESUMABLE_CHANGES`) is refused with one line saying what to do
(:class:`RunRefused`), before anything of the run is built.
"""
from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from fed_server.checkpoint import RESUMABLE_CHANGES, config_differences
from fed_server.run_dir import RunDirectory
from shared.config import RunConfig
from shared.files import atomic_write

#: The file (in the runs folder) holding the id of the run a start took up last.
CURRENT = "current"
#: What a run id given by the operator may look like: it is a directory name.
RUN_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"


class RunRefused(Exception):
    """The run this start would take up cannot be: the message says why and what to do."""


@dataclass(frozen=True)
class RunChoice:
    """The run a start takes up: its id, its directory, whether it exists already (resumed, or
    served when it is over) and why it was chosen (one line for the log)."""

    run_id: str
    path: Path
    resume: bool
    why: str


class RunsRoot:
    """The runs folder: one directory per run (``<folder>/<run id>``) and the ``current`` file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def current(self) -> str | None:
        """The run the last start took up, if its directory is still there."""
        try:
            run_id = (self.path / CURRENT).read_text().strip()
        except FileNotFoundError:
            return None
        return run_id if re.fullmatch(RUN_ID_PATTERN, run_id) and (self.path / run_id).is_dir() else None

    def runs(self) -> list[str]:
        """The ids of the runs in the folder, oldest first by their generated names."""
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if (p / "config.yaml").is_file())

    def choose(self, config: RunConfig, resume: str | None = None, new_run: bool = False,
               run_id: str | None = None) -> RunChoice:
        """The run a start with these flags takes up (:class:`RunRefused` when it cannot be):
        ``resume``, ``--resume ID``; ``new_run``, ``--new-run``; ``run_id``, ``--run-id`` (the id
        of a new run, or of the current unfinished run, which is then resumed)."""
        if resume is not None and (new_run or run_id is not None):
            raise RunRefused("--resume takes up a run, --new-run and --run-id begin one: give one of them")
        for given in (resume, run_id):
            if given is not None and not re.fullmatch(RUN_ID_PATTERN, given):
                raise RunRefused(f"bad run id {given!r}: 1 to 64 letters, digits, '_', '.' or '-', not starting "
                                 f"with '.', '_' or '-'")
        if resume is not None:
            if not (self.path / resume / "config.yaml").is_file():
                held = ", ".join(self.runs()) or "none"
                raise RunRefused(f"no run {resume} in {self.path} to resume (runs there: {held})")
            self._check_resumable(resume, config, f"start with its configuration ({self.path / resume / 'config.yaml'}) "
                                                  f"to resume it, or without --resume {resume} to begin a new run")
            return RunChoice(resume, self.path / resume, True, f"resuming run {resume} (--resume)")
        current = self.current()
        unfinished = current is not None and not self._over(current)
        # --run-id naming the current unfinished run is the same start again (a supervisor's fixed
        # SFL_RUN_ID after a crash): it resumes; a run id already used otherwise is refused below.
        if unfinished and not new_run and run_id in (None, current):
            assert current is not None
            self._check_resumable(current, config, f"to resume it, start with its configuration "
                                                   f"({self.path / current / 'config.yaml'}); to begin a new run and "
                                                   f"leave it as it is, start with --new-run (SFL_NEW_RUN=1)")
            return RunChoice(current, self.path / current, True, f"resuming run {current}: it is unfinished")
        new_id = run_id or self._new_id(config)
        if (self.path / new_id).exists():
            raise RunRefused(f"run {new_id} exists in {self.path}: resume it with --resume {new_id}, or give "
                             f"another --run-id")
        if current is None:
            why = f"new run {new_id}"
        elif unfinished:
            why = (f"new run {new_id} ({'--new-run' if new_run else '--run-id'}); the unfinished run {current} "
                   f"stays in {self.path / current}")
        else:
            why = f"new run {new_id}: the last run, {current}, is over"
        return RunChoice(new_id, self.path / new_id, False, why)

    def take(self, choice: RunChoice) -> None:
        """Note ``choice`` as the current run (the next start resumes it while it is unfinished)."""
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path / CURRENT, f"{choice.run_id}\n".encode())

    def _over(self, run_id: str) -> bool:
        """Whether the run has ended (finished, or stopped by its failures): its summary is written."""
        return RunDirectory.summary_path_of(self.path / run_id).is_file()

    def _check_resumable(self, run_id: str, config: RunConfig, what_to_do: str) -> None:
        """Refuse to resume a run whose checkpoint was made under another configuration."""
        path = self.path / run_id
        run = RunDirectory(path)
        previous = run.read_config()
        if previous is None or not run.checkpoint_path.exists():
            return   # nothing trained yet: the run starts over under this configuration
        changed = config_differences(previous, config.model_dump(mode="json"))
        if changed:
            state = "finished" if self._over(run_id) else "unfinished"
            raise RunRefused(f"run {run_id} in {path} is {state} and was started with another configuration "
                             f"({', '.join(changed)} differ; a resume may change only "
                             f"{', '.join(RESUMABLE_CHANGES)}): {what_to_do}")

    @staticmethod
    def _new_id(config: RunConfig) -> str:
        """A new run's id: its start time (UTC) and algorithm, so the folder lists runs in the
        order they began, and a few random digits, so two starts in one second differ."""
        return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{config.algorithm}-{secrets.token_hex(2)}"
