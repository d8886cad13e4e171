"""The testbed's process plumbing: secrets handed to the children as owner-only files."""
from __future__ import annotations

import os
import stat

from testbed.processes import SecretFiles


def test_secret_files_are_owner_only_and_removed():
    files = SecretFiles({"service": "s3cret", "enrolment": "3nrol"})
    try:
        assert stat.S_IMODE(os.stat(files.folder).st_mode) == 0o700
        for name, value in (("service", "s3cret"), ("enrolment", "3nrol")):
            path = files.paths[name]
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert open(path).read() == value
    finally:
        files.remove()
    assert not files.folder.exists()
