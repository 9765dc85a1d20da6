"""Fault injection: the :class:`Faults` controls, the JSON fault specs they send, the
receiver-side plan that applies them, and seeded :class:`RandomFaults`."""

from __future__ import annotations

import enum
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypedDict, Unpack

from outbox.testing.receiver.ratelimit import RateLimitSpec, TokenBucket


@dataclass(frozen=True, kw_only=True)
class RandomFaults:
    """Independent per-new-key fault probabilities, drawn from one seeded generator.

    ``stuck`` and ``fail_before_work`` are drawn when an unseen key arrives; the
    after-commit faults when its effect commits (precedence when several hit: drop,
    stored 500, 500, delay).
    """

    seed: int = 0
    p_drop_after_commit: float = 0.0
    p_fail_before_work: float = 0.0
    p_fail_after_commit: float = 0.0
    p_stored_500: float = 0.0
    p_delay_after_commit: float = 0.0
    delay_seconds: float = 2.0
    p_stuck: float = 0.0
    #: ``Retry-After`` sent with random 503s; None sends none.
    retry_after: str | None = "1"

    def to_argv(self) -> list[str]:
        """The command-line flags that reproduce these settings."""
        argv = ["--seed", str(self.seed), "--delay-seconds", repr(self.delay_seconds)]
        for f in fields(self):
            if f.name.startswith("p_"):
                argv += ["--" + f.name.replace("_", "-"), repr(getattr(self, f.name))]
        argv += ["--retry-after", self.retry_after if self.retry_after is not None else ""]
        return argv


class _Default(enum.Enum):
    TOKEN = 0


_DEFAULT = _Default.TOKEN
_FAULT_KINDS = frozenset(
    {
        "drop_after_commit",
        "fail_before_work",
        "fail_after_commit",
        "delay_after_commit",
        "hang_after_commit",
        "stuck_in_progress",
    }
)
HANG_KINDS = frozenset({"hang_after_commit"})
AFTER_COMMIT_KINDS = frozenset(
    {"drop_after_commit", "fail_after_commit", "delay_after_commit", "hang_after_commit"}
)


class Target(TypedDict, total=False):
    """Which requests a fault rule hits, beyond ``times``: the keyword options every
    :class:`Faults` rule takes (``stuck_in_progress`` and ``rate_limit`` aside)."""

    #: Hit each matching request with this probability; ``times`` then defaults to
    #: unlimited.
    probability: float | None
    #: Seeds the rule's own draws, for a run that repeats.
    seed: int | None
    #: Only requests with this Idempotency-Key.
    key: str | None
    #: Only requests to this path.
    path: str | None


#: Target's names, in its order: every one is in each spec, None where not given.
_TARGET_KEYS = tuple(Target.__annotations__)


def _targeting(kind: str, times: int | _Default | None, target: Target) -> dict[str, Any]:
    """The fault spec of a ``kind`` rule: the fields that say which requests it hits
    (``times`` left at its default is 1, or unlimited when ``probability`` is given)."""
    unknown = sorted(target.keys() - set(_TARGET_KEYS))
    if unknown:
        raise TypeError(f"{kind}() got unexpected keyword arguments: {', '.join(unknown)}")
    probability = target.get("probability")
    if times is _DEFAULT:
        times = None if probability is not None else 1
    return {"kind": kind, "times": times, **{name: target.get(name) for name in _TARGET_KEYS}}


