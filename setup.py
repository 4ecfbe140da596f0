"""Only what setup.cfg cannot say: the cffi extensions.

``kvtierd/io/_liburing_build.py`` (the system's liburing) and ``kvtierd/store/_copyhash_build.py``
(copy and xxh3-64 in one pass, over xxHash's header) describe them. Both are optional: a host
without liburing's headers still installs kvtierd (and runs its thread-pool disk backend), one
without xxHash's copies and hashes in Python.
"""

from setuptools import setup

setup(
    cffi_modules=[
        "kvtierd/io/_liburing_build.py:ffibuilder",
        "kvtierd/store/_copyhash_build.py:ffibuilder",
    ]
)
