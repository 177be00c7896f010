"""`python -m specdec.core.kernels`: builds the native kernels now (the install script does)."""
import logging

from specdec.core.kernels import native

logging.basicConfig(level=logging.INFO)
built = native()
print(f"native engine kernels: {built.__file__ if built else 'unavailable (the engine runs torch ops instead)'}")
