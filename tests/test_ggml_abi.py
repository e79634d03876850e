"""Every ggml function, callback type, struct and enum value deltarun uses, checked against the
headers and the library of the installed ggml-python (issue 29).

deltarun runs ggml-python 0.0.45's hand-written ctypes declarations on a newer ggml
(scripts/ggml-wheel.sh). A declaration that no longer matches its C prototype does not fail: it
passes arguments of the wrong width or reads garbage and corrupts memory. So this test reads the
headers the library was built from (installed in `ggml/include` by scripts/ggml-wheel.sh) and
compares, for every ggml name deltarun's code mentions: each function's arguments and result
(pointer, integer width and sign, bool, float, struct by value), each callback type, the layout of
each ctypes struct (offsets and sizes from the C compiler), and each enum value or integer macro.
ggml-python's own `GGML_OP_*` constants are wrong after the ops ggml inserted in the middle of
`enum ggml_op`; deltarun reads op names with `ggml_op_desc` and must not use them.
"""

from __future__ import annotations

import ast
import ctypes
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("pycparser")

from deltarun.base.ggml_compat import POINTER_RESTYPE_FIXES, ggml  # noqa: E402  (fixes applied)
from deltarun.runner.devices import CPU_FEATURES  # noqa: E402
from deltarun.runner.repack import EXTRA_BUFTS_FN  # noqa: E402

import ggml_headers  # noqa: E402
from ggml_headers import Headers, compare, ctypes_kind, struct_layout  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
INCLUDE = Path(ggml.__file__).resolve().parent / "include"
#: Build flags ggml-python defines in Python (GGML_USE_CUDA, ...): not in any header.
PYTHON_ONLY = re.compile(r"GGML_USE_\w+")


def used_names() -> set[str]:
    """The ggml names deltarun's code mentions (`ggml.<name>`), plus the ones it looks up by a
    computed name (CPU feature queries) and the ones ggml_compat repairs."""
    names: set[str] = set()
    for folder in ("deltarun", "models"):
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r"\bggml\.((?:ggml|GGML)_\w+)", path.read_text()))
    names |= {f"ggml_cpu_has_{f}" for f in CPU_FEATURES}
    names |= set(POINTER_RESTYPE_FIXES)
    return {n for n in names if not PYTHON_ONLY.fullmatch(n)}


@pytest.fixture(scope="module")
def headers() -> Headers:
    if not INCLUDE.is_dir():
        pinned = re.search(r"^GGML_VERSION=(\S+)", (REPO / "scripts" / "ggml-wheel.sh").read_text(), re.M)
        if pinned and ggml.ggml_version().decode() == pinned.group(1):
            pytest.fail(f"ggml-python {ggml.__version__} is on ggml {pinned.group(1)}, as scripts/ggml-wheel.sh "
                        f"builds it, but has no headers in {INCLUDE}")
        pytest.skip(f"ggml-python {ggml.__version__} (ggml {ggml.ggml_version().decode()}) carries no headers: "
                    "scripts/install.sh builds one that does")
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to read the headers with")
    return Headers(INCLUDE)


def declared_in_source() -> dict[str, tuple[object, object]]:
    """(argtypes, restype) of every `@ggml_function(name, argtypes, restype, ...)` in ggml-python's
    source, evaluated in its module: the declarations of functions this build leaves unbound (a
    backend it was not built with) can be checked too."""
    module = ggml.ggml if hasattr(ggml, "ggml") else ggml
    tree = ast.parse(Path(module.__file__).read_text())
    out: dict[str, tuple[object, object]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for dec in node.decorator_list:
            if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id.endswith("_function")
                    and len(dec.args) >= 3 and isinstance(dec.args[0], ast.Constant)):
                env = vars(module)
                out[dec.args[0].value] = (eval(compile(ast.Expression(dec.args[1]), "<decl>", "eval"), env),
                                          eval(compile(ast.Expression(dec.args[2]), "<decl>", "eval"), env))
    return out


def function_problems(names: set[str], hdr: Headers) -> list[str]:
    """One line per function whose ctypes declaration disagrees with the headers or the library."""
    source = None
    problems = []
    for name in sorted(n for n in names if n.startswith("ggml_")):
        obj = getattr(ggml, name, None)
        if name in hdr.function_typedefs or isinstance(obj, type):
            continue                      # a callback type or a struct: checked below
        proto = hdr.prototypes.get(name)
        if proto is None:
            problems.append(f"{name}: not declared in {', '.join(hdr.header_names)}")
            continue
        if obj is not None and hasattr(obj, "argtypes"):
            argtypes, restype = obj.argtypes, obj.restype
            if not hasattr(ggml.lib, name):
                problems.append(f"{name}: not exported by the library")
        else:                              # bound only in builds with its backend
            source = source if source is not None else declared_in_source()
            if name not in source:
                problems.append(f"{name}: ggml-python declares no such function")
                continue
            argtypes, restype = source[name]
            if name in POINTER_RESTYPE_FIXES:   # what ggml_compat sets when the backend is there
                restype = ctypes.c_void_p
        for p in compare(proto, argtypes, restype):
            problems.append(f"{name}: {p}   [{proto.text}]")
    return problems


