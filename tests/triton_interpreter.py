"""Triton's interpreter (TRITON_INTERPRET=1) running liger-kernel on CPU tensors, for the kernel tests only.

Import this before anything imports triton, in a process started with TRITON_INTERPRET=1 (the interpreter is
chosen when triton is first imported). Two test-side adaptations make liger 0.8.5 run there (GPU_NOTES):
  * the interpreter passes Python float kernel arguments unwrapped, and liger calls `eps.to(tl.float32)` on them:
    floats are wrapped as fp32 scalars, as compiled Triton does;
  * `triton.language.extra.libdevice` is a stub the interpreter does not patch (`rsqrt` returns None): its
    `rsqrt` is routed to `tl.math.rsqrt`, which the interpreter implements.
Nothing here is in veomni/: on a GPU the real compiler runs and needs neither.

`Launches` counts kernel launches (one per `kernel[grid](...)`), to show which model ran Triton.
"""

import os
import sys

if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
    raise RuntimeError("tests/triton_interpreter.py must be imported first, in a process with TRITON_INTERPRET=1")

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.language.extra.libdevice as libdevice  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_implicit_cvt = interpreter._implicit_cvt


def _wrap_floats(arg):
    if isinstance(arg, float):
        return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
    return _implicit_cvt(arg)


def _rsqrt(x, **_):
    return tl.math.rsqrt(x)  # patched by the interpreter while a kernel runs


interpreter._implicit_cvt = _wrap_floats
libdevice.rsqrt = _rsqrt


class Launches:
    """with Launches() as n: ...; n.count = Triton kernel launches inside the block."""

    _run = interpreter.InterpretedFunction.run

    def __enter__(self):
        self.count = 0
        launches = self

        def run(fn, *args, **kwargs):
            launches.count += 1
            return Launches._run(fn, *args, **kwargs)

        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = Launches._run
