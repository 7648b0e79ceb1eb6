"""The HTTP front's gatekeeping (peer uid, bearer token, loopback rule) without a model."""

from __future__ import annotations

import os
import time
from collections import Counter
from types import SimpleNamespace

import aiohttp
import pytest

from prefixd.daemon.front.http_front import start_http_front
from prefixd.daemon.front.peer_auth import PeerPolicy

openai = pytest.importorskip("openai")


TINY = {"name": "tiny", "loaded": True, "resident_bytes": 1, "weight_bytes": 1, "loaded_at": 0.0, "expires_at": None,
        "keep_alive": "forever", "active_jobs": 0}


def fake_handlers():
    # /v1/models reads only these: the names and the engine's describe_models, answered at once; no model.
    # (observers: where /metrics subscribes)
    async def call(fn):
        return fn()

    engine = SimpleNamespace(model_names=("tiny",), default_model="tiny", call=call,
                             controls=SimpleNamespace(describe_models=lambda: [TINY]))
    return SimpleNamespace(engine=engine, started_at=time.time(), observers=[], prompts_normalized=Counter())


async def get_models(path, headers=None):
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path))) as session:
        async with session.get("http://prefixd/v1/models", headers=headers) as response:
            return response.status, await response.json()


async def test_unix_socket_peers_of_another_uid_get_403(tmp_path):
    path = tmp_path / "http.sock"
    front = await start_http_front(fake_handlers(), unix_path=path, peer_policy=PeerPolicy(own_uid=os.getuid() + 1))
    try:
        status, body = await get_models(path)
    finally:
        await front.cleanup()
    assert status == 403 and body["error"]["type"] == "permission_error" and "--allow-uid" in body["error"]["message"]
    assert not path.exists()  # cleanup removes the socket file


async def test_the_unix_socket_needs_no_token_its_peer_check_is_the_guard(tmp_path):
    path = tmp_path / "http.sock"
    front = await start_http_front(fake_handlers(), unix_path=path, token="t0ken")
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        status, body = await get_models(path)
        assert (await get_models(path, {"Authorization": "Bearer wrong"}))[0] == 200  # not looked at here
    finally:
        await front.cleanup()
    assert status == 200 and body["data"][0]["id"] == "tiny"


async def test_tcp_needs_the_token_and_openai_sends_it_as_the_api_key():
    front = await start_http_front(fake_handlers(), host="127.0.0.1", port=0, token="t0ken")
    try:
        host, port = front.addresses[0][:2]
        base_url = f"http://{host}:{port}/v1"
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "t0ken"}):
                async with session.get(f"{base_url}/models", headers=headers) as response:
                    status, body = response.status, await response.json()
                assert status == 401, headers
                assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
                assert "API key" in body["error"]["message"]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="t0ken", max_retries=0) as client:
            assert [model.id async for model in client.models.list()] == ["tiny"]
        async with openai.AsyncOpenAI(base_url=base_url, api_key="guess", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
    finally:
        await front.cleanup()


async def test_non_loopback_needs_a_token():
    with pytest.raises(ValueError, match="bearer token"):
        await start_http_front(fake_handlers(), host="0.0.0.0", port=0)
    front = await start_http_front(fake_handlers(), host="127.0.0.1", port=0)
    try:
        host, port = front.addresses[0][:2]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{host}:{port}/v1/models") as response:
                assert response.status == 200
    finally:
        await front.cleanup()