def callback_problems(names: set[str], hdr: Headers) -> list[str]:
    """One line per ctypes callback type that disagrees with its C typedef."""
    problems = []
    for name in sorted(n for n in names if n in hdr.function_typedefs):
        t = getattr(ggml, name)
        for p in compare(hdr.function_typedefs[name], t._argtypes_, t._restype_):
            problems.append(f"{name}: {p}   [{hdr.function_typedefs[name].text}]")
    return problems


def value_problems(names: set[str], hdr: Headers, namespace: object = ggml) -> list[str]:
    """One line per enum value or integer macro whose Python value differs from the headers'."""
    problems = []
    for name in sorted(n for n in names if n.startswith("GGML_")):
        if name in hdr.enums:
            want, what = hdr.enums[name], f"enum {hdr.enum_of[name]}"
        elif name in hdr.macros:
            want, what = hdr.macros[name], "#define"
        else:
            problems.append(f"{name}: neither an enum value nor an integer macro of the headers")
            continue
        got = getattr(namespace, name)
        if got != want:
            problems.append(f"{name} = {got} in ggml-python, {want} in the headers ({what})")
    return problems


# ------------------------------------------------------------------------------------------------
def test_the_headers_are_those_of_the_library(headers: Headers) -> None:
    assert ggml.ggml_version().decode() == "{}.{}.{}".format(
        *(headers.macros.get(k, -1) for k in ("GGML_VERSION_MAJOR", "GGML_VERSION_MINOR", "GGML_VERSION_PATCH"))) \
        or "GGML_VERSION_MAJOR" not in headers.macros
    # the list of names is not empty by accident (a changed import style would empty it)
    names = used_names()
    assert {"ggml_mul_mat", "ggml_gated_delta_net", "ggml_backend_sched_graph_compute", "GGML_TYPE_F32"} <= names
    assert len([n for n in names if n.startswith("ggml_")]) > 100


def test_every_function_deltarun_calls_matches_its_prototype(headers: Headers) -> None:
    problems = function_problems(used_names(), headers)
    assert not problems, "ctypes declarations that do not match ggml's headers:\n" + "\n".join(problems)


def test_the_restype_fixes_are_still_needed(headers: Headers) -> None:
    # each function ggml_compat repairs returns a pointer that ggml-python declares as a NewType
    source = declared_in_source()
    for name in POINTER_RESTYPE_FIXES:
        assert headers.prototypes[name].result.kind == "ptr"
        assert "not a ctypes type" in str(ctypes_kind(source[name][1])), name


def test_every_callback_type_matches_its_typedef(headers: Headers) -> None:
    names = used_names() & set(headers.function_typedefs)
    assert {"ggml_backend_sched_eval_callback", "ggml_log_callback"} <= names
    problems = callback_problems(used_names(), headers)
    # the function-pointer type deltarun makes itself for a proc address of the CPU registry
    for p in compare(headers.function_typedefs["ggml_backend_dev_get_extra_bufts_t"],
                     EXTRA_BUFTS_FN._argtypes_, EXTRA_BUFTS_FN._restype_):
        problems.append(f"repack.EXTRA_BUFTS_FN: {p}")
    assert not problems, "\n".join(problems)


def test_every_enum_value_and_macro_deltarun_uses_matches(headers: Headers) -> None:
    problems = value_problems(used_names(), headers)
    assert not problems, "\n".join(problems)


def test_the_rpc_probe_speaks_the_headers_protocol(headers: Headers) -> None:
    # deltarun's Python HELLO probe (runner/rpc.py) checks a server's version against this
    from deltarun.runner.rpc import PROTOCOL
    assert PROTOCOL == tuple(headers.macros[f"RPC_PROTO_{k}_VERSION"] for k in ("MAJOR", "MINOR", "PATCH"))


def test_deltarun_uses_no_ggml_op_constant() -> None:
    # ggml-python 0.0.45's GGML_OP_* stop matching ggml's enum after the ops inserted since 0.15.3
    assert not [n for n in used_names() if n.startswith(("GGML_OP_", "GGML_UNARY_OP_", "GGML_GLU_OP_"))]


def test_gguf_tensor_types_are_ggml_types(headers: Headers) -> None:
    # deltarun reads a tensor's type id from the file (gguf-py's GGMLQuantizationType) and hands it
    # to ggml as an enum ggml_type: the two numberings must be one
    gguf = pytest.importorskip("gguf")
    problems = [f"{t.name}: gguf {t.value}, ggml {headers.enums[f'GGML_TYPE_{t.name}']}"
                for t in gguf.GGMLQuantizationType
                if f"GGML_TYPE_{t.name}" in headers.enums and headers.enums[f"GGML_TYPE_{t.name}"] != t.value]
    assert not problems
    assert headers.enums["GGML_TYPE_Q8_0"] == gguf.GGMLQuantizationType.Q8_0 == 8


