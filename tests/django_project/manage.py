#!/usr/bin/env python
"""A minimal Django project using outbox.contrib.django (tests/acceptance/test_django.py).

Database from SHOP_DATABASE_URL (sqlite:////path or postgresql://...?options=...),
the inventory receiver from SHOP_INVENTORY_URL.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
