"""Deprecated alias: moved to :mod:`outbox.wire.transport`; removed in the next release."""

import warnings

from outbox.wire.transport import *  # noqa: F403
from outbox.wire.transport import __all__  # noqa: F401

warnings.warn(
    "outbox.transport moved to outbox.wire.transport; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
