"""The objects a process made while starting up, kept out of the garbage collector's way.

Loading a model and its tokenizer leaves hundreds of thousands of long-lived objects; each
full (generation 2) collection walks them all, about 100 ms on a 2-core host with the
default model, and the step or the stream chunk it lands in waits that long (an inter-token
latency spike). After start-up :func:`freeze_startup_heap` collects once and moves every
surviving object to the permanent generation (``gc.freeze``), so later collections walk
only what serving allocates. Objects frozen this way are still freed when their reference
count drops to zero; only reference cycles among them outlive their use.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
