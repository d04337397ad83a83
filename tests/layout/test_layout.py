"""The project's layout rules, checked on its source: no import circles between its modules, and
the libraries of the simulator and the load generator name the fields of their set-ups in errors,
never the CLI's flags (only `penelope.commands` maps one to the other)."""
import ast
import re

import import_graph
import pytest

from penelope.commands.fields import as_flags

FLAG = re.compile(r"(?<![\w`-])--[a-z{]")


def test_no_module_imports_itself_back():
    assert import_graph.cycles(import_graph.graph()) == []


def test_the_cycle_finder_finds_a_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.cycles(edges) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def _raised_texts(path):
    """The source of every raised expression (f-strings whole, so `f"--{name}"` shows)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            yield node.lineno, ast.unparse(node.exc)


# The libraries of the simulator and of the load generator (`penelope load`, `ab`, `calibrate`).
LIBRARY = sorted([*(import_graph.ROOT / "penelope" / "sim").rglob("*.py"),
                  *(import_graph.ROOT / "penelope" / "loadgen").glob("*.py")])


@pytest.mark.parametrize("path", LIBRARY, ids=lambda path: str(path.relative_to(import_graph.ROOT)))
def test_library_errors_name_fields_not_flags(path):
    found = [f"{line}: {text}" for line, text in _raised_texts(path) if FLAG.search(text)]
    assert found == []


def test_a_field_is_shown_as_the_flag_of_its_command():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("path", nargs="?")
    parser.add_argument("--gpu-cache")
    flags = {"gpu_cache": "--gpu-cache", "path": "PATH"}
    assert as_flags("`gpu_cache` 1 is below `block` and `path`", flags) == "--gpu-cache 1 is below `block` and PATH"
    from penelope.commands.fields import field_flags

    assert field_flags(parser) == flags
    assert field_flags(parser, trace="path")["trace"] == "PATH"
