from django.db import models


class Order(models.Model):
    sku = models.CharField(max_length=64)
    quantity = models.IntegerField()
    status = models.CharField(max_length=16, default="new")
