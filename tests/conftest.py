"""Suite-wide test settings."""
import torch

# One torch thread per process: on a 2-core machine the test process shares the cores with the
# service processes the integration tests start, and a two-thread torch collapses under contention.
torch.set_num_threads(1)
