"""What a .pt2 may contain before torch reads it: no code runs from a program file.

`torch.export.load` runs code from the file it is given on several paths: pickles (a weight or
constant whose entry says `use_pickle`, custom and opaque objects, the sample inputs and constants
after a failed `weights_only` load, the legacy formats), shared libraries (AOTInductor entries) and
the symbolic shape expressions of the program's JSON, which sympy parses with Python's `eval`.
`check_archive` admits an archive only when it holds nothing but what `torch.export.save` writes
for a program of tensors:

* the archive's own records (`archive_format` "pt2", `archive_version`, `byteorder`, `.data/...`);
* programs (`models/<name>.json`), whose operator targets name registered ops (`torch.ops.*`) or the
  builtins torch's verifier allows, and whose symbolic expressions are sympy constructors of numbers
  and symbols only (`Symbol('s0', positive=True)`, `Add(...)`, `FloorDiv(...)`: no other name, no
  attribute, no string but a symbol's name, bounded powers and shifts);
* weights and tensor constants as raw bytes, each listed in its config with `use_pickle` false;
* sample inputs that `torch.load(weights_only=True)` loads (torch then never falls back to a full
  unpickle, since it tries the same load on the same bytes first);
* extra files (`extra/...`, read as text).

Anything else is refused with `ProgramRefused`, naming the entry. Every entry's CRC is checked too
(a corrupt archive is refused, never rewritten). The checks read the archive through torch's own
zip reader, so they see the bytes torch will load; Python's zipfile checks the CRCs, and both must
list the same entries.
"""
from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from collections.abc import Iterator
from typing import IO, Any

#: bytes read at a time while the CRCs are checked
CHUNK = 1 << 20

#: longest symbolic expression accepted (torch writes a few hundred characters at most)
MAX_EXPR_CHARS = 10_000
#: the largest integer literal in an expression (sizes are int64)
MAX_INT = 1 << 64
#: powers and shifts: the largest literal exponent or shift
MAX_EXPONENT = 64
#: a Float's largest `precision`
MAX_PRECISION = 1024

_ARCHIVE_RECORDS = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}

#: sympy constructors torch's printer (sympy's srepr) writes, and torch's own sympy functions
_EXPR_CALLS = {
    "Symbol", "Dummy", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "floor",
    "ceiling", "sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "LessThan",
    "StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "Xor", "Piecewise", "ExprCondPair", "ITE",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat",
    "Identity", "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or",
}
#: constructors whose second argument is an exponent or a shift (bounded: 2**(2**62) never ends)
_POWER_CALLS = {"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"}
_EXPR_KEYWORDS = {"positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "infinite",
                  "zero", "nonzero", "even", "odd", "rational", "precision", "evaluate", "commutative"}
_SYMBOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d{1,4})?|[-+]?(inf|nan)")
#: operator targets a program may name: registered ops and the symbolic-size builtins torch's verifier
#: allows (which then admits only OpOverloads, higher-order ops and those builtins)
_TARGET = re.compile(r"torch\.ops(\.\w+)+|torch\._?sym_\w+|math\.(ceil|floor|trunc)"
                     r"|_operator\.(getitem|add|mul|sub|truediv|ge|le|gt|lt|eq|ne|floordiv|mod|and_|or_|not_|pow|neg"
                     r"|abs|lshift|rshift)")


class ProgramRefused(ValueError):
    """A .pt2 k3fuse will not load: an entry that could run code, a corrupt entry, or not a program.

    `str()` is one line naming the entry and why; `entry` is the entry's name inside the archive."""

    def __init__(self, path: Any, entry: str | None, why: str):
        self.path, self.entry, self.why = str(path), entry, why
        where = f"entry {entry}: " if entry else ""
        super().__init__(f"{self.path}: {where}{why}")


class NotAProgram(ProgramRefused):
    """The file is not a torch.export archive at all (not a zip, no archive_format, no program)."""


