"""Django: an order and the task that ships it, in one ``transaction.atomic()`` (issue 35).

The view writes the order with Django's connection and submits the task on the same
connection (``conn=connection.connection``: Django's own psycopg connection), inside
``transaction.atomic()``: the task exists only if the order commits. A failing request
(``?fail=1``) rolls both back. Single-file Django (settings, URLs and view here)::

    pip install 'metafora-cluster[examples]'
    export DATABASE_URL=postgresql://localhost/shop METAFORA_URL=postgresql://localhost/shop
    python examples/transactional/django_app.py runserver
"""

from __future__ import annotations

import sys
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path

from metafora import Client, Task, open_client

_client: Client | None = None


def configure(database_url: str, store_url: str) -> None:
    """Django settings for a PostgreSQL ``database_url``; the metafora store at ``store_url``
    (the same database: one transaction covers both)."""
    global _client
    parts = urlsplit(database_url)
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=[],
        INSTALLED_APPS=[],
        DATABASES={"default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": parts.path.lstrip("/"), "USER": parts.username or "",
            "PASSWORD": parts.password or "", "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
        }},
    )
    import django

    django.setup()
    _client = open_client(store_url)
    _client.tasks()  # creates metafora's schema if this is the store's first use
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE IF NOT EXISTS example_django_orders"
                       " (id text PRIMARY KEY, item text NOT NULL)")


def create_order(request: HttpRequest, order_id: str) -> HttpResponse:
    """POST /orders/<id>: the order row and its ``ship-<id>`` task, committed together."""
    assert _client is not None, "call configure() first"
    item = request.GET.get("item", "book")
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("INSERT INTO example_django_orders (id, item) VALUES (%s, %s)",
                               [order_id, item])
            # Django's own psycopg connection, inside the atomic block's transaction.
            _client.submit_task(Task(f"ship-{order_id}", {"order": order_id, "item": item}),
                                conn=connection.connection, if_exists="ignore")
            if request.GET.get("fail"):
                raise PaymentDeclined(order_id)
    except PaymentDeclined:
        return JsonResponse({"error": "payment declined"}, status=402)
    return JsonResponse({"order": order_id, "task": f"ship-{order_id}"})


class PaymentDeclined(Exception):
    """Stands for anything that fails before the commit."""


urlpatterns: list[Any] = [path("orders/<str:order_id>", create_order)]


if __name__ == "__main__":
    import os

    from django.core.management import execute_from_command_line

    configure(os.environ["DATABASE_URL"], os.environ["METAFORA_URL"])
    execute_from_command_line(sys.argv)
