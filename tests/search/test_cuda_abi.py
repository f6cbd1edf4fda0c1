"""The host-kernel ABI of the CUDA backend (search_service/cuda/abi.py),
checked without a GPU or CuPy: the table is consistent (fields inside their
records, no overlaps, aligned), its layouts are the ones the kernels were
written for, the generated header is the table, and the kernels' sources
take every shared constant and row offset from it by name."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from search_service.cuda import abi, module
from search_service.mcts import tree as tr

_DEFINE = re.compile(r"^#define (\w+) \(?(-?\d+)\)?\s", re.M)
_ABI_PREFIXES = tuple(f"{layout.prefix}_" for layout in abi.LAYOUTS)


def _code(text: str) -> str:
    """C source without comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _kernel_sources() -> dict[str, str]:
    return {name: _code((module.KERNEL_DIR / name).read_text()) for name in module.KERNEL_FILES}


@pytest.mark.parametrize("layout", abi.LAYOUTS, ids=lambda layout: layout.prefix)
def test_fields_fit_do_not_overlap_and_are_aligned(layout):
    used = np.zeros(layout.nbytes, np.int32)
    for f in layout.fields:
        start = f.offset * layout.word.itemsize
        assert start % f.dtype.itemsize == 0, f.name  # a u64 at an even 32-bit word
        assert 0 <= start and start + f.nbytes <= layout.nbytes, f.name
        used[start : start + f.nbytes] += 1
    assert used.max() == 1
    assert len({f.name for f in layout.fields}) == len(layout.fields)
    # Row b + 1 starts aligned for every field, and the dtype is the record.
    assert layout.nbytes % max(f.dtype.itemsize for f in layout.fields) == 0
    assert layout.dtype.itemsize == layout.nbytes
    for f in layout.fields:
        dtype, byte = layout.dtype.fields[f.name][:2]
        assert byte == f.offset * layout.word.itemsize
        assert dtype.base == f.dtype and dtype.shape == ((f.count,) if f.count > 1 else ())


def test_layouts_are_the_ones_the_kernels_were_written_for():
    # Bit-for-bit the rows before they had names (word offsets; widths in words).
    def offsets(layout):
        return {f.name: (f.offset, f.count) for f in layout.fields}, layout.words

    assert offsets(abi.RESULT) == ({
        "visits": (0, 7), "value_sum": (7, 7), "root_visits": (14, 1), "nodes": (15, 1), "max_depth": (16, 1),
        "done": (17, 1), "exhausted": (18, 1), "deadline": (19, 1), "pv_length": (20, 1), "pv": (21, 42),
        "cycles": (64, 4), "outcome": (72, 8),
    }, 74)
    assert offsets(abi.INIT) == ({
        "current": (0, 1), "mask": (2, 1), "nodes": (4, 1), "fresh": (5, 1), "root_visits": (6, 1),
        "has_priors": (7, 1), "priors": (8, 7),
    }, 16)
    assert offsets(abi.TREE_STATE) == ({
        "started": (0, 1), "done": (1, 1), "nodes": (2, 1), "exhausted": (3, 1), "max_depth": (4, 1),
        "deadline": (5, 1), "wave_base": (6, 1),
    }, 8)
    assert offsets(abi.CYCLES) == ({"select": (0, 1), "expand": (1, 1), "evaluate": (2, 1), "backup": (3, 1)}, 4)
    assert offsets(abi.META) == ({"leaf": (0, 1), "depth": (1, 1), "terminal": (2, 1), "leader": (3, 1)}, 4)
    assert offsets(abi.OBS) == ({"current": (0, 42), "opponent": (42, 42)}, 84)
    assert offsets(abi.EVAL) == ({"value": (0, 1), "priors": (1, 7)}, 8)
    assert offsets(abi.EDGE_RECORD) == ({"visits": (0, 1), "vloss": (1, 1), "value_sum": (2, 1), "prior": (3, 1)}, 4)
    assert offsets(abi.HEADER_RECORD) == (
        {"visits": (0, 1), "terminal": (1, 1), "parent": (2, 1), "action": (3, 1)}, 4)
    assert offsets(abi.POSITION) == ({"current": (0, 1), "mask": (1, 1)}, 2)
    assert [layout.nbytes for layout in abi.LAYOUTS] == [16, 16, 16, 64, 32, 32, 296, 16, 84, 32]
    assert (abi.ROW, abi.HEADER, abi.ROWS_BYTES, abi.CHILD_BYTES, abi.POS_BYTES, abi.NODE_BYTES) == (
        8, 7, 128, 32, 16, 176)
    # A node row: 7 edge records, then the header, one 128-byte line.
    assert abi.NODE_ROW.itemsize == abi.ROWS_BYTES == abi.ROW * abi.EDGE_RECORD.nbytes
    assert abi.NODE_ROW.fields["header"][1] == abi.HEADER * abi.EDGE_RECORD.nbytes
    assert abi.EDGE_RECORD.nbytes == abi.HEADER_RECORD.nbytes
    assert abi.OBS.words == 2 * abi.CELLS and abi.PHASES == ("select", "expand", "evaluate", "backup")
    assert abi.RESULT.dtype["cycles"].shape == (len(abi.PHASES),)


