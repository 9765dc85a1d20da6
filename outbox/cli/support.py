"""What every ``outbox`` command shares: where the database is, how a failure becomes
one line and an exit code, and the options that may come before or after the command.

Exit codes (the table in docs/guide/command-line-and-console.md):

====  =====================================================================================
0     done
1     refused: wrong state, conflict, not found, changed by someone else, a failed
      ``status --check``, a bulk action that left some operations unchanged
2     usage: a bad option or duration, ``--app`` not importable or not an Outbox,
      a bulk action without a terminal and without ``--yes``
3     the database: unreachable, wrong credentials, no file, no schema, schema too old
4     a bug in outbox (rerun with ``--debug`` and report the traceback)
130   interrupted (Ctrl-C)
====  =====================================================================================

Read commands never create or migrate anything: only ``outbox migrate`` does.
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import re
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard, TypeVar, cast

import click

from outbox.cli.process import PROCESS
from outbox.errors import (
    ConcurrentModification,
    ConfigurationError,
    OperationConflict,
    OperationNotFound,
    OperatorActionRefused,
    OutboxError,
    SchemaError,
    StoreError,
    ValidationError,
)

if TYPE_CHECKING:
    from sqlalchemy.exc import DBAPIError

    from outbox.base.keys import KeyRing
    from outbox.client import Outbox

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_STORE, EXIT_BUG = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130


#: Environment variables naming the database, first found wins. OUTBOX_DATABASE_URL is
#: the older name, still read.
DB_ENVVARS = ("OUTBOX_DB", "OUTBOX_DATABASE_URL")


class AppError(click.UsageError):
    """``--app`` could not be turned into an Outbox."""


class Context:
    """The database (or application) a command works on, opened on first use."""

    def __init__(self) -> None:
        self.db: str | None = None
        #: The environment variable the URL came from, if it came from one.
        self.db_env: str | None = None
        self.schema: str | None = None
        #: The schema came from OUTBOX_SCHEMA, not the command line.
        self.schema_env = False
        self.app: str | None = None
        #: ``module:attr`` naming the key ring (encryption at rest), or OUTBOX_KEYS.
        self.keys: str | None = os.environ.get("OUTBOX_KEYS") or None
        #: The key ring came from OUTBOX_KEYS, not the command line.
        self.keys_env = self.keys is not None
        self.debug = False
        self.log_level = "info"
        self.log_format = "auto"
        self._outbox: Outbox | None = None

    def configure_logs(self) -> None:
        from outbox.base import logs

        logs.configure(self.log_level, self.log_format)

    def outbox(self) -> Outbox:
        """The application's Outbox (``--app``) or one on ``--db``; never creates."""
        if self._outbox is None:
            if self.app:
                app = load_app(self.app)
                try:
                    self._same_database(app)
                except BaseException:
                    app.close()
                    raise
                self._outbox = app
                if self.keys:  # the operator's key ring, over the application's
                    from outbox.store.sealing import Sealer

                    self._outbox.keys = ring = load_keys(self.keys)
                    self._outbox.store.sealer = Sealer(ring)
            else:
                from outbox.client import Outbox

                if not self.db:
                    raise click.UsageError(
                        "name the database: --db URL (or set OUTBOX_DB), or --app module:attr"
                    )
                keys = load_keys(self.keys) if self.keys else None
                self._outbox = Outbox(self.db, schema=self.schema, auto_migrate=False, keys=keys)
        return self._outbox

    def _same_database(self, app: Outbox) -> None:
        """With ``--app``, the application's Outbox names the database: a ``--db`` or
        ``--schema`` typed on the command line that names another is refused rather
        than silently not used (OUTBOX_DB and OUTBOX_SCHEMA are not the operator's word
        beside ``--app``; they are not read)."""
        from outbox.store.engine import same_database, schema_of

        theirs, given = app.engine.url, self.db_in_use()
        if given is not None and not same_database(given, theirs):
            shown = theirs.render_as_string(hide_password=True)
            raise click.UsageError(
                f"--app {self.app} is on {shown}, not the --db given: "
                "give one of them (the application names its database)"
            )
        known = schema_of(app.engine)
        if self.schema is not None and not self.schema_env and self.schema != known:
            if known is None:
                raise click.UsageError(
                    f"--app {self.app} names no schema to outbox (its connection's "
                    f"search_path decides): --schema {self.schema} is not used; drop it"
                )
            raise click.UsageError(
                f"--app {self.app} keeps its tables in schema {known}, not "
                f"{self.schema}: give one of them"
            )

    def db_in_use(self) -> str | None:
        """The URL the command works on, when it is one given to outbox: ``--db``, or
        OUTBOX_DB without ``--app`` (beside ``--app`` the environment's is not used, so
        it is neither compared nor printed). None: the application's, or none."""
        return self.db if self.db_env is None or not self.app else None

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()

    def where(self) -> str:
        """The database, as it may be printed (password hidden), with its schema."""
        db = self.db_in_use()
        if db is None:
            return f"the database of --app {self.app}" if self.app else "the database"
        try:
            from sqlalchemy.engine import make_url

            shown = make_url(db).render_as_string(hide_password=True)
        except Exception:
            shown = "the --db URL"
        return shown + (f" (schema {self.schema})" if self.schema else "")

    def command_hint(self, *args: str) -> str:
        """``outbox ARGS --db URL [--schema S]``, quoted so that pasting it runs it."""
        command = " ".join(shlex.quote(w) for w in ("outbox", *args))
        in_use = self.db_in_use()
        if in_use is not None:
            try:
                from sqlalchemy.engine import make_url

                has_password = make_url(in_use).password is not None
            except Exception:
                has_password = False
            # Never print a secret: with a password in the URL, point at where it is.
            db = f'"${self.db_env or DB_ENVVARS[0]}"' if has_password else shlex.quote(in_use)
            command += f" --db {db}"
        elif self.app is not None:
            command += f" --app {shlex.quote(self.app)}"
        return command + self._schema_words()

    def _schema_words(self) -> str:
        return f" --schema {shlex.quote(self.schema)}" if self.schema else ""


