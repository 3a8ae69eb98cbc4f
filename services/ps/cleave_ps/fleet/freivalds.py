"""Freivalds' check of every result block on the PS (pure numpy, no I/O): a worker's block C for the tile
A·Btᵀ (A: rows x K of `a`, Bt: cols x K of `bt`) is compared as `C·x` against `A·(Btᵀ·x)` for a random
vector x, in O(rows·K + cols·K + rows·cols) instead of the tile's O(rows·cols·K).

x has a random sign and a magnitude in [1, 2) in every entry, drawn from the operating system's randomness
for each GEMM run, one entry per column of its output (a block reads the entries of its columns; the blocks of
one column strip share Btᵀ·x, computed once, `Strip`);
it never leaves the PS, so no worker can predict it or learn it from another block: a wrong element δ moves
its row's residual by at least |δ|, and several wrong elements cancel only by chance. Honest blocks differ from the exact product by float rounding;
the tolerance of each row bounds that rounding under the usual model (each operation rounds by at most the
unit roundoff u, independently; the random signs of x make the sum over a row's columns a random walk), times
`DEFAULT_Z`, for any order of summation a worker may use (sequential sums are the worst):

- the worker's float32 accumulation over K: u·√K·‖aᵢ‖·‖x∘‖bⱼ‖‖ (Cauchy-Schwarz bounds Σₖ|aᵢₖ·bⱼₖ| by
  ‖aᵢ‖·‖bⱼ‖);
- the PS's own sums: y = Btᵀ·x as partial sums of 16 rows in float32 (u·√16·‖aᵢ‖·‖x∘‖bⱼ‖‖) added up in float64
  (u₆₄·cols·‖aᵢ‖·Σⱼ|xⱼ|·‖bⱼ‖, bounded by u₆₄·cols·√cols·‖aᵢ‖·‖x∘‖bⱼ‖‖: next to nothing), y rounded to float32
  and A·y summed over K in float32 (u·(√K + 1)·‖aᵢ‖·‖y‖), and C·x in float32 (u·√cols·Σⱼ|cᵢⱼ·xⱼ|, bounded by
  u·√cols·‖cᵢ‖·‖x‖, or by u·cols·‖cᵢ∘x‖ for a half-precision block, which needs that norm anyway);
- a bf16 or fp16 block's rounding to its dtype: u_out·‖cᵢ∘x‖, and where its elements are subnormal, half their
  spacing each: s·Σⱼ|xⱼ| ≤ s·√cols·‖x‖ (a hard bound, not a multiple of `DEFAULT_Z`).

The norms of `a`'s and `bt`'s rows are computed once per GEMM run (`Norms`), Btᵀ·x and the tolerance's
terms that do not depend on the block once per strip (`Strip`), and A·y for every strip of the run's tiles in
one product; a block's own check reads the block itself, once (and its rows of A for a strip the tiles did not
name): a float32 block whose residuals are within the tolerance
less C·x's rounding term (which needs ‖cᵢ‖, a second pass over the block) passes without reading it again (the
verdict is the same: the tolerance only grows with that term). `tests/unit/test_freivalds.py`
measures how far honest blocks stay below the tolerance and which lies it catches; `benchmarks/step.py`
what the checks cost the PS per step.
"""

from __future__ import annotations

import functools
import math
import secrets
import threading
from dataclasses import dataclass

import numpy as np
import threadpoolctl
import torch

DEFAULT_Z = 10.0  # the tolerance in multiples of the rounding bound (honest blocks measured at most 1/4 of it)
U32 = 2.0**-24  # float32's unit roundoff: workers accumulate in float32 whatever the job's precision
U64 = 2.0**-53  # float64's
CHUNK_ELEMENTS = 1 << 15  # of bt converted to float64 at once (256 KiB)
PARTIAL = 16  # rows of bt summed in float32 by BLAS for each of Btᵀ·x's partial sums, which add up in float64
PRODUCT_ELEMENTS = 1 << 17  # of a multiplied at once by its strips' vectors (512 KiB of float32)
TINY_SQUARES = 2.0**-100  # a row's sum of squares below this may have underflowed float32: taken in float64
FLOOR = 1e-30  # absolute slack per term, for blocks of (near) zeros: underflow, not lies
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNIT_ROUNDOFF = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}  # of a block's rounding to its dtype
# ... which is relative only above the dtype's subnormals: below, a value rounds by up to half their spacing (a
# weight gradient of float16 at a large learning rate had elements of 2**-24: 14 times the relative bound)
SUBNORMAL_ROUNDOFF = {"float32": 0.0, "bfloat16": 2.0**-134, "float16": 2.0**-25}


