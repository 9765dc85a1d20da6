"""What the in-process :class:`Receiver` and a spawned :class:`RemoteReceiver` share."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self

from outbox.testing.receiver.faults import Faults
from outbox.testing.receiver.oracle import Oracle


class ReceiverHandle(Oracle, abc.ABC):
    """A test receiver in this process or in another: its URL, its :class:`Faults`
    controls, its SQLite file read as the oracle, and its lifecycle. Code that drives
    either kind takes this type. As a context manager it closes the receiver on exit."""

    #: Fault injection controls.
    faults: Faults

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """``http://HOST:PORT`` of the receiver."""

    @abc.abstractmethod
    def start(self) -> Self:
        """Start serving (again, on the same file); returns the receiver."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop serving; :meth:`start` may follow."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop, and remove what this object made (a temporary database, a process)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
