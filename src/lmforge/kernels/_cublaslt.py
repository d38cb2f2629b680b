"""cuBLASLt through ctypes: one GEMM with a chosen algorithm configuration.

torch's ``mm`` on CUDA runs whichever kernel cuBLAS's heuristic ranks first. cuBLASLt can list
several candidate algorithms for a problem (tile shape, stages, cluster shape, split-K, …) and
run any of them; timing each and keeping the fastest is what TunableOp does on ROCm (on CUDA it
only has the default). The heuristic lists at most 8 on an H200; an algorithm id also accepts
other configurations (on the H200's id 66: 634 tile ids × 8 custom options × cluster shapes ×
split-K), which :func:`search` explores in two screened stages and ``cublasLtMatmulAlgoCheck``
validates. This module is the thin binding: the library is the one torch already loaded (found
in the process's memory map), descriptors are built once per problem, and a planned GEMM runs
on torch's current stream with a workspace torch allocates, so it can be captured in a CUDA
graph.

Layouts: a row-major (M, N) result is, read column-major, its transpose, so ``a @ b`` with
a (M, K) and b (K, N) is computed as the column-major product (b's memory) · (a's memory) =
(a @ b)ᵀ of shape (N, M). Each operand is either contiguous or the transpose of a contiguous
tensor (what autograd hands a Linear layer: x, Wᵀ, dy, dyᵀ), which becomes cuBLASLt's "N" or
"T" operation on the same memory.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "LtError",
    "LtPlan",
    "available",
    "choices",
    "gemm",
    "plan",
    "preset_choices",
    "search",
    "summary",
    "variants",
]

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType CUDA_R_32F
_DTYPES = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}  # CUDA_R_16BF, _16F, _32F
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE = 1
_OP_N, _OP_T = 0, 1
_CONFIG_ATTRS = {  # cublasLtMatmulAlgoConfigAttributes_t: what identifies an algorithm
    "id": 0,
    "tile": 1,
    "splitk": 2,
    "reduction": 3,
    "swizzle": 4,
    "custom": 5,
    "stages": 6,
    "cluster": 8,
}
_INNER_SHAPE = 7  # CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID (part of an algorithm's identity too)
# cublasLtMatmulAlgoCapAttributes_t: what an algorithm id can be configured with
_CAP_SPLITK, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_STAGES_IDS = 0, 6, 7, 13
# cublasLtClusterShape_t values tried in the wide search: 1x1, 2x1, 4x1, 1x2, 2x2, 1x4 (Hopper's
# GEMMs use clusters of at most 4); the check drops what an algorithm cannot run. The winners
# of a full grid on GPT-2-small's GEMMs (634 tiles × 8 custom options × these, run 41) differed
# from the heuristic's in tile and custom option together; the cluster shape mattered less.
_CLUSTERS = (2, 3, 4, 5, 6, 8)
_SPLITS = (2, 3, 4, 6, 8)  # split-K factors tried on the heuristic's own configurations
_REDUCE_IN_COMPUTE_TYPE = 2  # CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
WORKSPACE_BYTES = 32 * 2**20


class LtError(RuntimeError):
    """cuBLASLt is missing or refused a call (the status code is in the message)."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


_LIB: ctypes.CDLL | None = None
_HANDLE: ctypes.c_void_p | None = None
_WORKSPACE: dict[int, torch.Tensor] = {}