def as_float32(t: torch.Tensor) -> np.ndarray:
    """A float32 numpy view (a copy, for half precision) of a CPU tensor, converted by numpy in its own layout
    (torch's conversion wakes its thread pool: 2 to 3 times the CPU on a busy PS)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return block_float32(t.view(torch.int16).numpy(), "bfloat16")
    return t.numpy() if t.dtype == torch.float32 else t.numpy().astype(np.float32)


def block_float32(block: np.ndarray, dtype: str) -> np.ndarray:
    """A result block as read from its message (bf16 as its int16 bits) in float32 (a view when it is)."""
    if dtype == "bfloat16":
        bits = block.astype(np.int32)  # (sign-extended: the shift below drops those bits)
        bits <<= 16
        return bits.view(np.float32)
    return block if block.dtype == np.float32 else block.astype(np.float32)


def mv(m: np.ndarray, v: np.ndarray) -> np.ndarray:
    """m · v by BLAS's gemv (three times numpy's einsum: 4 against 13 µs for 256 x 256), on the calling thread
    once `one_blas_thread` has run (the PS runs it at start)."""
    return m @ v


@functools.cache
def one_blas_thread() -> None:
    """numpy's BLAS on the calling thread alone, for the whole process: the checks run beside the training thread,
    and a thread pool's barrier costs more than a pass over memory when the machine is busy (measured: 15 ms for
    a 256 x 256 product). Torch's own BLAS and threads are not touched."""
    threadpoolctl.threadpool_limits(1, user_api="blas")


class Norms:
    """Row norms of a GEMM run's inputs and its random vector, computed once (`ready`: as its tiles are dealt,
    `examine.prepare`, or by its first check if that comes first) and shared by all its checks, which may run
    in several threads; with the run's column strips known (`planned`, from its tiles), also every strip's y
    and A·[y₁ … y_S] in one product, so that A is read once for all strips and a block's check reads only the
    block (`ay`; a strip not planned is computed by its first check). Computed with numpy on the calling
    thread: torch's reductions wake its thread pool, which on a busy PS cost 10 to 50 times the pass itself
    (measured: 12 ms against 0.3 ms for 1,024 rows of 128)."""

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, planned: tuple[tuple[int, int], ...] = ()) -> None:
        self.a, self.bt = a.detach(), bt.detach()  # (a weight requires grad; its values are all a check reads)
        self.planned = planned
        self.ay: np.ndarray | None = None  # A·y of each planned strip, a row each (float32)
        self.tol: np.ndarray | None = None  # a block's tolerance less the terms that need the block, the same layout
        self._lock = threading.Lock()
        self.a_norm = self.bt_sq = None  # ‖aᵢ‖ per row of a, ‖bⱼ‖² per row of bt (float64 upper bounds)
        self.x = self.x64 = self.x_sq = None  # the random vector, one entry per row of bt; in float64; squared
        self.strips: dict[tuple[int, int], Strip] = {}  # (c0, c1) -> its random vector and Btᵀ·x
        # float32 inputs as numpy views, once (half-precision ones are converted a tile's slice at a time)
        self.a32 = self.a.numpy() if self.a.dtype == torch.float32 else None
        self.bt32 = self.bt.numpy() if self.bt.dtype == torch.float32 else None

    def ready(self) -> Norms:
        if self.is_ready:  # (a_norm is set last, below)
            return self
        with self._lock:
            if self.a_norm is None:
                self.x = random_vector(self.bt.shape[0])
                self.x64 = self.x.astype(np.float64)
                self.x_sq = self.x64 * self.x64
                bt32 = self.bt32 if self.bt32 is not None else as_float32(self.bt)
                self.bt_sq = row_squares(bt32)
                a32 = self.a32 if self.a32 is not None else as_float32(self.a)
                a_norm = np.sqrt(row_squares(a32))
                if self.planned:
                    ys = [self._strip(c0, c1, bt32[c0:c1], column) for column, (c0, c1) in enumerate(self.planned)]
                    with np.errstate(all="ignore"):  # (inf or NaN where y overflowed: decided in float64)
                        self.ay = rows_times(a32, np.stack([st.y for st in ys], axis=1)).T.copy()  # a strip a row
                        tol = np.multiply.outer([DEFAULT_Z * st.inputs for st in ys], a_norm)
                        tol += np.array([[floor(a32.shape[1], c1 - c0)] for c0, c1 in self.planned])
                        self.tol = tol  # (float64, as the general path computes it)
                    self.strips.update(zip(self.planned, ys, strict=True))
                self.a_norm = a_norm
        return self

    @property
    def is_ready(self) -> bool:
        """Whether what all checks share is computed (`ready`)."""
        return self.a_norm is not None

    def _strip(self, c0: int, c1: int, bt_rows: np.ndarray, column: int = -1) -> Strip:
        """Strip [c0, c1) from `bt_rows`, rows c0 to c1 of bt in float32."""
        return Strip.of(self.x[c0:c1], self.x64[c0:c1], self.x_sq[c0:c1], bt_rows, self.bt_sq[c0:c1], column)

    def strip(self, c0: int, c1: int) -> Strip:
        """Column strip [c0, c1)'s part of the random vector and what follows from it (by its first check)."""
        got = self.strips.get((c0, c1))  # (a dict's get needs no lock)
        if got is None:
            got = self._strip(c0, c1, self.bt32[c0:c1] if self.bt32 is not None else as_float32(self.bt[c0:c1]))
            with self._lock:
                got = self.strips.setdefault((c0, c1), got)  # (a strip drawn twice at once: the first one kept)
        return got


