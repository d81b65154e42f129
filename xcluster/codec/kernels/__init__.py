"""The codec's hot loops, compiled by numba where it is there and works (``jit.py``), each with a
pure-numpy twin that gives the same results (used without numba, and by the tests to check them)."""