class Faults:
    """Fault injection controls; the same API drives in-process and subprocess receivers.

    Rules are tried in the order they were added; at each stage the first matching rule
    that has ``times`` left (and wins its ``probability`` draw, if any) applies. ``key``
    and ``path`` narrow a rule to one Idempotency-Key or one path. After-commit faults
    apply only to requests that committed a new effect, never to replays.
    """

    def __init__(self, submit: Callable[[dict[str, Any]], None], clear: Callable[[], None]) -> None:
        self._submit = submit
        self._clear = clear

    def drop_after_commit(
        self, times: int | _Default | None = _DEFAULT, **target: Unpack[Target]
    ) -> None:
        """Commit the effect and receipt, then close the socket without a byte.

        ``times`` defaults to 1, or to unlimited when ``probability`` is given.
        """
        self._submit(_targeting("drop_after_commit", times, target))

    def fail_before_work(
        self,
        status: int = 503,
        *,
        retry_after: str | None = "2",
        times: int | None = None,
        **target: Unpack[Target],
    ) -> None:
        """Answer ``status`` (5xx or 429) before any work; ``times=None`` means always."""
        spec = _targeting("fail_before_work", times, target)
        self._submit({**spec, "status": status, "retry_after": retry_after})

    def fail_after_commit(
        self,
        status: int = 500,
        *,
        times: int | _Default | None = _DEFAULT,
        stored: bool = False,
        **target: Unpack[Target],
    ) -> None:
        """Commit the effect, then answer ``status``.

        With ``stored=True`` that error becomes the receipt's response, so every replay
        answers it too.
        """
        spec = _targeting("fail_after_commit", times, target)
        self._submit({**spec, "status": status, "stored": stored})

    def delay_after_commit(
        self, seconds: float, *, times: int | _Default | None = _DEFAULT, **target: Unpack[Target]
    ) -> None:
        """Commit, sleep ``seconds``, then answer normally."""
        self._submit({**_targeting("delay_after_commit", times, target), "seconds": seconds})

    def hang_after_commit(
        self, *, times: int | None = None, replays: bool = False, **target: Unpack[Target]
    ) -> None:
        """Commit, then never answer: the socket stays open until the receiver stops.

        With ``replays=True`` later requests for an already applied key hang as well.
        """
        self._submit({**_targeting("hang_after_commit", times, target), "replays": replays})

    def stuck_in_progress(self, key: str, tenant: str = "") -> None:
        """Leave ``(tenant, key)``'s receipt "processing": every request with it gets 409.

        It is stored in the database, so it survives restarts; :meth:`clear` removes it.
        """
        self._submit({"kind": "stuck_in_progress", "key": key, "tenant": tenant})

    def rate_limit(
        self,
        rate: float,
        *,
        burst: float | None = None,
        retry_after: str | None = "1",
        headers: str = "none",
        status: int = 429,
    ) -> None:
        """Admit ``rate`` requests per second, whatever their key (a token bucket of
        ``burst`` tokens, one second's worth by default); answer the others ``status``
        (429; 503 as some load balancers do; 403 as GitHub's REST API does) with
        ``Retry-After`` before any work. ``headers``: ``"none"``, ``"ietf"``
        (``RateLimit``/``RateLimit-Policy``), ``"x-ratelimit"`` (``X-RateLimit-*``) or
        ``"github"`` (``X-RateLimit-*`` with an epoch reset). Replaces an earlier rate
        limit; :meth:`clear` removes it."""
        spec = RateLimitSpec(rate, burst, retry_after, headers, status)
        self._submit(spec.to_spec())

    def clear(self) -> None:
        """Remove every fault: rules, random start-up faults, the rate limit, and
        stuck receipts."""
        self._clear()


@dataclass(slots=True)
class Rule:
    kind: str
    times: int | None
    probability: float | None
    seed: int | None
    key: str | None
    path: str | None
    status: int
    retry_after: str | None
    stored: bool
    seconds: float
    rng: random.Random
    #: hang_after_commit only: also hang replays of a key already applied, so the
    #: receiver never answers that key again (a permanently hanging endpoint).
    replays: bool = False

    def matches(self, path: str, key: str | None) -> bool:
        if self.key is not None and self.key != key:
            return False
        return self.path is None or self.path in (path, path.split("?", 1)[0])

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rng"}