def _find_library() -> str | None:
    """The path of the libcublasLt torch loaded (after its first CUDA matmul), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcublasLt.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def _lib() -> ctypes.CDLL:
    global _LIB, _HANDLE
    if _LIB is not None:
        return _LIB
    if not torch.cuda.is_available():
        raise LtError("cuBLASLt needs CUDA")
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)  # makes torch load (and initialise) cuBLAS and cuBLASLt
    path = _find_library()
    if path is None:
        raise LtError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(path)
    vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i32, i32]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, ctypes.c_uint64,
                                               ctypes.c_uint64, ctypes.c_int64]  # fmt: skip
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32,
                                                   ctypes.POINTER(_Heuristic),
                                                   ctypes.POINTER(i32)]  # fmt: skip
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [ctypes.POINTER(_Algo), i32, vp, sz,
                                                         ctypes.POINTER(sz)]  # fmt: skip
    lib.cublasLtMatmulAlgoConfigSetAttribute.argtypes = [ctypes.POINTER(_Algo), i32, vp, sz]
    lib.cublasLtMatmulAlgoCapGetAttribute.argtypes = [ctypes.POINTER(_Algo), i32, vp, sz,
                                                      ctypes.POINTER(sz)]  # fmt: skip
    lib.cublasLtMatmulAlgoCheck.argtypes = [vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo),
                                            ctypes.POINTER(_Heuristic)]  # fmt: skip
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp,
                                   ctypes.POINTER(_Algo), vp, sz, vp]  # fmt: skip
    for name in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                 "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                 "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
                 "cublasLtMatmulAlgoConfigGetAttribute", "cublasLtMatmulAlgoConfigSetAttribute",
                 "cublasLtMatmulAlgoCapGetAttribute", "cublasLtMatmulAlgoCheck",
                 "cublasLtMatmul"):  # fmt: skip
        getattr(lib, name).restype = i32
    handle = vp()
    _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    _LIB, _HANDLE = lib, handle
    return lib


def available() -> bool:
    """Whether cuBLASLt can be called here (CUDA, and torch's copy of the library found)."""
    try:
        _lib()
        return True
    except (LtError, OSError, AttributeError):
        return False


def _check(status: int, what: str) -> None:
    if status != 0:
        raise LtError(f"{what} failed with cuBLAS status {status}")


def _workspace(device: torch.device) -> torch.Tensor:
    index = device.index if device.index is not None else torch.cuda.current_device()
    ws = _WORKSPACE.get(index)
    if ws is None:
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WORKSPACE[index] = ws
    return ws


def _operand(t: torch.Tensor) -> tuple[bool, int, int, int]:
    """(transposed, rows, cols, ld) of a row-major 2-D operand as cuBLASLt's column-major
    matrix: contiguous (r, c) is column-major (c, r) with ld = c; the transpose of a contiguous
    (c, r) tensor is column-major (r, c) with ld = r."""
    r, c = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(1, c):
        return False, c, r, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, r):
        return True, r, c, t.stride(1)
    raise LtError(f"operand of shape {tuple(t.shape)} and strides {t.stride()} is not a matrix")


