"""Every command the docs show runs, in a quick form: each shell command of README.md,
benchmarks/README.md, docs/*.md and docs/algorithms/*.md, read from the pages by this test, so a
changed command is run as it now reads and a new one fails here until it is given a quick form or
a reason to be left out.

Quick forms (:func:`quick_form`): a testbed command (``python -m testbed ...``, ``make run
ARGS="..."``) runs its own flags through the testbed's own command line at 2 rounds and small data,
its services forked from the suite's warm starter (the ``Testbed`` the command line builds is given
``warm=``; everything else is the command's); ``--help`` runs as it is; ``benchmarks.run`` with
``--quick``; the benchmark modules at their smallest sizes; ``experiments list`` and ``report``
on a copy of the results; the credential commands in a session of their own. The services a user
starts by hand (the README's "Running the services yourself") run as one
deployment on loopback each, their host names and ports replaced by free loopback ports. Commands
whose quick forms are the same run once.

Left out, each with the reason the skip prints (:data:`LEFT_OUT`): what needs root, a container
engine or cluster, the network (pip), another machine, an elided or placeholder argument, the
test suite itself, or longer than the suite can give (named with the test that runs a short
form of it).
"""
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from integration_support import final_status, read_metrics
from testbed.processes import ProcessGroup, free_port, wait_healthy
from testbed.warm_start import shared_starter

#: The tests that run documented commands take about 11 minutes in all: `make docs-commands` runs
#: them (and `make check`, CI, after the suite), `make test` leaves them out; the checks that every
#: command has a quick form or a reason to be left out take a second and run in `make test`.
slow = pytest.mark.docs_commands

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "benchmarks/README.md",
         *sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("docs/*.md"), *ROOT.glob("docs/algorithms/*.md")])]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.S | re.M)
#: The quick form of every testbed command: two rounds, a run directory of the test's own.
ROUNDS = 2
#: Training samples of a built-in data set in a quick run (``data.max_samples``).
SAMPLES = 600


