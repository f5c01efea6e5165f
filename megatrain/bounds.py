"""Sizes megatrain refuses at once: the one place that bounds what a config, a flag or a data file
asks for before anything is allocated or traced, each bound with the limit named in its error.

Without these, an absurd size is not an error but minutes of silence or a crash: ``megatrain plan``
with 10^15 parameters, 10^6 layers or ``--global-batch 10^18`` printed nothing for minutes;
``num_hidden_layers: 10^9`` did the same in ``megatrain train``; ``hidden_size: 2^40`` overflowed a
storage size; ``--image-size 100000x100000`` was a ``MemoryError``; a YAML alias bomb of 9 levels
hung and one of 8 printed a 254 MB ``error:`` line. Each bound is far beyond what a real run asks
for and below what breaks, and says why in its docstring.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from megatrain.errors import ConfigError

__all__ = ["MAX_CHAT_MESSAGES", "MAX_CONFIG_NODES", "MAX_ERROR_CHARS", "MAX_GLOBAL_BATCH", "MAX_IMAGE_PIXELS",
           "MAX_JSON_DEPTH", "MAX_LAYERS", "MAX_NUM_SAMPLES", "MAX_PARAMETERS", "MAX_SEQ_LEN", "MAX_TEMPLATE_CHARS", "TEMPLATE_SECONDS",
           "check_expanded_size", "check_json_depth", "check_image_size",
           "check_model_size", "shorten", "time_limit"]

MAX_PARAMETERS = 10**13
"""Parameters of a model megatrain plans: 12 bytes of host state each (FP32 master weights and two
Adam moments) make 10^13 parameters 120 TB, more than the largest host preset (3 TiB) with the
largest NVMe array preset (8 x 15.36 TB drives, 123 TB) together: no plan of one node fits more."""

MAX_LAYERS = 10**4
"""Decoder blocks: tracing, solving and lowering are at least linear in them, and the deepest
published LLMs have 126 (Llama 3.1 405B): 10^4 is 80 times that."""

MAX_SEQ_LEN = 2**24
"""Tokens a row: 16 M, 32 times the 512k-token context the design targets."""

MAX_GLOBAL_BATCH = 2**24
"""Rows a step: 16 M, four thousand times the largest published batches (Llama 3: 16 M tokens, 4,096
rows of 4,096 tokens)."""

MAX_NUM_SAMPLES = 2**28
"""Examples a data registry's ``num_samples`` takes from one dataset an epoch: 268 M, a hundred times
the largest public SFT sets (a few million examples); an epoch's int64 index of them is 2 GiB."""

MAX_JSON_DEPTH = 500
"""Levels of nesting of a JSON data file's values: Python's json reader stops at its recursion limit
(1,000), and the reader ``datasets`` uses crashed the process (a segfault, no message) on a record
with an unused field 50,000 levels deep; chat records nest 4 to 8 levels."""

MAX_CONFIG_NODES = 10**5
"""Values in a settings file with its YAML aliases expanded: a run's settings are about 60 scalars;
a YAML alias bomb (each level nine aliases of the last) passes 10^5 at its sixth level."""

MAX_IMAGE_PIXELS = 89_478_485
"""Pixels of one image: Pillow's ``Image.MAX_IMAGE_PIXELS`` (a 3-channel 8-bit image of 256 MiB),
past which Pillow calls a file a decompression bomb; megatrain resizes and reads no larger."""

TEMPLATE_SECONDS = 10.0
"""Seconds a chat template may take to render one record (all the renders that split it): a template
renders a chat in milliseconds; one of nested ``range(99999)`` loops never finished (and held the
run past SIGTERM)."""

MAX_CHAT_MESSAGES = 2**11
"""Messages of one chat record: a template without ``{% generation %}`` markers is split by
rendering the chat's every prefix (``megatrain.data.sft``), time quadratic in the messages: 8,192
short ones took 0.9 s on a loaded 2-core machine, and a record of a 10,000-exchange history 121 s
with no word. 2,048 (a thousand exchanges; long agent traces have hundreds of messages) render in
well under a second."""

MAX_TEMPLATE_CHARS = MAX_SEQ_LEN * 16
"""Characters a chat template may render for one record: the longest row megatrain trains
(:data:`MAX_SEQ_LEN` tokens) at 16 characters a token, more than any tokenizer's average."""

MAX_ERROR_CHARS = 2_000
"""Characters of one ``error:`` line: every message megatrain means is shorter; a longer one quotes
an input (a value, a record) whose middle is left out."""