@dataclass
class LtPlan:
    """One GEMM problem (shapes, layouts, dtype) with its candidate algorithms."""

    key: tuple
    desc: ctypes.c_void_p
    a_desc: ctypes.c_void_p  # cuBLASLt's A: the memory of torch's b
    b_desc: ctypes.c_void_p  # cuBLASLt's B: the memory of torch's a
    c_desc: ctypes.c_void_p
    algos: list[_Heuristic]  # cuBLASLt's heuristic list first, then what a search appended
    listed: int = -1  # how many of ``algos`` the heuristic listed (-1: all of them)

    def __post_init__(self) -> None:
        if self.listed < 0:
            self.listed = len(self.algos)

    def describe(self, i: int) -> str:
        """The i-th algorithm's identifying configuration, e.g. 'id=66 tile=… stages=…'."""
        algo = self.algos[i].algo
        parts = []
        for name, attr in _CONFIG_ATTRS.items():
            value = _get_config(algo, attr)
            if value is not None:
                parts.append(f"{name}={value}")
        return " ".join(parts) + f" ws={self.algos[i].workspace_size}"

    def run(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        out: torch.Tensor,
        algo: int = 0,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """out = a @ b (or out += a @ b) with the ``algo``-th candidate; no checks beyond the
        plan's key (callers get the plan from ``plan`` with the same tensors)."""
        lib = _lib()
        alpha = ctypes.c_float(1.0)
        beta = ctypes.c_float(1.0 if accumulate else 0.0)
        ws = _workspace(out.device)
        stream = torch.cuda.current_stream(out.device).cuda_stream
        _check(
            lib.cublasLtMatmul(
                _HANDLE, self.desc, ctypes.byref(alpha), ctypes.c_void_p(b.data_ptr()),
                self.a_desc, ctypes.c_void_p(a.data_ptr()), self.b_desc, ctypes.byref(beta),
                ctypes.c_void_p(out.data_ptr()), self.c_desc, ctypes.c_void_p(out.data_ptr()),
                self.c_desc, ctypes.byref(self.algos[algo].algo), ctypes.c_void_p(ws.data_ptr()),
                ws.numel(), ctypes.c_void_p(stream),
            ),
            "cublasLtMatmul",
        )  # fmt: skip
        return out


_PLANS: dict[tuple, LtPlan] = {}


def _attr_size(algo: _Algo, attr: int) -> int:
    """The byte size of a configuration attribute (reads and writes must match it), or 0."""
    size = ctypes.c_size_t(0)
    if _lib().cublasLtMatmulAlgoConfigGetAttribute(
        ctypes.byref(algo), attr, None, 0, ctypes.byref(size)
    ) or size.value not in (1, 2, 4, 8):
        return 0
    return size.value


def _get_config(algo: _Algo, attr: int) -> int | None:
    size = _attr_size(algo, attr)
    if not size:
        return None
    value = ctypes.c_uint64(0)  # little-endian: a narrower attribute lands in the low bytes
    written = ctypes.c_size_t(0)
    status = _lib().cublasLtMatmulAlgoConfigGetAttribute(
        ctypes.byref(algo), attr, ctypes.byref(value), size, ctypes.byref(written)
    )
    return value.value if status == 0 else None


def _set_config(algo: _Algo, attr: int, value: int) -> bool:
    size = _attr_size(algo, attr)
    if not size:
        return False
    buf = ctypes.c_uint64(value)
    return _lib().cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr,
                                                       ctypes.byref(buf), size) == 0  # fmt: skip


