"""What ggml's C headers declare, read with the C preprocessor and pycparser, for the ABI test.

deltarun calls ggml through ggml-python's ctypes declarations, which are written by hand for the
ggml that ggml-python vendors. deltarun builds them on a newer ggml (scripts/ggml-wheel.sh), so
each declaration it relies on is checked against the headers that ggml was built from; the wheel
carries them in `ggml/include` (scripts/ggml-wheel.sh copies them there). A declaration is reduced
to what decides the calling convention and the meaning of the bits: for every argument and the
return value, a pointer, a signed or unsigned integer of some width, a bool, a float or double,
or a struct passed by value (named). `enum` values and integer `#define`s are evaluated.

The headers are preprocessed with `gcc -E -nostdinc` against a few lines standing in for the C
library (stdint, stddef, stdbool, stdio), so the result is plain C99 that pycparser reads.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pycparser import c_ast, c_parser

#: The C library as far as ggml's public headers use it (x86-64 / aarch64 Linux: LP64).
FAKE_LIBC = {
    "stdint.h": """
typedef signed char int8_t; typedef unsigned char uint8_t;
typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t;
typedef long int64_t; typedef unsigned long uint64_t;
typedef long intptr_t; typedef unsigned long uintptr_t;
""",
    "stddef.h": "typedef unsigned long size_t; typedef long ptrdiff_t;\n#define NULL ((void*)0)\n",
    "stdbool.h": "typedef _Bool bool;\n#define true 1\n#define false 0\n",
    "stdio.h": "typedef struct _IO_FILE FILE;\n",
}

#: The headers of the parts of ggml that ggml-python binds and deltarun uses (plain C; some other
#: backends' headers are C++).
C_HEADERS = ("ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h", "ggml-rpc.h", "ggml-vulkan.h",
             "ggml-cuda.h", "gguf.h")

#: Integer widths of C's base type names (LP64), with their signedness.
_BASE_INTS = {
    ("char",): (True, 1), ("signed", "char"): (True, 1), ("unsigned", "char"): (False, 1),
    ("short",): (True, 2), ("unsigned", "short"): (False, 2),
    ("int",): (True, 4), ("signed",): (True, 4), ("unsigned",): (False, 4), ("unsigned", "int"): (False, 4),
    ("long",): (True, 8), ("unsigned", "long"): (False, 8),
    ("long", "long"): (True, 8), ("unsigned", "long", "long"): (False, 8),
}


@dataclass(frozen=True)
class Kind:
    """How one argument or return value is passed: what the ABI and the bits depend on.

    kind: "void", "ptr", "int", "bool", "float", "struct"; size in bytes; signed for "int";
    name: the struct's tag for "struct", else "".
    """

    kind: str
    size: int = 0
    signed: bool = False
    name: str = ""

    def __str__(self) -> str:
        if self.kind == "int":
            return f"{'' if self.signed else 'u'}int{8 * self.size}"
        if self.kind == "float":
            return "float" if self.size == 4 else "double"
        if self.kind == "struct":
            return f"struct {self.name}"
        return self.kind


VOID = Kind("void")
PTR = Kind("ptr", 8)


@dataclass(frozen=True)
class Prototype:
    """A function's declaration reduced to kinds; `text` is the C declaration, for messages."""

    name: str
    result: Kind
    args: tuple[Kind, ...]
    variadic: bool
    text: str


