"""What every doctor check returns, and how checks run the host's tools.

A check never raises for the host's state: what it finds, including that it could not
look (a tool missing, no devices), is a Check. Checks that run commands take a Runner,
so tests can feed them canned outputs; the real one puts a deadline on every command.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"  # only FAIL blocks (exit 1)

NOT_FOUND, TIMED_OUT = 127, 124  # Output.code of a command that did not start / did not finish


@dataclass
class Check:
    name: str
    status: str
    detail: str


@dataclass(frozen=True)
class Output:
    code: int  # the exit status, or NOT_FOUND / TIMED_OUT
    text: str  # stdout, then stderr

    def last_line(self) -> str:
        lines = [line.strip() for line in self.text.strip().splitlines() if line.strip()]
        return lines[-1][:200] if lines else f"exit {self.code}, no output"


Runner = Callable[[Sequence[str], float], Output]
Which = Callable[..., "str | None"]  # shutil.which's signature: (cmd, mode=..., path=None)


def run_tool(argv: Sequence[str], timeout_s: float) -> Output:
    """Run a host tool with a deadline. Never raises."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return Output(NOT_FOUND, f"{argv[0]}: not found")
    except subprocess.TimeoutExpired:
        return Output(TIMED_OUT, f"{argv[0]}: no answer in {timeout_s:g} s")
    except OSError as exc:
        return Output(126, f"{argv[0]}: {exc.strerror or exc}")
    return Output(done.returncode, done.stdout + done.stderr)


def find_tool(name: str, which: Which = shutil.which, also: Sequence[str] = ()) -> str | None:
    """`name` on PATH, else in one of `also` (vendor directories that are often off PATH)."""
    return which(name) or (which(name, path=":".join(also)) if also else None)