def _cap(algo: _Algo, attr: int, many: bool = False) -> list[int]:
    """A capability of the algorithm's id: one 32-bit value, or (``many``) a list of them (tile
    ids, stage ids); empty when the library does not report it."""
    size = 4096 if many else 1
    buf = (ctypes.c_uint32 * size)()
    written = ctypes.c_size_t(0)
    status = _lib().cublasLtMatmulAlgoCapGetAttribute(
        ctypes.byref(algo), attr, buf, 4 * size, ctypes.byref(written)
    )
    if status != 0:
        return []
    return list(buf[: min(size, written.value // 4)])


def _caps_text(p: LtPlan, i: int = 0) -> str:
    """What the i-th candidate's algorithm id can be configured with (for probes)."""
    algo = p.algos[i].algo
    tiles = _cap(algo, _CAP_TILE_IDS, many=True)
    stages = _cap(algo, _CAP_STAGES_IDS, many=True)
    return (f"id {_get_config(algo, _CONFIG_ATTRS['id'])}: {len(tiles)} tiles {tiles[:40]}, "
            f"stages {stages[:40]}, custom options ≤ {_cap(algo, _CAP_CUSTOM_MAX)}, "
            f"split-K {_cap(algo, _CAP_SPLITK)}")  # fmt: skip


def _signature(algo: _Algo) -> tuple:
    return tuple(_get_config(algo, a) for a in (*_CONFIG_ATTRS.values(), _INNER_SHAPE))


def variants(
    base: dict[str, int],
    tiles: list[int] | None = None,
    customs: int | None = None,
    clusters: tuple[int, ...] = (),
    splits: tuple[int, ...] = (),
) -> list[dict[str, int]]:
    """Configurations around one candidate ``base`` ({"tile", "custom", "cluster", "splitk",
    "reduction"}): each of ``tiles`` × custom options 0..``customs`` × ``clusters`` (an omitted
    axis keeps the base's value; its own cluster comes first), then the base with each split-K
    factor of ``splits`` (reducing in the compute type where it had no reduction). Pure (no
    library), ordered, without ``base`` itself and without repeats."""
    tile_axis = tiles if tiles else [base["tile"]]
    custom_axis = range(customs + 1) if customs is not None and customs >= 0 else [base["custom"]]
    grid = itertools.product(tile_axis, custom_axis, (base["cluster"], *clusters))
    trials = [{**base, "tile": t, "custom": c, "cluster": k} for t, c, k in grid]
    trials += [{**base, "splitk": s, "reduction": base["reduction"] or _REDUCE_IN_COMPUTE_TYPE}
               for s in splits if s != base["splitk"]]  # fmt: skip
    out: list[dict[str, int]] = []
    seen = {tuple(sorted(base.items()))}
    for trial in trials:
        key = tuple(sorted(trial.items()))
        if key not in seen:
            seen.add(key)
            out.append(trial)
    return out


SEARCH = "wide"
"""Which candidates a tuned problem considers: ``heuristic`` (cuBLASLt's list, up to 8 on an
H200), or ``wide``: also configurations around them that cuBLASLt's check accepts, found in two
screened stages (:func:`search`)."""
_NAMES = ("tile", "custom", "cluster", "splitk", "reduction")
TOP_CONFIGS = 8  # configurations whose cluster shapes the wide search's second stage tries


def _config(algo: _Algo) -> dict[str, int] | None:
    current = {n: _get_config(algo, _CONFIG_ATTRS[n]) for n in _NAMES}
    return None if any(v is None for v in current.values()) else current  # type: ignore[return-value]


def _accepted(p: LtPlan, algo: _Algo) -> _Heuristic | None:
    """``algo`` as a candidate of ``p`` (its workspace size filled in) if cuBLASLt's check
    accepts it for this problem within our workspace, else None."""
    result = _Heuristic()
    if _lib().cublasLtMatmulAlgoCheck(_HANDLE, p.desc, p.a_desc, p.b_desc, p.c_desc, p.c_desc,
                                      ctypes.byref(algo), ctypes.byref(result)) != 0:  # fmt: skip
        return None
    if result.state != 0 or result.workspace_size > WORKSPACE_BYTES:
        return None
    result.algo = algo
    return result


def _extend(p: LtPlan, around: list[int], **axes: object) -> list[int]:
    """The indices in ``p.algos`` of the configurations :func:`variants` lists around each
    candidate in ``around`` (``axes``: its keyword arguments; tiles=True means every tile the
    algorithm id has, customs=True every custom option) that cuBLASLt's check accepts with a
    workspace within ours, appending those not there yet."""
    seen = {_signature(h.algo): i for i, h in enumerate(p.algos)}
    added: list[int] = []
    taken: set[int] = set()
    for i in around:
        h = p.algos[i]
        current = _config(h.algo)
        if current is None:
            continue
        kw = dict(axes)
        if kw.get("tiles") is True:
            kw["tiles"] = _cap(h.algo, _CAP_TILE_IDS, many=True)
        if kw.get("customs") is True:
            kw["customs"] = (_cap(h.algo, _CAP_CUSTOM_MAX) or [0])[0]
        if kw.get("splits") and not (_cap(h.algo, _CAP_SPLITK) or [0])[0]:
            kw["splits"] = ()
        for trial in variants(current, **kw):  # type: ignore[arg-type]
            algo = _Algo.from_buffer_copy(h.algo)
            if not all(_set_config(algo, _CONFIG_ATTRS[n], v) for n, v in trial.items()):
                continue
            result = _accepted(p, algo)
            if result is None:
                continue
            sig = _signature(algo)
            if sig not in seen:
                p.algos.append(result)
                seen[sig] = len(p.algos) - 1
            if seen[sig] not in taken:
                taken.add(seen[sig])
                added.append(seen[sig])
    return added


def search(p: LtPlan, time_one: Callable[[int], float]) -> list[int]:
    """The wide search on a plan: candidate indices, fastest first by one quick timing each
    (``time_one(i)``: ms, or raises LtError). Stage 1 times the heuristic's candidates and, on
    one of them per distinct (split-K, reduction), every tile × custom option (cluster shape
    kept) plus split-K factors; stage 2 every cluster shape on the ``TOP_CONFIGS`` fastest.
    Appends what it tries to ``p.algos``."""
    quick: dict[int, float] = {}

    def screen(indices: list[int]) -> None:
        for i in indices:
            if i not in quick:
                try:
                    quick[i] = time_one(i)
                except LtError:
                    continue

    heuristic = list(range(p.listed))
    bases: dict[tuple, int] = {}  # one per (split-K, reduction): tiles are searched on it
    for i in heuristic:
        c = _config(p.algos[i].algo)
        if c is not None:
            bases.setdefault((c["splitk"], c["reduction"]), i)
    screen(heuristic + _extend(p, list(bases.values()), tiles=True, customs=True, splits=_SPLITS))
    tops = sorted(quick, key=quick.__getitem__)[:TOP_CONFIGS]
    screen(_extend(p, tops, clusters=_CLUSTERS))
    return sorted(quick, key=quick.__getitem__)


def plan(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
         candidates: int = 16, wide: bool = False) -> LtPlan:  # fmt: skip
    """The plan (descriptors and up to ``candidates`` heuristic algorithms, best-ranked first)
    for ``a @ b`` with a (M, K) and b (K, N), each contiguous or a transposed contiguous tensor,
    of one dtype (bf16, fp16 or fp32), output row-major (M, N) of ``out_dtype`` (a's dtype).
    ``wide``: a plan of its own, which the wide search (:func:`search`) extends."""
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise LtError(f"cuBLASLt GEMM needs two bf16, fp16 or fp32 operands, got {a.dtype}, "
                      f"{b.dtype}")  # fmt: skip
    out_dtype = out_dtype or a.dtype
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise LtError(f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    ta, ar, ac, alda = _operand(b)  # cuBLASLt's A (N×K after op) is torch's b
    tb, br, bc, bldb = _operand(a)  # cuBLASLt's B (K×M after op) is torch's a
    key = (m, n, k, ta, ar, ac, alda, tb, br, bc, bldb, a.dtype, out_dtype, candidates, wide)
    found = _PLANS.get(key)
    if found is not None:
        return found
    lib = _lib()
    vp = ctypes.c_void_p
    desc = vp()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "desc")
    for attr, trans in ((_DESC_TRANSA, ta), (_DESC_TRANSB, tb)):
        op = ctypes.c_int(_OP_T if trans else _OP_N)
        _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(op), 4), "trans")
    dt, odt = _DTYPES[a.dtype], _DTYPES[out_dtype]
    a_desc, b_desc, c_desc = vp(), vp(), vp()
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(a_desc), dt, ar, ac, alda), "layout A")
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(b_desc), dt, br, bc, bldb), "layout B")
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(c_desc), odt, n, m, n), "layout C")
    pref = vp()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    ws = ctypes.c_uint64(WORKSPACE_BYTES)
    _check(
        lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8),
        "workspace preference",
    )
    results = (_Heuristic * candidates)()
    count = ctypes.c_int(0)
    _check(
        lib.cublasLtMatmulAlgoGetHeuristic(_HANDLE, desc, a_desc, b_desc, c_desc, c_desc, pref,
                                           candidates, results, ctypes.byref(count)),
        "cublasLtMatmulAlgoGetHeuristic",
    )  # fmt: skip
    algos = [results[i] for i in range(count.value) if results[i].state == 0]
    if not algos:
        raise LtError(f"cuBLASLt has no algorithm for {tuple(a.shape)} @ {tuple(b.shape)}")
    found = LtPlan(key, desc, a_desc, b_desc, c_desc, algos)
    _PLANS[key] = found
    return found