class Headers:
    """Everything the headers in one folder declare: prototypes, typedefs, enums and macros."""

    def __init__(self, include_dir: Path, headers: list[str] | None = None):
        self.include_dir = Path(include_dir)
        names = headers or [h for h in C_HEADERS if (self.include_dir / h).exists()]
        self.header_names = names
        self.source = _preprocess(self.include_dir, names)
        self.macros = _integer_macros(self.include_dir, names)
        ast = c_parser.CParser().parse(self.source, filename="<ggml headers>")
        self.typedefs: dict[str, c_ast.Node] = {}
        self.enum_tags: set[str] = set()
        self.enums: dict[str, int] = {}
        self.enum_of: dict[str, str] = {}          # enumerator -> its enum's tag or typedef name
        self.prototypes: dict[str, Prototype] = {}
        self.function_typedefs: dict[str, Prototype] = {}
        for ext in ast.ext:
            self._visit(ext)

    # -- reading the AST -----------------------------------------------------------------------
    def _visit(self, node: c_ast.Node) -> None:
        if isinstance(node, c_ast.Typedef):
            self.typedefs[node.name] = node.type
            self._collect_enums(node.type, node.name)
            fn = _function_decl(node.type)
            if fn is not None:
                self.function_typedefs[node.name] = self._prototype(node.name, fn, node)
        elif isinstance(node, c_ast.Decl):
            self._collect_enums(node.type, None)
            if isinstance(node.type, c_ast.FuncDecl) and node.name:
                self.prototypes[node.name] = self._prototype(node.name, node.type, node)

    def _collect_enums(self, node: c_ast.Node, typedef_name: str | None) -> None:
        while isinstance(node, (c_ast.TypeDecl, c_ast.PtrDecl, c_ast.ArrayDecl)):
            node = node.type
        if not isinstance(node, c_ast.Enum) or node.values is None:
            return
        owner = node.name or typedef_name or "?"
        if node.name:
            self.enum_tags.add(node.name)
        value = -1
        for e in node.values.enumerators:
            value = self._eval(e.value) if e.value is not None else value + 1
            self.enums[e.name] = value
            self.enum_of[e.name] = owner

    def _eval(self, node: c_ast.Node) -> int:
        if isinstance(node, c_ast.Constant):
            text = node.value.rstrip("uUlL")
            if node.type == "char":
                return ord(node.value.strip("'"))
            return int(text, 0) if not re.fullmatch(r"0[0-7]+", text) else int(text, 8)
        if isinstance(node, c_ast.ID):
            return self.enums[node.name]
        if isinstance(node, c_ast.UnaryOp):
            v = self._eval(node.expr)
            return {"-": -v, "+": v, "~": ~v, "!": int(not v)}[node.op]
        if isinstance(node, c_ast.BinaryOp):
            a, b = self._eval(node.left), self._eval(node.right)
            ops = {"+": a + b, "-": a - b, "*": a * b, "<<": a << b if b >= 0 else 0, ">>": a >> b if b >= 0 else 0,
                   "|": a | b, "&": a & b, "^": a ^ b}
            if node.op == "/":
                return int(a / b)
            return ops[node.op]
        if isinstance(node, c_ast.Cast):
            return self._eval(node.expr)
        raise ValueError(f"cannot evaluate {type(node).__name__} in an enum")

    def _prototype(self, name: str, fn: c_ast.FuncDecl, decl: c_ast.Node) -> Prototype:
        args: list[Kind] = []
        variadic = False
        for p in (fn.args.params if fn.args else []):
            if isinstance(p, c_ast.EllipsisParam):
                variadic = True
                continue
            k = self.kind(p.type)
            if k == VOID:            # f(void)
                continue
            args.append(k)
        from pycparser import c_generator
        text = c_generator.CGenerator().visit(decl).strip()
        return Prototype(name, self.kind(fn.type), tuple(args), variadic, text)

    def kind(self, node: c_ast.Node) -> Kind:
        """The Kind of a type node: typedefs resolved, arrays and functions passed as pointers."""
        if isinstance(node, (c_ast.PtrDecl, c_ast.ArrayDecl, c_ast.FuncDecl)):
            return PTR
        if isinstance(node, c_ast.TypeDecl):
            return self.kind(node.type)
        if isinstance(node, c_ast.Enum):
            return Kind("int", 4, True)
        if isinstance(node, c_ast.Struct):
            return Kind("struct", 0, False, node.name or "")
        if isinstance(node, c_ast.IdentifierType):
            names = tuple(n for n in node.names if n not in ("const", "volatile"))
            if len(names) == 1 and names[0] in self.typedefs:
                return self.kind(self.typedefs[names[0]])
            if names == ("void",):
                return VOID
            if names == ("_Bool",):
                return Kind("bool", 1)
            if names in (("float",),):
                return Kind("float", 4)
            if names in (("double",),):
                return Kind("float", 8)
            key = tuple(n for n in names if n != "int") or ("int",)
            if names != ("int",) and key in _BASE_INTS:
                signed, size = _BASE_INTS[key]
            elif names in _BASE_INTS:
                signed, size = _BASE_INTS[names]
            else:
                raise ValueError(f"unknown C type {' '.join(names)}")
            return Kind("int", size, signed)
        raise ValueError(f"unknown type node {type(node).__name__}")


def _function_decl(node: c_ast.Node) -> c_ast.FuncDecl | None:
    """The FuncDecl of a function-pointer typedef (`typedef R (*name)(...)`), else None."""
    if isinstance(node, c_ast.PtrDecl) and isinstance(node.type, c_ast.FuncDecl):
        return node.type
    return None


def _fake_libc(folder: Path) -> None:
    for name, text in FAKE_LIBC.items():
        (folder / name).write_text(text)


def _gcc() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise FileNotFoundError("no C compiler (gcc) to preprocess ggml's headers")
    return cc


def _run_cpp(include_dir: Path, headers: list[str], extra: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp)
        _fake_libc(fake)
        main = fake / "all.c"
        main.write_text("".join(f'#include "{h}"\n' for h in headers))
        # Plain C: no GNU attributes, no visibility, no deprecation (the declarations stay).
        cmd = [_gcc(), "-E", "-P", "-nostdinc", "-std=c99", "-U__GNUC__", "-D__attribute__(x)=",
               "-D__declspec(x)=", "-I", str(fake), "-I", str(include_dir), *extra, str(main)]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _preprocess(include_dir: Path, headers: list[str]) -> str:
    return _run_cpp(include_dir, headers, [])


