"""A CLI and API a person can trust (issue 22): each case runs the way a user meets it, mostly the
real `k3fuse` command in a subprocess, and checks the exit status, the one line it prints and the
files it leaves.

Full disk and read-only filesystem: a small tmpfs mounted for the test where the process may mount
(root in a container); otherwise the error is injected at the one call that writes output bytes
(k3fuse.fileio.write_bytes). Permission denied is always injected there (root ignores file modes).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import digest, k3fuse, one_line_error

pytestmark = pytest.mark.slow


@pytest.fixture()
def work(tmp_path, programs):
    shutil.copy(programs["tp1"], tmp_path / "tp1.pt2")
    return tmp_path


@contextlib.contextmanager
def tmpfs(where: Path, size: str, read_only: bool = False):
    """A tmpfs of `size` at `where`, or None when this process may not mount one."""
    where.mkdir(exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    ok = shutil.which("mount") and subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                                                  capture_output=True).returncode == 0
    try:
        yield where if ok else None
    finally:
        if ok:
            subprocess.run(["umount", str(where)], check=True)


def _fill(directory: Path) -> None:
    """Fill the filesystem of `directory` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 4096)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"x")


# One failing call at the write that reaches the filesystem (the fallback when no tmpfs can be
# mounted, and the way to get EACCES as root): the first write goes through, the next fails.
FAILING_WRITE = """
import errno, os, sys
import k3fuse.fileio, k3fuse.tools.cli
real, calls = k3fuse.fileio.write_bytes, []
def failing(f, data):
    calls.append(1)
    if len(calls) > 1:
        code = getattr(errno, sys.argv[1])
        raise OSError(code, os.strerror(code))
    return real(f, data)
k3fuse.fileio.write_bytes = failing
sys.exit(k3fuse.tools.cli.main(sys.argv[2:]))
"""


