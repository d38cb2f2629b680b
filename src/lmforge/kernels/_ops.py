"""The helper every kernel module registers its torch custom ops (``torch.ops.lmforge.*``) with.

An ``autograd.Function`` whose forward launches Triton kernels is opaque to Dynamo only if it is
wrapped in ``torch.compiler.disable``, and every such call splits the compiled model into two
graphs (a graph break per attention/norm layer). A custom op is one node in the graph instead:
Dynamo and AOTAutograd see its output shapes through a fake (meta) implementation and its
gradient through a registered backward, while the real implementation — the same Triton launches
— runs unchanged at run time. So ``torch.compile(model, fullgraph=True)`` covers the whole model.

Each kernel module (``flash_attention``, ``rms_norm``, ``swiglu``, ``rope``, ``cross_entropy``)
defines its ops at its top with :func:`_define`: a forward op whose registered autograd saves
what the Triton backward needs and calls the backward op, which AOTAutograd records in the
backward graph. Rules these follow (custom-op contracts): no output aliases an input (every
output is a fresh buffer; reshapes to the caller's shape happen outside, in the public
functions); every output layout is contiguous and the fake implementations return exactly those
layouts; an implementation makes its inputs contiguous where a kernel needs it, since the
compiler may hand it a strided or padded buffer; non-tensor arguments are plain
bool/int/float/str. Autocast casts stay in the public functions: a custom op is not
autocast-aware, so it runs in the dtypes it is given.

Registration happens once per process at import of the kernel module and imports no Triton: the
implementations import the ``_*_triton`` modules on first call. Exercise:
``pytest tests/test_kernels_compile.py``.
"""

from collections.abc import Callable

import torch
from torch import Tensor

_NS = "lmforge"


def _define(
    name: str,
    impl: Callable[..., object],
    fake: Callable[..., object],
    backward: Callable[..., object] | None = None,
    setup_context: Callable[..., None] | None = None,
) -> torch._ops.OpOverload:
    """Register ``lmforge::name`` (implementation, fake, optional autograd) and return it.

    An op already defined (``importlib.reload`` of this module, as in tests) is reused as it is
    rather than defined again, which would swap the op out under compiled graphs and handles
    that already refer to it.
    """
    if not hasattr(getattr(torch.ops, _NS), name):
        op = torch.library.custom_op(f"{_NS}::{name}", impl, mutates_args=())
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
    return getattr(getattr(torch.ops, _NS), name).default


def _unit_stride(x: Tensor) -> Tensor:
    # Kernels that take row strides still need a unit stride along the last dim.
    return x if x.stride(-1) == 1 else x.contiguous()
