"""``python tools/mutation.py [--module NAME ...] [--sample N] [--seed S] [--out DIR]``: mutation testing
of the core math (``make mutation``; not part of ``make test`` or CI).

For each module of ``MODULES`` it lists every mutant cosmic-ray's operators make of the module
(``pip install -e .[mutation]``), samples ``--sample`` of them with a seed fixed per module (the
same mutants on every run while the module's code is unchanged), applies each in turn to a copy of
the tree and runs that module's unit tests against it. A mutant is *killed* when the tests fail
(or time out), *survives* when they pass. Mutants listed in ``EQUIVALENT`` change no behaviour
(docs/mutation-testing.md says why, one by one) and are left out of the score:
``score = killed / (mutants - equivalent)``.

The tests run in a process forked from this one, which has imported torch, numpy and pytest
once (but none of the project's modules) and warmed up torch's FLOP counter, so each mutant
costs its tests' run and not a fresh interpreter's 3 s of imports. Writes ``<out>/mutation.md`` (the table and every survivor's diff)
and ``<out>/mutation.json`` (every mutant's outcome).
"""
from __future__ import annotations

import argparse
import ast
import datetime
import difflib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Module under test -> the unit tests that pin it (run for each of its mutants).
MODULES: dict[str, tuple[str, ...]] = {
    "shared/algorithms/aggregation.py": ("tests/unit/shared/test_aggregation.py",
                                         "tests/unit/shared/algorithms/test_aggregation.py"),
    "shared/algorithms/robust_aggregation.py": ("tests/unit/shared/algorithms/test_robust_aggregation.py",),
    "shared/algorithms/label_balance.py": ("tests/unit/shared/algorithms/test_label_balance.py",
                                           "tests/unit/shared/test_grouping.py"),
    "shared/algorithms/grouping.py": ("tests/unit/shared/test_grouping.py",
                                      "tests/unit/shared/algorithms/test_grouping.py"),
    "shared/algorithms/group_loss.py": ("tests/unit/shared/algorithms/test_group_loss.py",),
    "shared/algorithms/data_weighted_loss.py": ("tests/unit/shared/algorithms/test_group_loss.py",),
    "fed_server/time_table.py": ("tests/unit/fed_server/test_time_table.py",),
    "fed_server/split_planner.py": ("tests/unit/fed_server/test_split_planner.py",),
    "shared/wire.py": ("tests/unit/shared/test_wire.py", "tests/unit/shared/test_wire_fast_paths.py"),
}

