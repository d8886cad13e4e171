"""``python -m experiments``: run a grid of testbed runs from an experiment file and report on it."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from experiments.grid import expand, parse_only
from experiments.report import render_report
from experiments.results import load_results
from experiments.runner import is_finished, run_grid
from experiments.spec import load_spec
from shared.run_config import ConfigError, exit_on_config_error
from shared.service import interrupt_on_sigterm
from testbed.warm_start import WarmStarter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m experiments",
        description="Run an experiment grid (algorithms x partitions x seeds x device mixes ...) where every cell "
                    "is a real testbed run through the services, then write results.csv/json, summary.csv, PNG "
                    "plots and report.md. Finished cells are skipped when the grid is run again. "
                    "Format of the experiment file: docs/experiments.md.")
    parser.add_argument("command", choices=["run", "report", "list"],
                        help="run: run unfinished cells, then report; report: re-render from finished cells; "
                             "list: print the cells and whether they are finished")
    parser.add_argument("file", help="experiment file (YAML), e.g. experiments/grids/table2_cnn.yaml")
    parser.add_argument("--out", help="experiment folder (default runs/experiments/<name>)")
    parser.add_argument("--only", action="append", default=[], metavar="AXIS=LABEL[,LABEL]",
                        help="restrict to a sub-grid, e.g. --only seed=0 --only algorithm=fedavg,s2fl (repeatable; "
                             "the report still covers every cell that has results)")
    parser.add_argument("--log-level", default="WARNING", help="log level of the services (logs go to each cell's logs/)")
    parser.add_argument("--warm-start", action="store_true",
                        help="fork every cell's services from one process that has imported torch and the services "
                             "once: each cell starts about 6 s sooner on a 2-core machine; its wall_s then counts "
                             "less start-up, and memory is shared between the processes (docs/experiments.md)")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.file)
        every = expand(spec)
        cells = expand(spec, parse_only(args.only))
    except ConfigError as exc:
        exit_on_config_error(exc)
    except ValueError as exc:   # --only naming an unknown axis or label
        parser.error(str(exc))
    out = Path(args.out or f"runs/experiments/{spec.name}")
    command = "python -m experiments run " + " ".join(shlex.quote(a) for a in [args.file, *(
        ["--out", args.out] if args.out else [])])

    if args.command == "list":
        for cell in cells:
            print(f"{'finished' if is_finished(out, cell) else 'to run  '}  {cell.cell_id}")
        return
    if args.command == "run":
        interrupt_on_sigterm()
        todo = sum(not is_finished(out, c) for c in cells)
        print(f"experiment {spec.name}: {len(cells)} cells ({todo} to run) -> {out}", flush=True)
        warm = WarmStarter() if args.warm_start else None
        try:
            outcomes = run_grid(spec, cells, out, Path(args.file).read_text(), log_level=args.log_level, warm=warm)
        except KeyboardInterrupt:
            print("\ninterrupted; finished cells are kept and skipped next time", file=sys.stderr)
            sys.exit(130)
        failed = [o for o in outcomes if o.status == "failed"]
        if failed:
            print(f"{len(failed)} cell(s) failed (the report lists them; run again to retry)", file=sys.stderr)
    report = render_report(load_results(spec, every, out), spec, out, command)
    print(f"report: {report}")
    if args.command == "run" and any(o.status == "failed" for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
