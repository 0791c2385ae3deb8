"""``tslice demo``: two simulated RL jobs on the pools of a recorded run, exclusive then
time-sliced, on a real local cluster (``runner``)."""
