"""Compiles the Triton row kernels (kernels/_triton_rows.py) for an H100 (sm_90) on a machine
without a GPU: Triton's front end, its passes and ptxas, which the interpreter skips (it accepts,
for instance, a kernel reading a global that is not a constexpr, which the compiler refuses).
Each kernel with every flag off and every flag on (each ``if FLAG:`` branch compiled both ways),
the statistics kernel as a first tile and as a merge, the gradient kernel for bf16, fp16 and
float32 outputs. Run by test_triton_rows.py in a fresh interpreter (one that has not
built the kernels for Triton's interpreter); prints one line per compiled kernel."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from microrl.kernels import _triton_rows

H100 = GPUTarget("cuda", 90, 32)
FLAGS = ("PER_ROW_T", "HAS_BIAS", "HAS_CAP", "WITH_ENT")
POINTERS = {"tgt_ptr": "*i64"}  # every other pointer is a float32 one but the output
SCALARS = {"ld": "i32", "ld_out": "i32", "n_cols": "i32", "col0": "i32"}


def compile_kernel(kernel, constexprs: dict, out: str = "*fp32") -> int:
    """PTX lines of ``kernel`` compiled with ``constexprs`` (the others typed by their names)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "out_ptr":
            signature[name] = out
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*fp32")
        else:
            signature[name] = SCALARS.get(name, "fp32")
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return len(triton.compile(source, target=H100, options={"num_warps": 8}).asm["ptx"].split())


def main() -> None:
    for on in (False, True):
        flags = {**dict.fromkeys(FLAGS, on), "BLOCK": 4096}
        for first in (False, True):
            words = compile_kernel(_triton_rows._stats_kernel, {**flags, "FIRST": first})
            print(f"stats flags={on} FIRST={first}: {words} PTX words")
        for out in ("*bf16", "*fp16", "*fp32") if on else ("*bf16",):
            words = compile_kernel(_triton_rows._grads_kernel, flags, out)
            print(f"grads flags={on} {out}: {words} PTX words")


if __name__ == "__main__":
    main()
