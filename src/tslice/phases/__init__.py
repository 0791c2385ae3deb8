"""Phase models of RL jobs from recorded runs, and their replay: the model and its
loading (``trace``), its derivation from a run's windows and events (``derive``), a
simulated job that plays it against a real orchestrator (``rljob``), a run of such jobs
on a local cluster (``replay``) and what it measured (``measure``). The demo, the
planner and ``bench/trace_replay.py`` build on it."""
