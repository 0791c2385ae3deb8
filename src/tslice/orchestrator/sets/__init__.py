"""All-or-nothing acquires of several groups (AcquireSet)."""