@dataclass(frozen=True)
class Strip:
    """A column strip's part of the random vector x (float32 and float64), y = Btᵀ·x (float64 and rounded to
    float32), ‖x‖, and the rounding bound's terms that do not depend on the block, per unit of ‖aᵢ‖ (`inputs`:
    the worker's sums, y's and A·y's); `column`: its row of `Norms.ay` and `Norms.tol` (-1: none, both are
    computed per block)."""

    x: np.ndarray
    x2: np.ndarray  # x squared (float32)
    x64: np.ndarray
    y64: np.ndarray
    y: np.ndarray
    xn: float
    inputs: float
    column: int = -1

    @staticmethod
    def of(x: np.ndarray, x64: np.ndarray, x_sq: np.ndarray, bt: np.ndarray, bt_sq: np.ndarray,
           column: int = -1) -> Strip:
        cols, k = bt.shape
        with np.errstate(all="ignore"):
            y64 = btx64(bt, x, x64)
            y = y64.astype(np.float32)  # (inf where it exceeds float32: the check then decides in float64)
        xb = math.sqrt(float(x_sq @ bt_sq))  # ‖x∘‖bⱼ‖‖
        yn = math.sqrt(float(y64 @ y64))
        inputs = U32 * ((math.sqrt(k) + math.sqrt(PARTIAL)) * xb + (math.sqrt(k) + 1) * yn) + U64 * cols * math.sqrt(cols) * xb
        return Strip(x, np.square(x), x64, y64, y, math.sqrt(float(x_sq.sum())), inputs, column)


