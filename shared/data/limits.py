"""How much a device's local files may hold (``--max-data-bytes``, ``--max-image-pixels``).

The loaders (:mod:`shared.data.local`) check these against what a file *declares* (an ``.npz``
member's npy header and zip entry, an image's header) before anything is decompressed or decoded,
so a small file that claims or unpacks to gigabytes is refused in one line instead of exhausting
the device's memory. Kept free of torch so that the agent's flags can name the defaults.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

#: Images above this many pixels are refused from their header: 32 Mi pixels (e.g. 8192 x 4096),
#: a 384 MiB float32 RGB sample once transformed; larger photos are scaled down before training.
DEFAULT_MAX_IMAGE_PIXELS = 2 ** 25

#: The default byte limit where the machine's memory is unknown.
_FALLBACK_MAX_DATA_BYTES = 2 ** 30


def default_max_data_bytes() -> int:
    """The default limit on the bytes of one ``.npz`` file's arrays: a sixteenth of this machine's
    physical memory (1 GiB where it cannot be read).

    Loading holds the raw arrays and their float32 model inputs, with the transform's intermediate
    copies, at once: about 13 times the file's bytes at the peak for ``uint8`` pixels (4 bytes for
    each byte, three times), and the device keeps its data in memory while it trains.
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 16
    except (AttributeError, ValueError, OSError):   # no sysconf, or no such name on this platform
        return _FALLBACK_MAX_DATA_BYTES


@dataclass(frozen=True)
class FileLimits:
    """The limits a device's files are checked against before they are read.

    ``max_bytes``: the bytes the arrays ``x`` and ``y`` of one ``.npz`` file may hold together
    (each member's declared shape x item size, and its uncompressed size in the archive).
    ``max_pixels``: width x height of one image in an image folder.
    """

    max_bytes: int = field(default_factory=default_max_data_bytes)
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
