"""``python -m outbox.cli``."""

from outbox.cli import main

if __name__ == "__main__":
    main()
