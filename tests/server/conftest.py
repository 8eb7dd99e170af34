"""Clients of the module's `live` server (each server test module starts its own, with its own options)."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import openai_client


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai_client(live.base_url)


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.base_url, timeout=120) as session:
        yield session
