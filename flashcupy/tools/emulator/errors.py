"""The emulator's exceptions: what the driver raises for a bad build, a bad launch, a failed kernel.

Room: errors. Every one is an EmulatorError; driver.py turns a launch's report (abi.py's
_LaunchReport) into the KernelError subclass that fits (EmulatedFunction._error).
"""

from __future__ import annotations

class EmulatorError(RuntimeError):
    """Base class of every error the emulator raises."""


class CompileError(EmulatorError):
    """g++ rejected the kernel source (the message carries its diagnostics)."""


class LaunchError(EmulatorError, ValueError):
    """The launch itself is invalid: grid, block, shared memory or arguments."""


class KernelError(EmulatorError):
    """The kernel failed while running. `kernel`, `block` and `thread` say where (None if unknown)."""

    def __init__(self, message, kernel, block=None, thread=None):
        super().__init__(message)
        self.kernel = kernel
        self.block = block
        self.thread = thread


class OutOfBoundsError(KernelError):
    """An access outside an argument's array or outside the dynamic shared memory requested.

    `argument` is the index of the argument (None for shared memory), `access`
    is 'read', 'write' or 'access' (unknown).
    """

    def __init__(self, message, kernel, block=None, thread=None, argument=None, access="access"):
        super().__init__(message, kernel, block, thread)
        self.argument = argument
        self.access = access


class DeadlockError(KernelError):
    """Threads of a block wait for one another forever (divergent barriers or warp collectives)."""
