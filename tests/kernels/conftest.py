"""Kernel tests: run Triton in its interpreter when no GPU is present (set before any kernel is defined)."""

from __future__ import annotations

import os
import sys

import torch

INTERPRET = not torch.cuda.is_available()
if INTERPRET:
    # TRITON_INTERPRET is read when a @triton.jit function is defined, triton.language's own helpers
    # (tl.cdiv, ...) included, so it must be set before the first `import triton` of the process.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
                           "set it (when CUDA is unavailable) at the top of tests/conftest.py instead")
    # Nothing else in the CPU suite runs Triton, so the variable is harmless to the rest of the process.
    os.environ["TRITON_INTERPRET"] = "1"

    from triton.runtime import interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor_numpy24(tensor, scope):
        # triton 3.6 + numpy >= 2.4: `range(lo, hi)` over loaded scalars calls int() on a shape-(1,) array,
        # which numpy 2.4 refuses (triton-lang/triton#9171, fixed upstream after 3.6).
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor_numpy24

    import numpy as np

    _convert_float = _interpreter._convert_float
    _FP8 = {(3, 7): torch.float8_e4m3fn, (2, 15): torch.float8_e5m2}  # (mantissa bits, exponent bias)

    def _convert_float_fp8_rne(input, input_dtype, output_dtype, rounding_mode):
        # triton 3.6's interpreter rounds float -> fp8 half-up on one cut-off bit and ORs a mantissa carry
        # into the exponent, so a value just below a power of two can come out halved (-127.9 -> -64 in
        # e4m3). The GPU converts round-to-nearest-even, as torch does: use torch for fp32/fp16 -> fp8.
        target = _FP8.get((output_dtype.fp_mantissa_width, output_dtype.exponent_bias))
        if output_dtype.primitive_bitwidth == 8 and target is not None and input.dtype in (np.float32, np.float16):
            converted = torch.from_numpy(np.ascontiguousarray(input)).to(target).view(torch.uint8)
            return converted.numpy().reshape(input.shape)
        return _convert_float(input, input_dtype, output_dtype, rounding_mode)

    _interpreter._convert_float = _convert_float_fp8_rne