@dataclass(frozen=True)
class DocCommand:
    """One command of a page: its logical line (continuations joined, comment dropped)."""

    page: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _without_comment(line: str) -> str:
    """``line`` less a shell comment (a ``#`` that starts a word outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def page_commands(page: str, text: str | None = None) -> list[DocCommand]:
    """The commands of ``page``'s shell blocks (of ``text`` where given, else the file's), in order."""
    text = (ROOT / page).read_text() if text is None else text
    out = []
    for block in SHELL_BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", 0
        for offset, raw in enumerate(block.group(1).splitlines()):
            line = raw if pending else _without_comment(raw)
            if not pending:
                start = first + offset
            if line.endswith("\\"):
                pending += line[:-1].strip() + " "
                continue
            # A multi-line python -c "..." string: lines inside the quotes are part of the command.
            joined = (pending + line.strip()).strip() if pending else line.strip()
            if joined.count('"') % 2:
                pending = joined + "\n"
                continue
            pending = ""
            if joined:
                # A comment after a continued line's last part is the shell's, not an argument.
                out.append(DocCommand(page, start, _without_comment(joined)))
    return out


def documented_commands() -> list[DocCommand]:
    return [c for page in PAGES for c in page_commands(page)]


# --- what is left out, and why ------------------------------------------------------------------

#: (pattern, reason): a command matching the pattern is not run; the skip prints the reason.
LEFT_OUT: list[tuple[re.Pattern[str], str]] = [(re.compile(p), why) for p, why in [
    (r"^sudo ", "needs root (network namespaces and tc); tests/integration/test_real_links.py runs the testbed on "
                "real links where the suite has root"),
    (r"^(docker|podman|kubectl) |kustomize|^openssl rand .*deploy/kubernetes",
     "needs a container engine or a Kubernetes cluster; `make compose-check` (CI, after the suite) builds the "
     "images with podman and runs the compose testbed"),
    (r"pip install|^python3 -m venv", "installs from PyPI over the network (a machine's set-up; the suite runs in "
                                      "the installed .venv)"),
    (r"^scp ", "copies a file to another machine"),
    (r"^export SFL_PKI_DIR=|^printf 'SFL_PKI_DIR=|^curl --cacert \S+ https://localhost:8080/",
     "sets the variables of, or asks, a compose testbed or a port-forwarded pod (a container engine or cluster); "
     "`make compose-check` sets the same variables and reads the status over HTTPS"),
    (r"(^| )\.\.\.( |$)", "an elided command (`...`): its flags run in full in another command of the page"),
    (r"<[a-z][a-z ]*>", "a placeholder (`<...>`) stands for an argument"),
    (r"^make test\b", "the test suite itself"),
    (r"^make scan\b", "installs checkov from PyPI into .venv-scan; tests/deploy/test_kubernetes.py runs the same "
                      "scan (test_manifests_pass_the_policy_scan)"),
    (r"make mutation|tools/mutation\.py", "mutation testing: on demand, about 15 minutes on 2 cores, with "
                                          "cosmic-ray, which the dev install does not hold (docs/mutation-testing.md)"),
    (r"-m experiments run ", "a grid of full-length testbed runs, minutes to hours; "
                             "tests/integration/test_experiments.py runs the same command on a 2-round grid"),
    (r"mlflow\.lab", "needs an MLflow tracking server at mlflow.lab; tests/integration/test_tracking.py records to "
                    "MLflow's local store instead"),
    (r"^kill -HUP ", "a signal to a running Fed Server by its pid; tests/integration/test_security.py sends it after a "
                     "revocation"),
    (r"-m device_agent .*--slice ", "one half of a population over two machines, beside a Fed Server at "
                                    "fed:8080; tests/integration/test_agent_slices.py runs agents with --slice"),
    (r"from shared\.run_config import resolve_run_config", "step 3's data check: tests/unit/test_docs_tutorial.py "
                                                           "runs it, read from this page"),
    (r"docker/local-ca\.sh ", "makes a deployment's certificates for the names it is given; "
                              "tests/integration/test_local_ca_tls.py runs it and a split run over HTTPS with them"),
    (r"https?://(SERVER-HOST|fed\.example\.org|main-server\.example\.org|HOST)\b|"
     r"^python -m fed_server --config run\.yaml$|"
     r"^python -m (main_server|device_agent) --model my_pkg",
     "a service started by hand on one of several machines; the same services' flags run as a deployment on "
     "loopback in README.md's services block (this test)"),
]]
#: Why the tutorial's steps 2, 5 and 8 are not run one by one: their commands run on the project
#: the tutorial builds, and :func:`test_the_tutorials_three_machines_on_loopback` builds it from the
#: page and runs step 6 (the deployment) on it.
TUTORIAL = ("the tutorial's project: test_the_tutorials_three_machines_on_loopback builds it from steps 2 and 4 and "
            "runs step 6's secrets, servers and agents on loopback")


def left_out(command: DocCommand) -> str | None:
    """Why ``command`` is not run (None: it has a quick form)."""
    if command in _tutorial_steps():
        return TUTORIAL
    if _in_scenario(command):
        return None
    return next((why for pattern, why in LEFT_OUT if pattern.search(command.text)), None)


# --- the scenarios: services started by hand, the tutorial ---------------------------------------

def _section(page: str, heading: str) -> list[DocCommand]:
    """The commands of ``page``'s section ``heading`` (up to the next heading of its level or above;
    lines inside code blocks are not headings)."""
    level = len(heading.split(" ", 1)[0])
    lines = (ROOT / page).read_text().splitlines()
    fenced, first, last = False, None, len(lines)
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line == heading:
            first = number
        elif not fenced and first is not None and re.match(rf"#{{1,{level}}} ", line):
            last = number
            break
    assert first is not None, f"{page} has no section {heading!r}"
    return [c for c in page_commands(page) if first <= c.line <= last]


@functools.cache
def _services_block() -> tuple[DocCommand, ...]:
    """README.md's "Running the services yourself" commands."""
    return tuple(_section("README.md", "## Running the services yourself"))


@functools.cache
def _tutorial_steps() -> tuple[DocCommand, ...]:
    """The tutorial's commands of steps 2, 5, 6 and 8 (:data:`TUTORIAL`; step 3's data check runs
    in tests/unit/test_docs_tutorial.py, step 6 in :func:`test_the_tutorials_three_machines_on_loopback`)."""
    return tuple(c for heading in ("## 2. The model", "## 5. Try it on one machine", "## 6. Three machines",
                                   "## 8. Use the trained model") for c in _section("docs/tutorial.md", heading))