# -- the tuned GEMM: torch's kernel or the fastest cuBLASLt candidate, chosen once per problem

_CHOICE: dict[tuple, int] = {}  # problem key (with accumulate) → -1 (torch) or candidate index
_PRESET: dict[str, dict] = {}  # choices a checkpoint recorded, by key text (see preset_choices)
TUNING_LOG: list[str] = []  # one line per tuned problem: what was timed, what was chosen
_TUNED: list[tuple[float, bool]] = []  # per tuned problem: seconds spent, another kernel chosen
MIN_GAIN = 0.02  # a candidate must beat torch's kernel by this fraction to replace it
SCREEN_KEEP = 8  # candidates (besides torch's) that go on to the timed rounds


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """t itself when cuBLASLt can read it (contiguous, or a contiguous tensor's transpose)."""
    r, c = t.shape
    if (t.stride(1) == 1 and t.stride(0) >= max(1, c)) or (
        t.stride(0) == 1 and t.stride(1) >= max(1, r)
    ):
        return t
    return t.contiguous()


def _torch_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """out = a @ b (out += a @ b with ``accumulate``): a (M, K), b (K, N) CUDA bf16/fp16, out
    (M, N) contiguous of the same dtype, with the kernel tuned for this problem on its first
    call (outside CUDA-graph capture; during a capture an untuned problem runs torch's)."""
    a, b = _matrix(a), _matrix(b)
    try:
        p = plan(a, b, out.dtype, wide=SEARCH == "wide")
    except LtError:  # no candidate for this problem: torch's kernel
        _torch_gemm(a, b, out, accumulate)
        return
    key = (*p.key, accumulate)
    choice = _CHOICE.get(key)
    if choice is None:
        choice = _preset(p, key)
        if choice is not None:
            _CHOICE[key] = choice
        elif torch.cuda.is_current_stream_capturing():
            choice = -1
        else:
            choice = _CHOICE[key] = _tune(p, a, b, out, accumulate)
    if choice < 0:
        _torch_gemm(a, b, out, accumulate)
    else:
        p.run(a, b, out, choice, accumulate)


