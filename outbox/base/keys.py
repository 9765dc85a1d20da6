"""Keys for encryption at rest: the key ring the application supplies.

A :class:`KeyRing` holds key-encryption keys by id (one of them *current*, used to wrap
new data keys; the others still unwrap old ones) and the fingerprint key under which
the conflict fingerprint becomes an HMAC. Keys come from a mapping, or from a callable
``lookup(key_id) -> bytes | None`` so that a KMS or a secret store can be plugged in.

The store's :mod:`outbox.store.sealing` uses it; nothing here touches a database.
AES-GCM comes from ``cryptography`` (the ``encryption`` extra), imported on first use.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping
from typing import Any

from outbox.errors import ConfigurationError, KeyUnavailableError

__all__ = ["KeyLookup", "KeyRing", "KeyUnavailableError"]

#: A callable that returns the key-encryption key of an id, or None when unknown.
KeyLookup = Callable[[str], "bytes | None"]

_KEY_SIZES = (16, 24, 32)


def _aesgcm(key: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ConfigurationError(
            "encryption at rest needs the 'cryptography' package: "
            "pip install 'http-outbox[encryption]'"
        ) from exc
    return AESGCM(key)


def _checked_key(key_id: str, key: Any) -> bytes:
    if not isinstance(key, bytes) or len(key) not in _KEY_SIZES:
        raise ConfigurationError(
            f"key {key_id!r}: a key is 16, 24 or 32 bytes (AES-128/192/256), "
            f"got {type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}"
        )
    return key


class KeyRing:
    """Key-encryption keys by id, the current one, and the fingerprint key.

    ``KeyRing({"k2": k2, "k1": k1}, current="k2")``; or ``KeyRing(lookup, current="k2")``
    with ``lookup(key_id) -> bytes | None``. ``fingerprint_key`` defaults to a key derived
    from the current key's *id and bytes at construction*; set it explicitly (and keep it
    for good) when the current key will rotate, or conflicts stop being detected across
    the rotation.
    """

    def __init__(
        self,
        keys: Mapping[str, bytes] | KeyLookup,
        *,
        current: str,
        fingerprint_key: bytes | None = None,
    ) -> None:
        if callable(keys):
            self._lookup: KeyLookup = keys
        else:
            ring = {kid: _checked_key(kid, k) for kid, k in keys.items()}
            self._lookup = ring.get
        if ":" in current or not current:
            raise ConfigurationError(f"key id {current!r}: a non-empty id without ':'")
        self.current = current
        current_key = self.key(current)
        if fingerprint_key is None:
            fingerprint_key = hashlib.sha256(b"outbox fingerprint\x00" + current_key).digest()
        self.fingerprint_key = _checked_key("fingerprint", fingerprint_key)

    def key(self, key_id: str) -> bytes:
        """The key-encryption key ``key_id``; :class:`KeyUnavailableError` if unknown."""
        found = self._lookup(key_id)
        if found is None:
            raise KeyUnavailableError(f"encrypted: key {key_id} not available", key_id=key_id)
        return _checked_key(key_id, found)

    def has(self, key_id: str) -> bool:
        try:
            self.key(key_id)
        except KeyUnavailableError:
            return False
        return True

    def wrap(self, data_key: bytes) -> tuple[str, bytes]:
        """``data_key`` wrapped under the current key: (key id, nonce + ciphertext)."""
        nonce = os.urandom(12)
        aad = b"outbox dek\x00" + self.current.encode()
        return self.current, nonce + _aesgcm(self.key(self.current)).encrypt(nonce, data_key, aad)

    def unwrap(self, key_id: str, wrapped: bytes) -> bytes | None:
        """The data key ``wrapped`` under ``key_id``; None when the ring lacks that key,
        :class:`KeyUnavailableError` when the key does not unwrap it (wrong bytes)."""
        from cryptography.exceptions import InvalidTag

        found = self._lookup(key_id)
        if found is None:
            return None
        aad = b"outbox dek\x00" + key_id.encode()
        try:
            aes = _aesgcm(_checked_key(key_id, found))
            return bytes(aes.decrypt(wrapped[:12], wrapped[12:], aad))
        except InvalidTag as exc:
            raise KeyUnavailableError(
                f"encrypted: key {key_id} does not unwrap this data key (wrong key bytes?)",
                key_id=key_id,
            ) from exc

    def fingerprint(self, args_sha256: str) -> str:
        """The conflict fingerprint under the fingerprint key (64 hex, like a SHA-256)."""
        return hmac.new(self.fingerprint_key, args_sha256.encode(), hashlib.sha256).hexdigest()
