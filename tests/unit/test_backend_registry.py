"""The storage backends' registry: every scheme finds its class, spellings of one place compare
equal, and no code outside ``storage/backends`` picks a backend by testing a URL's scheme."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from storage.backends import registry
from storage.backends.azure import AzureBackend
from storage.backends.base import OtherBackend
from storage.backends.gcs import GcsBackend
from storage.backends.local import LocalBackend
from storage.backends.memory import MemoryBackend
from storage.backends.s3 import S3Backend

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("url", "kind"), [
    ("bucket", LocalBackend), ("/abs/bucket", LocalBackend), ("file:///abs/bucket", LocalBackend),
    ("memory://run", MemoryBackend), ("s3://b/run", S3Backend), ("S3A://b/run", S3Backend), ("gs://b/run", GcsBackend),
    ("gcs://b/run", GcsBackend), ("az://c/run", AzureBackend), ("abfs://c/run", AzureBackend),
    ("abfss://c/run", AzureBackend), ("https://host/run", OtherBackend), ("simplecache::s3://b/run", OtherBackend),
])
def test_each_url_finds_the_backend_of_its_scheme(url, kind):
    assert registry.backend_class(url) is kind


def test_every_scheme_belongs_to_one_backend_and_spellings_of_one_place_compare_equal(tmp_path, monkeypatch):
    seen = [s for b in registry.BACKENDS for s in b.schemes]
    assert len(seen) == len(set(seen)) and set(registry.schemes()) == set(seen)
    monkeypatch.chdir(tmp_path)
    assert registry.canonical_url("bucket/") == registry.canonical_url(f"file://{tmp_path}/bucket") == str(tmp_path / "bucket")
    for spellings in (("s3://b/run", "s3a://b/run/"), ("gs://b/run", "gcs://b/run"),
                      ("az://c/run", "abfs://c/run", "abfss://c/run/")):
        assert len({registry.canonical_url(u) for u in spellings}) == 1, spellings
    assert registry.canonical_url("s3://b/run") != registry.canonical_url("gs://b/run")


def test_only_the_backends_with_an_atomic_create_are_offered_to_publishers():
    publishable = registry.forms(publishable=True)
    assert all(b.form in publishable for b in registry.BACKENDS if b.supports_conditional_create)
    assert not OtherBackend.supports_conditional_create


def _scheme_literals(node: ast.AST, schemes: set[str], bare: bool) -> list[str]:
    """The string constants in ``node`` (a constant, or a tuple/list/set of them) that start a URL
    of a registered scheme (``"s3://"``), or (``bare``) name one (``"memory"``)."""
    values = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    out = []
    for v in values:
        if isinstance(v, ast.Constant) and isinstance(v.value, str):
            s = v.value.lower()
            if (bare and s in schemes) or any(s.startswith(f"{scheme}://") for scheme in schemes):
                out.append(v.value)
    return out


def _about_schemes(nodes) -> bool:
    """Whether an expression reads a URL's scheme (a name or attribute called ...protocol or ...scheme)."""
    names = {n.id for e in nodes for n in ast.walk(e) if isinstance(n, ast.Name)}
    names |= {n.attr for e in nodes for n in ast.walk(e) if isinstance(n, ast.Attribute)}
    return any("protocol" in n.lower() or "scheme" in n.lower() for n in names)


def test_nothing_outside_the_backends_tests_a_url_scheme():
    """A comparison of a scheme (``root.protocol == "memory"``, ``protocol in ("s3", "s3a")``) or a
    ``url.startswith("memory://")`` outside ``storage/backends`` is a backend picked by string: ask
    the backend (its capabilities) or the registry instead."""
    schemes = set(registry.schemes())
    bad = []
    for pkg in ("dcr_core", "storage", "flows"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path.is_relative_to(REPO / "storage" / "backends"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                found = []
                if isinstance(node, ast.Compare):
                    operands = [node.left, *node.comparators]
                    for i, operand in enumerate(operands):
                        found += _scheme_literals(operand, schemes, _about_schemes(operands[:i] + operands[i + 1:]))
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in ("startswith", "endswith", "removeprefix"):
                    for arg in node.args:
                        found += _scheme_literals(arg, schemes, False)
                bad += [f"{path.relative_to(REPO)}:{node.lineno}: {lit!r}" for lit in found]
    assert not bad, "\n".join(bad)


def test_the_scheme_check_finds_what_it_is_for():
    """The check above is not vacuous: the forms it exists to catch are caught."""
    schemes = set(registry.schemes())
    for src in ('root.protocol == "memory"', 'protocol in ("s3", "s3a")', 'get_protocol(u) != "gs"'):
        cmp = ast.parse(src, mode="eval").body
        operands = [cmp.left, *cmp.comparators]
        assert any(_scheme_literals(o, schemes, _about_schemes(operands[:i] + operands[i + 1:]))
                   for i, o in enumerate(operands)), src
    call = ast.parse('url.startswith("memory://")', mode="eval").body
    assert _scheme_literals(call.args[0], schemes, False)
    assert not _scheme_literals(ast.parse('kind == "file"', mode="eval").body.comparators[0], schemes,
                                _about_schemes([ast.parse("kind", mode="eval").body]))
