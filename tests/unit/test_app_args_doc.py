"""docs/app-args.md is the app arguments' own fields, laid out (serve_app/app_args_doc.py)."""

from __future__ import annotations

from serve_app.app_args_doc import DOC, render
from serve_app.config import AppArgs


def test_the_page_lists_every_argument_as_the_fields_describe_it() -> None:
    assert DOC.read_text() == render(), "docs/app-args.md is stale: run `python -m serve_app.app_args_doc`"


def test_every_argument_says_what_it_does() -> None:
    assert [name for name, field in AppArgs.model_fields.items() if not (field.description or "").strip()] == []


def test_the_shipped_yaml_column_shows_what_the_file_sets() -> None:
    rows = {line.split("|")[1].strip(" `"): line for line in render().splitlines() if line.startswith("| `")}
    assert set(rows) == set(AppArgs.model_fields)
    assert rows["num_workers"].rstrip(" |").endswith("`auto`")  # the launch default, which deploy/serve.yaml also sets
    assert rows["served_model_name"].endswith("|  |")  # not set there
