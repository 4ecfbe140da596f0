"""Only what setup.cfg cannot say: the cffi extension over the system's liburing.

``kvtierd/io/_liburing_build.py`` describes it; it is optional, so a host without liburing's
headers still installs kvtierd (and runs its thread-pool disk backend).
"""

from setuptools import setup

setup(cffi_modules=["kvtierd/io/_liburing_build.py:ffibuilder"])
