"""System benchmark of the S2FL testbed (``python -m benchmarks.run``); not part of the test suite."""
