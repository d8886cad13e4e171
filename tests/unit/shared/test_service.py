"""Service settings: defaults < settings file < environment < flags."""
from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import pytest

from shared.service import add_server_args, parse_service_args, positive_seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_server_args(parser, default_port=8080)
    return parser


def test_settings_file_environment_and_flags_in_order(tmp_path, monkeypatch):
    monkeypatch.delenv("SFL_PORT", raising=False)
    monkeypatch.delenv("SFL_HOST", raising=False)
    settings = tmp_path / "s.yaml"
    settings.write_text("port: 9001\nhost: 0.0.0.0\nlog-level: DEBUG\n")
    args = parse_service_args(_parser(), ["--settings", str(settings)])
    assert (args.port, args.host, args.log_level) == (9001, "0.0.0.0", "DEBUG")
    args = parse_service_args(_parser(), ["--settings", str(settings), "--port", "9002"])
    assert args.port == 9002
    monkeypatch.setenv("SFL_PORT", "9003")
    args = parse_service_args(_parser(), ["--settings", str(settings)])
    assert args.port == 9003 and args.host == "0.0.0.0"


def test_unknown_setting_is_an_error(tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text("prot: 1\n")
    with pytest.raises(SystemExit):
        parse_service_args(_parser(), ["--settings", str(settings)])


@pytest.mark.parametrize("text, message", [(None, "s.yaml: file not found"),
                                           ("port: [1\n", "s.yaml, line 2, column 1: not valid YAML")])
def test_a_missing_or_broken_settings_file_is_a_usage_error_naming_it(tmp_path, capsys, text, message):
    settings = tmp_path / "s.yaml"
    if text is not None:
        settings.write_text(text)
    with pytest.raises(SystemExit) as info:
        parse_service_args(_parser(), ["--settings", str(settings)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path}/{message}" in err and "Traceback" not in err, err


def test_defaults_without_settings(monkeypatch):
    monkeypatch.delenv("SFL_PORT", raising=False)
    monkeypatch.delenv("SFL_SETTINGS", raising=False)
    args = parse_service_args(_parser(), [])
    assert args.port == 8080 and args.torch_threads >= 1


def test_connection_timeouts_default_and_must_be_positive_seconds(monkeypatch):
    monkeypatch.delenv("SFL_HEAD_TIMEOUT_S", raising=False)
    monkeypatch.delenv("SFL_KEEP_ALIVE_S", raising=False)
    monkeypatch.delenv("SFL_SHUTDOWN_GRACE_S", raising=False)
    args = parse_service_args(_parser(), [])
    assert (args.head_timeout_s, args.keep_alive_s, args.shutdown_grace_s) == (10.0, 5.0, 3.0)
    args = parse_service_args(_parser(), ["--head-timeout-s", "2.5", "--keep-alive-s", "1", "--shutdown-grace-s", "0.5"])
    assert (args.head_timeout_s, args.keep_alive_s, args.shutdown_grace_s) == (2.5, 1.0, 0.5)
    monkeypatch.setenv("SFL_SHUTDOWN_GRACE_S", "7")
    assert parse_service_args(_parser(), []).shutdown_grace_s == 7.0
    assert positive_seconds("2.5") == 2.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number of seconds"):
            positive_seconds(bad)
        with pytest.raises(SystemExit):
            parse_service_args(_parser(), ["--head-timeout-s", bad])


def test_freezing_startup_objects_collects_first_then_keeps_them_out_of_every_collection():
    """In a process of its own: the test process's objects are not to be frozen."""
    code = textwrap.dedent("""
        import gc, weakref
        from shared.service import freeze_startup_objects

        class Node:
            pass

        kept = Node()                      # alive at start: lives as long as the process
        dropped = Node()
        dropped.self = dropped             # a cycle already garbage at start
        dropped_ref = weakref.ref(dropped)
        del dropped
        freeze_startup_objects()
        assert dropped_ref() is None, "garbage alive at the freeze must be collected, not frozen for good"
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
        assert not any(o is kept for o in gc.get_objects()), "a frozen object is traversed by no generation"
        later = Node()
        later.self = later                 # made after the freeze: collected as before
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGUSR2"), reason="no SIGUSR2 on this platform")
def test_sigusr2_writes_every_thread_s_stack_to_stderr_and_the_service_goes_on():
    # A configured service waiting in a second thread: SIGUSR2 shows where each thread waits, and
    # the process is not stopped by it (it prints "still running" after the signal).
    code = textwrap.dedent("""
        import os, signal, sys, threading, time
        from shared.service import configure_process
        configure_process()
        waiting = threading.Event()
        def wait_for_a_peer():
            waiting.wait()
        threading.Thread(target=wait_for_a_peer, daemon=True).start()
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        print("still running")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "still running", done.stderr
    assert "in wait_for_a_peer" in done.stderr and "Current thread" in done.stderr, done.stderr