def _opt(spec: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``spec[name]`` if present and of ``kind`` (bools are not numbers here), else None."""
    value = spec.get(name)
    if value is None:
        return None
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise ValueError(f"{name}: unexpected value {value!r}")
    return value


def _parse_rule(spec: Mapping[str, Any]) -> Rule:
    """Validate one fault spec (see the module docstring) into a rule."""
    kind = spec.get("kind")
    if kind not in _FAULT_KINDS or kind == "stuck_in_progress":
        raise ValueError(f"unknown fault kind {kind!r}")
    known = {f.name for f in fields(Rule)} - {"rng"} | {"kind"}
    unknown = set(spec) - known
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)} for {kind}")
    times = _opt(spec, "times", int)
    if times is not None and times < 0:
        raise ValueError("times must be >= 0")
    probability = _opt(spec, "probability", (int, float))
    if probability is not None and not 0.0 <= probability <= 1.0:
        raise ValueError("probability must be within [0, 1]")
    seed = _opt(spec, "seed", int)
    default_status = 503 if kind == "fail_before_work" else 500
    status = _opt(spec, "status", int) or default_status
    if not 100 <= status <= 599:
        raise ValueError("status must be an HTTP status code")
    retry_after = _opt(spec, "retry_after", (str, int))
    stored = _opt(spec, "stored", bool) or False
    replays = _opt(spec, "replays", bool) or False
    if replays and kind != "hang_after_commit":
        raise ValueError("replays applies to hang_after_commit only")
    seconds = _opt(spec, "seconds", (int, float))
    if kind == "delay_after_commit" and (seconds is None or seconds < 0):
        raise ValueError("delay_after_commit needs seconds >= 0")
    return Rule(
        kind=kind,
        times=times,
        probability=None if probability is None else float(probability),
        seed=seed,
        key=_opt(spec, "key", str),
        path=_opt(spec, "path", str),
        status=status,
        retry_after=None if retry_after is None else str(retry_after),
        stored=bool(stored),
        seconds=float(seconds or 0.0),
        rng=random.Random(seed),
        replays=bool(replays),
    )


class FaultPlan:
    """The receiver-side fault state, shared by every request thread."""

    def __init__(self, random_faults: RandomFaults | None) -> None:
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._random = random_faults
        self._rng = random.Random(random_faults.seed if random_faults else 0)
        #: The receiver's rate limit (``Faults.rate_limit``); None: unlimited.
        self.bucket: TokenBucket | None = None

    def add(self, rule: Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self._random = None
            self.bucket = None

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            rules = [rule.describe() for rule in self._rules]
            if self.bucket is not None:
                rules.append(self.bucket.spec.to_spec())
            return rules

    def admit(self) -> tuple[int, tuple[tuple[str, str], ...]] | None:
        """None if the rate limit (if any) admits a request now; else the status and
        headers of its refusal."""
        bucket = self.bucket
        headers = None if bucket is None else bucket.admit()
        return None if bucket is None or headers is None else (bucket.spec.status, headers)

    def take(
        self, kinds: frozenset[str], path: str, key: str | None, *, replay: bool = False
    ) -> Rule | None:
        """The first matching rule of ``kinds`` that fires now, with one use consumed.

        For a replay only rules marked ``replays`` apply.
        """
        with self._lock:
            for rule in self._rules:
                if rule.kind not in kinds or rule.times == 0 or not rule.matches(path, key):
                    continue
                if replay and not rule.replays:
                    continue
                if rule.probability is not None and rule.rng.random() >= rule.probability:
                    continue
                if rule.times is not None:
                    rule.times -= 1
                return rule
            return None

    def draw_new_key(self) -> tuple[bool, Rule | None]:
        """Random start-up faults for an unseen key: (stuck, fail-before-work rule)."""
        with self._lock:
            rf = self._random
            if rf is None:
                return False, None
            stuck = self._rng.random() < rf.p_stuck
            fail = self._rng.random() < rf.p_fail_before_work
        if stuck:
            return True, None
        if fail:
            return False, _parse_rule(
                {"kind": "fail_before_work", "status": 503, "retry_after": rf.retry_after}
            )
        return False, None

    def draw_after_commit(self) -> Rule | None:
        """Random start-up after-commit fault for a key whose effect just committed."""
        with self._lock:
            rf = self._random
            if rf is None:
                return None
            drop = self._rng.random() < rf.p_drop_after_commit
            stored = self._rng.random() < rf.p_stored_500
            fail = self._rng.random() < rf.p_fail_after_commit
            delay = self._rng.random() < rf.p_delay_after_commit
        if drop:
            return _parse_rule({"kind": "drop_after_commit"})
        if stored:
            return _parse_rule({"kind": "fail_after_commit", "stored": True})
        if fail:
            return _parse_rule({"kind": "fail_after_commit"})
        if delay:
            return _parse_rule({"kind": "delay_after_commit", "seconds": rf.delay_seconds})
        return None


def apply_fault_spec(
    spec: Mapping[str, Any], plan: FaultPlan, mark_stuck: Callable[[str, str], None]
) -> None:
    """Apply one JSON fault spec to ``plan`` (stuck keys go through ``mark_stuck``)."""
    if spec.get("kind") == "stuck_in_progress":
        key, tenant = spec.get("key"), spec.get("tenant") or ""
        if not isinstance(key, str) or not key or not isinstance(tenant, str):
            raise ValueError("stuck_in_progress needs a key (and an optional tenant)")
        mark_stuck(tenant, key)
        return
    if spec.get("kind") == "rate_limit":
        plan.bucket = TokenBucket(RateLimitSpec.from_spec(spec))
        return
    plan.add(_parse_rule(spec))