def _tune(p: LtPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> int:
    """Check the candidates against torch's result on these operands, time the good ones with
    torch's kernel in interleaved rounds (CUDA events, medians), return the fastest's index (-1:
    torch's, unless a candidate is MIN_GAIN faster). On a wide plan the candidates come from
    :func:`search`, fastest first, and the ``SCREEN_KEEP`` fastest that are correct go on to the
    rounds. ``out`` is left as it was."""
    began = time.perf_counter()
    base = out.clone() if accumulate else None
    scratch = torch.empty_like(out)

    def call(c: int) -> None:
        if c < 0:
            _torch_gemm(a, b, scratch, accumulate)
        else:
            p.run(a, b, scratch, c, accumulate)

    def fresh() -> None:
        if base is not None:
            scratch.copy_(base)

    def timed(c: int, calls: int) -> float:
        fresh()
        call(c)  # warm
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            call(c)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    order = list(range(p.listed))
    if p.key[-1]:  # a wide plan: the staged search, fastest first
        order = search(p, lambda c: timed(c, 2))
    fresh()
    call(-1)
    want = scratch.float()
    tol = 2.0**-6 * float(want.abs().max()) + 1e-6
    good = [-1]
    for c in order:
        if len(good) > SCREEN_KEEP:
            break
        fresh()
        try:
            call(c)
        except LtError:
            continue
        if float((scratch.float() - want).abs().max()) <= tol:
            good.append(c)
    del want
    times: dict[int, list[float]] = {c: [] for c in good}
    for r in range(7):  # rounds, each candidate in turn: drifts in clock or power hit all alike
        for c in good[r % len(good) :] + good[: r % len(good)]:  # and none always goes first
            times[c].append(timed(c, 3))
    med = {c: sorted(v)[len(v) // 2] for c, v in times.items()}
    best = min(med, key=med.__getitem__)
    if best >= 0 and med[best] > (1.0 - MIN_GAIN) * med[-1]:
        best = -1
    m, k = a.shape
    n = b.shape[1]
    TUNING_LOG.append(
        f"{m}×{k}×{n}{' +=' if accumulate else ''} a{'ᵀ' if a.stride(0) == 1 else ''} "
        f"b{'ᵀ' if b.stride(0) == 1 else ''}: torch {1e3 * med[-1]:.1f} µs, "
        + (f"candidate #{best} {1e3 * med[best]:.1f} µs ({p.describe(best)})" if best >= 0
           else "kept")
        + f"; {len(good) - 1} correct candidates timed of {len(p.algos)}; "
        f"{time.perf_counter() - began:.1f} s"
    )  # fmt: skip
    _TUNED.append((time.perf_counter() - began, best >= 0))
    return best


def summary() -> str:
    """One line on the problems tuned in this process so far ('' when none)."""
    if not _TUNED:
        return ""
    seconds = sum(t for t, _ in _TUNED)
    faster = sum(1 for _, f in _TUNED if f)
    return (f"tuned {len(_TUNED)} GEMM problems in {seconds:.1f} s ({SEARCH} search): "
            f"{faster} run a faster cuBLASLt kernel than torch's")  # fmt: skip


# -- choices across runs: a checkpoint records them so that a resumed run uses the same kernels
# (the same last bits) instead of timing again. An entry is the candidate's index in cuBLASLt's
# list and its configuration; it is used only if this library lists the same configuration at
# that index (another GPU or cuBLAS version tunes afresh).


def _key_text(key: tuple) -> str:
    return "|".join(str(k) for k in key)


def _describe(p: LtPlan, choice: int) -> str:
    return "torch" if choice < 0 else p.describe(choice)


def choices() -> dict[str, dict]:
    """The choices made in this process: {key text: {"index": i, "algo": configuration}}."""
    out = {}
    for key, choice in _CHOICE.items():
        p = _PLANS.get(key[:-1])
        if p is not None:
            out[_key_text(key)] = {"index": choice, "algo": _describe(p, choice)}
    return out


def preset_choices(saved: dict[str, dict]) -> None:
    """Use these recorded choices (from :func:`choices`) for problems not tuned yet."""
    for text, entry in saved.items():
        if isinstance(entry, dict) and isinstance(entry.get("index"), int):
            _PRESET[text] = entry


def _preset(p: LtPlan, key: tuple) -> int | None:
    entry = _PRESET.get(_key_text(key))
    if entry is None:
        return None
    index, text = entry["index"], entry.get("algo")
    if index < 0:
        return -1 if text == "torch" else None
    if index < len(p.algos) and _describe(p, index) == text:
        return index
    return _rebuild(p, str(text))  # a wide search's pick: its index depends on the timings


def _rebuild(p: LtPlan, text: str) -> int | None:
    """The index in ``p.algos`` of the configuration ``text`` describes (``describe``'s form),
    appended after cuBLASLt's check accepts it; None when it does not (another library)."""
    for i in range(len(p.algos)):
        if p.describe(i) == text:
            return i
    try:
        want = dict(part.split("=", 1) for part in text.split())
        values = {k: int(v) for k, v in want.items()}
    except ValueError:
        return None
    base = next((h for h in p.algos if _get_config(h.algo, _CONFIG_ATTRS["id"]) == values.get("id")),
                None)  # fmt: skip
    if base is None:
        return None
    algo = _Algo.from_buffer_copy(base.algo)
    for name, attr in _CONFIG_ATTRS.items():
        if name != "id" and name in values and not _set_config(algo, attr, values[name]):
            return None
    result = _accepted(p, algo)
    if result is None:
        return None
    p.algos.append(result)
    if p.describe(len(p.algos) - 1) != text:
        p.algos.pop()
        return None
    return len(p.algos) - 1
