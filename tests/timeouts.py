"""A guard for tests that feed hostile input to decoders: their loops must all be bounded."""

import contextlib
import signal


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """Fail instead of hanging forever."""
    def boom(signum, frame):
        raise TimeoutError("decoding did not terminate")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