def _expr_problem(expr: str) -> str | None:
    """Why the symbolic expression `expr` could run code or never finish, or None when it is made of
    numbers, symbols and the constructors above only."""
    if len(expr) > MAX_EXPR_CHARS:
        return f"a symbolic expression of {len(expr)} characters (at most {MAX_EXPR_CHARS})"
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return f"a symbolic expression that does not parse ({type(exc).__name__})"
    stack: list[tuple[ast.AST, bool]] = [(tree.body, False)]
    while stack:
        node, in_power = stack.pop()
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else None
            if name not in _EXPR_CALLS:
                return f"a symbolic expression calling {ast.unparse(node.func)[:80]!r}, not a sympy constructor"
            power = name in _POWER_CALLS
            if power and in_power:
                return "a symbolic expression with a power inside a power"
            if power and (len(node.args) != 2 or not _small_literal(node.args[1])):
                return f"a symbolic expression {name}(...) whose exponent is not a literal of at most {MAX_EXPONENT}"
            if name in ("Symbol", "Dummy"):
                if not (node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                        and _SYMBOL_NAME.fullmatch(node.args[0].value)):
                    return "a symbolic expression with a malformed Symbol name"
                rest = node.args[1:]
            elif name == "Float" and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                if not _FLOAT_TEXT.fullmatch(node.args[0].value):
                    return "a symbolic expression with a malformed Float"
                rest = node.args[1:]
            else:
                rest = node.args
            for kw in node.keywords:
                if kw.arg not in _EXPR_KEYWORDS or not isinstance(kw.value, ast.Constant) \
                        or not isinstance(kw.value.value, (bool, int)):
                    return f"a symbolic expression with the keyword {kw.arg!r}"
                if kw.arg == "precision" and not 0 < int(kw.value.value) <= MAX_PRECISION:
                    return f"a symbolic expression with precision {kw.value.value}"
            stack.extend((a, in_power or power) for a in rest)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or node.value is None:
                continue
            if isinstance(node.value, int) and abs(node.value) <= MAX_INT:
                continue
            if isinstance(node.value, float):
                continue
            return f"a symbolic expression with the literal {str(node.value)[:40]!r}"
        elif isinstance(node, ast.Name):  # a symbol (s0) or a constant (oo): an object, never called
            if node.id.startswith("_"):
                return f"a symbolic expression naming {node.id!r}"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            stack.append((node.operand, in_power))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv,
                                                                  ast.Mod)):
            stack.extend(((node.left, in_power), (node.right, in_power)))
        elif isinstance(node, ast.Compare) and all(isinstance(o, (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE))
                                                   for o in node.ops):
            stack.extend((c, in_power) for c in (node.left, *node.comparators))
        else:
            return f"a symbolic expression with {type(node).__name__} syntax"
    return None