@pytest.mark.parametrize("struct", ["ggml_tensor", "ggml_init_params"])
def test_struct_layout_matches_the_compiler(headers: Headers, struct: str) -> None:
    t = getattr(ggml, struct)
    fields = [f[0] for f in t._fields_]
    size, layout = struct_layout(INCLUDE, "ggml.h", struct, fields)
    got = {f: (getattr(t, f).offset, getattr(t, f).size) for f in fields}
    assert (ctypes.sizeof(t), got) == (size, layout)


# ------------------------------------------------------------------------------------------------
# The checks fail on a wrong declaration
# ------------------------------------------------------------------------------------------------
def test_a_wrong_ctypes_declaration_is_caught(headers: Headers) -> None:
    proto = headers.prototypes["ggml_rope_ext"]
    good = list(ggml.ggml_rope_ext.argtypes)
    assert compare(proto, good, ggml.ggml_rope_ext.restype) == []
    narrow = good.copy()
    narrow[4] = ctypes.c_int64                                  # int n_dims declared as int64
    assert compare(proto, narrow, ggml.ggml_rope_ext.restype) == ["argument 5 is int32, ctypes says int64"]
    assert compare(proto, good[:-1], ggml.ggml_rope_ext.restype)[0] == f"{len(good)} arguments, ctypes declares {len(good) - 1}"
    swapped = good.copy()
    swapped[7], swapped[8] = ctypes.c_int, ctypes.c_float       # freq_base (float) <-> an int
    assert len(compare(proto, swapped, ggml.ggml_rope_ext.restype)) == 1
    # the pointer-truncating restypes ggml_compat repairs (a typing.NewType)
    assert "not a ctypes type" in str(ctypes_kind(ggml.ggml_tensor_p))
    assert compare(headers.prototypes["ggml_backend_alloc_buffer"], ggml.ggml_backend_alloc_buffer.argtypes,
                   ggml.ggml_tensor_p)[0].startswith("returns ptr, ctypes says not a ctypes type")


def test_a_changed_header_is_caught(headers: Headers, tmp_path: Path) -> None:
    """What a future ggml bump looks like: an argument widened, an enum value inserted in the
    middle (as ggml 0.25 did to enum ggml_op), a macro renumbered."""
    for h in headers.header_names:
        shutil.copy(INCLUDE / h, tmp_path / h)
    ggml_h = tmp_path / "ggml.h"
    text = ggml_h.read_text()
    text, n1 = re.subn(r"(ggml_rope_ext\(\s*struct ggml_context \* ctx,\s*struct ggml_tensor  \* a,\s*"
                       r"struct ggml_tensor  \* b,\s*struct ggml_tensor  \* c,\s*)int  ", r"\1int64_t ", text)
    text, n2 = re.subn(r"(GGML_TRI_TYPE_UPPER_DIAG\s*=\s*)(\d+)", lambda m: m.group(1) + str(int(m.group(2)) + 7), text)
    text, n3 = re.subn(r"#define GGML_ROPE_TYPE_NEOX\s+\d+", "#define GGML_ROPE_TYPE_NEOX 3", text)
    ggml_h.write_text(text)
    backend_h = tmp_path / "ggml-backend.h"
    btext, n4 = re.subn(r"(enum ggml_backend_dev_type \{\s*)", r"\1GGML_BACKEND_DEVICE_TYPE_NEW,\n", backend_h.read_text())
    backend_h.write_text(btext)
    assert (n1, n3, n4) == (1, 1, 1), "the header no longer reads as this test expects: update the edits"
    changed = Headers(tmp_path)
    names = used_names()
    fn = function_problems(names, changed)
    assert fn == [f"ggml_rope_ext: argument 5 is int64, ctypes says int32   [{changed.prototypes['ggml_rope_ext'].text}]"]
    values = value_problems(names, changed)
    assert "GGML_ROPE_TYPE_NEOX = 2 in ggml-python, 3 in the headers (#define)" in values
    assert any(v.startswith("GGML_BACKEND_DEVICE_TYPE_CPU = 0 in ggml-python, 1 in the headers") for v in values)
    assert any(v.startswith("GGML_BACKEND_DEVICE_TYPE_ACCEL") for v in values)
    if n2:  # enum values after an explicitly numbered one move with it
        assert not [v for v in values if v.startswith("GGML_TRI_TYPE_LOWER ")]


def test_the_reader_evaluates_enums_like_the_compiler(headers: Headers, tmp_path: Path) -> None:
    # the enum values read from the AST against the values the C compiler prints, for every enum
    # value deltarun uses (implicit increments, explicit numbers, shifts)
    names = sorted(n for n in used_names() if n in headers.enums)
    src = tmp_path / "values.c"
    src.write_text('#include "ggml.h"\n#include "ggml-backend.h"\n#include <stdio.h>\nint main(void) {\n'
                   + "".join(f'  printf("%lld\\n", (long long) {n});\n' for n in names) + "  return 0;\n}\n")
    import subprocess
    exe = tmp_path / "values"
    subprocess.run([shutil.which("gcc"), "-I", str(INCLUDE), str(src), "-o", str(exe)], check=True)
    printed = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert printed == [headers.enums[n] for n in names]
    assert ggml_headers.Kind("int", 4, True) == headers.kind(headers.typedefs["int32_t"])
