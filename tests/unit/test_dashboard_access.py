"""Who sees the dashboard (dashboard/access.py, dashboard/routes.py), through the real proxy and
metaserver apps: loopback open; elsewhere a login with the cluster token that sets an HttpOnly,
SameSite=Strict session cookie (never a token in a URL); wrong token 401; logout ends the
session; no token and no allow_unauthenticated: 403. The client address is set per test
(httpx's ASGI transport), so "elsewhere" needs no network."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ascendserve.config import load
from ascendserve.dashboard import routes
from ascendserve.dashboard.access import Access, is_loopback_client

TOKEN = "dashboard-test-token-0123456789"
ELSEWHERE = ("10.1.2.3", 40000)


@pytest.fixture(autouse=True)
def _no_login_delay(monkeypatch):
    monkeypatch.setattr(routes, "FAILED_LOGIN_DELAY_S", 0.0)


def _app(role: str = "proxy", **flags):
    if role == "proxy":
        from ascendserve.router.app import create_app
    else:
        from ascendserve.metaserver.app import create_app
    return create_app(load(role, None, flags, env={}))


def _call(app, client, *requests):
    """Send (method, path, kwargs) in order with one cookie jar; return the responses."""
    async def run():
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://dash.test") as http:
            # an event stream that opens by mistake never ends: a failure, not a hang
            return [await asyncio.wait_for(http.request(method, path, **kw), 20) for method, path, kw in requests]

    return asyncio.run(run())


def test_loopback_addresses():
    assert all(is_loopback_client(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"))
    assert not any(is_loopback_client(h) for h in ("10.1.2.3", "::ffff:10.0.0.1", "testclient", "", "0.0.0.0"))


@pytest.mark.parametrize("role", ["proxy", "metaserver"])
def test_loopback_is_open_even_with_a_token(role):
    app = _app(role, cluster__token=TOKEN)
    page, snap, js = _call(app, ("127.0.0.1", 5000), ("GET", "/dashboard", {}), ("GET", "/dashboard/snapshot", {}),
                           ("GET", "/dashboard/static/dashboard.js", {}))
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]  # no inline or foreign script
    assert 'id="logout"' not in page.text  # nothing to log out of
    assert snap.status_code == 200 and snap.json()["kind"] == role
    assert js.status_code == 200 and "EventSource" in js.text


@pytest.mark.parametrize("role", ["proxy", "metaserver"])
def test_elsewhere_needs_a_login_and_the_cookie_is_httponly_and_strict(role):
    app = _app(role, cluster__token=TOKEN)
    page, events, form, wrong, good, after, snap = _call(
        app, ELSEWHERE,
        ("GET", "/dashboard", {}), ("GET", "/dashboard/events", {}), ("GET", "/dashboard/login", {}),
        ("POST", "/dashboard/login", {"data": {"token": "not-the-token"}}),
        ("POST", "/dashboard/login", {"data": {"token": TOKEN}}),
        ("GET", "/dashboard", {}), ("GET", "/dashboard/snapshot", {}))
    assert page.status_code == 303 and page.headers["location"] == "/dashboard/login"
    assert events.status_code == 401 and events.json()["error"]["type"] == "authentication_error"
    assert form.status_code == 200 and 'method="post"' in form.text and 'name="token"' in form.text
    assert wrong.status_code == 401 and "not the cluster token" in wrong.text and "set-cookie" not in wrong.headers
    assert good.status_code == 303 and good.headers["location"] == "/dashboard"  # no token in the URL
    cookie = good.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/dashboard" in cookie
    assert TOKEN not in cookie and TOKEN not in good.text
    assert after.status_code == 200 and 'id="logout"' in after.text
    assert snap.status_code == 200 and snap.json()["kind"] == role


def test_a_token_in_the_url_does_not_open_it():
    app = _app(cluster__token=TOKEN)
    page, snap, login = _call(app, ELSEWHERE, ("GET", f"/dashboard?token={TOKEN}", {}),
                              ("GET", f"/dashboard/snapshot?token={TOKEN}", {}),
                              ("POST", f"/dashboard/login?token={TOKEN}", {"data": {}}))
    assert page.status_code == 303 and snap.status_code == 401
    assert login.status_code == 401 and "set-cookie" not in login.headers


def test_the_token_as_a_header_opens_it_for_scripts():
    app = _app(cluster__token=TOKEN)
    (snap, wrong) = _call(app, ELSEWHERE, ("GET", "/dashboard/snapshot", {"headers": {"authorization": f"Bearer {TOKEN}"}}),
                          ("GET", "/dashboard/snapshot", {"headers": {"x-cluster-token": TOKEN + "x"}}))
    assert snap.status_code == 200 and wrong.status_code == 401


def test_logout_ends_the_session():
    app = _app(cluster__token=TOKEN)
    login, before, out, after = _call(app, ELSEWHERE, ("POST", "/dashboard/login", {"data": {"token": TOKEN}}),
                                      ("GET", "/dashboard/snapshot", {}), ("POST", "/dashboard/logout", {}),
                                      ("GET", "/dashboard/snapshot", {}))
    assert before.status_code == 200
    assert out.status_code == 303 and out.headers["location"] == "/dashboard/login"
    assert "Max-Age=0" in out.headers["set-cookie"]
    assert after.status_code == 401
    # the old cookie itself no longer works, even when a client keeps sending it
    session = login.headers["set-cookie"].split(";")[0]
    (again,) = _call(app, ELSEWHERE, ("GET", "/dashboard/snapshot", {"headers": {"cookie": session}}))
    assert again.status_code == 401


def test_without_a_token_elsewhere_is_refused_unless_allowed():
    (page, snap) = _call(_app(), ELSEWHERE, ("GET", "/dashboard", {}), ("GET", "/dashboard/snapshot", {}))
    assert page.status_code == 403 and "cluster.token" in page.json()["error"]["message"]
    assert snap.status_code == 403 and snap.json()["error"]["type"] == "permission_error"
    (page,) = _call(_app(cluster__allow_unauthenticated=True), ELSEWHERE, ("GET", "/dashboard", {}))
    assert page.status_code == 200


def test_sessions_expire_and_are_bounded():
    now = [0.0]
    access = Access(TOKEN, False, 8000, ttl_s=60, max_sessions=3, clock=lambda: now[0])
    assert access.login("wrong") is None and access.login("") is None
    first = access.login(TOKEN)
    assert access.valid(first) and not access.valid(first + "x") and not access.valid("")
    for _ in range(3):
        access.login(TOKEN)
    assert not access.valid(first)  # the oldest went when the table was full
    latest = access.login(TOKEN)
    now[0] = 61.0
    assert not access.valid(latest)
    assert Access("", False, 8000).login("") is None  # no token: nothing to log in with


def test_static_files_are_only_the_shipped_ones():
    app = _app()
    css, missing, escape = _call(app, ("127.0.0.1", 1), ("GET", "/dashboard/static/dashboard.css", {}),
                                 ("GET", "/dashboard/static/nope.js", {}),
                                 ("GET", "/dashboard/static/..%2Frouter%2Fapp.py", {}))
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert missing.status_code == 404 and escape.status_code == 404
    assert set(routes.assets()) >= {"index.html", "login.html", "dashboard.js", "dashboard.css"}
