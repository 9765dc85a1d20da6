"""``python -m outbox.testing.receiver`` (see :mod:`outbox.testing.receiver.command`)."""

from outbox.testing.receiver.command import main

if __name__ == "__main__":
    raise SystemExit(main())
