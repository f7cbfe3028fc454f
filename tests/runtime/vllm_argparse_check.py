"""Parse vLLM server argv lists with the installed vLLM's own parser (run as a subprocess).

stdin: a JSON list of argv lists (the server arguments only). stdout: one JSON object per argv, in order:
``{"ok": true, "args": {...namespace...}}`` or ``{"ok": false, "error": "..."}``. vLLM's import is slow and
noisy, so the test module starts this once for all its cases.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__"):
        return {k: _plain(v) for k, v in vars(value).items() if not k.startswith("_")}
    return str(value)


def main() -> int:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argvs = json.load(sys.stdin)
    out = []
    for argv in argvs:
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-server"))
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parser.parse_args(argv)
            validate_parsed_serve_args(ns)
            AsyncEngineArgs.from_cli_args(ns)
            if ns.tool_call_parser:  # what the server looks up at start-up (KeyError when unknown)
                ToolParserManager.get_tool_parser(ns.tool_call_parser)
        except SystemExit:
            lines = [ln for ln in err.getvalue().splitlines() if "error" in ln]
            out.append({"ok": False, "error": lines[-1] if lines else err.getvalue()[-500:]})
            continue
        except Exception as exc:
            out.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        out.append({"ok": True, "args": {k: _plain(v) for k, v in vars(ns).items()}})
    import vllm

    sys.stdout.write(json.dumps({"version": vllm.__version__, "results": out}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
