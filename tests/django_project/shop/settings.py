"""Settings of the test shop: one app with an Order model, plus outbox.contrib.django."""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy.engine import make_url

SECRET_KEY = "test-only-not-secret"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["shop", "outbox.contrib.django"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _database(url_text: str) -> dict[str, Any]:
    url = make_url(url_text)
    if url.get_backend_name() == "sqlite":
        # IMMEDIATE: a transaction takes SQLite's write lock at BEGIN, so it waits for the
        # outbox dispatcher's short writes instead of failing to upgrade a read lock.
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": url.database,
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 10},
            # manage.py test: a file, which the outbox's own connection can open too.
            "TEST": {"NAME": os.environ.get("SHOP_TEST_DATABASE", "test-shop.sqlite3")},
        }
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": url.database,
        "USER": url.username or "",
        "PASSWORD": url.password or "",
        "HOST": url.host or "",
        "PORT": str(url.port or ""),
        "OPTIONS": dict(url.query),
    }


DATABASES = {"default": _database(os.environ["SHOP_DATABASE_URL"])}
OUTBOX = {"ENDPOINTS": "shop.integrations.endpoints"}
LOGGING_CONFIG = None
