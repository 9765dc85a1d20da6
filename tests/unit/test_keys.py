"""The key ring: bad keys refused at construction, lookups through a callable, the
fingerprint an HMAC that depends on its key."""

from __future__ import annotations

import pytest

from outbox import ConfigurationError, KeyRing, KeyUnavailableError
from outbox.store.sealing import Sealed, Sealer, request_aad


def test_keys_of_a_wrong_size_or_type_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="key 'k1': a key is 16, 24 or 32 bytes"):
        KeyRing({"k1": b"short"}, current="k1")
    with pytest.raises(ConfigurationError, match="a key is 16, 24 or 32 bytes"):
        KeyRing({"k1": "a" * 32}, current="k1")  # type: ignore[dict-item]
    with pytest.raises(KeyUnavailableError, match="key k2 not available"):
        KeyRing({"k1": b"1" * 32}, current="k2")
    with pytest.raises(ConfigurationError, match="without ':'"):
        KeyRing({"a:b": b"1" * 32}, current="a:b")


def test_a_callable_lookup_is_asked_for_each_key_it_knows() -> None:
    asked: list[str] = []

    def lookup(key_id: str) -> bytes | None:
        asked.append(key_id)
        return {"k1": b"1" * 32}.get(key_id)

    ring = KeyRing(lookup, current="k1", fingerprint_key=b"f" * 32)
    sealer = Sealer(ring)
    row = sealer.seal_request({"tenant": "t", "operation_id": "o", "headers": "{}", "body": "1"})
    assert sealer.open(row["body"], request_aad("t", "o", "body")) == "1"
    assert "k1" in asked
    other = Sealer(KeyRing({"k9": b"9" * 32}, current="k9"))
    assert other.open(row["body"], request_aad("t", "o", "body")) == Sealed("k1")
    assert Sealer(None).open(row["body"], request_aad("t", "o", "body")) == Sealed("k1")
    assert Sealer(None).open('{"plain": 1}', b"") == '{"plain": 1}'


def test_the_fingerprint_is_an_hmac_under_its_own_key() -> None:
    a = KeyRing({"k1": b"1" * 32}, current="k1", fingerprint_key=b"a" * 32)
    b = KeyRing({"k2": b"2" * 32}, current="k2", fingerprint_key=b"a" * 32)
    c = KeyRing({"k1": b"1" * 32}, current="k1", fingerprint_key=b"c" * 32)
    sha = "0" * 64
    assert a.fingerprint(sha) == b.fingerprint(sha)  # survives a rotation of k1 -> k2
    assert a.fingerprint(sha) != c.fingerprint(sha)
    assert len(a.fingerprint(sha)) == 64 and a.fingerprint(sha) != sha
