"""cProfile of the orchestrator process only, for load profiles (bench/load.py starts it).

Put this directory on PYTHONPATH and name the output file; the orchestrator writes its
profile at its (graceful) exit:

    TSLICE_CPROFILE=/tmp/orch.prof PYTHONPATH=$PWD/bench/profile \\
        python bench/load.py --seconds 8 --jobs 100 --groups 25
    python -c "import pstats; pstats.Stats('/tmp/orch.prof').sort_stats('tottime').print_stats(30)"
"""

import os

_out = os.environ.get("TSLICE_CPROFILE")
if _out:
    try:
        with open("/proc/self/cmdline", "rb") as cmdline:
            _cmd = cmdline.read().split(b"\0")
    except OSError:
        _cmd = []
    if b"orchestrator" in _cmd and b"tslice" in _cmd:
        import atexit
        import cProfile

        _prof = cProfile.Profile()
        _prof.enable()

        def _dump() -> None:
            _prof.disable()
            _prof.dump_stats(_out)

        atexit.register(_dump)