#: wire.py's byte-order test, of which four mutants are equivalent on a little-endian machine.
_BYTEORDER = 'if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian'
#: Mutants that change no behaviour, per module: (operator, the changed source line before, after).
#: Their reasons are in docs/mutation-testing.md.
EQUIVALENT: dict[str, set[tuple[str, str, str]]] = {
    "shared/algorithms/aggregation.py": {
        ("core/ReplaceComparisonOperator_Eq_LtE", "if len(contributions) == 0:", "if len(contributions) <= 0:"),
        ("core/NumberReplacer", "largest = max((g.numel() for g in global_state.values()), default=0)",
         "largest = max((g.numel() for g in global_state.values()), default= 1)"),
        ("core/NumberReplacer", "largest = max((g.numel() for g in global_state.values()), default=0)",
         "largest = max((g.numel() for g in global_state.values()), default= -1)"),
    },
    "shared/algorithms/label_balance.py": {
        ("core/NumberReplacer", "if arr.shape[0] == 0 or arr.shape[1] == 0:", "if arr.shape[0] == -1 or arr.shape[1] == 0:"),
        ("core/ReplaceUnaryOperator_USub_Invert", "arr = np.asarray(c, dtype=np.float64).reshape(-1)",
         "arr = np.asarray(c, dtype=np.float64).reshape(~1)"),
        ("core/NumberReplacer", "return np.where(total[..., 0] > 0, dist, 0.0)",
         "return np.where(total[..., -1] > 0, dist, 0.0)"),
        ("core/ReplaceComparisonOperator_Eq_LtE", "if n_dev == 0:", "if n_dev <= 0:"),
        ("core/NumberReplacer", "if arr.shape[0] == 0 or arr.shape[1] == 0:", "if arr.shape[ 1] == 0 or arr.shape[1] == 0:"),
        ("core/NumberReplacer", "elif arr.shape[0] != n_classes:", "elif arr.shape[ -1] != n_classes:"),
        ("core/ReplaceComparisonOperator_Gt_NotEq", "return np.where(total[..., 0] > 0, dist, 0.0)",
         "return np.where(total[..., 0] != 0, dist, 0.0)"),
    },
    "shared/algorithms/robust_aggregation.py": {
        ("core/ReplaceTrueWithFalse", "coordinatewise = True", "coordinatewise = False"),
        ("core/ReplaceComparisonOperator_Gt_GtE", "if n > PAIRWISE_MAX:", "if n >= PAIRWISE_MAX:"),
        ("core/ReplaceBinaryOperator_BitAnd_Mul", "kept_w = ((rank >= trim) & (rank < n - trim)) * weights[:, None]",
         "kept_w = ((rank >= trim) * (rank < n - trim)) * weights[:, None]"),
        ("core/NumberReplacer",
         "nearest = distances.sort(dim=1).values[:, 1:neighbours + 1]   # column 0: the candidate itself",
         "nearest = distances.sort(dim=1).values[:, 0:neighbours + 1]   # column 0: the candidate itself"),
        ("core/ReplaceComparisonOperator_NotEq_Lt", "return out, {d: w for d, w in out.items() if w != weights[d]}",
         "return out, {d: w for d, w in out.items() if w < weights[d]}"),
        ("core/NumberReplacer", "largest = max((g.numel() for g in global_state.values()), default=0)",
         "largest = max((g.numel() for g in global_state.values()), default= 1)"),
    },
    "shared/algorithms/grouping.py": {
        ("core/AddNot", "if TYPE_CHECKING:", "if not TYPE_CHECKING:"),
    },
    "shared/wire.py": {
        ("core/AddNot", _BYTEORDER, _BYTEORDER.replace("if sys", "if not sys")),
        ("core/ReplaceComparisonOperator_NotEq_Gt", _BYTEORDER, _BYTEORDER.replace("!=", ">")),
        ("core/ReplaceComparisonOperator_NotEq_GtE", _BYTEORDER, _BYTEORDER.replace("!=", ">=")),
        ("core/ReplaceComparisonOperator_NotEq_LtE", _BYTEORDER, _BYTEORDER.replace("!=", "<=")),
        ("core/ReplaceComparisonOperator_NotEq_Eq", _BYTEORDER, _BYTEORDER.replace("!=", "==")),
        ("core/ReplaceComparisonOperator_NotEq_GtE", 'if t.device.type != "cpu":', 'if t.device.type >= "cpu":'),
        ("core/ReplaceComparisonOperator_NotEq_IsNot", 'if t.device.type != "cpu":', 'if t.device.type is not "cpu":'),
    },
    "fed_server/time_table.py": {
        ("core/ReplaceUnaryOperator_USub_Not", "best_j, best_gap = -1, math.inf", "best_j, best_gap = not 1, math.inf"),
    },
    "fed_server/split_planner.py": {
        ("core/NumberReplacer", "if parts is not None and parts.transfer_s > 0 and moved > 0 and math.isfinite(moved / parts.transfer_s):",
         "if parts is not None and parts.transfer_s > 0 and moved > 1 and math.isfinite(moved / parts.transfer_s):"),
        ("core/ReplaceComparisonOperator_Gt_NotEq", "if parts is not None and parts.transfer_s > 0 and moved > 0 and math.isfinite(moved / parts.transfer_s):",
         "if parts is not None and parts.transfer_s > 0 and moved != 0 and math.isfinite(moved / parts.transfer_s):"),
        ("core/ReplaceComparisonOperator_Gt_GtE", "if parts is not None and parts.transfer_s > 0 and moved > 0 and math.isfinite(moved / parts.transfer_s):",
         "if parts is not None and parts.transfer_s > 0 and moved >= 0 and math.isfinite(moved / parts.transfer_s):"),
        ("core/ReplaceComparisonOperator_Gt_GtE", "if factor > 1.0 and rate is not None:", "if factor >= 1.0 and rate is not None:"),
        ("core/ReplaceComparisonOperator_Eq_GtE", 'if self.mode == "zero":', 'if self.mode >= "zero":'),
        ("core/ReplaceComparisonOperator_Eq_LtE", 'if self.mode == "fixed":', 'if self.mode <= "fixed":'),
    },
}

#: What the copy of the tree holds: the packages and the tests (with their pytest settings).
_COPIED = ("pyproject.toml", "shared", "fed_server", "main_server", "device_agent", "http_api", "testbed",
           "experiments", "benchmarks", "tests")
