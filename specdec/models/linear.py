"""Linear layers laid out for the fastest CPU kernel of their dtype.

Decoding and verification multiply every weight matrix by a handful of rows (1 to k+1), a
shape CPU BLAS handles badly. Four layouts fix that:

- bfloat16 on an x86 CPU with avx512_bf16 (``dot_products()``): the weight packed once and multiplied by
  specdec's bf16 kernel (linear16.py): the input rounded to bf16 as oneDNN rounds it, the sums and the result
  float32; dot products for 1-4 rows and, where the CPU has AMX, tiles on the same layout for 5 and more. On
  EPYC-Zen5 the shipped target's products cost 0.58x oneDNN's at 1 row and 0.7-0.9x up to 33 rows; on
  Xeon-AMX-FP16 its compiled step 0.61x oneDNN's, a 5-token verify 0.71x (docs/benchmarks.md, "bf16 dot products", "AMX tiles").
- bfloat16 on another CPU with native bf16 instructions (``cpu.native_bf16``: arm64 bf16, or where the kernels
  cannot build): the weight is reordered once into oneDNN's blocked layout and multiplied
  with oneDNN's inner product, which reads half the bytes of float32 and costs nearly the same for 1 to
  6 rows (figures: docs/benchmarks.md, "Other backend measurements"). On native x86, for 4 rows and more
  oneDNN computes each output row the same way whatever the number of rows (tested there only), one
  reason large models pad to 4 rows.
- bf16 or f16 on an x86 CPU without native bf16 but with AVX2 (``linear16.available()``): the weight
  stays in its 16 bits, packed once, and specdec's kernel (linear16.py) converts it to float32 in
  registers and multiplies in float32: half the bytes of float32 weights, the same products up to
  the order of the sums, the input and the result in float32.
- anything else on CPU: ``(w @ x^T)^T`` with a row-major x of at least two rows, because
  ``F.linear``'s ``x @ w^T`` takes slow paths for few rows.

On CUDA, bf16 or f16 weights multiply rows rounded to their dtype and give float32 results
(``torch.mm(..., out_dtype=float32)``: cuBLAS accumulates in float32 and writes the sums unrounded), so
the residual stream and the logits stay float32 there as on the CPU: rounding every product to bf16
would let a row's result move by a bf16 step with the kernel cuBLAS picks for the batch's shape, and
logits rounded to bf16 tie. Elsewhere it is ``F.linear``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specdec.models import linear8, linear16
from specdec.models.cpu import native_bf16


# oneDNN's bf16 inner product streams weights from memory faster for a few rows than for 1 or 2
# (docs/benchmarks.md), and its results for 4+ rows do not depend on the row count. Models too large for
# the CPU's caches pad their products to this many rows; small ones, whose weights stay in cache,
# are faster unpadded.
ONEDNN_MIN_ROWS = 4


# oneDNN keeps up to 1,024 built kernels by default, with their buffers, so a burst of varied batch
# shapes leaves a server holding memory it no longer needs. 128 covers the shapes of steady
# decoding. Read by oneDNN when it first builds a kernel; a value set by the user stays.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
KERNEL_NAMES = {"onednn": "oneDNN bf16 inner product", "w16": "16-bit weights, float32 products (specdec AVX2 kernel)",
                "w16dot": "bf16 dot products, float32 sums (specdec AVX-512 BF16 kernel)",
                "wxt": "w @ x^T (ATen)", "mm32": "16-bit products with float32 results (torch.mm out_dtype)",
                "dense": "F.linear", "w8": "int8 weights and inputs, int32 sums (specdec VNNI kernel)",
                "w4": "int4 weights in groups, int8 inputs, int32 sums (specdec VNNI / AVX2 kernel)"}  # by kind
HALF_DTYPES = (torch.bfloat16, torch.float16)


_MM_OUT_FLOAT32: dict[tuple[str, torch.dtype], bool] = {}


def mm_out_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for ``dtype`` inputs on ``device``
    (CUDA, torch >= 2.8), tried once per device and dtype."""
    key = (str(device), dtype)
    if key not in _MM_OUT_FLOAT32:
        try:
            a = torch.ones(2, 8, dtype=dtype, device=device)
            _MM_OUT_FLOAT32[key] = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_FLOAT32[key] = False
    return _MM_OUT_FLOAT32[key]


NO_DOT_ENV = "SPECDEC_NO_BF16_DOT"  # set to 1: bf16 weights on oneDNN where bf16 is native (the kernel before it)


