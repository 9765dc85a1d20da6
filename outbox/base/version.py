"""The package's version, written here only: pyproject.toml reads it at build time
([tool.hatch.version]) and ``outbox.__version__`` re-exports it. A module, not
``importlib.metadata``, so lower layers (heartbeats, the console, traces) read it without
importing the package or paying for metadata look-ups at start-up."""

__version__ = "0.1.0"
