"""cProfile of one tslice process kind, for load profiles (bench/load.py starts them).

Put this directory on PYTHONPATH and name the output file; the profiled process writes
its profile at its (graceful) exit. ``TSLICE_CPROFILE_ROLE`` picks the process kind:
``orchestrator`` (default) or ``agent``; agents write ``<file>.<pid>`` (one per node):

    TSLICE_CPROFILE=/tmp/orch.prof PYTHONPATH=$PWD/bench/profile \\
        python bench/load.py --seconds 8 --jobs 100 --groups 25
    python -c "import pstats; pstats.Stats('/tmp/orch.prof').sort_stats('tottime').print_stats(30)"
    TSLICE_CPROFILE=/tmp/agent.prof TSLICE_CPROFILE_ROLE=agent PYTHONPATH=$PWD/bench/profile \\
        python bench/load.py --seconds 8 --jobs 100 --groups 25 --nodes 1
"""

import os

_out = os.environ.get("TSLICE_CPROFILE")
_role = os.environ.get("TSLICE_CPROFILE_ROLE", "orchestrator").encode()
if _out:
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            _cmd = cmdline.read().split(b"\0")
    except OSError:
        _cmd = []
    if _role in _cmd and b"tslice" in _cmd:
        import atexit
        import cProfile

        if _role != b"orchestrator":
            _out = f"{_out}.{os.getpid()}"
        _prof = cProfile.Profile()
        _prof.enable()

        def _dump() -> None:
            _prof.disable()
            _prof.dump_stats(_out)

        atexit.register(_dump)
