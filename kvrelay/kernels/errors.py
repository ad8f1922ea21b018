"""The kernels package's error type."""

from kvrelay.core.errors import KvrelayError


class KernelError(KvrelayError, ValueError):
    """Bad arguments to a kernel op (shape, dtype, device or index out of range)."""