def _small_literal(node: ast.AST) -> bool:
    """An exponent or shift: an integer literal of at most MAX_EXPONENT, or Integer(that)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Integer" \
            and len(node.args) == 1 and not node.keywords:
        return _small_literal(node.args[0])
    return isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= MAX_EXPONENT


def _walk(value: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair of the objects nested in a decoded JSON document (no recursion)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                yield k, item
                stack.append(item)
        elif isinstance(v, list):
            stack.extend(v)


def _program_problem(doc: Any) -> str | None:
    """Why a decoded models/<name>.json could run code when torch deserializes it, or None."""
    for key, value in _walk(doc):
        if key == "expr_str":
            problem = _expr_problem(value) if isinstance(value, str) else "a symbolic expression that is not text"
            if problem:
                return problem
        elif key == "target" and isinstance(value, str) and not _TARGET.fullmatch(value):
            return f"an operator target {value[:80]!r} that is not a registered op or an allowed builtin"
    return None


def _json(reader: Any, path: Any, entry: str) -> Any:
    try:
        return json.loads(reader.get_record(entry))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ProgramRefused(path, entry, f"not JSON ({type(exc).__name__})") from None


def _payload_entries(reader: Any, path: Any, config_entry: str, directory: str, what: str) -> set[str]:
    """The tensor files a weights/constants config lists; refuses a pickled or object entry."""
    config = _json(reader, path, config_entry)
    items = config.get("config") if isinstance(config, dict) else None
    if not isinstance(items, dict):
        raise ProgramRefused(path, config_entry, "not a payload config")
    files = set()
    for fqn, meta in items.items():
        name = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise ProgramRefused(path, config_entry, f"{what} {fqn!r} has no file name")
        if meta.get("use_pickle"):
            raise ProgramRefused(path, directory + name,
                                 f"{what} {fqn!r} is stored as a pickle (use_pickle), which runs code when loaded; "
                                 "k3fuse loads tensors only: re-save the program from plain tensors")
        if directory.endswith("constants/") and not name.startswith("tensor_"):
            raise ProgramRefused(path, directory + name,
                                 f"{what} {fqn!r} is a Python or TorchScript object (a pickle), not a tensor")
        files.add(directory + name)
    return files


def _check_sample_inputs(reader: Any, path: Any, entry: str) -> None:
    import torch

    try:
        torch.load(io.BytesIO(reader.get_record(entry)), weights_only=True)
    except Exception as exc:  # the unpickler's refusal, or a damaged pickle
        text = str(exc)
        # torch's message is a page of advice; the line that names what the pickle asked for is the one
        said = re.search(r"(Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+|[^\n]*Error: [^\n]*)", text)
        why = said.group(1) if said else (text.strip().splitlines() or [type(exc).__name__])[0]
        raise ProgramRefused(path, entry, f"the sample inputs do not load as plain tensors with weights_only=True "
                                          f"({why[:200]}); k3fuse never unpickles anything else") from None


def _check_crcs(f: IO[bytes], path: Any, torch_names: set[str]) -> None:
    """Every entry reads back with its CRC, and zipfile lists the entries torch's reader lists."""
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
            names = [i.filename for i in infos]
            if len(set(names)) != len(names):
                dup = next(n for n in names if names.count(n) > 1)
                raise ProgramRefused(path, dup, "appears twice in the archive")
            roots = {n.split("/", 1)[0] for n in names}
            stripped = {n.split("/", 1)[1] if "/" in n else n for n in names}
            if len(roots) != 1 or stripped != torch_names:
                raise ProgramRefused(path, None, "the archive's directory does not match its entries "
                                                 "(torch and zipfile read different files)")
            for info in infos:
                with zf.open(info) as member:
                    while member.read(CHUNK):
                        pass
    except zipfile.BadZipFile as exc:
        named = re.search(r"'([^']*)'", str(exc))
        entry = named.group(1).split("/", 1)[-1] if named else None
        why = "its CRC-32 does not match its bytes" if "CRC" in str(exc) else str(exc)
        raise ProgramRefused(path, entry, f"corrupt ({why}): the archive was damaged after it was written") from None
    except (NotImplementedError, RuntimeError) as exc:  # compression or encryption zipfile cannot read
        raise ProgramRefused(path, None, f"not an archive torch.export.save writes ({exc})") from None


def check_archive(f: IO[bytes], path: Any) -> list[str]:
    """Check the open archive `f` (named `path` in messages) as the module says; returns the names of
    its programs. Raises ProgramRefused. `f` is left at an arbitrary position."""
    import torch

    f.seek(0)
    if not zipfile.is_zipfile(f):
        raise NotAProgram(path, None, "not a zip archive")
    f.seek(0)
    try:
        reader = torch._C.PyTorchFileReader(f)
        names = set(reader.get_all_records())
    except RuntimeError as exc:
        raise NotAProgram(path, None, f"not an archive torch can read ({str(exc).splitlines()[0][:200]})") from None
    if "archive_format" not in names or reader.get_record("archive_format") != b"pt2":
        raise NotAProgram(path, None, "no archive_format 'pt2' (k3fuse does not load the older formats, which "
                                      "hold pickles)")
    models = sorted(n[len("models/"):-len(".json")] for n in names
                    if n.startswith("models/") and n.endswith(".json") and n.count("/") == 1)
    if not models:
        raise NotAProgram(path, None, "it holds no program (no models/<name>.json)")
    allowed = set(_ARCHIVE_RECORDS)
    for model in models:
        entry = f"models/{model}.json"
        problem = _program_problem(_json(reader, path, entry))
        if problem:
            raise ProgramRefused(path, entry, f"holds {problem}, which could run code when loaded")
        allowed.add(entry)
        for kind, directory in (("weights", "data/weights/"), ("constants", "data/constants/")):
            config = f"{directory}{model}_{kind}_config.json"
            if config in names:
                allowed.add(config)
                allowed |= _payload_entries(reader, path, config, directory, kind[:-1])
        sample = f"data/sample_inputs/{model}.pt"
        if sample in names:
            _check_sample_inputs(reader, path, sample)
            allowed.add(sample)
    for name in sorted(names - allowed):
        if not name.startswith("extra/"):
            raise ProgramRefused(path, name, "is not part of a program of tensors (k3fuse loads no pickles, "
                                             "compiled libraries or other payloads)")
    _check_crcs(f, path, names)
    return models


__all__ = ["check_archive", "ProgramRefused", "NotAProgram"]