#: pytest plugins the unit tests of ``MODULES`` do not use: loading hypothesis and schemathesis alone
#: took 2 s of each run.
_NO_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:xdist.looponfail", "-p", "no:anyio",
               "-p", "no:hypothesispytest", "-p", "no:schemathesis")
DEFAULT_SAMPLE = 60
DEFAULT_SEED = 20261127


@dataclass
class Mutant:
    """One mutation: cosmic-ray's operator and occurrence, and the lines it changes."""

    module: str
    operator: str
    occurrence: int
    line: int
    before: str
    after: str
    outcome: str = ""  # killed | survived | timeout | equivalent (survived, listed in EQUIVALENT)


def _changed_line(original: str, mutated: str) -> tuple[int, str, str]:
    """(1-based line, line before, line after) of the first line the mutation changes."""
    old, new = original.splitlines(), mutated.splitlines()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag != "equal":
            return i1 + 1, "\n".join(old[i1:i2]).strip(), "\n".join(new[j1:j2]).strip()
    raise ValueError("the mutation changes nothing")


def _without_annotations(source: str) -> str:
    """``source``'s syntax tree with every annotation removed, as text (to compare two versions)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
    return ast.dump(tree)


def all_mutants(module: str, source: str) -> list[tuple[Mutant, str]]:
    """Every mutant cosmic-ray's argument-free operators make of ``source`` that compiles, with its
    mutated code.

    Mutants that change only a type annotation are left out: the modules import ``from __future__
    import annotations``, so Python never evaluates them (pydantic does, for its models' fields,
    and those are left out too: a broken one fails at import, a changed one is a different type
    check, not the math)."""
    import cosmic_ray.plugins
    from cosmic_ray.ast import ast_nodes, get_ast
    from cosmic_ray.mutating import mutate_code

    bare = _without_annotations(source)
    out: list[tuple[Mutant, str]] = []
    for name in sorted(cosmic_ray.plugins.operator_names()):
        operator_class = cosmic_ray.plugins.get_operator(name)
        if operator_class.arguments():
            continue
        operator = operator_class()
        positions = sum(len(list(operator.mutation_positions(node))) for node in ast_nodes(get_ast(source)))
        for occurrence in range(positions):
            try:
                mutated = mutate_code(source, operator, occurrence)
            except AttributeError:  # cosmic-ray 8.7's ExceptionReplacer fails on some except clauses
                continue
            try:
                if mutated is None or _without_annotations(mutated) == bare:
                    continue
            except SyntaxError:  # not a program (cosmic-ray mutates a few tokens out of their grammar)
                continue
            line, before, after = _changed_line(source, mutated)
            out.append((Mutant(module, name, occurrence, line, before, after), mutated))
    return out


def sample(mutants: list[tuple[Mutant, str]], count: int, seed: int, module: str) -> list[tuple[Mutant, str]]:
    """``count`` mutants drawn with a generator seeded by ``seed`` and the module, in source order."""
    rng = random.Random(f"{seed}:{module}")
    picked = mutants if len(mutants) <= count else rng.sample(mutants, count)
    return sorted(picked, key=lambda m: (m[0].line, m[0].operator, m[0].occurrence))


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results", ".pytest_cache", ".mypy_cache")
    for name in _COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def run_tests(tests: tuple[str, ...], timeout: float) -> str:
    """Run ``tests`` with pytest in a forked child (output discarded): ``survived`` when they
    pass, ``killed`` when they fail or cannot be collected, ``timeout`` past ``timeout`` seconds."""
    pid = os.fork()
    if pid == 0:  # the child: its own process group, so a timeout kills whatever it started
        code = 70
        try:
            os.setpgid(0, 0)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            import pytest
            code = int(pytest.main(["-q", "-x", *_NO_PLUGINS, *tests]))
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            if code == 5:
                raise SystemExit(f"no tests collected from {' '.join(tests)}")
            return "survived" if code == 0 else "killed"
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def mutate_module(module: str, tests: tuple[str, ...], count: int, seed: int, copy: Path) -> list[Mutant]:
    """Run ``module``'s sampled mutants against its tests in ``copy``; the module is restored after."""
    path = copy / module
    source = path.read_text(encoding="utf-8")
    started = time.monotonic()
    if run_tests(tests, timeout=600) != "survived":
        raise SystemExit(f"{module}: its tests fail without a mutation ({' '.join(tests)})")
    timeout = 10.0 + 5.0 * (time.monotonic() - started)
    picked = sample(all_mutants(module, source), count, seed, module)
    equivalent = EQUIVALENT.get(module, set())
    try:
        for mutant, mutated in picked:
            path.write_text(mutated, encoding="utf-8")
            mutant.outcome = run_tests(tests, timeout)
            if mutant.outcome == "survived" and (mutant.operator, mutant.before, mutant.after) in equivalent:
                mutant.outcome = "equivalent"
            print(f"  {mutant.outcome:10} {module}:{mutant.line} {mutant.operator}  {mutant.after}", flush=True)
    finally:
        path.write_text(source, encoding="utf-8")
    return [m for m, _ in picked]


