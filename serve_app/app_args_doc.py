"""docs/app-args.md, written from the app arguments themselves (serve_app.config.AppArgs).

    .venv/bin/python -m serve_app.app_args_doc        # rewrites docs/app-args.md

Each argument's meaning is written once, as its field's description; this module only lays the
fields out, beside their defaults and the values deploy/serve.yaml sets. A unit test fails when
the file and the fields disagree, so the page cannot drift from what the app accepts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import SecretStr
from pydantic_core import PydanticUndefined

from serve_app.config import LAUNCH_DEFAULTS, AppArgs

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "app-args.md"
SHIPPED_YAML = ROOT / "deploy" / "serve.yaml"

HEADER = """\
# App arguments

Every argument `serve_app.app:build_app` takes: the `args:` of a Serve YAML file, or `key=value`
after `serve run serve_app.app:build_app`. The app checks them all at start and refuses an unknown
one with a message that names it.

The default is what a launch gets where its args leave the argument out, the same for the YAML
file, `serve run serve_app.app:build_app model=...` and `scripts/serve.sh`. The last column is
what `deploy/serve.yaml`, the shipped deployment, sets; a blank there means the default.

This page is written from the fields themselves (`python -m serve_app.app_args_doc`).

| argument | default | what it does | deploy/serve.yaml |
|---|---|---|---|
"""


def literal(value: Any) -> str:
    """A value as YAML would spell it, in code quotes (a secret's value never shown)."""
    if isinstance(value, SecretStr):
        return "`(secret)`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (int, float, str)):
        return f"`{value}`"
    return f"`{json.dumps(value, default=str)}`"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def shipped_args() -> dict[str, Any]:
    config = yaml.safe_load(SHIPPED_YAML.read_text())
    return config["applications"][0]["args"]


def render() -> str:
    shipped = shipped_args()
    rows = []
    for name, field in AppArgs.model_fields.items():
        if name in LAUNCH_DEFAULTS:
            default = literal(LAUNCH_DEFAULTS[name])
        elif field.default is not PydanticUndefined:
            default = literal(field.default)
        elif field.default_factory is not None:
            default = literal(field.default_factory())
        else:
            default = "(required)"
        in_yaml = literal(shipped[name]) if name in shipped else ""
        rows.append(f"| `{name}` | {default} | {cell(field.description or '')} | {in_yaml} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> None:
    DOC.write_text(render())
    print(f"wrote {DOC.relative_to(ROOT)} ({len(AppArgs.model_fields)} arguments)", file=sys.stderr)


if __name__ == "__main__":
    main()