def _fail_write(errno_name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", FAILING_WRITE, errno_name, *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


# --- 1. an atomic replace keeps mode, owner and symlink ---------------------------------------------


def test_apply_keeps_the_mode_and_owner_of_the_file_it_replaces(work):
    out = work / "p.pt2"
    out.write_bytes(b"old program")
    os.chmod(out, 0o640)
    chowned = os.getuid() == 0
    if chowned:
        os.chown(out, 1234, 1234)
    res = k3fuse("apply", "tp1.pt2", "-o", "p.pt2", "--log", "rw.jsonl", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    st = out.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640
    if chowned:
        assert (st.st_uid, st.st_gid) == (1234, 1234)
    torch.export.load(out)
    # a new file gets what open() would give it: 0666 less the umask (the test's umask is 022)
    res = k3fuse("apply", "tp1.pt2", "-o", "fresh.pt2", cwd=work)
    assert res.returncode == 0 and stat.S_IMODE((work / "fresh.pt2").stat().st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def test_in_place_keeps_the_mode(work):
    os.chmod(work / "tp1.pt2", 0o604)
    res = k3fuse("apply", "tp1.pt2", "--in-place", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert stat.S_IMODE((work / "tp1.pt2").stat().st_mode) == 0o604


def test_output_through_a_symlink_replaces_its_target_and_keeps_the_link(work):
    (work / "releases").mkdir()
    target = work / "releases" / "v1.pt2"
    target.write_bytes(b"old program")
    os.chmod(target, 0o644)
    (work / "deploy.pt2").symlink_to(target)
    res = k3fuse("apply", "tp1.pt2", "-o", "deploy.pt2", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (work / "deploy.pt2").is_symlink() and os.readlink(work / "deploy.pt2") == str(target)
    torch.export.load(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert not [p for p in (work / "releases").iterdir() if p.name.startswith(".k3fuse-tmp-")]


# --- 2. --rules: the K3FUSE_RULES grammar, unknown names an error ---------------------------------


def _events(path: Path, rule: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["rule"] == rule]


def test_rules_plus_turns_an_off_by_default_rule_on_like_the_variable(work):
    res = k3fuse("apply", "tp1.pt2", "-o", "a.pt2", "--log", "plain.jsonl", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {e["guard"] for e in _events(work / "plain.jsonl", "weight_prefetch")} == {"rule_disabled"}
    res = k3fuse("apply", "tp1.pt2", "-o", "b.pt2", "--rules", "+weight_prefetch", "--log", "plus.jsonl", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    flag = _events(work / "plus.jsonl", "weight_prefetch")
    assert flag and all(e["guard"] != "rule_disabled" for e in flag), flag
    res = k3fuse("apply", "tp1.pt2", "-o", "c.pt2", "--log", "env.jsonl", cwd=work,
                 env={"K3FUSE_RULES": "+weight_prefetch"})
    env = _events(work / "env.jsonl", "weight_prefetch")
    assert [(e["decision"], e["guard"]) for e in env] == [(e["decision"], e["guard"]) for e in flag]


@pytest.mark.parametrize("verb", ["apply tp1.pt2 -o x.pt2", "demo", "bench --device cpu", "validate"])
@pytest.mark.parametrize("spec", ["+nope", "-nope", "decode_gemm,nope"])
def test_an_unknown_rule_in_rules_is_one_line_in_every_verb(work, verb, spec):
    res = k3fuse(*verb.split(), "--rules", spec, cwd=work)
    one_line_error(res, "unknown rule name(s) ['nope']", "known rules: ")
    assert not (work / "x.pt2").exists()


# --- 3. full disk, read-only filesystem, no permission: one line naming the path, old file intact --


def test_full_disk_is_one_line_and_the_old_program_survives(work):
    with tmpfs(work / "small", "64k") as small:
        if small is None:  # no mount here: the same failure, injected at the write
            (work / "out.pt2").write_bytes(b"old program")
            res = _fail_write("ENOSPC", "apply", "tp1.pt2", "-o", "out.pt2", cwd=work)
            out = work / "out.pt2"
        else:
            out = small / "out.pt2"
            out.write_bytes(b"old program")
            _fill(small)
            res = k3fuse("apply", "tp1.pt2", "-o", str(out), cwd=work)
        line = one_line_error(res, f"could not save {out}: No space left on device", f"{out} was left as it was")
        assert "terminate called" not in res.stderr and "Traceback" not in line
        assert out.read_bytes() == b"old program"
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(".k3fuse-tmp-")] == []


def test_log_on_a_full_disk_is_one_line_naming_the_log(work):
    with tmpfs(work / "small", "16k") as small:
        if small is None:
            pytest.skip("the log's append is an os.write of the pipeline: needs a full filesystem to fail")
        _fill(small)
        before = digest(work / "tp1.pt2")
        res = k3fuse("apply", "tp1.pt2", "-o", "out.pt2", "--log", str(small / "rw.jsonl"), cwd=work)
        one_line_error(res, f"{small / 'rw.jsonl'}", "No space left on device")
        assert digest(work / "tp1.pt2") == before and not (work / "out.pt2").exists()


def test_read_only_filesystem_is_one_line_before_any_work(work):
    with tmpfs(work / "ro", "64k", read_only=True) as ro:
        if ro is None:
            pytest.skip("no tmpfs mount here; a read-only filesystem needs one")
        res = k3fuse("apply", "tp1.pt2", "-o", str(ro / "out.pt2"), cwd=work)
        one_line_error(res, f"-o {ro / 'out.pt2'}", "read-only filesystem")
        res = k3fuse("bench", "--device", "cpu", "--json", str(ro / "r.json"), cwd=work)
        one_line_error(res, "--json", "read-only filesystem")


def test_permission_denied_on_write_is_one_line_and_the_old_file_survives(work):
    (work / "out.pt2").write_bytes(b"old program")
    res = _fail_write("EACCES", "apply", "tp1.pt2", "-o", "out.pt2", cwd=work)
    one_line_error(res, "could not save out.pt2: Permission denied", "out.pt2 was left as it was")
    assert (work / "out.pt2").read_bytes() == b"old program"


def test_save_program_names_the_path_it_was_given(tmp_path):
    from k3fuse.fileio import WriteFailed
    from k3fuse.offline import save_program

    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(WriteFailed) as err:
        save_program(ep, "/missing/x.pt2")
    assert str(err.value) == "could not write /missing/x.pt2: No such file or directory; /missing/x.pt2 was not created"


# --- 4. every argument checked before any work ----------------------------------------------------

BEFORE_WORK = [
    ("bench --device cpu --json .", ["--json . is a directory"]),
    ("bench --device cpu --tp 0", ["--tp", "positive integer"]),
    ("bench --device cpu --steps 0", ["--steps", "positive integer"]),
    ("bench --device cpu --replays 0", ["--replays", "positive integer"]),
    ("bench --device cpu --plots tp1.pt2", ["--plots tp1.pt2 is a file, not a directory"]),
    ("bench --device cpu --log .", ["--log . is a directory"]),
    ("validate --tp 3", ["TP=3 does not divide"]),
    ("validate --batch 0", ["--batch", "positive integer"]),
    ("validate --steps 0", ["--steps", "positive integer"]),
    ("validate --batch 65", ["--batch 65", "1-64"]),
    ("validate --temperature -1", ["--temperature", ">= 0"]),
    ("validate --json .", ["--json . is a directory"]),
    ("demo --tp 3", ["TP=3 does not divide"]),
    ("demo --steps 0", ["--steps", "positive integer"]),
]


@pytest.mark.parametrize("args,fragments", BEFORE_WORK, ids=[a for a, _ in BEFORE_WORK])
def test_a_bad_argument_is_one_line_before_any_work(work, args, fragments):
    res = k3fuse(*args.split(), cwd=work)
    one_line_error(res, *fragments)
    assert res.stdout == ""  # nothing started: no banner, no progress line
    assert sorted(p.name for p in work.iterdir()) == ["tp1.pt2"]  # no .tmp, no half result


def test_every_verb_that_compiles_takes_log():
    """`--log` is accepted by every verb that compiles (the README says so)."""
    for verb in ("demo", "bench", "validate", "apply"):
        res = k3fuse(verb, "--help")
        assert res.returncode == 0 and "--log" in res.stdout, verb


# --- 6. settings: parsed once where the process starts, one line -----------------------------------


@pytest.mark.parametrize("env,name", [({"K3FUSE_STRICT": "maybe"}, "K3FUSE_STRICT"),
                                      ({"K3FUSE_DISABLE": "2"}, "K3FUSE_DISABLE"),
                                      ({"K3FUSE_DEBUG": "maybe"}, "K3FUSE_DEBUG")])
def test_a_bad_setting_is_one_line_before_the_verb(work, env, name):
    res = k3fuse("apply", "tp1.pt2", "-o", "out.pt2", cwd=work, env=env)
    one_line_error(res, f"{name}={env[name]!r}", "expected 1/0 (or true/false, yes/no, on/off)")
    assert not (work / "out.pt2").exists()


def test_every_bad_setting_is_named_in_one_line(work):
    res = k3fuse("log", "x.jsonl", cwd=work, env={"K3FUSE_STRICT": "maybe", "K3FUSE_AR_PROTOCOL": "smoke"})
    one_line_error(res, "K3FUSE_STRICT='maybe'", "K3FUSE_AR_PROTOCOL='smoke': expected 'lamport' or 'flags'")


def test_import_k3fuse_checks_every_setting(work):
    """The Python API meets a bad value at `import k3fuse` (which loads k3fuse at once where torch is
    imported; without torch, at k3fuse's first use), not inside a compiled model's forward."""
    env = {**os.environ, "K3FUSE_STRICT": "maybe"}
    res = subprocess.run([sys.executable, "-c", "import torch, k3fuse"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        "k3fuse.settings.SettingsError: K3FUSE_STRICT='maybe': expected 1/0 (or true/false, yes/no, on/off)")


# --- 7. disable() wins over strict() ----------------------------------------------------------------


KILL_SWITCH = """
import torch, k3fuse
class Step(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
    def forward(self, x):
        return torch.nn.functional.linear(x, self.w)
model = Step().eval()
x = torch.randn(4, 64)
compiled = torch.compile(model, backend="k3fuse", options={"compiler": "eager"})
with torch.no_grad():
    with k3fuse.strict():
        fused = compiled(x)
    assert "decode_gemm" in k3fuse.stats(), k3fuse.stats()  # the rewrite fired
    k3fuse.reset_stats()
    with k3fuse.strict(), k3fuse.disable():
        stock = compiled(x)
print(k3fuse.stats(), float((stock - model(x)).abs().max()))
"""


def test_the_kill_switch_wins_over_strict_mode():
    res = subprocess.run([sys.executable, "-c", KILL_SWITCH], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    stats, err = res.stdout.strip().rsplit(" ", 1)
    assert "fallback:disabled" in stats and float(err) == 0.0


# --- 8. worker-rank errors: one line in the parent -------------------------------------------------


def test_a_worker_rank_error_is_one_line(work):
    (work / "failing_rank.py").write_text(
        "def fail(rank, world_size, cfg):\n    raise ValueError(f'rank {rank} found no peer')\n")
    driver = ("import sys; sys.path.insert(0, '.'); import failing_rank\n"
              "import k3fuse.tools.validate as v, k3fuse.tools.cli as cli\n"
              "from k3fuse.dist import launch\n"
              "v.run_validate = lambda cfg: launch(failing_rank.fail, 2, backend='gloo', args=(cfg,), timeout_s=120)\n"
              "sys.exit(cli.main(['validate', '--preset', 'tiny']))\n")
    env = {**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, cwd=work, env=env,
                         timeout=300)
    line = one_line_error(res, "k3fuse validate: error: rank ", "failed: ValueError: rank ", "found no peer")
    assert "--debug shows the traceback" in line


def test_a_hung_run_is_one_line():
    res = k3fuse("validate", "--preset", "tiny", "--layers", "1", "--steps", "1", "--timeout", "1")
    one_line_error(res, "k3fuse validate: error:", "a dead or hung rank?")


# --- 9. advice that works, API errors that say what to do ---------------------------------------------


def test_demo_tokens_advice_names_a_flag_value_that_parses(work):
    line = one_line_error(k3fuse("demo", "--tokens", "1-64", cwd=work), "--batch")
    assert "--batch 1-64" not in line
    one_line_error(k3fuse("demo", "--batch", "1-64", cwd=work), "--batch takes one count", "--tokens LO-HI")


def test_api_errors_name_the_fix():
    import k3fuse
    from k3fuse.context import DecodeContext
    from k3fuse.offline import ProgramTypeError

    with pytest.raises(ProgramTypeError, match="got the module Linear; export it first"):
        k3fuse.apply(torch.nn.Linear(2, 2), DecodeContext())
    with pytest.raises(ProgramTypeError, match="got the path 'x.pt2'; load it first"):
        k3fuse.apply("x.pt2", DecodeContext())
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="a decode context must be a DecodeContext or a dict"):
        torch.compile(model, backend="k3fuse", options={"context": "x"})(torch.randn(2, 4))
    with pytest.raises(Exception, match="rules='nope' must be a list of Rule objects"):
        torch.compile(model, backend="k3fuse", options={"rules": "nope"})(torch.randn(2, 4))


# --- 10. output a person reads -------------------------------------------------------------------------


def test_a_shared_flag_means_one_thing_in_every_verb():
    """--tokens is the guarded range (apply only); tokens per step are --batch wherever they appear."""
    helps = {verb: " ".join(k3fuse(verb, "--help").stdout.split()) for verb in ("apply", "demo", "bench", "validate")}
    assert "--tokens TOKENS token range the rewrites are guarded for" in helps["apply"]
    for verb in ("demo", "bench", "validate"):
        assert "--tokens" not in helps[verb] and "--batch" in helps[verb], verb
        assert "tokens decoded per step (one per sequence)" in helps[verb], verb
    for verb, text in helps.items():
        assert "--rules SPEC which rules run, as K3FUSE_RULES" in text, verb


def test_log_table_wraps_between_words_and_counts_off_rules_apart(work):
    res = k3fuse("apply", "tp1.pt2", "-o", "a.pt2", "--log", "rw.jsonl", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    res = k3fuse("log", "rw.jsonl", cwd=work, env={"COLUMNS": "120"})
    assert res.returncode == 0, res.stderr[-3000:]
    reason = next(e["reason"] for e in _events(work / "rw.jsonl", "weight_prefetch"))
    assert reason.startswith("off by default")
    cells = " ".join(re.sub(r"[│┃]", " ", line) for line in res.stdout.splitlines())
    words = set(cells.split())
    assert all(w in words for w in reason.split()), [w for w in reason.split() if w not in words]
    row = next(line for line in res.stdout.splitlines() if line.startswith("│ weight_prefetch"))
    cols = [c.strip() for c in row.strip("│").split("│")]
    assert cols[:3] == ["weight_prefetch", "0", "0"] and cols[5] == "yes"  # not rejected: off


def test_the_log_file_and_the_in_memory_summary_show_the_same_time(tmp_path, programs):
    import k3fuse
    from k3fuse.log import RewriteLog

    ep = torch.export.load(programs["tp1"])
    _, rlog = k3fuse.apply(ep, k3fuse.DecodeContext(), log=tmp_path / "rw.jsonl")
    memory = {r: s["time_ms"] for r, s in rlog.summary().items()}
    read_back = {r: s["time_ms"] for r, s in RewriteLog.from_jsonl(tmp_path / "rw.jsonl").summary().items()}
    assert memory == read_back and any(memory.values())


def test_the_compile_door_logs_the_models_line_not_the_helper(tmp_path):
    import k3fuse
    from k3fuse import spelling
    from k3fuse.log import RewriteLog

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            return spelling.linear(x, self.w)  # the line the log should name

    line = Step.forward.__code__.co_firstlineno + 1
    rlog = RewriteLog(None)
    torch._dynamo.reset()
    compiled = torch.compile(Step().eval(), backend="k3fuse", options={"compiler": "eager", "log": rlog})
    with torch.no_grad():
        compiled(torch.randn(4, 64))
    applied = rlog.select("decode_gemm", "applied")
    assert applied and all(e.source == f"{__file__}:{line}" for e in applied), [e.source for e in applied]
