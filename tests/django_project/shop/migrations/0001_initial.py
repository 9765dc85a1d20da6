from typing import Any, ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("sku", models.CharField(max_length=64)),
                ("quantity", models.IntegerField()),
                ("status", models.CharField(default="new", max_length=16)),
            ],
        ),
    ]
