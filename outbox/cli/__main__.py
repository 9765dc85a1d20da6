"""``python -m outbox.cli``: the same process as ``python -m outbox`` and the script."""

from outbox.__main__ import main

if __name__ == "__main__":
    main()
