"""The fake-driver fixtures for the tests in this folder (tests/test_cuda.py imports them)."""

from fake_cuda.fixtures import fake, fake_cuda_backends, fake_lib, runtime

__all__ = ["fake", "fake_cuda_backends", "fake_lib", "runtime"]
