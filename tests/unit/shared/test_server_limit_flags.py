"""The servers' limits on slow request bodies: ``--min-body-rate`` and ``--body-grace-s``
(shared/service.py), read by ``http_api.serve``."""
from __future__ import annotations

import argparse

import pytest

from shared.service import DEFAULT_BODY_GRACE_S, DEFAULT_MIN_BODY_RATE, add_server_args, parse_service_args, positive_rate


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser, default_port=8080)
    return parse_service_args(parser, argv)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in ("SFL_MIN_BODY_RATE", "SFL_BODY_GRACE_S", "SFL_SETTINGS"):
        monkeypatch.delenv(name, raising=False)


def test_defaults_flags_and_environment(monkeypatch):
    args = _parse([])
    assert (args.min_body_rate, args.body_grace_s) == (DEFAULT_MIN_BODY_RATE, DEFAULT_BODY_GRACE_S) == (1024, 10.0)
    args = _parse(["--min-body-rate", "250.5", "--body-grace-s", "3"])
    assert (args.min_body_rate, args.body_grace_s) == (250.5, 3.0)
    monkeypatch.setenv("SFL_MIN_BODY_RATE", "4096")
    monkeypatch.setenv("SFL_BODY_GRACE_S", "1.5")
    args = _parse([])
    assert (args.min_body_rate, args.body_grace_s) == (4096.0, 1.5)


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_a_rate_must_be_a_positive_number(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="positive number of bytes a second"):
        positive_rate(bad)
    for flag in ("--min-body-rate", "--body-grace-s"):
        with pytest.raises(SystemExit):
            _parse([flag, bad])