def _in_scenario(command: DocCommand) -> bool:
    return command in _services_block()


# --- quick forms --------------------------------------------------------------------------------

TESTBED = re.compile(r'^(?:make run(?: ARGS="(?P<make>[^"]*)")?|(?:\.venv/bin/)?python -m testbed(?P<args>(?: .*)?))$')


def cli_args_of(command: DocCommand) -> list[str] | None:
    """The testbed flags of a testbed command (``make run`` passes ``ARGS`` to ``python -m testbed``)."""
    match = TESTBED.match(command.text)
    if match is None:
        return None
    return shlex.split(match.group("make") or match.group("args") or "")


def quick_testbed_args(args: list[str]) -> list[str]:
    """``args`` at 2 rounds (in place of the command's own), with few samples of the default data
    set (a run file, the devices' own data or another data set keep theirs)."""
    quick: list[str] = []
    words = iter(args)
    for word in words:
        if word == "--rounds":
            next(words, None)
        else:
            quick.append(word)
    quick += ["--rounds", str(ROUNDS)]
    if "--config" not in args and "--device-data" not in args and not any(a.startswith("data.dataset=") for a in args):
        quick += ["--set", f"data.max_samples={SAMPLES}"]
    return quick


HELP = re.compile(r"^(?:\.venv/bin/)?python -m [\w.]+ --help$")
BENCHMARK = re.compile(r"^(?:\.venv/bin/)?python -m benchmarks\.(?P<module>\w+)(?P<args>(?: .*)?)$")
EXPERIMENTS = re.compile(r"^(?:\.venv/bin/)?python -m experiments (?P<verb>list|report) +(?P<rest>.*)$")
PYTHON_C = re.compile(r'^python -c "\n?from shared\.models import ')
CREDENTIALS = re.compile(r"^umask 077$|^python -c \"import secrets; print\(secrets\.token_hex\(32\)\)\" > \S+$|"
                         r"^python -m fed_server credentials ")


#: The flags that choose the attack benchmark's runs (a command with none runs them all, for hours),
#: each with the value of its quick form where the command does not give one.
ATTACK_SELECTION = {"--behaviours": "silent", "--algorithms": "fedavg", "--harmful": "1", "--policies": "default"}


def benchmark_args(command: DocCommand) -> list[str] | None:
    """The quick form of a benchmark command: the module and its smallest sizes."""
    match = BENCHMARK.match(command.text)
    if match is None:
        return None
    module, args = match.group("module"), shlex.split(match.group("args"))
    if module == "run":
        return ["run", *[a for a in args if a != "--quick"], "--quick"]
    if module == "attacks":   # hours unless a selection is given; the selection at its shortest
        if not args:
            return ["run", "--only", "g", "--quick"]
        # What the command does not select, at its smallest: one behaviour, FedAvg, one device.
        selection = [part for flag, value in ATTACK_SELECTION.items() if flag not in args for part in (flag, value)]
        return ["attacks", *args, *selection, "--rounds", "2", "--controls", "1"]
    if module == "population":
        return ["run", "--only", "h", "--quick"] if not args else ["population", "--sizes", "100"]
    if module == "main_server_memory":
        return ["run", "--only", "i", "--quick"]
    if module == "scenarios":   # four scenarios, two or three runs each, unless a subset is given: one
        subset = [] if "--scenarios" in args else ["--scenarios", "link_drop"]
        return ["scenarios", *[a for a in args if a != "--quick"], "--quick", *subset]
    if module == "secure_aggregation":   # 8 runs, to 100 devices, at its defaults
        return ["secure_aggregation", "--quick"]
    if module == "dp_accuracy":   # 12 runs, to 1,000 devices, at its defaults
        return ["dp_accuracy", "--quick"]
    if module == "privacy":   # hours at its defaults: the quick form, or the selection given at one seed and 2 rounds
        return ["privacy", "--quick"] if not args or "--quick" in args else ["privacy", *args, "--seeds", "1", "--rounds", "2"]
    return None