def _attribute(spec: str, flag: str, example: str) -> tuple[Any, str]:
    """The attribute ``module:attr`` names (``flag`` and ``example`` for the errors)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise AppError(f"{flag} takes module:attr, e.g. {example}; got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    failed = f"{flag} {spec}: importing {module_name!r} failed"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise AppError(
                f"{flag} {spec}: no module named {module_name!r} (run from the directory "
                "that holds it, or set PYTHONPATH)"
            ) from exc
        raise AppError(f"{failed}: {_described(exc)}") from exc
    except Exception as exc:
        raise AppError(f"{failed}: {_described(exc)}") from exc
    try:
        return getattr(module, attr), attr
    except AttributeError as exc:
        raise AppError(f"{flag} {spec}: module {module_name!r} has no attribute {attr!r}") from exc


def _called(target: Any, spec: str, flag: str, attr: str, kind: type) -> Any:
    if callable(target) and not isinstance(target, kind):
        try:
            target = target()
        except OutboxError:
            raise
        except Exception as exc:
            raise AppError(f"{flag} {spec}: calling {attr}() failed: {_described(exc)}") from exc
    return target


def _load(spec: str, flag: str, example: str, kind: type[T], kind_name: str) -> T:
    """``module:attr`` naming a ``kind``, or a callable returning one."""
    target, attr = _attribute(spec, flag, example)
    target = _called(target, spec, flag, attr, kind)
    if not isinstance(target, kind):
        raise AppError(
            f"{flag} {spec}: {attr} is a {type(target).__name__}, not an {kind_name} "
            "(or a function returning one)"
        )
    return target


def load_app(app: str) -> Outbox:
    """``module:attr`` naming an Outbox, or a callable returning one."""
    from outbox.client import Outbox

    return _load(app, "--app", "myapp.jobs:outbox", Outbox, "outbox.Outbox")


def load_keys(spec: str) -> KeyRing:
    """``module:attr`` naming an outbox.base.keys.KeyRing, or a callable returning one."""
    from outbox.base.keys import KeyRing

    return _load(spec, "--keys", "myapp.secrets:keys", KeyRing, "outbox.base.keys.KeyRing")


# -- options that work before or after the command ------------------------------------


def _setter(field: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def store(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is None or value is False:
            return  # not given here: the group's value (or the environment's) stands
        obj = ctx.ensure_object(Context)
        setattr(obj, field, value)
        if field == "db":
            obj.db_env = None
        elif field in ("schema", "keys"):
            setattr(obj, f"{field}_env", False)

    return store


@dataclass(frozen=True, slots=True)
class Page:
    """The page of a listing its ``--limit`` and ``--offset`` ask for (:func:`page_options`),
    and what every listing prints of it."""

    limit: int
    offset: int

    def as_json(self, total: int, name: str, items: list[Any]) -> dict[str, Any]:
        """A listing's JSON: how many match in all, this page, and its ``items``."""
        return {"total": total, "limit": self.limit, "offset": self.offset, name: items}

    def next_words(self, shown: int, total: int) -> list[str] | None:
        """The ``--limit`` and ``--offset`` words of the next page after ``shown`` items
        of ``total``; None when this page is the last."""
        if self.offset + shown >= total:
            return None
        return ["--limit", str(self.limit), "--offset", str(self.offset + shown)]