def test_constants_are_the_python_constants():
    names = [c.name for c in abi.CONSTANTS]
    assert len(set(names)) == len(names)
    for c in abi.CONSTANTS:  # abi's own, or the NumPy tree's codes
        assert getattr(abi if hasattr(abi, c.name) else tr, c.name) == c.value, c.name


def test_header_is_the_table():
    text = abi.header()
    assert text == abi.header()  # deterministic: NVRTC's input, and CuPy's cache key
    defines = _DEFINE.findall(text)
    names = [name for name, _ in defines]
    assert len(set(names)) == len(names) == text.count("#define ")
    expected = {c.name: c.value for c in abi.CONSTANTS}
    for layout in abi.LAYOUTS:
        expected.update({layout.macro(f.name): f.offset for f in layout.fields})
        expected[layout.macro("words")] = layout.words
    assert {name: int(value) for name, value in defines} == expected


def test_the_compiled_source_starts_with_the_header():
    src = module.source()
    assert src.startswith(f'// ==== {module.HEADER_NAME} ====\n#line 1 "{module.HEADER_NAME}"\n{abi.header()}')
    for name in module.KERNEL_FILES:
        assert f'#line 1 "{name}"\n{(module.KERNEL_DIR / name).read_text()}' in src


def test_kernels_take_shared_names_from_the_header_only():
    header = set(name for name, _ in _DEFINE.findall(abi.header()))
    for name, code in _kernel_sources().items():
        defined = set(re.findall(r"#define (\w+)", code))
        assert not defined & header, (name, defined & header)  # one source: abi.py
        used = {w for w in re.findall(r"\b[A-Z][A-Z0-9_]+\b", code) if w.startswith(_ABI_PREFIXES)}
        assert used <= header, (name, used - header)


# Kernel pointers to ABI rows (search.cu's names): a row pointer and the field
# subscripts on it, or an array base and the row stride it is advanced by.
_ROW_POINTERS = ("in", "out", "ts", "m", "ev", "o")
_ROW_ARRAYS = ("init", "res", "tsa", "cyc", "meta", "vin", "obs")


def test_kernels_index_rows_by_name_not_by_number():
    code = _kernel_sources()
    search = code["search.cu"]
    # The one number allowed in a field subscript: the high word of a u64 field.
    wide = "|".join(layout.macro(f.name) for layout in abi.LAYOUTS for f in layout.fields
                    if f.dtype.itemsize > layout.word.itemsize)
    for ptr in _ROW_POINTERS:
        for index in re.findall(rf"\b{ptr}\[([^\]]*)\]", search):
            assert not re.search(r"\b\d+\b", index) or re.fullmatch(rf"(?:{wide}) \+ 1", index), (ptr, index)
    for arr in _ROW_ARRAYS:
        for stride in re.findall(rf"\b{arr} \+ ([^;,]*)", search):
            assert re.search(r"\b[A-Z][A-Z_]+_WORDS\b", stride), (arr, stride)
    # The numbers the rows were once read by do not come back (nor the header
    # record's index, nor the shared-memory table's size).
    for name, text in code.items():
        assert not re.search(r"\b(72|84|1024)\b", text), name
        assert not re.search(r"ROW \+ 7\b|\[7\]|, 7\)|\brec \+ \d", text), name
        assert "__launch_bounds__(128)" not in text, name


def test_carve_slices_one_buffer_in_order():
    buf = np.arange(40, dtype=np.uint8)
    a, b, c = abi.carve(buf, 16, 8, 16)
    assert a[0] == 0 and b[0] == 16 and c[0] == 24 and len(c) == 16
    assert c.view(np.uint64).shape == (2,)
    with pytest.raises(ValueError, match="expected 32 bytes"):
        abi.carve(buf, 16, 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        abi.carve(buf, 4, 36)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_the_source_compiles(tmp_path):
    # What NVRTC gets on a GPU host, compiled ahead of time for an H100/H200.
    cu = tmp_path / "mcts.cu"
    cu.write_text(module.source())
    cmd = ["nvcc", "-arch=sm_90", *module.OPTIONS, "-c", "-o", str(tmp_path / "mcts.o"), str(cu)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
