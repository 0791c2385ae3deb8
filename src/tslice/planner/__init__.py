"""The placement planner (``tslice plan``): which jobs should share which pools.

:mod:`.recording` reads a trace or an orchestrator event log, :mod:`.profile` measures
each job's use of each group, :mod:`.predict` models jobs sharing pools, :mod:`.search`
scores the groupings, :mod:`.plan` ties them together, :mod:`.simulate` replays the
recommendation through the real orchestrator and :mod:`.topology` writes it as a
topology file.
"""