def quick_form(command: DocCommand) -> str | None:
    """Which quick form runs ``command``: ``testbed``, ``help``, ``python`` (a ``python -c`` of the
    model API), ``benchmark``, ``experiments``, ``credentials`` or ``services``; None
    when it has none."""
    if command in _services_block():
        return "services"
    if HELP.match(command.text):
        return "help"
    if cli_args_of(command) is not None:
        return "testbed"
    if PYTHON_C.match(command.text):
        return "python"
    if benchmark_args(command) is not None:
        return "benchmark"
    if EXPERIMENTS.match(command.text):
        return "experiments"
    if CREDENTIALS.match(command.text):
        return "credentials"
    return None


def test_every_documented_command_has_a_quick_form_or_a_reason_to_be_left_out():
    commands = documented_commands()
    assert len(commands) > 60 and {c.page for c in commands} >= {"README.md", "benchmarks/README.md",
                                                                 "docs/tutorial.md", "docs/algorithms/scaffold.md"}
    unplaced = [f"{c.where}: {c.text}" for c in commands if left_out(c) is None and quick_form(c) is None]
    assert unplaced == [], ("commands with neither a quick form nor a reason to be left out "
                            "(tests/integration/test_documented_commands.py):\n" + "\n".join(unplaced))


def test_the_reader_joins_continuations_and_drops_comments_but_not_hashes_in_quotes():
    page = ("Text\n\n```bash\n# a comment line\nsudo .venv/bin/python -m testbed --real-links \\\n"
            "    --set 'devices.profiles=[low,mid,high]' --rtt-ms 2   # trailing comment\n"
            "python -c \"\nimport sys  # kept\nprint(1)\"\n```\n")
    commands = page_commands("page.md", page)
    assert [(c.line, c.text) for c in commands] == [
        (5, "sudo .venv/bin/python -m testbed --real-links --set 'devices.profiles=[low,mid,high]' --rtt-ms 2"),
        (7, 'python -c "\nimport sys  # kept\nprint(1)"')]
    assert _without_comment('python -c "a # b"  # c') == 'python -c "a # b"'


def _by_form(form: str) -> dict[str, list[DocCommand]]:
    """The commands of a quick form, grouped by what runs (commands with the same quick form share a run)."""
    groups: dict[str, list[DocCommand]] = {}
    for command in documented_commands():
        if left_out(command) is None and quick_form(command) == form:
            key = {"testbed": lambda c: shlex.join(quick_testbed_args(cli_args_of(c) or [])),
                   "benchmark": lambda c: shlex.join(benchmark_args(c) or [])}.get(form, lambda c: c.text)(command)
            groups.setdefault(key, []).append(command)
    return groups


def _ids(groups: dict[str, list[DocCommand]]) -> list[str]:
    return [" ".join(c.where for c in commands) for commands in groups.values()]


@slow
@pytest.mark.parametrize("command", [c for c in documented_commands() if left_out(c)], ids=lambda c: c.where)
def test_left_out(command):
    pytest.skip(f"{command.text[:80]}: {left_out(command)}")


# --- running the quick forms --------------------------------------------------------------------

def _env(extra_path: Path | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(extra_path) if extra_path else "", str(ROOT)) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(argv)} exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def run_testbed_cli(args: list[str], cwd: Path, monkeypatch, capsys, extra_path: Path | None = None) -> str:
    """``python -m testbed ARGS`` through its own command line (``testbed.__main__.main``) in this
    process, its services forked from the suite's warm starter; returns what it printed. Fails
    with its output when it exits with an error."""
    import testbed.__main__ as cli
    from testbed.runner import Testbed

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(cli, "Testbed", functools.partial(Testbed, warm=shared_starter()))
    if extra_path is not None:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(extra_path), str(ROOT)]))
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        cli.main([*args, "--timeout", "300"])
    except SystemExit as exc:
        out = capsys.readouterr()
        pytest.fail(f"python -m testbed {shlex.join(args)} exited with {exc.code}:\n{out.out[-3000:]}\n{out.err[-3000:]}")
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    return capsys.readouterr().out


