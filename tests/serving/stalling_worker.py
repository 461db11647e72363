"""A decode worker that a test kills mid-decode without guessing when (tests/serving/test_decoder_crash.py):
serving/codecs/image_worker.py run as it is, its `decode_body` wrapped. The test points the pool at
this module (image_decoder.WORKER_MODULE) and names a folder in DECODE_STALL_ENV; a worker that claims
a `ticket*` file there (unlinks it: one worker per ticket) writes `busy-<pid>` and waits, holding the
body, until it is killed. Nothing of it is in serving/."""
from __future__ import annotations

import os
import signal
import sys

from serving.codecs import image_worker

DECODE_STALL_ENV = "TESTS_DECODE_STALL_DIR"


def stall(folder: str) -> None:
    for name in sorted(os.listdir(folder)):
        if not name.startswith("ticket"):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:  # another worker claimed it
            continue
        open(os.path.join(folder, f"busy-{os.getpid()}"), "w").close()
        while True:
            signal.pause()


def main(argv: list[str]) -> None:
    folder, decode = os.environ[DECODE_STALL_ENV], image_worker.decode_body

    def stalling(*args, **kwargs):
        stall(folder)
        return decode(*args, **kwargs)

    image_worker.decode_body = stalling  # serve() looks it up per request
    image_worker.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
