"""The kernels package's error type."""


class KernelError(ValueError):
    """Bad arguments to a kernel op (shape, dtype, device or index out of range)."""
