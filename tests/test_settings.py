"""Every K3FUSE_* variable is parsed in k3fuse/settings.py and nowhere else, and the README's
Settings table lists exactly those variables (issue 12, item 6)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from k3fuse import settings

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("k3fuse", "patterns", "kernels") for p in (ROOT / d).rglob("*.py")]


def test_no_module_but_settings_reads_a_k3fuse_variable():
    reads = re.compile(r"""(environ(\.get)?[\[(]|getenv\()\s*["']K3FUSE_""")
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES
                 if p.name != "settings.py" and reads.search(p.read_text())]
    assert offenders == []


def test_every_variable_named_in_the_code_is_a_setting():
    named = {m for p in SOURCES for m in re.findall(r"\bK3FUSE_[A-Z0-9_]+\b", p.read_text())}
    known = {v.env for v in settings.VARIABLES} | {settings.NOT_SETTINGS_PREFIX}  # the tests' own prefix
    assert named <= known, sorted(named - known)


def test_the_readme_table_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(K3FUSE_[A-Z0-9_]+)` \|", table, flags=re.M))
    assert listed == {v.env for v in settings.VARIABLES}


def test_parsing_and_defaults():
    s = settings.parse({})
    assert (s.strict, s.disable, s.ar_protocol, s.spin_timeout_s, s.gemv_max_m) == (False, False, "lamport", 5.0, None)
    s = settings.parse({"K3FUSE_STRICT": "yes", "K3FUSE_AR_PROTOCOL": " Flags ", "K3FUSE_AR_TIMEOUT_MS": "250",
                        "K3FUSE_GEMV_MAX_M": "4", "K3FUSE_LOG": "/tmp/x.jsonl"})
    assert (s.strict, s.ar_protocol, s.spin_timeout_s, s.gemv_max_m, s.log_path) == (True, "flags", 0.25, 4,
                                                                                    "/tmp/x.jsonl")


@pytest.mark.parametrize("env, match", [({"K3FUSE_STRICT": "maybe"}, "K3FUSE_STRICT='maybe': expected 1/0"),
                                        ({"K3FUSE_AR_PROTOCOL": "nccl"}, "expected 'lamport' or 'flags'"),
                                        ({"K3FUSE_GEMV_MAX_M": "0"}, "K3FUSE_GEMV_MAX_M='0': expected a positive"),
                                        ({"K3FUSE_AR_TIMEOUT_S": "-1"}, "K3FUSE_AR_TIMEOUT_S=.-1.: .* from 0.001 to 3600 s")])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(settings.SettingsError, match=match):
        settings.parse(env)


def test_current_follows_the_environment(monkeypatch):
    monkeypatch.delenv("K3FUSE_STRICT", raising=False)
    assert settings.current().strict is False
    monkeypatch.setenv("K3FUSE_STRICT", "1")
    assert settings.current().strict is True
    from k3fuse import runtime

    assert runtime.is_strict()