def shorten(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` as it is when at most ``limit`` characters, else its start and end with the number of
    characters left out between them."""
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]} ... ({len(text) - 2 * keep:,} characters left out) ... {text[-keep:]}"


def check_model_size(config: Mapping[str, Any], source: str) -> None:
    """Refuse a model config (a config.json's fields) that describes more than :data:`MAX_LAYERS`
    blocks or :data:`MAX_PARAMETERS` parameters, counted from its sizes alone, before transformers
    builds a config object from it (which lays out per-layer lists) or a model is traced; a
    vision-language config's ``text_config``.

    Raises:
        ConfigError: naming the value, the limit and why.
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config

    def size(*names: str) -> int:
        for name in names:
            v = text.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return 0

    h, layers, vocab = size("hidden_size", "n_embd", "d_model"), size("num_hidden_layers", "n_layer"), size("vocab_size")
    if layers > MAX_LAYERS:
        raise ConfigError(f"{source}: num_hidden_layers {layers:,} is more than megatrain plans "
                          f"({MAX_LAYERS:,}; the deepest published LLMs have 126); use a model of fewer layers")
    inner = size("intermediate_size", "n_inner") or 4 * h
    # Per block 4 h^2 for attention (no grouped-query saving: an upper bound) and 3 h i for a gated
    # MLP, plus 2 V h for the embeddings and the head; Python integers, so nothing overflows.
    n = layers * (4 * h * h + 3 * h * inner) + 2 * vocab * h
    if n > MAX_PARAMETERS:
        raise ConfigError(f"{source}: its sizes (hidden_size {h:,}, intermediate_size {inner:,}, num_hidden_layers "
                          f"{layers:,}, vocab_size {vocab:,}) make about {n:.3g} parameters, more than megatrain "
                          f"plans ({MAX_PARAMETERS:.0e}: 12 bytes of host state each, past any one host with its "
                          "NVMe array); use a smaller model")


def check_image_size(height: int, width: int, what: str) -> None:
    """Refuse an image size of more than :data:`MAX_IMAGE_PIXELS` pixels.

    Raises:
        ConfigError: naming ``what`` (``"image_size 100000x100000"``) and the limit.
    """
    if height * width > MAX_IMAGE_PIXELS:
        raise ConfigError(f"{what} is {height * width:,} pixels, more than megatrain reads an image at "
                          f"({MAX_IMAGE_PIXELS:,}, Pillow's decompression-bomb limit: 256 MiB as RGB); give a "
                          "smaller size")


def check_expanded_size(value: Any, what: str, limit: int = MAX_CONFIG_NODES) -> None:
    """Refuse a value parsed from a file (YAML, whose aliases share one object among many places)
    that holds more than ``limit`` values once expanded: counted over the shared objects once each,
    so an alias bomb is measured without being expanded.

    Raises:
        ConfigError: naming ``what``, the count and the limit.
    """
    sizes: dict[int, int] = {}
    keep = []  # the objects measured, alive while their ids are keys

    def count(v: Any, depth: int) -> int:
        if depth > 100:
            raise ConfigError(f"{what} nests values more than 100 levels deep; a settings file is a flat mapping")
        if not isinstance(v, (dict, list, tuple)):
            return 1
        if id(v) in sizes:
            return sizes[id(v)]
        items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else v
        n = 1 + sum(count(x, depth + 1) for x in items)
        sizes[id(v)] = n
        keep.append(v)
        if n > limit:
            raise ConfigError(f"{what} holds more than {limit:,} values once its YAML aliases are expanded "
                              f"({n:,} at least); a run's settings are a few dozen: remove the aliases")
        return n

    count(value, 0)


class _OutOfTime(BaseException):
    # A BaseException, so that the ``except Exception`` around a template's render lets it through.
    pass


@contextmanager
def time_limit(seconds: float, error: Callable[[], Exception]) -> Iterator[None]:
    """Raise ``error()`` when the block runs past ``seconds`` (SIGALRM: a Python loop that prints
    nothing, as a template's, is stopped too). Only the main thread of a process can take signals,
    so elsewhere, or while another timer runs, the block runs unbounded.

    Raises:
        Exception: ``error()``, when the time is up.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def on_alarm(signum, frame):
        raise _OutOfTime

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _OutOfTime:
        raise error() from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def check_json_depth(path, limit: int = MAX_JSON_DEPTH, chunk: int = 1 << 20) -> None:
    """Refuse a JSON or JSON Lines file whose values nest more than ``limit`` levels deep, measured
    with NumPy over its bytes, ``chunk`` at a time (brackets inside strings, escapes included, do not
    count), before a parser recurses into it.

    Raises:
        ValueError: naming the file, the byte offset, the depth and the limit.
    """
    import numpy as np

    depth, in_string, run, offset = 0, 0, 0, 0  # run: backslashes ending the previous chunk
    with open(path, "rb") as f:
        while data := f.read(chunk):
            b = np.frombuffer(data, np.uint8)
            quote = b == 0x22
            # A quote after an odd run of backslashes is escaped: each quote right after a
            # backslash looks up where its run started (a run at the chunk's start continues the
            # previous chunk's).
            bs = b == 0x5C
            starts = np.flatnonzero(np.diff(bs.astype(np.int8), prepend=np.int8(0)) == 1)
            after = np.flatnonzero(quote[1:] & bs[:-1]) + 1
            if after.size:
                start = starts[np.searchsorted(starts, after - 1, side="right") - 1]
                escaped = (after - start + np.where(start == 0, run, 0)) % 2 == 1
                quote[after[escaped]] = False
            if run % 2 and len(b) and quote[0]:
                quote[0] = False
            # (uint8 sums wrap, parity stays; small types and chunks keep it fast)
            outside = 1 - ((quote.view(np.uint8).cumsum(dtype=np.uint8) + in_string) & 1)
            step = ((b == 0x5B) | (b == 0x7B)).view(np.int8) - ((b == 0x5D) | (b == 0x7D)).view(np.int8)
            levels = np.cumsum(step * outside.view(np.int8), dtype=np.int32) + depth
            if levels.size and int(levels.max()) > limit:
                at = offset + int(np.argmax(levels > limit))
                raise ValueError(f"{str(path)!r}: values nest more than {limit} levels deep (at byte {at:,}), more "
                                 f"than megatrain reads (megatrain.bounds.MAX_JSON_DEPTH; records of chats nest 4 to "
                                 "8): flatten or remove that field")
            depth, in_string = int(levels[-1]), 1 - int(outside[-1])
            tail = len(data) - len(data.rstrip(b"\\"))
            run = tail + (run if tail == len(data) else 0)
            offset += len(b)