def page_options(most: int) -> Callable[[F], F]:
    """``--limit`` (1 to ``most``, 50 by default) and ``--offset``: a page of a listing,
    which the command is given as ``page``."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def paged(*args: Any, limit: int, offset: int, **kwargs: Any) -> Any:
            return fn(*args, page=Page(limit, offset), **kwargs)

        options = click.option(
            "--offset", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True
        )
        limit = click.IntRange(1, most)
        paged = options(paged)
        return cast(F, click.option("--limit", type=limit, default=50, show_default=True)(paged))

    return decorate


#: The options every command takes before or after it: (flag, help), in help order.
_SHARED_OPTIONS = (
    ("db", "Database URL (or OUTBOX_DB)."),
    ("schema", "PostgreSQL schema holding the outbox tables (or OUTBOX_SCHEMA)."),
    ("app", "module:attr naming the application's Outbox (or OUTBOX_APP)."),
    ("keys", "module:attr naming the key ring for encrypted rows (or OUTBOX_KEYS)."),
    ("debug", "On failure, print the traceback too."),
)


def shared_options(fn: F) -> F:
    """``--db``, ``--schema``, ``--app`` and ``--debug`` on a command: given after the
    command they override what came before it or from the environment."""
    for field, help_text in reversed(_SHARED_OPTIONS):
        # (is_flag only where it is one: click 8.2 reads an explicit is_flag=False as
        # "the value may be left out", and "--schema" with none was silently dropped.)
        flag: dict[str, Any] = {"is_flag": True} if field == "debug" else {}
        fn = click.option(
            f"--{field}", expose_value=False, callback=_setter(field), help=help_text, **flag
        )(fn)
    return fn


# -- failures ---------------------------------------------------------------------------


def _one_line(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else (str(exc) or type(exc).__name__)
    line = ""
    for part in (p.strip() for p in text.strip().splitlines()):
        if part:
            # A line ending in ":" or "," goes on (click's "Choose from:" list).
            line += ("" if not line else " " if line.endswith((":", ",")) else "; ") + part
    return line


def failure(exc: BaseException, obj: Context | None) -> tuple[int, str]:
    """The exit code and the one line for an exception that ended a command."""
    obj = obj or Context()
    if isinstance(exc, SchemaError):
        fix = obj.command_hint("migrate")
        if getattr(exc, "missing", False) and "does not exist" in str(exc):
            return EXIT_STORE, f"{_one_line(exc)}. Check the path; to create it: {fix}"
        message = _one_line(exc).replace("run: outbox migrate --db URL", f"run: {fix}")
        return EXIT_STORE, message
    if isinstance(exc, ConcurrentModification) and exc.operation_id:
        again = obj.command_hint(
            "reconcile", "show", exc.operation_id, *(["--tenant", exc.tenant] if exc.tenant else [])
        )
        message = _one_line(exc).replace(
            "Run `outbox reconcile show` again.", f"Look again: {again}"
        )
        return EXIT_REFUSED, message
    if isinstance(exc, (OperatorActionRefused, OperationNotFound, OperationConflict)):
        return EXIT_REFUSED, _one_line(exc)
    if isinstance(exc, (ValidationError, ConfigurationError)):
        return EXIT_USAGE, _one_line(exc)
    if isinstance(exc, StoreError):
        cause = exc.__cause__
        if _is_dbapi(cause) and (cause.connection_invalidated or _is_connect(cause)):
            # The store said what it was doing ("cannot read URL"); the operator needs
            # to know the database is not reachable at all.
            orig = cause.orig if cause.orig is not None else cause
            return EXIT_STORE, _cannot_connect(obj.where(), _one_line(orig))
        return EXIT_STORE, _one_line(exc)
    if isinstance(exc, OutboxError):
        return EXIT_REFUSED, _one_line(exc)
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, OSError) and exc.filename is not None:
        # A path the system refused (too long, a file where a directory must be, a
        # read-only or virtual file system): the database's file or its directory.
        from outbox.canonical import quoted

        path = os.fsdecode(exc.filename)
        reason = exc.strerror or type(exc).__name__
        if isinstance(exc, FileExistsError | NotADirectoryError) and not os.path.isdir(path):
            reason = "a file is in the way where a directory must be"
        return EXIT_STORE, f"cannot use {quoted(path, 200)}: {reason}"
    from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError

    if isinstance(exc, (ArgumentError, NoSuchModuleError)):
        if isinstance(obj.db, str) and "://" not in obj.db:
            return EXIT_USAGE, (
                f"--db {obj.db!r} is not a database URL: did you mean "
                f"sqlite:///{os.path.abspath(obj.db)}?"
            )
        return EXIT_USAGE, f"--db is not a database URL outbox can use: {_one_line(exc)}"
    if isinstance(exc, DBAPIError):
        cause = exc.orig if exc.orig is not None else exc
        if exc.connection_invalidated or _is_connect(exc):
            return EXIT_STORE, _cannot_connect(obj.where(), _one_line(cause))
        return EXIT_STORE, f"database error at {obj.where()}: {_one_line(cause)}"
    if isinstance(exc, SQLAlchemyError):
        return EXIT_STORE, f"database error at {obj.where()}: {_one_line(exc)}"
    return EXIT_BUG, (
        f"unexpected {type(exc).__name__}: {_one_line(exc)} (a bug in outbox; rerun with "
        "--debug and report the traceback)"
    )


def _described(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_one_line(exc)}"


def _is_dbapi(exc: BaseException | None) -> TypeGuard[DBAPIError]:
    if exc is None or "sqlalchemy" not in sys.modules:
        return False
    from sqlalchemy.exc import DBAPIError

    return isinstance(exc, DBAPIError)


def _is_connect(exc: Any) -> bool:
    text = str(getattr(exc, "orig", exc)).lower()
    return "connect" in text or "authentication" in text or "password" in text


def fail(code: int, message: str) -> NoReturn:
    from outbox.base.safetext import neutralise

    click.echo(f"error: {neutralise(message)}", err=True)
    sys.exit(code)


def command(
    group: click.Group, name: str | None = None, *, reads: bool = False, **attrs: Any
) -> Callable[[F], F]:
    """Make ``fn(obj, **options)`` a command of ``group`` with the shared options; any
    exception it raises ends the process with one line and the documented exit code
    (``--debug``: the traceback first).

    ``reads``: the command only reads the database (and never dispatches): logging is
    not set up (the library's loggers stay quiet; tests/acceptance/test_cli_startup.py
    pins what a read imports)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            obj = click.get_current_context().find_object(Context)
            if reads:
                PROCESS.read_command = True
            else:
                if PROCESS.gc_paused:
                    gc.enable()
                    PROCESS.gc_paused = False
                if obj is not None:
                    obj.configure_logs()
            try:
                return fn(obj, *args, **kwargs)
            except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort):
                raise
            except BrokenPipeError:
                # `outbox reconcile list | head`: the reader left; say nothing more.
                # (Python's documented way: stdout to /dev/null, so the exit flush is quiet.)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(EXIT_REFUSED)
            except BaseException as exc:
                if isinstance(exc, SystemExit):
                    raise
                if obj is not None and obj.debug:
                    traceback.print_exception(exc, file=sys.stderr)
                if isinstance(exc, click.UsageError):
                    raise
                fail(*failure(exc, obj))

        return group.command(name, **attrs)(shared_options(run))  # type: ignore[return-value]

    return decorate


