"""Fixtures of the deploy tests: the fake Kubernetes API and stand-in servers."""

import pytest_asyncio

from backends import Backend
from fake_kube import FakeKube


@pytest_asyncio.fixture
async def kube():
    api = await FakeKube().start()
    try:
        yield api
    finally:
        await api.close()


@pytest_asyncio.fixture
async def backends():
    """`await backends("name", delay_s=...)` starts one; all are closed at the end."""
    started: list[Backend] = []

    async def start(name: str, **options) -> Backend:
        backend = await Backend(name, **options).start()
        started.append(backend)
        return backend

    try:
        yield start
    finally:
        for backend in started:
            await backend.close()
