"""FastAPI: an order and the task that ships it, committed together (issue 35).

The order row and the task are written in one SQLAlchemy async session: the task exists only
if the order does. A failed request (here: ``?fail=true``) rolls both back.

Run it (PostgreSQL; the store URL names the same database)::

    pip install 'metafora-cluster[examples]' uvicorn
    export DATABASE_URL=postgresql+psycopg://localhost/shop
    export METAFORA_URL=postgresql://localhost/shop
    uvicorn examples.transactional.fastapi_app:app

and run a consumer on METAFORA_URL with a handler for ``ship-*`` tasks.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from sqlalchemy import String
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from metafora import Task, open_async_client


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "example_orders"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    item: Mapped[str] = mapped_column(String(200))


def create_app(database_url: str, store_url: str) -> FastAPI:
    """The app on ``database_url`` (SQLAlchemy async URL) and the store at ``store_url``."""
    engine = create_async_engine(database_url)
    sessions = async_sessionmaker(engine, class_=AsyncSession, expire_on_commit=False)
    client = open_async_client(store_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        await client.tasks()  # creates metafora's schema if this is the store's first use
        yield
        await client.close()
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/orders/{order_id}")
    async def create_order(order_id: str, item: str = "book", fail: bool = False) -> dict[str, str]:
        async with sessions() as session, session.begin():
            session.add(Order(id=order_id, item=item))
            # In the session's transaction: the task commits (and wakes consumers) with the order.
            await client.submit_task(Task(f"ship-{order_id}", {"order": order_id, "item": item}),
                                     conn=session, if_exists="ignore")
            if fail:  # anything failing before the commit takes the order and its task back
                raise HTTPException(status_code=402, detail="payment declined")
        return {"order": order_id, "task": f"ship-{order_id}"}

    @app.get("/orders/{order_id}")
    async def order_status(order_id: str) -> dict[str, str]:
        task = await client.task(f"ship-{order_id}")
        return {"order": order_id, "shipping": task.state.value}

    return app


if "DATABASE_URL" in os.environ:  # `uvicorn examples.transactional.fastapi_app:app`
    app = create_app(os.environ["DATABASE_URL"], os.environ.get("METAFORA_URL", ""))
