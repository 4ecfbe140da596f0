"""Generate the blocking client's API from the async one: ``python -m tools.unasync_client``.

The client's API (namespaces, admin calls, blocks) is written once, in
``kvtierd/client/_async/client.py``; ``kvtierd/client/_sync/client.py`` is made from it by
`unasync <https://github.com/python-trio/unasync>`_ (``async`` and ``await`` dropped, the async
names below renamed), then put through ``ruff`` (imports sorted again; a line that lost its
``await`` may fit on fewer lines). ``--check`` writes nothing and fails when the checked-in
file differs from what would be generated: CI runs it (``tools/test.sh``), and so does
``tools/tests``.
"""

from __future__ import annotations

import argparse
import difflib
import io
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

import unasync  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "kvtierd" / "client" / "_async" / "client.py"
TARGET = ROOT / "kvtierd" / "client" / "_sync" / "client.py"
#: Where ruff takes the generated text to lie (its settings are the project's there).
FORMAT_AS = TARGET

#: Names unasync's defaults leave alone or would name ``Sync...``.
REPLACEMENTS = {
    "_async": "_sync",
    "AsyncClient": "Client",
    "AsyncNamespace": "Namespace",
    "connect_async": "connect",
    "retrying_async": "retrying",
}
HEADER = (
    "# Generated from kvtierd/client/_async/client.py by `python -m tools.unasync_client`:\n"
    "# do not edit by hand (CI fails when it is not what the tool makes).\n"
)


def generate() -> str:
    """The text ``TARGET`` must have."""
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "_async" / "client.py"
        source.parent.mkdir()
        source.write_text(SOURCE.read_text())
        rule = unasync.Rule("/_async/", "/_sync/", additional_replacements=REPLACEMENTS)
        unasync.unasync_files([str(source)], rules=[rule])
        text = HEADER + (Path(tmp) / "_sync" / "client.py").read_text()
    # the renamed imports sorted again, then the lines that lost an ``await`` joined
    text = _ruff(["check", "--select", "I", "--fix", "--exit-zero", "--quiet"], text)
    text = _ruff(["format"], text)
    left = _async_left(text)
    if left:
        raise SystemExit(
            f"unasync_client: the blocking client would still use {', '.join(left)}: give the "
            "async source's transport a name the sync transport has too"
        )
    return text


#: What must not survive into the blocking face's code (docstrings and comments aside).
ASYNC_ONLY = frozenset({"async", "await", "anyio", "aclose", "trio", "asyncio"})


def _async_left(text: str) -> list[str]:
    """The async-only names in ``text``'s code (not in its strings or comments)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return sorted({t.string for t in tokens if t.type == tokenize.NAME and t.string in ASYNC_ONLY})


def _ruff(command: list[str], text: str) -> str:
    """``text`` through ``ruff`` with the project's settings (as if it were ``FORMAT_AS``)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--stdin-filename", str(FORMAT_AS), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"unasync_client: ruff {command[0]} failed: {done.stderr.strip()}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if the generated file is not current"
    )
    args = parser.parse_args(argv)
    wanted = generate()
    current = TARGET.read_text() if TARGET.exists() else ""
    if args.check:
        # formatted by this machine's ruff too: a ruff that wraps lines otherwise is no failure
        if current == wanted or _ruff(["format"], current) == wanted:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            wanted.splitlines(keepends=True),
            str(TARGET),
            "generated",
        )
        sys.stderr.write("".join(diff))
        sys.stderr.write(
            f"{TARGET} is not what {SOURCE.relative_to(ROOT)} generates: "
            "run `python -m tools.unasync_client`\n"
        )
        return 1
    if current != wanted:
        TARGET.write_text(wanted)
        print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