def rows_times(a: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """a · ys (rows of a x columns of ys, float32) by BLAS, a few rows of a at a time (at most PRODUCT_ELEMENTS,
    in cache): one product of a large `a` with a few vectors is several times slower (measured: 150 against
    55 µs for 1024 x 512 and two vectors, and `ys.T @ a.T` 400)."""
    step = max(1, PRODUCT_ELEMENTS // a.shape[1])
    if a.shape[0] <= step:
        return a @ ys
    out = np.empty((a.shape[0], ys.shape[1]), np.float32)
    for i in range(0, a.shape[0], step):
        np.matmul(a[i:i + step], ys, out=out[i:i + step])
    return out


def btx64(bt: np.ndarray, x: np.ndarray, x64: np.ndarray) -> np.ndarray:
    """Btᵀ·x in float64: sums of PARTIAL rows each by BLAS in float32 (batched, one call), added up in float64,
    where bt's rows are contiguous (3 to 4 times faster than converting bt; their rounding, at most
    u·√PARTIAL·‖x∘‖bⱼ‖‖ in norm under the usual model, is in the tolerance); else, or where a partial sum
    overflows float32, exactly in float64 (`btx64_exact`)."""
    cols, k = bt.shape
    whole = cols - cols % PARTIAL
    if whole and bt.strides[1] == bt.itemsize and bt.strides[0] == k * bt.itemsize:
        with np.errstate(all="ignore"):
            partial = np.matmul(x[:whole].reshape(-1, 1, PARTIAL), bt[:whole].reshape(-1, PARTIAL, k))
            y64 = partial.sum(axis=0, dtype=np.float64)[0]
            if whole < cols:
                y64 += btx64_exact(bt[whole:], x64[whole:])
        if np.isfinite(y64).all():
            return y64
    return btx64_exact(bt, x64)


def btx64_exact(bt: np.ndarray, x64: np.ndarray) -> np.ndarray:
    """Btᵀ·x in float64 (its rounding is next to nothing), `bt` converted a few rows at a time (at most
    CHUNK_ELEMENTS, in cache; a strip converted whole is an allocation of its own, page faults and all: 8 times
    slower for 512 x 4096) and in its own layout (a transposed view, dX's Wᵀ: 5 times faster than numpy's
    implicit conversion)."""
    cols, k = bt.shape
    if cols * k <= CHUNK_ELEMENTS:
        return x64 @ bt.astype(np.float64)
    if bt.strides[0] > bt.strides[1]:  # rows contiguous: a few rows at a time, summed
        step = max(1, CHUNK_ELEMENTS // k)
        y64 = np.zeros(k)
        for i in range(0, cols, step):
            y64 += x64[i:i + step] @ bt[i:i + step].astype(np.float64)
        return y64
    step = max(1, CHUNK_ELEMENTS // cols)  # a transposed view: a few of its columns (rows of the tensor) at a time
    return np.concatenate([bt[:, j:j + step].T.astype(np.float64) @ x64 for j in range(0, k, step)])


def row_squares(m: np.ndarray) -> np.ndarray:
    """An upper bound on ‖mᵢ‖² of every row (float64): squares summed in float32, by BLAS's dot along contiguous
    rows (`np.vecdot`: twice as fast as einsum, four times float64's) and by einsum across the rows of a
    transposed view (dW's inputs, dX's Wᵀ: vecdot there is 50 times slower), so enlarged by their rounding, at
    most K·u relative, in any order; in float64 where float32 overflows."""
    with np.errstate(over="ignore", invalid="ignore"):
        squares = np.vecdot(m, m) if m.strides[-1] == m.itemsize else np.einsum("ij,ij->i", m, m)
    if squares.size and not math.isfinite(squares.max()):
        squares = np.einsum("ij,ij->i", m, m, dtype=np.float64)
    else:  # a row of tiny values whose squares underflowed float32 (to 0 or a subnormal): in float64
        tiny = np.flatnonzero(squares < TINY_SQUARES)
        if tiny.size:
            squares = squares.astype(np.float64)
            squares[tiny] = np.einsum("ij,ij->i", m[tiny], m[tiny], dtype=np.float64)
    return np.multiply(squares, 1 + m.shape[1] * U32, dtype=np.float64)


@dataclass(frozen=True)
class Verdict:
    passed: bool
    worst: float  # the largest residual over its tolerance (a pass is < 1; a float32 block that passes without
    # C·x's rounding term in its tolerance reports that ratio, a little larger)
    row: int  # of the block, where


_bits = np.random.PCG64(secrets.randbits(128))  # seeded from the operating system: no worker can know it
_bits_lock = threading.Lock()


def random_vector(n: int) -> np.ndarray:
    """n float32 entries of random sign and magnitude in [1, 2), fresh for every call: 32 random bits an entry
    give its sign and the 23 bits of its mantissa, under the exponent of 1.0."""
    with _bits_lock:
        bits = _bits.random_raw((n + 1) // 2).view(np.uint32)[:n]  # (PCG64: 64 bits a draw)
    bits &= 0x807FFFFF
    bits |= 0x3F800000
    return bits.view(np.float32)


def floor(k: int, cols: int) -> float:
    """The tolerance's absolute slack for a row of a block `cols` wide with inner dimension k."""
    return FLOOR * (k + 1) * cols


def check(norms: Norms, r0: int, r1: int, c0: int, c1: int, c: np.ndarray, dtype: str = "float32") -> Verdict:
    """Whether `c` (float32, `block_float32`) is a[r0:r1] · bt[c0:c1]ᵀ, its elements rounded to `dtype`,
    within float rounding (see the module docstring). A block with a value that is not finite fails."""
    n = norms.ready()
    if r1 <= r0 or c1 <= c0:
        return Verdict(True, 0.0, 0)
    st = n.strip(c0, c1)
    u_out = UNIT_ROUNDOFF.get(dtype, 0.0)
    with np.errstate(all="ignore"):  # overflow: the float64 path below decides
        if st.column >= 0:  # a planned strip: one product with the block, and for a float32 block C·x's rounding
            # term only if the residuals exceed the tolerance without it (NaN or inf: decided by `_check`)
            residual = mv(c, st.x)
            residual -= n.ay[st.column, r0:r1]
            np.abs(residual, out=residual)
            tol = n.tol[st.column, r0:r1]
            if u_out:  # ‖cᵢ∘x‖ (a second product): C·x's rounding and the block's to its dtype (as `_check`)
                c_sq_x = squares_x(c, st.x2)
                if not math.isfinite(c_sq_x.max()):  # (overflowed float32: judged in float64)
                    return _check(n, st, r0, r1, c, u_out, dtype)
                tol = tol + (DEFAULT_Z * (U32 * c.shape[1] + u_out)) * np.sqrt(c_sq_x) + subnormal(st, c.shape[1], dtype)
            residual /= tol
            worst = int(residual.argmax())
            if residual[worst] < 1.0:
                return Verdict(True, float(residual[worst]), worst)
        return _check(n, st, r0, r1, c, u_out, dtype)


def subnormal(st: Strip, cols: int, dtype: str) -> float:
    """The bound on a row's residual from a half-precision block's subnormal elements (their rounding is
    absolute): half their spacing times Σⱼ|xⱼ|."""
    return SUBNORMAL_ROUNDOFF.get(dtype, 0.0) * math.sqrt(cols) * st.xn


def _check(n: Norms, st: Strip, r0: int, r1: int, c: np.ndarray, u_out: float, dtype: str = "float32") -> Verdict:
    rows_of_a = lambda: n.a32[r0:r1] if n.a32 is not None else as_float32(n.a[r0:r1])  # noqa: E731 - when needed
    a_norm = n.a_norm[r0:r1]
    slack = floor(n.a.shape[1], c.shape[1]) + subnormal(st, c.shape[1], dtype)
    residual = mv(c, st.x)
    residual -= n.ay[st.column, r0:r1] if st.column >= 0 else mv(rows_of_a(), st.y)
    np.abs(residual, out=residual)
    if not u_out and st.column < 0:  # float32: within the tolerance less C·x's own rounding, the block need
        # not be read again
        ratio = residual / (a_norm * (DEFAULT_Z * st.inputs) + slack)  # (NaN or inf: decided below)
        worst = int(np.argmax(ratio))
        if ratio[worst] < 1.0:
            return Verdict(True, float(ratio[worst]), worst)
    c_sq_x, c_abs_x = _block_sums(c, st.x, st.xn, u_out)
    if not (np.isfinite(residual).all() and np.isfinite(c_abs_x).all()):  # float32 overflowed: in float64
        a, c = rows_of_a().astype(np.float64), c.astype(np.float64)
        residual = np.abs(mv(c, st.x64) - mv(a, st.y64))
        c_sq_x, c_abs_x = _block_sums(c, st.x64, st.xn, u_out)
    bound = st.inputs * a_norm + U32 * math.sqrt(c.shape[1]) * c_abs_x
    if c_sq_x is not None:
        bound += u_out * np.sqrt(c_sq_x)
    ratio = residual / (DEFAULT_Z * bound + slack)  # (> 0: a residual of NaN or inf fails)
    worst = int(np.argmax(ratio))
    return Verdict(bool(ratio[worst] < 1.0), float(ratio[worst]), worst)


def squares_x(c: np.ndarray, x2: np.ndarray) -> np.ndarray:
    """‖cᵢ∘x‖² of every row of a block (`x2`: x squared); a row of tiny values, whose squares underflowed
    float32 (a bf16 block of 1e-23s: its rounding term vanished, and honest rows failed), in float64."""
    with np.errstate(under="ignore"):
        c_sq_x = mv(np.square(c), x2)
    tiny = np.flatnonzero(c_sq_x < TINY_SQUARES)
    if tiny.size:
        c_sq_x = c_sq_x.astype(np.float64)
        rows = c[tiny].astype(np.float64)
        c_sq_x[tiny] = np.square(rows) @ x2.astype(np.float64)
    return c_sq_x


def _block_sums(c: np.ndarray, x: np.ndarray, xn: float, u_out: float) -> tuple[np.ndarray | None, np.ndarray]:
    """(‖cᵢ∘x‖² for a half-precision block, else None; a bound on Σⱼ|cᵢⱼ·xⱼ|), from one pass over the block."""
    if u_out:
        c_sq_x = squares_x(c, np.square(x))
        return c_sq_x, math.sqrt(c.shape[1]) * np.sqrt(c_sq_x)
    return None, np.sqrt(np.einsum("ij,ij->i", c, c)) * xn
