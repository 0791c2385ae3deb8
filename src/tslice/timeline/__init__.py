"""Timelines of runs: what held which pool when, the switches, duty per GPU, a summary.

One picture for a recorded trace (``shared/traces/*.json``), a real run's event history
(``tslice timeline --since 2h``, or a saved export) and the demo: everything is first put
in the recorded-run format (:mod:`tslice.timeline.export` turns orchestrator events into
it), read into the drawing model (:mod:`tslice.timeline.model`, :mod:`tslice.timeline.recorded`),
then drawn as a self-contained HTML page (:mod:`tslice.timeline.html`) or a PNG
(:mod:`tslice.timeline.png`). Rendering is kept apart from the data.
"""
