"""URLs of the django-idempotency-key receiver (``apps.django_idempotency_key``)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from idempotency_key.decorators import idempotency_key

from tests.middlewares.apps import apply_effect


@csrf_exempt
@idempotency_key
def reservations(request: HttpRequest) -> JsonResponse:
    result = apply_effect(request.headers.get("Idempotency-Key"), request.body)
    return JsonResponse(result, status=201)


@csrf_exempt
@idempotency_key
def explode(request: HttpRequest) -> Any:
    apply_effect(request.headers.get("Idempotency-Key"), request.body)
    raise RuntimeError("handler bug after the effect")


urlpatterns = [path("reservations", reservations), path("explode", explode)]
