"""A Snapshot as a terminal table: a headline (ready or what is missing), the proxy's totals, and a
row per instance in E -> P -> D -> PD order. Colour (ANSI) only where `use_colour` says so."""

from __future__ import annotations

import time

from ascendserve.status.snapshot import Row, Snapshot

ERROR_WIDTH = 60
RESET = "\033[0m"
GREEN, YELLOW, RED, DIM, BOLD = "\033[32m", "\033[33m", "\033[31m", "\033[2m", "\033[1m"
STATE_COLOURS = {"active": GREEN, "registered": GREEN, "probing": YELLOW, "suspect": YELLOW,
                 "draining": YELLOW, "ejected": RED}

# (header, cell) per source; a cell gives (text, colour or "")
PROXY_COLUMNS = ("ROLE", "URL", "ID", "STATE", "IN FLIGHT", "OTHERS", "KV USE", "KV FOR D", "SERVED", "FAILS",
                 "LAST ERROR")
REGISTRY_COLUMNS = ("ROLE", "URL", "ID", "STATE", "MODEL", "RUNNING", "WAITING", "KV USE", "AGE")


def use_colour(stream, env: dict[str, str]) -> bool:
    """Colour on a terminal only: never when piped, with NO_COLOR set (no-color.org: any non-empty
    value), or on TERM=dumb."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not env.get("NO_COLOR") and env.get("TERM") != "dumb"


def render(snap: Snapshot, colour: bool = False) -> str:
    paint = (lambda text, code: f"{code}{text}{RESET}" if code else text) if colour else (lambda text, code: text)
    lines = [_headline(snap, paint)]
    if snap.error:
        return lines[0]
    if summary := _summary(snap):
        lines.append(summary)
    rows = snap.sorted_rows()
    if not rows:
        lines.append("(no instances)")
        return "\n".join(lines)
    columns = PROXY_COLUMNS if snap.source == "proxy" else REGISTRY_COLUMNS
    cells = [[_cell(col, row) for col in columns] for row in rows]
    widths = [max(len(col), *(len(c[i][0]) for c in cells)) for i, col in enumerate(columns)]
    last = len(columns) - 1
    lines.append("  ".join(paint(col.ljust(w) if i < last else col, BOLD) for i, (col, w) in enumerate(zip(columns, widths))))
    for row_cells in cells:
        lines.append("  ".join(paint(text.ljust(w) if i < last else text, code)
                               for i, ((text, code), w) in enumerate(zip(row_cells, widths))).rstrip())
    return "\n".join(lines)


def _headline(snap: Snapshot, paint) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(snap.time))
    head = f"{snap.source} {snap.where}  {at}  "
    if snap.error:
        return head + paint("UNREACHABLE", RED) + f": {snap.error}"
    if snap.ready:
        return head + paint("READY", GREEN)
    return head + paint("NOT READY", RED) + ": " + "; ".join(snap.missing)


def _summary(snap: Snapshot) -> str:
    rows = snap.rows
    healthy = sum(r.healthy for r in rows)
    parts = [f"{len(rows)} instance(s), {healthy} healthy"]
    if snap.source == "proxy":
        parts.append(f"in flight {sum(r.in_flight or 0 for r in rows)}")
        t = snap.totals
        if t:
            parts.append(f"requests {t['requests']} ({t['failed']} failed)")
            parts += [f"{name.replace('_', ' ')} {t[name]}"
                      for name in ("retries", "migrations", "encoder_fallbacks", "client_disconnects")]
    if snap.push_pending is not None:
        parts.append(f"push pending {snap.push_pending}")
    return ", ".join(parts)


def _cell(column: str, row: Row) -> tuple[str, str]:
    if column == "ROLE":
        return row.role, ""
    if column == "URL":
        return row.url, ""
    if column == "ID":
        return row.instance_id or "-", ""
    if column == "STATE":
        return row.state or "-", STATE_COLOURS.get(row.state, "")
    if column == "KV USE":
        if row.kv_usage is None:
            return "-", ""
        return f"{row.kv_usage:.0%}", RED if row.kv_usage >= 0.9 else YELLOW if row.kv_usage >= 0.7 else ""
    if column == "FAILS":
        return _count(row.failures), RED if row.failures else ""
    if column == "LAST ERROR":  # the row names the instance: its URL in the error is room lost for the reason
        text = truncate(row.last_error.replace(row.url, "") if row.url else row.last_error)
        return text or "-", RED if text else ""
    if column == "MODEL":
        return row.model or "-", ""
    if column == "AGE":
        return age(row.age_s), ""
    value = {"IN FLIGHT": row.in_flight, "OTHERS": row.others, "KV FOR D": row.kv_held, "SERVED": row.served,
             "RUNNING": row.running, "WAITING": row.waiting}[column]
    return _count(value), ""


def _count(value) -> str:
    return "-" if value is None else str(value)


def truncate(text: str, width: int = ERROR_WIDTH) -> str:
    text = " ".join(text.split())  # one line: errors may carry newlines
    return text if len(text) <= width else text[:width - 3] + "..."


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"
