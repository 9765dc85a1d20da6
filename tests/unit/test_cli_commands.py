"""The ``outbox`` group imports each command's module when the command is used, from the
map in ``outbox.cli.root``; the map must name every command, each where it is defined."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click

from outbox.cli.root import main

COMMAND_MODULES = ("reading", "operator", "dispatching", "tools", "endpoints", "keys")


def test_the_lazy_map_names_every_command_where_it_is_defined() -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(f"outbox.cli.{name}")
    registered = {name: cmd.callback.__module__ for name, cmd in main.commands.items()}
    # A subgroup's callback lives where the group is defined, like a command's.
    assert registered == main.lazy_commands


def test_a_command_loads_its_own_module_and_help_loads_all() -> None:
    probe = (
        "import sys\n"
        "from outbox.cli import main\n"
        "ctx = main.make_context('outbox', ['status'])\n"
        "main.get_command(ctx, 'status')\n"
        "helpers = {'outbox.cli.support', 'outbox.cli.process', 'outbox.cli.demo'}\n"
        "def loaded():\n"
        "    return sorted(m for m in sys.modules\n"
        "                  if m.startswith('outbox.cli.') and m not in helpers)\n"
        "print(loaded())\n"
        "main.list_commands(ctx)\n"
        "print(loaded())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "['outbox.cli.reading', 'outbox.cli.root']"
    assert out[1] == str(sorted(f"outbox.cli.{m}" for m in (*COMMAND_MODULES, "root")))


def test_an_unknown_command_is_still_a_usage_error() -> None:
    ctx = main.make_context("outbox", ["status"])
    assert main.get_command(ctx, "no-such-command") is None
    assert isinstance(main.get_command(ctx, "reconcile"), click.Group)


def test_dispatch_children_get_the_db_the_operator_typed_not_the_environments() -> None:
    from outbox.cli.dispatching import _child_args
    from outbox.cli.support import Context

    typed = Context()
    typed.db, typed.app = "sqlite:///o.sqlite3", "shopapp:outbox"
    assert _child_args(typed)[-4:] == ["--db", "sqlite:///o.sqlite3", "--app", "shopapp:outbox"]
    # From OUTBOX_DB: the children inherit it; on their command line it would become the
    # operator's word (refused beside another --app database) and show a password in ps.
    inherited = Context()
    inherited.db, inherited.db_env = "postgresql://u:secret@127.0.0.1/db", "OUTBOX_DB"
    inherited.app = "shopapp:outbox"
    assert "--db" not in _child_args(inherited)
    assert _child_args(inherited)[-2:] == ["--app", "shopapp:outbox"]
    # The same for the schema and the key ring; the ones typed, and --debug, go on.
    inherited.schema, inherited.schema_env = "from_env", True
    inherited.keys, inherited.keys_env = "env.ring:keys", True
    assert _child_args(inherited)[-2:] == ["--app", "shopapp:outbox"]
    typed.schema, typed.keys, typed.debug = "shop", "shop.secrets:ring", True
    assert _child_args(typed)[4:] == ["--db", "sqlite:///o.sqlite3", "--schema", "shop",
                                      "--app", "shopapp:outbox", "--keys", "shop.secrets:ring",
                                      "--debug"]  # fmt: skip