def _integer_macros(include_dir: Path, headers: list[str]) -> dict[str, int]:
    """Object-like macros whose value is an integer literal or a simple expression of them."""
    out: dict[str, int] = {}
    for line in _run_cpp(include_dir, headers, ["-dM"]).splitlines():
        m = re.match(r"#define ((?:GGML|GGUF|RPC)_\w+) (.+)$", line)
        if not m:
            continue
        expr = re.sub(r"(?<=[0-9a-fA-F])[uUlL]+\b", "", m.group(2).strip())
        if re.fullmatch(r"[-+~()<>|&\s0-9a-fA-FxX]+", expr):
            try:
                out[m.group(1)] = int(eval(expr, {"__builtins__": {}}))  # digits and operators only
            except (SyntaxError, ValueError, TypeError):
                pass
    return out


# ------------------------------------------------------------------------------------------------
# The ctypes side
# ------------------------------------------------------------------------------------------------
_CTYPES_INTS = (ctypes.c_byte, ctypes.c_ubyte, ctypes.c_short, ctypes.c_ushort, ctypes.c_int, ctypes.c_uint,
                ctypes.c_long, ctypes.c_ulong, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_int8,
                ctypes.c_uint8, ctypes.c_int16, ctypes.c_uint16, ctypes.c_int32, ctypes.c_uint32,
                ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_ssize_t)
_UNSIGNED = (ctypes.c_ubyte, ctypes.c_ushort, ctypes.c_uint, ctypes.c_ulong, ctypes.c_ulonglong,
             ctypes.c_uint8, ctypes.c_uint16, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_size_t)


def ctypes_kind(t: object) -> Kind | str:
    """The Kind of a ctypes argtype or restype; a string saying why when it is not a ctypes type
    (e.g. a typing.NewType as restype: ctypes then returns a C int, cutting pointers to 32 bits)."""
    if t is None:
        return VOID
    if not isinstance(t, type):
        return f"not a ctypes type: {t!r}"
    if issubclass(t, (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_wchar_p, ctypes._Pointer,
                      ctypes._CFuncPtr)):  # type: ignore[attr-defined]
        return PTR
    if issubclass(t, ctypes.c_bool):
        return Kind("bool", 1)
    if issubclass(t, ctypes.c_float):
        return Kind("float", 4)
    if issubclass(t, ctypes.c_double):
        return Kind("float", 8)
    if issubclass(t, ctypes.c_char):
        return Kind("int", 1, True)
    if issubclass(t, _CTYPES_INTS):
        return Kind("int", ctypes.sizeof(t), not issubclass(t, _UNSIGNED))
    if issubclass(t, ctypes.Structure):
        return Kind("struct", 0, False, t.__name__)
    return f"not a ctypes type: {t!r}"


def compare(proto: Prototype, argtypes: object, restype: object) -> list[str]:
    """Where a ctypes declaration differs from the C prototype (empty when they agree)."""
    problems = []
    got = ctypes_kind(restype)
    if got != proto.result:
        problems.append(f"returns {proto.result}, ctypes says {got}")
    if argtypes is None:
        problems.append("ctypes declares no argtypes")
        return problems
    args = list(argtypes)
    if len(args) != len(proto.args):
        problems.append(f"{len(proto.args)} arguments, ctypes declares {len(args)}")
    for i, (c, t) in enumerate(zip(proto.args, args)):
        got = ctypes_kind(t)
        if got != c:
            problems.append(f"argument {i + 1} is {c}, ctypes says {got}")
    return problems


def struct_layout(include_dir: Path, header: str, struct: str, fields: list[str]) -> tuple[int, dict[str, tuple[int, int]]]:
    """sizeof(struct) and (offsetof, sizeof) of each field, as the C compiler lays them out."""
    lines = [f'#include "{header}"', "#include <stdio.h>", "#include <stddef.h>", "int main(void) {",
             f'  printf("%zu\\n", sizeof(struct {struct}));']
    for f in fields:
        lines.append(f'  printf("%zu %zu\\n", offsetof(struct {struct}, {f}), sizeof(((struct {struct} *)0)->{f}));')
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "layout.c"
        exe = Path(tmp) / "layout"
        src.write_text("\n".join(lines) + "\n")
        subprocess.run([_gcc(), "-std=c11", "-I", str(include_dir), str(src), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    size = int(out[0])
    layout = {f: tuple(int(x) for x in out[1 + i].split()) for i, f in enumerate(fields)}
    return size, layout  # type: ignore[return-value]
