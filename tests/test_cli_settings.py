"""Settings and rule selections at the command line and at import (issue 53 items 6 and 9): every
K3FUSE_* value checked where the process starts, misspelled names reported with the closest setting,
`--help` answering whatever the environment holds, a rule selection that has one reading only, and
the demo naming the kill switch."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from cli_helpers import k3fuse, one_line_error

from k3fuse import settings

pytestmark = pytest.mark.slow


def _import_k3fuse(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("K3FUSE_")}
    return subprocess.run([sys.executable, "-c", "import k3fuse"], capture_output=True, text=True, timeout=300,
                          env={**clean, **env})


@pytest.mark.parametrize("env,says", [
    ({"K3FUSE_STRICT": "maybe"}, "K3FUSE_STRICT='maybe': expected 1/0"),
    ({"K3FUSE_RULES": "nosuch"}, "K3FUSE_RULES names unknown rule(s) ['nosuch']"),
    ({"K3FUSE_RULES": "-decode_gem"}, "['decode_gem'] (did you mean decode_gem -> decode_gemm?)"),
    ({"K3FUSE_RULES": "decode_gemm,-fused_routing"}, "mixes bare names ['decode_gemm'] with ['-fused_routing']"),
    ({"K3FUSE_RULES": ",,,"}, "K3FUSE_RULES=',,,' names no rule"),
])
def test_readme_claim_every_setting_is_checked_at_import(env, says):
    """README: "Settings (K3FUSE_*) are all parsed when the process first imports k3fuse"."""
    res = _import_k3fuse(env)
    assert res.returncode == 1, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("k3fuse.settings.SettingsError: ") and says in last, last


def test_a_misspelled_setting_is_named_with_the_closest_one():
    res = _import_k3fuse({"K3FUSE_STRCT": "1", "K3FUSE_TEST_AR_TOKENS": "1,2"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "UnknownSettingWarning: ignoring K3FUSE_STRCT (did you mean K3FUSE_STRICT?)" in res.stderr
    assert "K3FUSE_TEST_AR_TOKENS" not in res.stderr  # the tests' own knobs are not settings
    res = k3fuse("log", "missing.jsonl", env={"K3FUSE_DISABLE_CUTEDSL": "1"})
    lines = res.stderr.strip().splitlines()
    assert lines[0] == ("k3fuse: warning: ignoring K3FUSE_DISABLE_CUTEDSL (did you mean K3FUSE_DISABLE_CUTE?): "
                        "not a k3fuse setting; the settings are listed in the README and k3fuse.settings.VARIABLES")
    assert len(lines) == 2 and "missing.jsonl does not exist" in lines[1]


def test_unknown_names_api():
    env = {"K3FUSE_STRCT": "1", "K3FUSE_NOTHING_LIKE_IT": "x", "K3FUSE_TEST_X": "1", "K3FUSE_STRICT": "1"}
    assert settings.unknown_names(env) == [("K3FUSE_NOTHING_LIKE_IT", None), ("K3FUSE_STRCT", "K3FUSE_STRICT")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings.check_environment(env)
    assert [type(w.message) for w in caught] == [settings.UnknownSettingWarning]


@pytest.mark.parametrize("argv", [["--help"], ["apply", "--help"], ["log", "--help"], ["demo", "--help"]])
def test_help_answers_whatever_the_environment_holds(argv):
    res = k3fuse(*argv, env={"K3FUSE_STRICT": "maybe", "K3FUSE_RULES": ",,,"})
    assert res.returncode == 0 and "usage: k3fuse" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("spec,says", [
    ("-decode_gemm,+weight_prefetch,fused_routing", "mixes bare names ['fused_routing'] with ['-decode_gemm', "
                                                    "'+weight_prefetch']"),
    ("", "--rules '' names no rule"),
    (",,,", "--rules ',,,' names no rule"),
    ("decode_gemm,,fused_routing", "has an empty item"),
    ("+", "has a bare '+' without a rule name"),
])
def test_a_rule_selection_has_one_reading(tmp_path, spec, says):
    (tmp_path / "in.pt2").write_bytes(b"")
    res = k3fuse("apply", "in.pt2", "-o", "out.pt2", "--rules", spec, cwd=tmp_path)
    one_line_error(res, says)


def test_the_forms_that_combine_still_run():
    from k3fuse.tools.flags import rule_selection

    chosen = rule_selection("-decode_gemm,+weight_prefetch")
    assert "decode_gemm" not in chosen and "weight_prefetch" in chosen and "fused_routing" in chosen
    assert rule_selection("decode_gemm,fused_routing") == ["fused_routing", "decode_gemm"]


def test_demo_names_the_kill_switch():
    res = k3fuse("demo", "--preset", "tiny", env={"K3FUSE_DISABLE": "1"}, timeout=120)
    one_line_error(res, "K3FUSE_DISABLE is set: the kill switch turns every rewrite off",
                   "unset K3FUSE_DISABLE to run the demo")
    assert res.stdout == ""
