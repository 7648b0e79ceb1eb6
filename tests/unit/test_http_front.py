"""The HTTP front's gatekeeping (peer uid, bearer token, loopback rule) without a model."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import aiohttp
import pytest

from prefixd.daemon.front.http_front import start_http_front
from prefixd.daemon.front.peer_auth import PeerPolicy


def fake_handlers():
    # /v1/models reads only these two; no engine, no model.
    return SimpleNamespace(engine=SimpleNamespace(model_names=("tiny",), default_model="tiny"), started_at=time.time())


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


async def test_own_uid_and_token(tmp_path):
    path = tmp_path / "http.sock"
    front = await start_http_front(fake_handlers(), unix_path=path, token="t0ken")
    try:
        assert path.stat().st_mode & 0o777 == 0o600
        assert (await get_models(path))[0] == 401
        assert (await get_models(path, {"Authorization": "Bearer wrong"}))[0] == 401
        status, body = await get_models(path, {"Authorization": "Bearer t0ken"})
    finally:
        await front.cleanup()
    assert status == 200 and body["data"][0]["id"] == "tiny"


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
