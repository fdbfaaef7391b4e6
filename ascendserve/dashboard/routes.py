"""The dashboard's HTTP routes (Litestar), read-only, on the proxy and on the metaserver.

    GET  /dashboard                 the page (open on loopback; elsewhere a session, see access.py)
    GET  /dashboard/events          server-sent events: history, events, a snapshot a second, events as they happen
    GET  /dashboard/snapshot        the current snapshot as JSON (the one the events carry)
    GET  /dashboard/login           the login form (cluster token; POSTed, never in a URL)
    POST /dashboard/login           form body token=... -> 303 to /dashboard with the session cookie, or 401
    POST /dashboard/logout          ends the session -> 303 to the login form
    GET  /dashboard/static/{name}   the page's script and style (shipped in the package; nothing secret)
Left out of the OpenAPI document (the fuzzers read it; an event stream never ends).
"""

from __future__ import annotations

import asyncio
import html
from importlib import resources
from urllib.parse import parse_qs

import structlog
from litestar import Request, Response, Router, get, post
from litestar.response import Stream

from ascendserve.dashboard.access import ALLOWED, LOGIN, OPEN, REFUSED_MESSAGE, Access
from ascendserve.dashboard.hub import Hub
from ascendserve.protocol.openai import APIError

log = structlog.get_logger("ascendserve.dashboard")
STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "x-frame-options": "DENY",
    "cache-control": "no-store",
}
FAILED_LOGIN_DELAY_S = 0.5  # a wrong token is answered this much later (slows guessing per connection)


def assets() -> dict[str, bytes]:
    """Every file of static/, read once (the package ships them; so does the tarball)."""
    folder = resources.files("ascendserve.dashboard") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}


def _page(body: bytes, status: int = 200, headers: dict | None = None) -> Response:
    return Response(body, status_code=status, media_type="text/html; charset=utf-8",
                    headers={**PAGE_HEADERS, **(headers or {})})


def _redirect(to: str, headers: dict | None = None) -> Response:
    return Response(b"", status_code=303, headers={"location": to, "cache-control": "no-store", **(headers or {})})


def dashboard_router(hub: Hub, access: Access) -> Router:
    files = assets()

    def allowed(request: Request, page: bool = False) -> Response | None:
        """None when `request` may see the dashboard; else the answer it gets."""
        verdict = access.decide(request)
        if verdict in (OPEN, ALLOWED):
            return None
        if verdict == LOGIN:
            if page:
                return _redirect("/dashboard/login")
            raise APIError(401, "log in at /dashboard/login (cluster token)", type="authentication_error", code="401")
        raise APIError(403, REFUSED_MESSAGE, type="permission_error", code="403")

    def login_page(error: str = "", status: int = 200) -> Response:
        text = files["login.html"].decode()
        if error:
            text = text.replace("<!--error-->", f'<p class="error" id="login-error">{html.escape(error)}</p>')
        return _page(text.encode(), status)

    @get("/dashboard", include_in_schema=False)
    async def page(request: Request) -> Response:
        if (refusal := allowed(request, page=True)) is not None:
            return refusal
        text = files["index.html"]
        if access.decide(request) == ALLOWED:  # a session: offer to end it
            text = text.replace(b"<!--logout-->", b'<form method="post" action="/dashboard/logout">'
                                                  b'<button id="logout" type="submit">Log out</button></form>')
        return _page(text)

    @get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> Stream:
        allowed(request)
        return Stream(hub.stream(), media_type="text/event-stream",
                      headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    @get("/dashboard/snapshot", include_in_schema=False)
    async def snapshot(request: Request) -> Response:
        allowed(request)
        return Response(hub.snapshot_json(), media_type="application/json", headers={"cache-control": "no-store"})

    @get("/dashboard/login", include_in_schema=False)
    async def login_form(request: Request) -> Response:
        if access.decide(request) in (OPEN, ALLOWED) or not access.login_enabled:
            return _redirect("/dashboard")
        return login_page()

    @post("/dashboard/login", include_in_schema=False, status_code=303)
    async def login(request: Request) -> Response:
        raw = await request.body()
        if not access.login_enabled:
            return _redirect("/dashboard")
        form = parse_qs(raw.decode(errors="replace"), max_num_fields=8)
        presented = (form.get("token") or [""])[0].strip()
        session_id = access.login(presented)
        client = request.client.host if request.client else ""
        if session_id is None:
            log.warning("dashboard login failed", client=client, presented=bool(presented))
            await asyncio.sleep(FAILED_LOGIN_DELAY_S)
            return login_page("That is not the cluster token.", 401)
        log.info("dashboard login", client=client)
        return _redirect("/dashboard", {"set-cookie": access.set_cookie(session_id)})

    @post("/dashboard/logout", include_in_schema=False, status_code=303)
    async def logout(request: Request) -> Response:
        await request.body()
        access.logout(request.cookies.get(access.cookie, ""))
        return _redirect("/dashboard/login" if access.login_enabled else "/dashboard",
                         {"set-cookie": access.clear_cookie()})

    @get("/dashboard/static/{name:str}", include_in_schema=False)
    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        suffix = name[name.rfind("."):] if "." in name else ""
        if name not in files or suffix not in STATIC_TYPES:
            raise APIError(404, f"no dashboard file {name!r}", type="not_found_error", code="404")
        return Response(files[name], media_type=STATIC_TYPES[suffix],
                        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff"})

    return Router(path="/", route_handlers=[page, events, snapshot, login_form, login, logout, static])