#: Lone surrogates: how Python spells the bytes of an argument that is not UTF-8.
_SURROGATES = re.compile("[\ud800-\udfff]")


class OutboxGroup(click.Group):
    """A click group whose usage errors are one line too (and a pointer to --help), and
    whose commands are imported when used: ``lazy_commands`` names the module that
    defines each one, so ``outbox status`` loads the read commands' module alone
    (``--help`` loads them all)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands: dict[str, str] = {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # An argument that is not UTF-8 reaches Python as lone surrogates, which no
        # database, header or terminal takes: refuse it here, once for every command.
        for number, arg in enumerate(args, 1):
            if _SURROGATES.search(arg):
                shown = ascii(arg[:60].encode("utf-8", "surrogateescape"))
                raise click.UsageError(f"argument {number} is not valid UTF-8: {shown}", ctx)
        return super().parse_args(ctx, args)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = self.lazy_commands.get(cmd_name)
        if module is not None and cmd_name not in self.commands:
            importlib.import_module(module)
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        for module in sorted(set(self.lazy_commands.values())):
            importlib.import_module(module)
        return super().list_commands(ctx)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            result = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "outbox"
            fail(exc.exit_code, f"{_one_line(exc.format_message())} (see: {where} --help)")
        except click.ClickException as exc:
            fail(exc.exit_code, _one_line(exc.format_message()))
        except click.Abort:
            fail(EXIT_REFUSED, "aborted; nothing was changed")
        sys.exit(result if isinstance(result, int) else EXIT_OK)


class DurationType(click.ParamType):  # type: ignore[type-arg]
    """``90s``, ``30m``, ``1h30m``, ``12h``, ``30d``, ``2w``."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        from outbox.base.durations import parse_duration

        try:
            return parse_duration(value)
        except ValidationError as exc:
            self.fail(str(exc), param, ctx)


DURATION = DurationType()


def _cannot_connect(where: str, detail: str) -> str:
    message = f"cannot connect to the database {where}: {detail}"
    if "unsupported startup parameter" in detail and "options" in detail:
        # pgbouncer refuses libpq's options (how --schema sets the search_path).
        message += (
            " (pgbouncer refuses the options startup parameter that --schema and "
            "?options= use: set the schema on the role instead, ALTER ROLE name SET "
            "search_path = schema, and drop --schema)"
        )
    return message