# The files a page's testbed commands name, written from the page's own blocks where it has them.
def _fenced(page: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", (ROOT / page).read_text(), re.S | re.M)


def _digits(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` of the embedded MNIST training digits as a device holds them: uint8 pixels, int labels."""
    from shared.data import load_embedded_mnist
    from shared.data.datasets import MNIST_MEAN, MNIST_STD

    digits = load_embedded_mnist("train")   # normalised: back to the pixels a device would hold
    pick = np.random.default_rng(seed).permutation(len(digits.y))[:count]
    pixels = (digits.x[pick].numpy() * MNIST_STD + MNIST_MEAN) * 255
    return pixels.round().clip(0, 255).astype(np.uint8).reshape(count, 1, 28, 28), digits.y[pick].numpy()


def _files_for(command: DocCommand, where: Path) -> Path | None:
    """Write the files ``command`` names into ``where``; returns a folder to put on PYTHONPATH."""
    if command.page == "docs/models.md":   # my_pkg/nets.py and the run file, from the page
        (where / "my_pkg").mkdir()
        (where / "my_pkg" / "__init__.py").write_text("")
        (where / "my_pkg" / "nets.py").write_text(next(b for b in _fenced(command.page, "python") if "def build" in b))
        (where / "run.yaml").write_text(next(b for b in _fenced(command.page, "yaml") if "my_pkg.nets:build" in b))
        return where
    if command.page == "docs/data.md":      # the page's run file; a device file per --device-data
        run = yaml.safe_load(_fenced(command.page, "yaml")[0])
        run["data"].pop("test_file")        # the page's /data/test.npz is a device's path
        (where / "local.yaml").write_text(yaml.safe_dump(run))
        for i, name in enumerate(re.findall(r"--device-data (\S+)", command.text)):
            x, y = _digits(150, i)
            np.savez(where / name, x=x, y=y)
        return None
    if "--config my-run.yaml" in command.text:   # "a config file": any run file
        run = {"algorithm": "s2fl", "data": {"num_devices": 4, "max_samples": SAMPLES}}
        (where / "my-run.yaml").write_text(yaml.safe_dump(run))
    return None


@slow
@pytest.mark.parametrize("key", list(_by_form("testbed")), ids=_ids(_by_form("testbed")))
def test_documented_testbed_command(key, tmp_path, monkeypatch, capsys):
    commands = _by_form("testbed")[key]
    extra = _files_for(commands[0], tmp_path)
    args = quick_testbed_args(cli_args_of(commands[0]) or [])
    out = run_testbed_cli([*args, "--run-dir", str(tmp_path / "run")], tmp_path, monkeypatch, capsys, extra)
    assert re.search(rf"^round\s+{ROUNDS}/{ROUNDS}\s", out, re.M) and f"done: {ROUNDS} rounds" in out, out
    records = [r for r in read_metrics(tmp_path / "run") if r["status"] == "ok"]
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1)), out


@slow
@pytest.mark.parametrize("command", [c for cs in _by_form("help").values() for c in cs], ids=lambda c: c.where)
def test_documented_help(command, tmp_path):
    out = _run([sys.executable, *shlex.split(command.text)[1:]], tmp_path, timeout=120).stdout
    assert out.startswith("usage: "), out


@slow
@pytest.mark.parametrize("key", list(_by_form("benchmark")), ids=_ids(_by_form("benchmark")))
def test_documented_benchmark(key, tmp_path):
    args = shlex.split(key)
    out = tmp_path / "results.json"
    page, shipped = None, ""
    if "--docs" in args:   # the page the table is written into: a copy of it, so the repository is not changed
        at = args.index("--docs") + 1
        shipped = (ROOT / args[at]).read_text()
        page = tmp_path / Path(args[at]).name
        page.write_text(shipped)
        args[at] = str(page)
    _run([sys.executable, "-m", f"benchmarks.{args[0]}", *args[1:], "--out", str(out)], ROOT, timeout=900)
    assert json.loads(out.read_text()), key
    if page is not None:   # the run's own table, in place of the page's
        assert page.read_text() != shipped and "| silent | " in page.read_text(), key


@slow
@pytest.mark.parametrize("command", [c for cs in _by_form("experiments").values() for c in cs], ids=lambda c: c.where)
def test_documented_experiments_command(command, tmp_path):
    match = EXPERIMENTS.match(command.text)
    assert match
    words = shlex.split(match.group("rest"))
    grid = next(w for w in words if w.endswith(".yaml")) if any(w.endswith(".yaml") for w in words) \
        else "experiments/grids/hics.yaml"   # the synopsis' FILE
    shipped = ROOT / "docs" / "results" / Path(grid).stem
    out = tmp_path / "out"
    if shipped.is_dir():   # a copy of the committed results: report re-renders into its folder
        import shutil
        shutil.copytree(shipped, out)
    done = _run([sys.executable, "-m", "experiments", match.group("verb"), grid, "--out", str(out)], ROOT, timeout=300)
    assert "cell" in done.stdout or (out / "report.md").is_file(), done.stdout


@slow
@pytest.mark.parametrize("command", [c for cs in _by_form("python").values() for c in cs], ids=lambda c: c.where)
def test_documented_python_of_the_model_api(command, tmp_path):
    extra = _files_for(command, tmp_path)
    code = shlex.split(command.text)[2]
    _run([sys.executable, "-c", code], tmp_path, timeout=120, env=_env(extra))


def _shell(commands: list[DocCommand], cwd: Path, replace: Callable[[str], str] = lambda text: text,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``commands`` in order in one bash session in ``cwd`` (``python`` is this interpreter)."""
    # "python" after the command's own variable assignments too (PYTHONPATH=... python -c ...).
    python = re.compile(r"^((?:\w+=\S*\s+)*)python ")
    ours = shlex.quote(sys.executable)
    script = "set -e\n" + "\n".join(replace(python.sub(lambda m: f"{m.group(1)}{ours} ", c.text)) for c in commands)
    return _run(["bash", "-c", script], cwd, timeout=300, env=env)


@slow
@pytest.mark.parametrize("page", sorted({c.page for cs in _by_form("credentials").values() for c in cs}))
def test_documented_credential_commands(page, tmp_path):
    commands = [c for cs in _by_form("credentials").values() for c in cs if c.page == page]
    _shell(commands, tmp_path)
    issued = sorted(p.name for p in (tmp_path / "credentials").iterdir())
    shards = re.search(r"--shards 0-(\d+) ", " ".join(c.text for c in commands))
    assert shards and len([n for n in issued if n.startswith("dev-")]) == int(shards.group(1)) + 1, issued
    assert oct((tmp_path / "enrolment.key").stat().st_mode & 0o777) == "0o600"   # umask 077


def on_loopback(text: str, ports: dict[str, int]) -> str:
    """A command written for other machines, on this one: every host name to 127.0.0.1, every port
    the page names to a free one (``ports``: page's port -> free port), ``--host 0.0.0.0`` to
    loopback, a trailing ``&`` dropped (the test starts each process itself)."""
    text = re.sub(r"https?://[A-Za-z][\w.-]*:(\d+)", lambda m: f"http://127.0.0.1:{ports[m.group(1)]}", text)
    text = re.sub(r"--port (\d+)", lambda m: f"--port {ports[m.group(1)]}", text)
    return text.replace("--host 0.0.0.0", "--host 127.0.0.1").removesuffix(" &")


SERVICE = re.compile(r"^(?:\.venv/bin/)?python -m (fed_server|main_server|device_agent) +(.*)$")


def _start_services(commands: list[str], group: ProcessGroup, fed_args: list[str],
                    env: dict[str, str] | None = None) -> str:
    """Start each ``python -m <service>`` of ``commands`` in ``group`` (the Fed Server's with
    ``fed_args`` added, each with ``env``); returns the Fed Server's URL once both servers answer."""
    urls = {}
    for i, text in enumerate(commands):
        match = SERVICE.match(text)
        assert match, text
        module, args = match.group(1), shlex.split(match.group(2))
        service = group.start(f"{module}-{i}", module, [*args, *(fed_args if module == "fed_server" else [])], env)
        if module != "device_agent":
            port = args[args.index("--port") + 1]
            urls[module] = f"http://127.0.0.1:{port}"
            wait_healthy(urls[module], service, timeout=120)
    return urls["fed_server"]


def _ports() -> dict[str, int]:
    return {"8080": free_port(), "8081": free_port()}


@slow
def test_the_readmes_services_started_by_hand(tmp_path, monkeypatch):
    commands = list(_services_block())
    ports = _ports()
    texts = [on_loopback(c.text, ports) for c in commands]
    shards = re.search(r"--shards (\d+)-(\d+)", " ".join(texts))
    assert shards, texts
    # run.yaml: the default run, as many devices as the agent hosts, at 2 rounds and few samples.
    devices = int(shards.group(2)) - int(shards.group(1)) + 1
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"rounds": ROUNDS, "data": {"num_devices": devices,
                                                                                   "max_samples": SAMPLES}}))
    monkeypatch.chdir(tmp_path)
    group = ProcessGroup(tmp_path / "logs", shared_starter())
    try:
        fed_url = _start_services([t for t in texts if SERVICE.match(t)], group, ["--run-dir", str(tmp_path / "run")])
        follow = next(t for t in texts if " testbed.follow " in t)
        out = _run([sys.executable, *shlex.split(follow)[1:], "--timeout", "300"], tmp_path, timeout=360).stdout
        assert re.search(rf"^round\s+{ROUNDS}/{ROUNDS}\s", out, re.M) and f"done: {ROUNDS} rounds" in out, out
        assert final_status(fed_url, 60)["state"] == "finished"
    finally:
        group.stop()


#: The tutorial's scp line: which credential goes to which device, and where it lands there.
SCP = re.compile(r"^scp credentials/(?P<file>\S*?)0(?P<suffix>\.credential) (?P<host>\S*?)0:(?P<dest>\S+)")


@slow
def test_the_tutorials_three_machines_on_loopback(tmp_path, monkeypatch):
    """Step 6 of the tutorial as the page writes it, on loopback: the project of step 2's model and
    step 4's run file (2 rounds), each device's images in step 3's image-folder layout, step 6's secrets and
    credentials made on the server host, both servers started there, and each device in a folder
    of its own holding its copy of the project, its own data and its own credential, as on three
    machines (agents sharing one folder would share one credential, and all but one be refused)."""
    page = "docs/tutorial.md"
    server = tmp_path / "server-host"
    project = server / "my_project"
    project.mkdir(parents=True)
    (project / "__init__.py").write_text("")
    (project / "model.py").write_text(next(b for b in _fenced(page, "python") if "def build" in b))
    run = yaml.safe_load(next(b for b in _fenced(page, "yaml") if "my_project.model:build" in b))
    run["rounds"] = ROUNDS
    (project / "run.yaml").write_text(yaml.safe_dump(run))
    step = _section(page, "## 6. Three machines")
    _shell([c for c in step if CREDENTIALS.match(c.text)], server)
    copy = next(SCP.match(c.text) for c in step if SCP.match(c.text))
    ports = _ports()
    texts = [on_loopback(c.text, ports) for c in step if SERVICE.match(c.text) and not CREDENTIALS.match(c.text)]
    agent = next(t for t in texts if " device_agent " in t)
    devices = run["data"]["num_devices"]
    env = {"PYTHONPATH": f"{server}{os.pathsep}{ROOT}"}
    group = ProcessGroup(tmp_path / "logs")
    try:
        monkeypatch.chdir(server)
        fed_url = _start_services([t for t in texts if " device_agent " not in t], group, [], env)
        for i in range(devices):   # a device: its project copy, its credential, its own data only
            home = tmp_path / f"{copy.group('host')}{i}"
            shutil.copytree(project, home / "my_project")
            shutil.copy(server / "credentials" / f"{copy.group('file')}{i}{copy.group('suffix')}",
                        home / copy.group("dest"))
            x, y = _digits(120, i)   # step 3's image folder: a sub-folder per class
            for k, (pixels, label) in enumerate(zip(x, y)):
                folder = home / "data" / f"device-{i}" / str(int(label))
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels[0]).save(folder / f"{k}.png")
            monkeypatch.chdir(home)
            args = shlex.split(SERVICE.match(agent.replace("data/device-0", f"data/device-{i}")).group(2))
            group.start(f"device-{i}", "device_agent", args, {"PYTHONPATH": f"{home}{os.pathsep}{ROOT}"})
        status = final_status(fed_url, 300)
        assert status["state"] == "finished", status
        summary = json.loads((server / "runs" / "first" / "summary.json").read_text())
        assert summary["rounds"] == ROUNDS and summary["failed_attempts"] == 0, summary
    finally:
        group.stop()
