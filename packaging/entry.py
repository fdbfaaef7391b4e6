"""The frozen program's entry point (the script PyInstaller builds `bin/ascendserve` from).

A frozen program has no separate Python interpreter: `sys.executable` is
`bin/ascendserve` itself, and whatever re-runs `sys.executable` reaches this
file with a Python command line instead of ours:
- multiprocessing (spawn): vLLM starts its engine core and CPU workers this
  way; `freeze_support()` turns those runs into the child (and runs the
  resource tracker), so it must come before anything else;
- `-m MODULE`: vLLM inspects a model's architecture in a subprocess
  (`sys.executable -m vllm.model_executor.models.registry`);
- `-c CODE`: for anything else that runs a snippet the same way (torch's
  inductor probes the CPU's vector ISA with `sys.executable -c`);
- `SCRIPT.py ...`: inductor's compile-worker pool runs
  `sys.executable .../torch/_inductor/compile_worker/__main__.py --workers=N ...`.
Everything else is ascendserve's own command line (none of its commands is a
`.py` path).
"""

import multiprocessing
import os
import re
import runpy
import sys

# Interpreter switches a Python command line may carry before -m/-c (-B, -s, -I, -u, -O, ...)
# and the two that take a value; the frozen interpreter has them fixed at build time.
_SWITCHES = re.compile(r"^-[bBdEiIOqsSuvx]+$")
_WITH_VALUE = ("-W", "-X")


def _python_command(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """('-m' | '-c' | 'script', target, rest) when argv is a Python command line, else None."""
    i = 0
    while i < len(argv) and (_SWITCHES.match(argv[i]) or argv[i] in _WITH_VALUE):
        i += 2 if argv[i] in _WITH_VALUE else 1
    if i + 1 < len(argv) and argv[i] in ("-m", "-c"):
        return argv[i], argv[i + 1], argv[i + 2:]
    if i < len(argv) and argv[i].endswith(".py") and os.path.isfile(argv[i]):
        return "script", argv[i], argv[i + 1:]
    return None


def main() -> None:
    multiprocessing.freeze_support()
    command = _python_command(sys.argv[1:])
    if command is None:
        from ascendserve.cli import main as cli_main

        cli_main()  # exits
        return
    kind, target, rest = command
    if kind == "-m":
        sys.argv = [target, *rest]  # runpy replaces argv[0] with the module's path
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "script":
        sys.argv = [target, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python SCRIPT` does
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main()