def score_row(module: str, mutants: list[Mutant]) -> dict[str, object]:
    """module / mutants / killed / survived / equivalent / score (killed of the non-equivalent)."""
    killed = sum(m.outcome in ("killed", "timeout") for m in mutants)
    equivalent = sum(m.outcome == "equivalent" for m in mutants)
    survived = sum(m.outcome == "survived" for m in mutants)
    live = len(mutants) - equivalent
    return {"module": module, "mutants": len(mutants), "killed": killed, "survived": survived,
            "equivalent": equivalent, "score": round(100.0 * killed / live, 1) if live else 100.0}


def tested_commit(paths: list[str]) -> str:
    """The commit the mutated modules and their tests are at: ``git rev-parse HEAD``, with
    ``+changes`` when one of ``paths`` differs from it (the score is then of uncommitted code);
    ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def render(rows: list[dict[str, object]], mutants: list[Mutant], seed: int, count: int, commit: str) -> str:
    """The Markdown report: the table, then every surviving mutant's line before and after."""
    lines = [f"# Mutation testing, {datetime.date.today().isoformat()}", "",
             f"Commit {commit}. cosmic-ray operators, {count} mutants sampled per module (seed {seed}); "
             "score = killed / (mutants - equivalent).", "",
             "| module | mutants | killed | survived | equivalent | score |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| `{r['module']}` | {r['mutants']} | {r['killed']} | {r['survived']} | {r['equivalent']} | "
              f"{r['score']} % |" for r in rows]
    survivors = [m for m in mutants if m.outcome == "survived"]
    if survivors:
        lines += ["", "## Survivors", ""]
        lines += [f"- `{m.module}:{m.line}` {m.operator}: `{m.before}` -> `{m.after}`" for m in survivors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the sampled mutants of the chosen modules and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--module", action="append", choices=sorted(MODULES),
                        help="a module to mutate (repeatable; default: every one)")
    parser.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, help="mutants per module")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}_mutation")
    args = parser.parse_args(argv)
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        parser.error("cosmic-ray is not installed: pip install -e '.[mutation]'")
    # What every test run needs, imported once here and inherited by each forked run.
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    # The FLOP counter (model profiles: the split planner's tests) builds its tables on first use,
    # 3 s that every forked run would pay again.
    with FlopCounterMode(display=False), torch.enable_grad():
        torch.nn.Linear(2, 2)(torch.zeros(1, 2)).sum().backward()

    sys.dont_write_bytecode = True
    # Ctrl-C or a kill ends the run through the cleanup below (the module restored, the copy removed).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict[str, object]] = []
    mutants: list[Mutant] = []
    chosen = args.module or list(MODULES)
    commit = tested_commit([*chosen, *(t for m in chosen for t in MODULES[m])])
    out = args.out.resolve()   # the runs below change into the tree's copy
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        copy = Path(tmp)
        _copy_tree(copy)
        os.chdir(copy)
        sys.path.insert(0, str(copy))
        for module in chosen:
            print(f"{module}: up to {args.sample} mutants, tests {' '.join(MODULES[module])}", flush=True)
            done = mutate_module(module, MODULES[module], args.sample, args.seed, copy)
            mutants += done
            rows.append(score_row(module, done))
            print("  " + ", ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutation.md").write_text(render(rows, mutants, args.seed, args.sample, commit), encoding="utf-8")
    (out / "mutation.json").write_text(json.dumps(
        {"commit": commit, "seed": args.seed, "sample": args.sample, "table": rows,
         "mutants": [asdict(m) for m in mutants]}, indent=1) + "\n", encoding="utf-8")
    print(render(rows, mutants, args.seed, args.sample, commit))
    print(f"written: {out / 'mutation.md'}, {out / 'mutation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
