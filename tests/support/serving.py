"""A ``fxsched serve`` command line running in-process, for the tests that drive it with real clients."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from fxsched.runtime.cli.app import build_parser
from fxsched.runtime.cli.serve import open_serving
from fxsched.runtime.logs import configure_logging


@contextlib.contextmanager
def running(argv: list[str]) -> Iterator[Any]:
    """The server of ``fxsched <argv>`` (parsed as the command parses it), running on a thread."""
    args = build_parser().parse_args(argv)
    try:
        with open_serving(args, on_started=lambda serving: None) as serving:
            thread = threading.Thread(target=serving.run, daemon=True)
            thread.start()
            try:
                assert serving.wait_started(60), "the server did not start"
                yield serving
            finally:
                serving.stop()
                thread.join(30)
                assert not thread.is_alive()
    finally:
        configure_logging(False, fmt="text")