def dot_products() -> bool:
    """Whether bf16 weights run on linear16's bf16 kernel here: it builds, avx512_bf16 runs, the CPU either has no
    AMX or the kernel's AMX tiles run (passes of 5 rows and more go to them: a prefill needs tiles, dot products
    read the weights once per 12 rows), and SPECDEC_NO_BF16_DOT is not set."""
    if os.environ.get(NO_DOT_ENV, "0") not in ("0", ""):
        return False
    if not (linear16.available().ok and linear16.dot_products()):
        return False
    return not torch.cpu.get_capabilities().get("amx_bf16") or linear16.amx_tiles()


def onednn_rows(rows: int, min_rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: at least ``min_rows``, then rounded up to
    one of 8 sizes per octave (multiples of 4 below 64). oneDNN builds and caches a kernel per
    shape (up to 1,024 of them, with their buffers); without buckets, the row counts a server's
    changing batches produce would keep adding kernels and memory. The padding adds at most 3
    rows below 64 (where a few rows more cost almost nothing) and 1/8 of the rows above."""
    rows = max(rows, min_rows)
    if rows <= min_rows:
        return rows
    step = max(4, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // step) * step


class Linear:
    """``y = x @ weight^T + bias`` for a fixed weight [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = 1,
                 quantize: str | None = None):
        """``quantize`` "int8" or "int4": the weight in int8, or int4 in groups of 64, where specdec's kernel for it
        runs (linear8.py: an approximation, for a drafter's products), else as without it."""
        self.out_features, self.in_features = weight.shape
        self.min_rows = min_rows  # the onednn kind pads fewer rows to this many
        self.dtype = weight.dtype
        self.bias = bias
        if quantize not in (None, "int8", "int4"):
            raise ValueError(f"quantize must be None, 'int8' or 'int4', got {quantize!r}")
        if quantize and weight.device.type == "cpu" and linear8.available(8 if quantize == "int8" else 4).ok:
            self.kind = "w8" if quantize == "int8" else "w4"
            self.dtype = torch.float32  # what it takes and gives
            weight = linear8.pack(weight) if quantize == "int8" else linear8.pack4(weight)
        elif weight.device.type == "cuda" and weight.dtype in HALF_DTYPES and mm_out_float32(weight.device, weight.dtype):
            self.kind = "mm32"
        elif weight.device.type != "cpu":
            self.kind = "dense"
        elif weight.dtype == torch.bfloat16 and native_bf16().native:
            if dot_products():
                self.kind = "w16dot"
                weight = linear16.pack_dot(weight.contiguous())  # [ceil(out / 16), ceil(in / 2), 16, 2]
            else:
                self.kind = "onednn"
                weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif weight.dtype in HALF_DTYPES and linear16.available().ok:
            self.kind = "w16"
            weight = linear16.pack(weight.contiguous())  # [ceil(out / 4), ceil(in / 8), 4, 8]
        else:
            self.kind = "wxt"
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] in any float dtype -> [..., out] in the weight's dtype (float32 for ``w16``, ``w16dot``, ``w8``,
        ``w4`` and ``mm32``).

        x is cast to the weight's dtype first (to float32 for ``w16``): with bf16 weights on oneDNN or
        ATen both the input and the result are rounded to bf16, on ``w16dot`` the input only. Adding the
        result to a float32 tensor promotes it back to float32."""
        x = x.to(torch.float32 if self.kind in ("w16", "w8", "w4") else self.dtype)
        if self.kind == "dense":
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        x2 = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, in]
        if self.kind == "onednn":  # the bias inside the kernel
            padded = onednn_rows(rows, self.min_rows)  # rows are computed independently: padding changes nothing else
            if padded > rows:
                x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])
            y = torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], "")[:rows]  # [rows, out]
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.kind == "mm32":
            y = torch.mm(x2, self.weight.t(), out_dtype=torch.float32)  # [rows, out] float32
        elif self.kind == "w16":
            y = linear16.linear16(x2, self.weight, self.out_features)  # [rows, out] float32
        elif self.kind == "w16dot":
            y = linear16.linear16_dot(x2, self.weight, self.out_features)  # [rows, out] float32
        elif self.kind == "w8":
            y = linear8.linear8(x2, self.weight, self.out_features)  # [rows, out] float32
        elif self.kind == "w4":
            y = linear8.linear4(x2, self.weight, self.out_features)  # [rows, out] float32
        else:
            if rows == 1:
                x2 = torch.cat([x2, x2])  # one column would take the slow matrix-vector path again
            y = (self.weight @ x2.t()).t()[:rows]  # x2^T is a transposed view of the row-major x2
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
